"""vLLM's CPU build, made fit for training: weights that can be reloaded while the engine runs.

vLLM's CPU backend prepares every linear layer for inference when the model is loaded
(`vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm`, called from each linear method's
`process_weights_after_loading`): it packs the weight into a oneDNN / sgl-kernel layout held by a closure
(`layer.cpu_linear`) and, for the linear layers, replaces `layer.weight` by an empty parameter without the
`weight_loader` that `model.load_weights` writes through. A trainer that pushes its weights into the engine after
each optimizer step (TRL's colocate mode, `VLLMGeneration.sync_weights`; the asynchronous trainer's
`async_.rollout.vllm.VLLMRolloutWorker`) then fails at the first sync with ``'Parameter' object has no attribute
'weight_loader'``, and the LM head, whose weight is kept, would still compute with the packed copy of the initial
weights.

`use_reloadable_cpu_linear` replaces that one function with one that keeps the plain parameter and computes with
`torch.nn.functional.linear` (the fallback vLLM itself uses where no packed kernel applies), so `load_weights` writes
the weights the layer computes with. The cost is vLLM's packed-GEMM speed-up, small for the models a CPU trains.
It is applied only where vLLM's platform is the CPU, and only in the process that builds the engine, before it is
built (the layers are prepared at load time); weights that are not 2-D (MoE experts, causal convolutions) keep
vLLM's own preparation.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable

import torch

__all__ = ["TESTED_VLLM", "is_vllm_importable", "silence_trl_vllm_version_warning", "use_reloadable_cpu_linear"]

#: The vLLM release the CPU path is tested with (`scripts/install_vllm_cpu.sh`, `tests/test_vllm.py`).
TESTED_VLLM = "0.32"


def is_vllm_importable() -> bool:
    """Whether the `vllm` module is installed, without importing it (importing vLLM changes the process: it binds
    OpenMP threads and replaces `torch.set_num_threads`)."""
    return importlib.util.find_spec("vllm") is not None


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def reloadable(dispatch: Callable[[torch.nn.Module, bool], None]) -> Callable[[torch.nn.Module, bool], None]:
    @functools.wraps(dispatch)
    def dispatch_reloadable_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # not a linear layer: vLLM's own preparation
            return dispatch(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # reads layer.weight at every call, as load_weights left it

    dispatch_reloadable_cpu_gemm.hf_rlloss_reloadable = True
    return dispatch_reloadable_cpu_gemm


def use_reloadable_cpu_linear() -> bool:
    """Make the linear layers of vLLM engines built afterwards in this process reloadable on CPU (see the module
    docstring); idempotent. Returns whether it applies (vLLM's platform is the CPU), doing nothing otherwise."""
    if not _is_cpu_platform():
        return False
    from vllm.model_executor.layers import utils

    if not getattr(utils.dispatch_cpu_unquantized_gemm, "hf_rlloss_reloadable", False):
        # linear.py and vocab_parallel_embedding.py import the function from this module at each call
        utils.dispatch_cpu_unquantized_gemm = reloadable(utils.dispatch_cpu_unquantized_gemm)
    return True


def silence_trl_vllm_version_warning() -> None:
    """TRL 1.16 warns that it supports vLLM 0.22-0.31 each time it checks for vLLM; the CPU build is 0.32, which the
    trainers are tested with (`tests/test_vllm.py`). Only that warning, for that release, is silenced."""
    warnings.filterwarnings(
        "ignore",
        message=r"TRL currently supports vLLM versions from 0\.22\.0 to 0\.31\.0\. You have version "
        + TESTED_VLLM.replace(".", r"\.")
        + r"\.",
        category=UserWarning,
    )
