"""Whether bf16 autocast is worth it on this CPU, and the recipes' fallback to float32 where it is not.

A bf16 matrix multiply on a CPU runs on oneDNN's bf16 kernels when the CPU has AVX-512 (natively with AVX512_BF16 or
AMX, emulated in AVX-512 registers otherwise). On a CPU with AVX2 only, oneDNN has no bf16 path and autocast falls back
to reference kernels: one optimizer step of the SmolLM2-135M demo took 5 to 6 minutes on a 2-core AVX2 machine
(2026-12-03), against seconds in float32. The recipes therefore train in float32 on such a CPU unless told otherwise
(`cpu_bf16_fallback: false`), and say so in one line.
"""

from __future__ import annotations

import os

import torch


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN runs bf16 matrix multiplies on this CPU (AVX-512 or better); False on AVX2-only CPUs.

    torch exposes this test only as a private op (`torch.ops.mkldnn._is_mkldnn_bf16_supported`, the check its own
    CPU autocast tests use); where that op is missing, the public CPU capability (`AVX512` or above) stands in.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def needs_float32_fallback(bf16: bool, use_cpu: bool, fallback: bool) -> bool:
    """Whether a recipe that asked for bf16 should train in float32: it trains on the CPU (`use_cpu`, or no
    accelerator present), the CPU lacks fast bf16 kernels, and the fallback is allowed."""
    on_cpu = use_cpu or not (torch.cuda.is_available() or torch.xpu.is_available())
    return bf16 and fallback and on_cpu and not cpu_has_fast_bf16()


FALLBACK_NOTE = (
    "bf16 autocast on this CPU ({capability}, no AVX-512) runs on slow reference kernels (minutes per step): "
    "training in float32 instead (bf16: false, mixed_precision: no). Set cpu_bf16_fallback: false to keep bf16."
)


def usable_cpu_count() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one (Linux), else every core (macOS and
    Windows have no `os.sched_getaffinity`)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
