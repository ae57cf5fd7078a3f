"""Log-probs of the sampled tokens straight from hidden states, in token chunks, without `(tokens, vocab)` logits.

Two entry points:

* :func:`chunked_logprobs` — a no-grad pass for old/reference/sequence-statistic log-probs (and the full-vocabulary
  entropy).
* :func:`chunked_objective` — forward *and* backward of a token-separable objective ``J(log π(o_1), …, log π(o_N))``
  in one sweep: for each chunk of tokens it computes the logits, ``log π`` of the labels, the objective's gradient
  w.r.t. those log-probs (autograd on an ``(n,)`` vector), and from it the gradients w.r.t. the hidden states and the
  head weight. Only one ``(chunk, vocab)`` block exists at a time, and the backward pass only scales the saved
  gradients. That is three GEMMs of ``tokens × hidden × vocab`` in all — the matmul limit of the machine.

Both operate on flat tensors of the valid tokens: ``hidden (N, H)``, ``labels (N,)``. Logits are
``(hidden @ weightᵀ) / temperature`` in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .metrics import accumulate_metrics

ChunkObjective = Callable[[torch.Tensor, slice, torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _chunk_log_softmax(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(logits), log π(label))`` of one chunk: ``(n, V)`` float32 and ``(n,)``."""
    logits = hidden @ weight.t()
    logits = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # in place: now log-probabilities
    return logits, logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (log-softmax needs it), float64 stays float64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


@torch.no_grad()
def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and optionally the full-vocabulary entropy) under ``softmax(hidden @ weightᵀ / T)``.

    Args:
        hidden (`torch.Tensor`): `(N, H)` hidden states of the valid tokens.
        weight (`torch.Tensor`): `(V, H)` LM-head weight.
        labels (`torch.Tensor`): `(N,)` token ids in `[0, V)`.
        temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
        chunk_size (`int`, *optional*, defaults to `512`): tokens per chunk; peak memory ~ `chunk_size × V × 4` bytes.
        with_entropy (`bool`, *optional*, defaults to `False`): also return the entropy of each token's distribution.

    Returns:
        `(torch.Tensor, torch.Tensor | None)`: `(N,)` float32 log-probs and `(N,)` entropies (or `None`).
    """
    n = labels.shape[0]
    dtype = _compute_dtype(hidden.dtype)
    logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
    entropy = torch.empty(n, dtype=dtype, device=hidden.device) if with_entropy else None
    for start in range(0, n, chunk_size):
        sl = slice(start, min(start + chunk_size, n))
        log_probs, logprobs[sl] = _chunk_log_softmax(hidden[sl], weight, labels[sl], temperature)
        if entropy is not None:
            entropy[sl] = _entropy_from_log_probs(log_probs)
    return logprobs, entropy


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
            log_probs, token_logprobs = _chunk_log_softmax(h, weight, labels[sl], temperature)
            entropy = _entropy_from_log_probs(log_probs) if with_entropy else None
            with torch.enable_grad():
                lp = token_logprobs.detach().requires_grad_(True)
                value, metrics = objective(lp, sl, entropy)
                (grad_lp,) = torch.autograd.grad(value, lp, allow_unused=True)
            total += value.detach().to(dtype)
            accumulate_metrics(metrics_out, metrics)
            if grad_lp is None or not (need_h or need_w):
                continue
            # d log π(y) / d logits = onehot(y) − softmax; reuse the log-prob buffer for the logits' gradient.
            grad_logits = log_probs.exp_().mul_(-grad_lp.unsqueeze(-1))
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
        ctx.save_for_backward(grad_hidden if need_h else None, grad_weight.to(weight.dtype) if need_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    objective: ChunkObjective,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
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
    value = _ChunkedObjective.apply(hidden, weight, labels, objective, chunk_size, temperature, with_entropy, metrics)
    return value, metrics
