"""Tolerances derived from the precision and the operation, not tuned on one machine.

Two computations of the same quantity that differ only in the order of their floating-point additions (stock TRL
and the loss layer; a packed and a padded forward; two CPUs whose BLAS blocks a matmul differently, e.g. AVX-512
with AMX against AVX2) each lie within ``γ_{n-1} Σ|x_i|`` of the exact sum of their ``n`` terms, where
``γ_k = k·u / (1 − k·u)`` and ``u`` is the unit round-off of the dtype (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., §4.2). So they differ from each other by at most ``2·γ_{n-1} Σ|x_i|``:
:func:`reordered_sum` returns that factor. Where the quantity should be exact (same operations in the same order),
compare it exactly instead.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u``: half the distance from 1 to the next representable number (float32: 2⁻²⁴ ≈ 6.0e-8)."""
    return torch.finfo(dtype).eps / 2


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """``γ_k = k·u / (1 − k·u)``: the relative error bound of ``k`` successive roundings (requires ``k·u < 1``)."""
    ku = k * unit_roundoff(dtype)
    assert ku < 1, f"{k} roundings of {dtype} bound nothing"
    return ku / (1 - ku)


def reordered_sum(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Largest difference between two evaluation orders of a sum of ``n`` terms, relative to ``Σ|x_i|``."""
    return 2 * gamma(max(n - 1, 1), dtype)


def step_tokens(args: dict) -> int:
    """Completion tokens one optimizer step reduces over: the per-token terms of every logged loss metric."""
    return args["per_device_train_batch_size"] * args["max_completion_length"] * args["gradient_accumulation_steps"]
