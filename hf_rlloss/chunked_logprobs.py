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
``(hidden @ weightᵀ) / temperature`` in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .metrics import accumulate_metrics

ChunkObjective = Callable[[torch.Tensor, slice, torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]]

# Elementwise passes over a chunk's `(n, V)` buffer run on blocks of rows, so that their temporaries stay small
# (64 × V) next to the one `(n, V)` buffer the chunk needs.
_ROW_BLOCK = 64


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk keeping one `(chunk, vocab)` float32 block near 128 MB: a power of two in [64, 2048]
    (512 at a 49k vocabulary, 256 at 152k). Larger chunks buy no GEMM speed on CPU and cost memory."""
    return int(min(2048, max(64, 2 ** round(math.log2(2**25 / vocab)))))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (log-softmax needs it), float64 stays float64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    want_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's logits turned, in their own `(n, V)` buffer, into probabilities (if `want_probs`), with
    ``log π(label)`` `(n,)` and the entropies `(n,)` — one `exp` per element.

    Per row block: ``m = max z``, ``e = exp(z − m)``, ``s = Σ e``; then ``log π(y) = z_y − m − log s``,
    ``H = log s − Σ e·(z − m) / s`` and ``p = e / s``.
    """
    logits = hidden @ weight.t()
    logits = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        logits.div_(temperature)
    label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
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
    return logits, label_logits - log_normalizer, entropy


@torch.no_grad()
def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and optionally the full-vocabulary entropy) under ``softmax(hidden @ weightᵀ / T)``.

    Args:
        hidden (`torch.Tensor`): `(N, H)` hidden states of the valid tokens.
        weight (`torch.Tensor`): `(V, H)` LM-head weight.
        labels (`torch.Tensor`): `(N,)` token ids in `[0, V)`.
        temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
        chunk_size (`int`, *optional*): tokens per chunk (peak memory ≈ `chunk_size × V × 4` bytes); defaults to
            `default_chunk_size(V)`.
        with_entropy (`bool`, *optional*, defaults to `False`): also return the entropy of each token's distribution.

    Returns:
        `(torch.Tensor, torch.Tensor | None)`: `(N,)` float32 log-probs and `(N,)` entropies (or `None`).
    """
    n = labels.shape[0]
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    dtype = _compute_dtype(hidden.dtype)
    logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
    entropy = torch.empty(n, dtype=dtype, device=hidden.device) if with_entropy else None
    for start in range(0, n, chunk_size):
        sl = slice(start, min(start + chunk_size, n))
        _, logprobs[sl], chunk_entropy = _chunk_softmax(
            hidden[sl], weight, labels[sl], temperature, with_entropy, want_probs=False
        )
        if entropy is not None:
            entropy[sl] = chunk_entropy
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` under ``π = softmax(z)``, ``z = hidden @ weightᵀ / T``, and ``log Σ_{v kept} π(v)``: the
    log of the mass that a sampling truncation of ``z`` keeps (replayed on the trainer's distribution).

    ``truncation(None, scores)`` must return the `(n, V)` scores with the removed tokens at ``-inf`` and the kept ones
    unchanged, as transformers' logits warpers do (`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper` in a
    `LogitsProcessorList`). Then ``log K = logsumexp(truncated z) − logsumexp(z)``, and the label's log-prob
    renormalized over the kept support is ``log π(y) − log K`` (``-inf`` if ``y`` was cut).

    Args:
        hidden, weight, labels, temperature, chunk_size: see `chunked_logprobs`.
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
        if temperature != 1.0:
            logits.div_(temperature)
        for block_start in range(0, logits.shape[0], _ROW_BLOCK):
            rows = slice(start + block_start, start + min(block_start + _ROW_BLOCK, logits.shape[0]))
            block = logits[block_start : block_start + _ROW_BLOCK]
            log_normalizer = torch.logsumexp(block, dim=-1)  # (b,)
            logprobs[rows] = block.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - log_normalizer
            kept_logmass[rows] = torch.logsumexp(truncation(None, block.clone()), dim=-1) - log_normalizer
    return logprobs, kept_logmass


class _ChunkedObjective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, objective, chunk_size, temperature, with_entropy, metrics_out):
        n = labels.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        # Accumulate the head gradient in float32 whatever the weight's dtype: it sums over every token.
        dtype = _compute_dtype(hidden.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            h = hidden[sl]
            probs, token_logprobs, entropy = _chunk_softmax(
                h, weight, labels[sl], temperature, with_entropy, want_probs=need_h or need_w
            )
            with torch.enable_grad():
                lp = token_logprobs.detach().requires_grad_(True)
                value, metrics = objective(lp, sl, entropy)
                (grad_lp,) = torch.autograd.grad(value, lp, allow_unused=True)
            total += value.detach().to(dtype)
            accumulate_metrics(metrics_out, metrics)
            if grad_lp is None or not (need_h or need_w):
                continue
            # d log π(y) / d logits = onehot(y) − softmax; reuse the probability buffer for the logits' gradient.
            grad_logits = probs.mul_(-grad_lp.unsqueeze(-1))
            grad_logits.scatter_add_(-1, labels[sl].unsqueeze(-1), grad_lp.unsqueeze(-1))
            if temperature != 1.0:
                grad_logits.div_(temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_h:
                grad_hidden[sl] = grad_logits @ weight
            if need_w and h.dtype == grad_weight.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            elif need_w:
                grad_weight.add_((grad_logits.t() @ h).to(grad_weight.dtype))
        # Kept as attributes, not saved tensors: backward hands them over without a copy (they are not inputs or
        # outputs, so there is no version counter to check).
        ctx.grads = (grad_hidden, grad_weight.to(weight.dtype) if need_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grads, ctx.grads = ctx.grads, None  # drop ctx's reference: autograd can then take the tensors as they are
        if grads is None:
            raise RuntimeError(
                "the chunked loss computes its gradients during the forward and hands them over once: backward "
                "through it a second time (retain_graph=True) is not supported; compute the loss again instead"
            )
        if not bool(grad_output == 1):  # a loss scale: the usual case is loss.backward() on this value directly
            grads = tuple(None if g is None else g * grad_output.to(g.dtype) for g in grads)
        return *grads, None, None, None, None, None, None


def chunked_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    objective: ChunkObjective,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
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
        temperature, chunk_size, with_entropy: see `chunked_logprobs`.

    Returns:
        `(torch.Tensor, dict)`: the scalar objective and the summed metrics.
    """
    metrics: dict[str, torch.Tensor] = {}
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    value = _ChunkedObjective.apply(hidden, weight, labels, objective, chunk_size, temperature, with_entropy, metrics)
    return value, metrics
