"""The rollout state of the asynchronous trainer's checkpoints with hf_rlloss' rollout workers
(`HFGenerateRolloutWorker`, `VLLMRolloutWorker`), in TRL's file and keys: TRL 1.16 writes and reads
`rollout_state.json` (`prompt_index`, `model_version`) for its own vLLM worker only, and a run resumed with another
worker starts again at the first prompt.

* `prompt_index`: the first prompt (counted from the start of training, over epochs) of which no sample was trained.
  The samples generated but not trained at the save (pulled ahead by the trainer's dataloader, in the queue, being
  generated) are not saved: the resumed worker generates them again from there, each batch under the same seed
  (`rollout/loop.py`'s `batch_seed`). The prompts counted as trained are those of the micro-batches the optimizer steps
  trained (`RLLossAsyncGRPOTrainer.get_batch_samples`), not TRL's collator count, which also holds the micro-batch
  pulled ahead for the next step.
* `model_version`: the policy version counter (the staleness of a sample is measured in it; the worker tags its
  samples with it).
* `rollout_weights`, with the worker's `fixed_lag` only: the policy versions the batches from `prompt_index` on are
  sampled from, one safetensors file each in `rollout_weights/`. They are older than the checkpoint's weights (the
  pipeline is `fixed_lag` steps deep), so the resumed worker loads them, and the trainer's cold weight sync is skipped
  (the newest of them is the last version the trainer sent). The regenerated samples are then the uninterrupted run's,
  bit for bit, and so is the training. Without `fixed_lag` the worker samples from the newest weights, which depends
  on timing; the resumed worker starts from the checkpoint's weights, which the trainer's cold sync sends under the
  saved `model_version` (the version they are), so the counter continues the interrupted run's exactly.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "ROLLOUT_STATE",
    "first_untrained",
    "load_rollout_state",
    "restore_rollout",
    "resumable",
    "save_rollout_state",
]

ROLLOUT_STATE = "rollout_state.json"  # TRL's name
WEIGHTS_DIR = "rollout_weights"


def resumable(worker: Any) -> bool:
    """Whether `worker` can be told where to resume (hf_rlloss' workers; TRL's own is restored by TRL)."""
    return callable(getattr(worker, "restore", None)) and hasattr(worker, "start_group")


def first_untrained(trained: set[int]) -> int:
    """The smallest group id (counted from the worker's start) with no trained sample."""
    return next(g for g in itertools.count() if g not in trained)


def save_rollout_state(checkpoint_dir: str, worker: Any, transfer: Any, trained: set[int], model_version: int) -> dict:
    """Write `rollout_state.json` (and, under `fixed_lag`, the policy versions still to sample from) into
    `checkpoint_dir`; returns the state written."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    prompt_index = worker.start_group + first_untrained(trained)
    state: dict[str, Any] = {"prompt_index": prompt_index, "model_version": int(model_version)}
    if getattr(worker, "fixed_lag", None) is not None:
        from safetensors.torch import save_file

        versions = range(worker.version_for_group(prompt_index), int(model_version) + 1)
        missing = [v for v in versions if v not in transfer.history]
        if missing:
            raise RuntimeError(f"rollout state: policy versions {missing} are no longer kept (fixed_lag)")
        os.makedirs(os.path.join(checkpoint_dir, WEIGHTS_DIR), exist_ok=True)
        state["rollout_weights"] = {}
        for version in versions:
            name = f"{WEIGHTS_DIR}/v{version}.safetensors"
            save_file(transfer.history[version], os.path.join(checkpoint_dir, name))
            state["rollout_weights"][str(version)] = name
    path = os.path.join(checkpoint_dir, ROLLOUT_STATE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    return state


def load_rollout_state(checkpoint_dir: str) -> dict | None:
    """The checkpoint's rollout state, or `None` (logged) when it has none."""
    path = os.path.join(checkpoint_dir, ROLLOUT_STATE)
    if not os.path.isfile(path):
        logger.warning(f"{path} not found: the rollout worker starts again at the first prompt")
        return None
    with open(path) as f:
        return json.load(f)


def restore_rollout(state: dict, checkpoint_dir: str, worker: Any, transfer: Any) -> None:
    """Tell `worker` (before it starts) where to resume and which policy versions to sample from; under `fixed_lag`
    the transfer keeps those versions again (a later checkpoint may need them)."""
    weights = [(int(v), os.path.join(checkpoint_dir, name)) for v, name in state.get("rollout_weights", {}).items()]
    if getattr(worker, "fixed_lag", None) is not None and not weights:
        raise ValueError(
            f"{checkpoint_dir}/{ROLLOUT_STATE} has no rollout_weights: it was saved by a worker without fixed_lag, "
            "and the policy versions its next batches are sampled from are gone; resume without fixed_lag"
        )
    worker.restore(int(state["prompt_index"]), weights)
    worker.update_model_version(int(state["model_version"]))
    if weights:
        from safetensors.torch import load_file

        for version, path in weights:
            transfer.keep(version, load_file(path))


def __getattr__(name: str) -> Any:
    """`check_fixed_lag_setup`, whose home is `staleness` with the other lag rules: read from there, with a
    `DeprecationWarning`, for one release."""
    if name == "check_fixed_lag_setup":
        import warnings

        from . import staleness

        warnings.warn(
            f"{__name__}.check_fixed_lag_setup is deprecated and will be removed in the next release: import it "
            f"from {staleness.__name__}",
            DeprecationWarning,
            stacklevel=2,
        )
        return staleness.check_fixed_lag_setup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
