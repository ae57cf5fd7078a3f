"""Log-probs of the sampled tokens straight from hidden states, in token chunks, without `(tokens, vocab)` logits.

Entry points:

* :func:`chunked_logprobs` — a no-grad pass for old/reference/sequence-statistic log-probs (and the full-vocabulary
  entropy).
* :func:`chunked_kept_logmass` — the same log-probs and, in the same pass, the log of the probability mass that a
  sampling truncation (top-k, top-p, min-p) keeps, for rollout importance sampling on the sampled support.
* :func:`chunked_objective` — forward *and* backward of a token-separable objective ``J(log π(o_1), …, log π(o_N))``
  in one sweep: for each chunk of tokens it computes the logits, ``log π`` of the labels, the objective's gradient
  w.r.t. those log-probs (autograd on an ``(n,)`` vector), and from it the gradients w.r.t. the hidden states and the
  head weight. Only one ``(chunk, vocab)`` block exists at a time, and the backward pass only scales the saved
  gradients. That is three GEMMs of ``tokens × hidden × vocab`` in all — the matmul limit of the machine.

Both operate on flat tensors of the valid tokens: ``hidden (N, H)``, ``labels (N,)``. Logits are
``(hidden @ weightᵀ) / temperature``. Per chunk the kernel runs four stages: the logits GEMM; the softmax statistics
(row max, log-sum-exp, entropy); the objective's gradient and from it the logits' gradient ``(onehot − p)·g/T``,
written over the logits; the two gradient GEMMs.

**Softcapping.** With final-logit softcapping ``c`` (Gemma 2's `final_logit_softcapping`) the logits are
``c·tanh((hidden @ weightᵀ) / c) / temperature``, as transformers' Gemma 2 and TRL apply them (softcap, then the
temperature). The chunk's block then holds ``t = tanh(z/c)`` in place of ``z``: the softmax reads it scaled by ``c/T``,
and the logits' gradient is multiplied by ``∂(c·t)/∂z = 1 − t²`` in the same elementwise pass, so softcapping adds one
``tanh`` per element and no buffer. In half precision ``t`` is rounded (|Δt| ≤ 2⁻⁹), so the softcapped logit moves by
at most ``c·2⁻⁹`` (bf16), the same order as the rounding of unsoftcapped logits of magnitude ``c``.

**Precision.** The GEMMs run in ``matmul_dtype`` (defaults to the inputs' common dtype) with float32 accumulation.

* float32 / float64: the logits are float32 / float64; the probabilities are written over them with one ``exp`` per
  element and scaled into the logits' gradient in place.
* bfloat16 / float16 (*half path*): the logits block stays in half precision (no CPU GEMM writes float32 from half
  operands, and half the bytes is half the memory traffic of every later pass). Every statistic is computed in
  float32 from it (max, log-sum-exp, entropy), the label logit is recomputed exactly (a float32 dot product of the
  hidden state with the label's weight row, `(n, H)` work), the per-token outputs are float32, and the logits'
  gradient is written back over the half block for the two gradient GEMMs. The head gradient is accumulated over the
  chunks in float32; the gradients come back in the dtype of ``hidden`` and ``weight`` (pass float32 master weights
  with ``matmul_dtype=torch.bfloat16`` to get float32 gradients from bf16 GEMMs).
  Error against a float64 reference on the same inputs, as `tests/test_context.py::test_half_path_matches_float64`
  bounds it (192 tokens, vocab 2048, logits of std 3.5 after the temperature): it is dominated by the rounding of the
  logits block (a logit z moves by at most 2⁻⁸|z| in bf16, 2⁻¹¹|z| in fp16, and log Z is a softmax-weighted mean of
  those moves, so ``|Δ log π| ≤ 2⁻⁸ max|z/T|``); the test holds the log-probs to that bound, the entropy to twice
  it, the loss to 1e-3 relative and the gradients to a relative error in norm per dtype (`_HALF_CASES` there).

  The gradients' error is the half-precision rounding of the returned gradients (bf16: 2⁻⁹ relative per element)
  and of the gradient block fed to the GEMMs. That is the precision of any bf16 LM head (naive bf16 logits round the
  label logit too, which this kernel does not).

**Epilogue.** The elementwise stages (softmax statistics; the logits' gradient) are memory-bound once the GEMMs run
in half precision. With ``compile_epilogue`` (default: on for half-precision matmuls, and for float32 ones from a
100k vocabulary) each is one `torch.compile`d kernel (Inductor: C++/OpenMP on CPU, Triton on GPU) that reads the
half block once or twice and writes the gradient in place, with no float32 temporary; it falls back to the eager
kernels, with a warning, when no compiler is available or compilation fails. The eager kernels work on blocks of
`_ROW_BLOCK` rows to keep their float32 temporaries small.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .metrics import accumulate_metrics

ChunkObjective = Callable[[torch.Tensor, slice, torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]]

# Elementwise passes over a chunk's `(n, V)` buffer run on blocks of rows, so that their temporaries stay small
# (64 × V) next to the one `(n, V)` buffer the chunk needs.
_ROW_BLOCK = 64
_HALF = (torch.bfloat16, torch.float16)


def default_chunk_size(vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Tokens per chunk keeping one `(chunk, vocab)` logits block near 128 MB in its dtype: a power of two in
    [64, 2048] (float32: 512 at a 49k vocabulary, 256 at 152k; half precision: twice that). Larger chunks buy no GEMM
    speed on CPU and cost memory."""
    element = 2 if dtype in _HALF else 4
    return int(min(2048, max(64, 2 ** round(math.log2(2**27 / element / vocab)))))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (log-softmax needs it), float64 stays float64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Epilogue kernels of the half path (also used for every dtype with compile_epilogue=True)


def _softmax_stats_eager(
    logits: torch.Tensor, inv_temp: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(n,)` float32 log-sum-exp of ``logits·inv_temp`` (and entropies), from a `(n, V)` block of any dtype."""
    dtype = _compute_dtype(logits.dtype)
    log_normalizer = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
    entropy = torch.empty_like(log_normalizer) if with_entropy else None
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        z = logits[rows].to(dtype, copy=True)  # (b, V) float32 temporary
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        row_max = z.amax(dim=-1, keepdim=True)
        z.sub_(row_max)
        exps = z.exp()
        total = exps.sum(dim=-1)
        log_total = total.log()
        log_normalizer[rows] = row_max.squeeze(-1) + log_total
        if entropy is not None:
            entropy[rows] = log_total - torch.linalg.vecdot(exps, z) / total
    return log_normalizer, entropy


def _softmax_stats_fused(
    logits: torch.Tensor, inv_temp: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same as `_softmax_stats_eager`, written for `torch.compile` (whole block: Inductor fuses it into reductions
    that never materialize the float32 values)."""
    z = logits.to(_compute_dtype(logits.dtype)) * inv_temp
    row_max = z.amax(dim=-1, keepdim=True)
    shifted = z - row_max
    exps = shifted.exp()
    total = exps.sum(dim=-1)
    log_total = total.log()
    entropy = log_total - (exps * shifted).sum(dim=-1) / total if with_entropy else None
    return row_max.squeeze(-1) + log_total, entropy


def _neg_scaled_probs_eager_(logits: torch.Tensor, log_normalizer: torch.Tensor, scale: torch.Tensor, inv_temp: float):
    """In place: ``logits ← −scale · softmax(logits·inv_temp)`` (`scale` `(n,)` float32), computed in float32."""
    dtype = _compute_dtype(logits.dtype)
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        block = logits[rows]
        z = block.to(dtype, copy=True)
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        z.sub_(log_normalizer[rows, None]).exp_().mul_(-scale[rows, None])
        block.copy_(z)
    return logits


def _neg_scaled_probs_fused_(logits: torch.Tensor, log_normalizer: torch.Tensor, scale: torch.Tensor, inv_temp: float):
    """Same as `_neg_scaled_probs_eager_`, for `torch.compile` (one pass, read and written in the block's dtype)."""
    z = logits.to(_compute_dtype(logits.dtype)) * inv_temp
    logits.copy_(torch.exp(z - log_normalizer[:, None]) * -scale[:, None])
    return logits


def _neg_scaled_probs_softcap_eager_(
    logits: torch.Tensor, log_normalizer: torch.Tensor, scale: torch.Tensor, inv_temp: float
):
    """Softcapped: the block holds ``t = tanh(z/c)`` and ``inv_temp = c/T``. In place:
    ``block ← −scale · softmax(t·c/T) · (1 − t²)`` (the chain rule through ``c·tanh(z/c)``), in float32."""
    dtype = _compute_dtype(logits.dtype)
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        block = logits[rows]
        t = block.to(dtype, copy=True)
        probs = (t * inv_temp).sub_(log_normalizer[rows, None]).exp_()
        block.copy_(probs.mul_(t.mul_(t).neg_().add_(1.0)).mul_(-scale[rows, None]))
    return logits


def _neg_scaled_probs_softcap_fused_(
    logits: torch.Tensor, log_normalizer: torch.Tensor, scale: torch.Tensor, inv_temp: float
):
    """Same as `_neg_scaled_probs_softcap_eager_`, for `torch.compile`."""
    t = logits.to(_compute_dtype(logits.dtype))
    logits.copy_(torch.exp(t * inv_temp - log_normalizer[:, None]) * (1.0 - t * t) * -scale[:, None])
    return logits


def _entropy_grad_eager_(
    logits: torch.Tensor,
    log_normalizer: torch.Tensor,
    scale: torch.Tensor,
    inv_temp: float,
    entropy: torch.Tensor,
    entropy_scale: torch.Tensor,
    softcapped: bool,
):
    """In place: ``block ← −p · (scale + entropy_scale · (log p + H))`` (× ``1 − t²`` when `softcapped`, the block
    then holding ``t = tanh(z/c)``), with ``log p = block·inv_temp − log Z``: the logits' gradient of
    ``g·log π(y) + g_H·H`` less the label's one-hot term, since ``∂H/∂z_v = −p_v (log p_v + H)`` (per unit of
    ``z/T``; `scale` and `entropy_scale` carry the ``1/T``). All `(n,)` inputs float32; computed in float32."""
    dtype = _compute_dtype(logits.dtype)
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        block = logits[rows]
        x = block.to(dtype, copy=True)
        log_p = (x * inv_temp).sub_(log_normalizer[rows, None])
        grad = (log_p + entropy[rows, None]).mul_(entropy_scale[rows, None]).add_(scale[rows, None])
        grad.mul_(log_p.exp_().neg_())
        if softcapped:
            grad.mul_(x.mul_(x).neg_().add_(1.0))
        block.copy_(grad)
    return logits


def _entropy_grad_fused_(logits, log_normalizer, scale, inv_temp, entropy, entropy_scale, softcapped):
    """Same as `_entropy_grad_eager_` (same arguments), for `torch.compile`."""
    x = logits.to(_compute_dtype(logits.dtype))
    log_p = x * inv_temp - log_normalizer[:, None]
    grad = -torch.exp(log_p) * (scale[:, None] + entropy_scale[:, None] * (log_p + entropy[:, None]))
    logits.copy_(grad * (1.0 - x * x) if softcapped else grad)
    return logits


def _accumulate_(total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``total += value`` (a float32 accumulator, a half-precision GEMM result). Compiled, the conversion is
    vectorized: eager CPU `add_` across dtypes runs several times slower than within one dtype."""
    return total.add_(value.to(total.dtype))


_EAGER = {
    "stats": _softmax_stats_eager,
    "grad": _neg_scaled_probs_eager_,
    "grad_softcap": _neg_scaled_probs_softcap_eager_,
    "grad_entropy": _entropy_grad_eager_,
    "accumulate": _accumulate_,
}
_FUSED = {
    "stats": _softmax_stats_fused,
    "grad": _neg_scaled_probs_fused_,
    "grad_softcap": _neg_scaled_probs_softcap_fused_,
    "grad_entropy": _entropy_grad_fused_,
    "accumulate": _accumulate_,
}
_compiled: dict[str, Callable] = {}
_compile_failed: str | None = None


# How the epilogue kernels are compiled. Inductor's C++ backend picks a kernel's vector width and whether it runs
# in parallel from the sizes of the *first* call it compiles for, and its on-disk cache then serves that kernel to
# every later process. Compiled with `dynamic=True`, a first call from a small problem (a test: vocab 13) gave a
# kernel with half-width masked loads and no OpenMP region, and a 4096 x 49k bf16 loss step on this 2-core CPU then
# spent 90 ms per 1024-row block in the gradient pass instead of 17 ms. So only the rows are dynamic (the vocabulary
# is fixed for a model; the kernel is specialized to it), and `cpp.dynamic_threads` keeps one parallel region
# whatever the first row count was.
_COMPILE_OPTIONS = {"cpp.dynamic_threads": True}


def _epilogue(name: str, compiled: bool) -> Callable:
    """The eager kernel, or the `torch.compile`d one (built once; see `_COMPILE_OPTIONS`); after the first failure
    to compile, the eager one for the rest of the process."""
    if not compiled or _compile_failed is not None:
        return _EAGER[name]
    if name not in _compiled:
        _compiled[name] = torch.compile(_FUSED[name], dynamic=None, options=_COMPILE_OPTIONS)
    return _compiled[name]


def _run_epilogue(name: str, compiled: bool, *args):
    global _compile_failed
    if compiled and _compile_failed is None:
        if name != "accumulate":  # block kernels: every tensor argument is indexed by the chunk's rows first
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
        try:
            return _epilogue(name, True)(*args)
        except Exception as error:  # no C++ compiler / Triton, an Inductor bug: the eager kernel is exact too
            _compile_failed = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"hf_rlloss: torch.compile of the chunked-loss epilogue failed, using the eager kernels "
                f"({_compile_failed.splitlines()[0][:300]})",
                stacklevel=3,
            )
    return _EAGER[name](*args)


# In float32 the GEMMs are slower and the epilogue matters less: compiling it paid at a 152k vocabulary (4096 tokens,
# H=576, 2-core CPU, 2026-12-02, two idle runs: 16.3 / 17.5 s compiled vs 19.3 / 19.0 s eager, 635 vs 705 MB) and not
# at 49k (5.12 vs 5.23 s), where a first-call compile would not pay back.
_FP32_COMPILE_FROM_VOCAB = 100_000


def _use_compiled(compile_epilogue: bool | None, matmul_dtype: torch.dtype, vocab: int) -> bool:
    """The epilogue's default: compiled for half-precision GEMMs, and for float32 ones from a 100k vocabulary."""
    if compile_epilogue is not None:
        return bool(compile_epilogue)
    return matmul_dtype in _HALF or (matmul_dtype == torch.float32 and vocab >= _FP32_COMPILE_FROM_VOCAB)


# ---------------------------------------------------------------------------------------------------------------
# One chunk


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`(n, V)` logits ``h @ weightᵀ`` (operands in the matmul dtype; float32 accumulation inside the GEMM)."""
    logits = h @ weight.t()
    return logits if logits.dtype in _HALF else logits.to(_compute_dtype(logits.dtype))


def _label_logits(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`(n,)` logits of the labels: gathered from a float32/float64 block; recomputed exactly (float32 dot products of
    the half operands) from a half block, whose rounding would otherwise go straight into ``log π(y)``."""
    if logits.dtype not in _HALF:
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return torch.linalg.vecdot(h.float(), weight[labels].float())


def _softcap_(
    logits: torch.Tensor, label_logits: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-logit softcapping of one chunk: the block becomes ``t = tanh(z/c)`` in place (the softcapped logits are
    ``c·t``; `_chunk_softmax` and `_grad_logits_` read it so), the label logits ``c·tanh(z_y/c)`` (from the exact
    label logits, in float32). Without `softcap`, both unchanged."""
    if softcap is None:
        return logits, label_logits
    logits.div_(softcap).tanh_()
    return logits, softcap * torch.tanh(label_logits / softcap)


def _chunk_softmax(
    logits: torch.Tensor,
    label_logits: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    want_probs: bool,
    compiled: bool,
    softcap: float | None = None,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``log π(label)`` `(n,)` and the entropies `(n,)` of one chunk's logits block.

    With `softcap` the block holds ``tanh(z/c)`` (see `_softcap_`) and `label_logits` are already softcapped: the
    statistics run through the epilogue kernels on the block scaled by ``c/T``, and the block is left as it is.
    So they do with `keep_logits` (the entropy's gradient needs ``log p``, which probabilities lose where they
    underflow).

    float32/float64 eager (one `exp` per element): per row block ``m = max z``, ``e = exp(z − m)``, ``s = Σ e``, then
    ``log π(y) = z_y − m − log s``, ``H = log s − Σ e·(z − m) / s``, and with `want_probs` ``p = e / s`` is written
    over the block. Otherwise only the statistics: the block is left as it is, and the probabilities are recomputed
    by the gradient stage (one more `exp`, no float32 buffer).

    Returns:
        `(block, log π(y), entropy, log Z)`: ``log Z`` `(n,)` is the log-normalizer of ``logits / T``, or `None` when
        the block now holds the probabilities.
    """
    if compiled or logits.dtype in _HALF or softcap is not None or keep_logits:
        block_inv_temp = (1.0 if softcap is None else softcap) / temperature
        log_normalizer, entropy = _run_epilogue("stats", compiled, logits, block_inv_temp, with_entropy)
        return logits, label_logits / temperature - log_normalizer, entropy, log_normalizer
    if temperature != 1.0:
        logits.div_(temperature)
        label_logits = label_logits / temperature
    log_normalizer = torch.empty_like(label_logits)
    entropy = torch.empty_like(label_logits) if with_entropy else None
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        block = logits[rows]
        row_max = block.amax(dim=-1, keepdim=True)
        block.sub_(row_max)
        exps = block.exp()
        total = exps.sum(dim=-1, keepdim=True)
        log_total = total.log().squeeze(-1)
        log_normalizer[rows] = row_max.squeeze(-1) + log_total
        if entropy is not None:
            entropy[rows] = log_total - torch.linalg.vecdot(exps, block) / total.squeeze(-1)
        if want_probs:
            torch.div(exps, total, out=block)
    return logits, label_logits - log_normalizer, entropy, None if want_probs else log_normalizer


def _grad_logits_(
    block: torch.Tensor,
    log_normalizer: torch.Tensor | None,
    labels: torch.Tensor,
    grad_lp: torch.Tensor,
    temperature: float,
    compiled: bool,
    softcap: float | None = None,
    label_logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place over the chunk's block: ``∂J/∂logits = (onehot(y) − softmax(z/T)) · g / T`` with
    ``g = ∂J/∂log π(y)`` `(n,)`; the block holds the probabilities when `log_normalizer` is `None`, else the logits.
    With `softcap` (the block holds ``tanh(z/c)``, `label_logits` the softcapped ``c·tanh(z_y/c)``) each column is
    also multiplied by ``1 − tanh²(z/c)``, the derivative of the softcap. With `grad_entropy` (``g_H = ∂J/∂H``
    `(n,)`) the entropy's gradient ``−g_H·p·(log p + H)/T`` is added in the same pass (`log_normalizer` required)."""
    scale = (grad_lp / temperature if temperature != 1.0 else grad_lp).to(_compute_dtype(block.dtype))
    label_scale = scale
    if softcap is not None:
        label_scale = scale * (1.0 - (label_logits.to(scale.dtype) / softcap) ** 2)
    if grad_entropy is not None:
        entropy_scale = (grad_entropy / temperature).to(scale.dtype)
        inv_temp = (1.0 if softcap is None else softcap) / temperature
        args = (block, log_normalizer, scale, inv_temp, entropy.to(scale.dtype), entropy_scale, softcap is not None)
        _run_epilogue("grad_entropy", compiled, *args)
    elif softcap is not None:
        _run_epilogue("grad_softcap", compiled, block, log_normalizer, scale, softcap / temperature)
    elif log_normalizer is None:
        block.mul_(-scale.unsqueeze(-1))
    else:
        _run_epilogue("grad", compiled, block, log_normalizer, scale, 1.0 / temperature)
    # + g/T at each row's label: indexing, not scatter_add_ (which is pathologically slow on CPU half tensors)
    rows = torch.arange(block.shape[0], device=block.device)
    block[rows, labels] += label_scale.to(block.dtype)
    return block


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor, matmul_dtype: torch.dtype | None) -> torch.dtype:
    """The GEMMs' operand dtype: `matmul_dtype`, else the inputs' common dtype."""
    dtype = matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"matmul_dtype must be a floating-point dtype; got {dtype}")
    return dtype


@torch.no_grad()
def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
    compile_epilogue: bool | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and optionally the full-vocabulary entropy) under ``softmax(hidden @ weightᵀ / T)``.

    Args:
        hidden (`torch.Tensor`): `(N, H)` hidden states of the valid tokens.
        weight (`torch.Tensor`): `(V, H)` LM-head weight.
        labels (`torch.Tensor`): `(N,)` token ids in `[0, V)`.
        temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
        chunk_size (`int`, *optional*): tokens per chunk (peak memory ≈ `chunk_size × V` logits in the matmul dtype);
            defaults to `default_chunk_size(V, matmul_dtype)`.
        with_entropy (`bool`, *optional*, defaults to `False`): also return the entropy of each token's distribution.
        matmul_dtype (`torch.dtype`, *optional*): dtype of the GEMM operands (e.g. `torch.bfloat16` under bf16
            mixed precision); defaults to the common dtype of `hidden` and `weight`. See the module docstring.
        compile_epilogue (`bool`, *optional*): `torch.compile` the softmax statistics; defaults to on for
            half-precision matmuls and for float32 ones from a 100k vocabulary. Falls back to the eager kernel if
            compilation fails.
        softcap (`float`, *optional*): final-logit softcapping ``c > 0``: the logits are ``c·tanh(z/c) / T`` (Gemma 2's
            `final_logit_softcapping`). Defaults to none.

    Returns:
        `(torch.Tensor, torch.Tensor | None)`: `(N,)` float32 (float64 for float64 inputs) log-probs and `(N,)`
        entropies (or `None`).
    """
    n = labels.shape[0]
    dtype = _matmul_dtype(hidden, weight, matmul_dtype)
    w = weight.to(dtype)  # cast once per call, not per chunk
    compiled = _use_compiled(compile_epilogue, dtype, weight.shape[0])
    chunk_size = chunk_size or default_chunk_size(weight.shape[0], dtype)
    out_dtype = _compute_dtype(dtype)
    logprobs = torch.empty(n, dtype=out_dtype, device=hidden.device)
    entropy = torch.empty(n, dtype=out_dtype, device=hidden.device) if with_entropy else None
    for start in range(0, n, chunk_size):
        chunk = slice(start, min(start + chunk_size, n))
        h = hidden[chunk].to(dtype)
        logits = _chunk_logits(h, w)
        logits, label_logits = _softcap_(logits, _label_logits(h, w, labels[chunk], logits), softcap)
        _, logprobs[chunk], chunk_entropy, _ = _chunk_softmax(
            logits, label_logits, temperature, with_entropy, want_probs=False, compiled=compiled, softcap=softcap
        )
        if entropy is not None:
            entropy[chunk] = chunk_entropy
    return logprobs, entropy


@torch.no_grad()
def chunked_kept_logmass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    truncation: Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` under ``π = softmax(z)``, ``z = hidden @ weightᵀ / T``, and ``log Σ_{v kept} π(v)``: the
    log of the mass that a sampling truncation of ``z`` keeps (replayed on the trainer's distribution).

    ``truncation(None, scores)`` must return the `(n, V)` scores with the removed tokens at ``-inf`` and the kept ones
    unchanged, as transformers' logits warpers do (`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper` in a
    `LogitsProcessorList`). Then ``log K = logsumexp(truncated z) − logsumexp(z)``, and the label's log-prob
    renormalized over the kept support is ``log π(y) − log K`` (``-inf`` if ``y`` was cut).

    Args:
        hidden, weight, labels, temperature, chunk_size, softcap (as in `chunked_logprobs`): the truncation sees the
            softcapped logits divided by the temperature, as in generation.
        truncation (`Callable`): `(input_ids or None, scores (n, V)) -> scores`; applied to blocks of 64 rows, so its
            temporaries (a sort for top-p) stay at `64 × V`.

    Returns:
        `(torch.Tensor, torch.Tensor)`: `(N,)` log-probs and `(N,)` kept log-masses (≤ 0), in float32 (or float64).
    """
    n = labels.shape[0]
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    dtype = _compute_dtype(hidden.dtype)
    logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
    kept_logmass = torch.empty(n, dtype=dtype, device=hidden.device)
    for start in range(0, n, chunk_size):
        logits = (hidden[start : start + chunk_size] @ weight.t()).to(dtype)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        if temperature != 1.0:
            logits.div_(temperature)
        for block_start in range(0, logits.shape[0], _ROW_BLOCK):
            rows = slice(start + block_start, start + min(block_start + _ROW_BLOCK, logits.shape[0]))
            block = logits[block_start : block_start + _ROW_BLOCK]
            log_normalizer = torch.logsumexp(block, dim=-1)  # (b,)
            logprobs[rows] = block.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - log_normalizer
            kept_logmass[rows] = torch.logsumexp(truncation(None, block.clone()), dim=-1) - log_normalizer
    return logprobs, kept_logmass


@dataclass(frozen=True)
class _ChunkOptions:
    """The non-tensor arguments of `_ChunkedObjective` (see `chunked_objective`)."""

    chunk_size: int
    temperature: float
    with_entropy: bool
    metrics_out: dict  # the objective's metrics, summed over chunks (filled by forward)
    dtype: torch.dtype  # of the head GEMMs
    compiled: bool
    softcap: float | None
    entropy_grad: bool


class _ChunkedObjective(torch.autograd.Function):
    @staticmethod
    def forward(fctx, hidden, weight, labels, objective, options: _ChunkOptions):
        chunk_size, temperature, with_entropy = options.chunk_size, options.temperature, options.with_entropy
        dtype, compiled, softcap, entropy_grad = options.dtype, options.compiled, options.softcap, options.entropy_grad
        n = labels.shape[0]
        need_h, need_w = fctx.needs_input_grad[0], fctx.needs_input_grad[1]
        w = weight.to(dtype)  # cast once per call, not per chunk
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        # Accumulate the head gradient in float32 whatever the weight's dtype: it sums over every token.
        acc_dtype = _compute_dtype(dtype)
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            chunk = slice(start, min(start + chunk_size, n))
            h = hidden[chunk].to(dtype)
            # 1. logits (n, V) and the softmax statistics
            logits = _chunk_logits(h, w)
            logits, label_logits = _softcap_(logits, _label_logits(h, w, labels[chunk], logits), softcap)
            block, token_logprobs, entropy, log_normalizer = _chunk_softmax(
                logits,
                label_logits,
                temperature,
                with_entropy,
                want_probs=need_h or need_w,
                compiled=compiled,
                softcap=softcap,
                keep_logits=entropy_grad,
            )
            # 2. the objective and its gradient w.r.t. the chunk's log-probs (autograd on an (n,) vector)
            with torch.enable_grad():
                lp = token_logprobs.detach().requires_grad_(True)
                ent = entropy.detach().requires_grad_(True) if entropy_grad else entropy
                value, metrics = objective(lp, chunk, ent)
                inputs = (lp, ent) if entropy_grad else (lp,)
                grad_lp, *grad_ent = torch.autograd.grad(value, inputs, allow_unused=True)
                grad_ent = grad_ent[0] if grad_ent else None
            if grad_lp is None and grad_ent is not None:
                grad_lp = torch.zeros_like(lp)
            total += value.detach().to(acc_dtype)
            accumulate_metrics(options.metrics_out, metrics)
            if grad_lp is None or not (need_h or need_w):
                continue
            # 3. d log π(y) / d logits = onehot(y) − softmax (× 1 − tanh² softcapped), written over the block
            grad_logits = _grad_logits_(
                block,
                log_normalizer,
                labels[chunk],
                grad_lp,
                temperature,
                compiled,
                softcap,
                label_logits,
                entropy,
                grad_ent,
            )
            grad_logits = grad_logits.to(dtype)
            # 4. the two gradient GEMMs
            if need_h:
                grad_hidden[chunk] = grad_logits @ w
            if need_w and dtype == acc_dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            elif need_w:
                _run_epilogue("accumulate", compiled, grad_weight, grad_logits.t() @ h)
        # Kept as attributes, not saved tensors: backward hands them over without a copy (they are not inputs or
        # outputs, so there is no version counter to check).
        fctx.grads = (grad_hidden, grad_weight.to(weight.dtype) if need_w else None)
        return total

    @staticmethod
    def backward(fctx, grad_output):
        grads, fctx.grads = fctx.grads, None  # drop fctx's reference: autograd can then take the tensors as they are
        if grads is None:
            raise RuntimeError(
                "the chunked loss computes its gradients during the forward and hands them over once: backward "
                "through it a second time (retain_graph=True) is not supported; compute the loss again instead"
            )
        # × the incoming gradient (1 for loss.backward() on this value: exact), unconditionally: testing for 1 would
        # read it back to the host in every backward
        grads = tuple(None if g is None else g * grad_output.to(g.dtype) for g in grads)
        return *grads, None, None, None


def chunked_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    objective: ChunkObjective,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
    compile_epilogue: bool | None = None,
    softcap: float | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Value of ``Σ_chunks objective(log π(labels[chunk]), chunk, entropy[chunk])``, differentiable w.r.t. ``hidden``
    and ``weight``, computed chunk by chunk with the gradients taken during the forward.

    Args:
        hidden (`torch.Tensor`): `(N, H)` hidden states of the valid tokens.
        weight (`torch.Tensor`): `(V, H)` LM-head weight.
        labels (`torch.Tensor`): `(N,)` token ids.
        objective (`Callable`): `(logprobs (n,), chunk slice, entropy (n,) or None) -> (scalar, metrics)`; it must be
            separable over tokens (a chunk's value may depend only on that chunk's log-probs). Metrics (detached
            0-dim tensors) are summed over chunks.
        temperature, chunk_size, with_entropy, matmul_dtype, compile_epilogue, softcap (as in `chunked_logprobs`): the
            gradients come back in the dtypes of `hidden` and `weight`, whatever `matmul_dtype`.
        entropy_grad (`bool`, *optional*, defaults to `False`): the objective may depend on the entropies it is
            given (needs `with_entropy`): their gradient ``∂J/∂H`` is taken with the log-probs' and propagated through
            ``∂H/∂z_v = −p_v (log p_v + H)`` in the same chunk pass (no `(tokens, vocab)` tensor beyond the chunk).

    Returns:
        `(torch.Tensor, dict)`: the scalar objective (float32, float64 for float64 inputs) and the summed metrics.
    """
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad=True needs with_entropy=True (the objective's entropy input)")
    metrics: dict[str, torch.Tensor] = {}
    dtype = _matmul_dtype(hidden, weight, matmul_dtype)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0], dtype)
    compiled = _use_compiled(compile_epilogue, dtype, weight.shape[0])
    options = _ChunkOptions(chunk_size, temperature, with_entropy, metrics, dtype, compiled, softcap, entropy_grad)
    value = _ChunkedObjective.apply(hidden, weight, labels, objective, options)
    return value, metrics
