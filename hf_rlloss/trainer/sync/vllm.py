"""vLLM rollouts for `RLLossGRPOTrainer`: what is checked before and after TRL builds the engine.

TRL builds the engine (`trl.generation.vllm_generation.VLLMGeneration`) and samples with it; the loss layer reads the
per-token log-probs vLLM reports for the sampled tokens (`sampling_per_token_logps`) as the rollout log-probs of
rollout IS and the mismatch metrics. Here:

* `check_vllm_config` (at configuration): the settings that cannot work or cannot be exact are refused, naming the
  option: server mode off CUDA (TRL syncs the weights to the server over NCCL only), and rollout IS against vLLM's
  log-probs on the full vocabulary under truncated sampling (vLLM reports them on the sampled support only).
* `prepare_vllm_engine` (before the engine is built, in the process that builds it): on vLLM's CPU backend, linear
  layers that can be reloaded (`vllm_cpu.use_reloadable_cpu_linear`), without which the first weight sync fails.
* `check_vllm_logprobs_mode` (after): vLLM reports the log-probs of the distribution it samples from (after
  temperature, penalties and truncation) only with `logprobs_mode="processed_logprobs"`; TRL sets it in colocate mode
  and checks the server's only for its own correction (`vllm_importance_sampling_correction`). The same check is
  made for `rl_loss.rollout_is`, and for the mismatch metrics (a warning: they would compare the trainer's tempered
  log-probs with raw ones).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import logging

from ..common.vllm_cpu import is_vllm_importable, silence_trl_vllm_version_warning, use_reloadable_cpu_linear

__all__ = ["check_vllm_config", "check_vllm_logprobs_mode", "prepare_vllm_engine"]

logger = logging.get_logger(__name__)

PROCESSED = "processed_logprobs"


def _truncation(args: Any) -> dict[str, Any]:
    """The truncating sampling settings vLLM samples with (TRL's top_k/top_p/min_p; generation_kwargs override)."""
    overrides = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    settings = {name: overrides.get(name, getattr(args, name, None)) for name in ("top_k", "top_p", "min_p")}
    off = {"top_k": (None, 0, -1), "top_p": (None, 1.0), "min_p": (None, 0.0)}
    return {name: value for name, value in settings.items() if value not in off[name]}


def check_vllm_config(args: Any, rollout_is_enabled: bool) -> None:
    """Refuse, at configuration, the vLLM settings that cannot work or cannot be exact (see the module docstring)."""
    if not args.use_vllm:
        return
    if args.vllm_mode == "server" and (args.use_cpu or not torch.cuda.is_available()):
        raise ValueError(
            "vllm_mode='server' needs a CUDA device: TRL sends the trained weights to the vLLM server over NCCL only "
            "(VLLMClient.init_communicator), so the server would sample from the initial weights for ever. On CPU use "
            "vllm_mode='colocate' (vLLM in the training process), or RLLossAsyncGRPOTrainer with "
            "VLLMRolloutWorker and QueueWeightTransfer (vLLM in a process of its own, weights through a queue)"
        )
    truncation = _truncation(args)
    if rollout_is_enabled and truncation and args.rollout_logprobs_support == "full":
        settings = ", ".join(f"{k}={v}" for k, v in truncation.items())
        raise ValueError(
            f"rollout_logprobs_support='full' with use_vllm and truncated sampling ({settings}): vLLM reports the "
            "log-probs of the truncated distribution it samples from, never the full-vocabulary ones, so rollout IS "
            "cannot compare on the full vocabulary. Set rollout_logprobs_support='sampled' (π_old renormalized over "
            "the replayed support), or sample without truncation"
        )


def prepare_vllm_engine(args: Any) -> None:
    """Before TRL builds a colocated engine in this process: reloadable linear layers on vLLM's CPU backend."""
    if not args.use_vllm or args.vllm_mode != "colocate" or not is_vllm_importable():
        return  # without vLLM, TRL raises its own ImportError naming `pip install trl[vllm]`
    silence_trl_vllm_version_warning()
    use_reloadable_cpu_linear()


def _engine_logprobs_mode(trainer: Any) -> str | None:
    generation = trainer.vllm_generation
    if trainer.args.vllm_mode == "colocate":
        return generation.llm.llm_engine.model_config.logprobs_mode
    if trainer.accelerator.is_main_process:  # the server: TRL's client lives on the main process only
        return generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
    return None


def check_vllm_logprobs_mode(trainer: Any, rollout_is_enabled: bool) -> None:
    """After the engine is built: its log-probs must be those of the distribution it samples from."""
    if not trainer.use_vllm:
        return
    mode = _engine_logprobs_mode(trainer)
    if mode is None or mode == PROCESSED:
        return
    message = (
        f"the vLLM engine reports logprobs_mode={mode!r}, not the log-probs of the distribution it samples from "
        f"(after temperature, penalties and truncation): start the server with `--logprobs-mode {PROCESSED}`"
    )
    if rollout_is_enabled:
        raise ValueError(f"rl_loss.rollout_is: {message}")
    logger.warning(f"the mismatch metrics (mismatch/*, rollout_is/*) are biased: {message}")


def shutdown_vllm_engine(trainer: Any) -> None:
    """Shut a colocated engine down while the process groups it uses still exist; idempotent, nothing to do without
    one. `Accelerator.end_training()` destroys every process group, and an engine still alive then fails in its own
    shutdown at interpreter exit (vLLM's finalizer raises `ValueError: Invalid process group specified`). Call this
    before `end_training` (the recipes do)."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()  # vLLM's own teardown; a second call (its finalizer) does nothing
