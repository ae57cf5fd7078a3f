"""The trainer layer: TRL's GRPO trainers with their loss delegated to the loss layer.

Two trainers, each a TRL-style config/trainer pair at the top of this package, and their parts in subpackages:

- synchronous: `grpo_config` (`RLLossGRPOConfig`, TRL's `GRPOConfig` plus the `rl_loss:` block and the options TRL
  lacks) and `grpo_trainer` (`RLLossGRPOTrainer`, TRL's override points, each labelled with the TRL method it
  replaces); its parts in `sync/` (checkpoints, non-finite guard, dynamic sampling, old log-probs, SP data, saving);
- asynchronous: `async_grpo_config`, `async_grpo_trainer` (`RLLossAsyncGRPOConfig`, `RLLossAsyncGRPOTrainer`, TRL's
  experimental async trainer with the loss layer, imported on first use: `trl.experimental` warns on import); its
  parts in `async_/`: the trainer's mixins (staleness and every lag rule, packed rows, their attention, resume,
  routing replay) and, in `async_/rollout/`, what runs in the rollout worker's process (the HF-`generate` and vLLM
  workers, their loop, scoring and tool calling, and the weight transfer for machines without a vLLM server or NCCL);
- shared by both: `common/` (forwards, LM head, reference model, engines, packing, SP batches, rollout recording,
  group advantages, multimodal inputs, vLLM's CPU build made reloadable).

The layer imports TRL, of the releases it is tested with (`check_trl_version`: another one is refused at import); it
sits on the loss layer (`hf_rlloss.loss`) and the parallelism layer (`hf_rlloss.parallel`), and of the recipe
support only the Hub card helper. `docs/layout.md` maps every module.
"""

import importlib.metadata
import os
import warnings

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

# ---------------------------------------------------------------------------------------------------------------
# The TRL releases the trainers are tested with. They override private methods of TRL's `GRPOTrainer` and
# `AsyncGRPOTrainer`, which TRL may change in any release. The tested releases are the package's own requirement on
# `trl` (pyproject.toml's `dependencies`, read back from the installed metadata: one home, so the two cannot drift).
# Another installed TRL is refused at import with an `ImportError`, unless `HF_RLLOSS_ALLOW_UNTESTED_TRL=1` turns it
# into a warning; run from a source tree that was never installed (no `hf-rlloss` metadata), nothing is checked. The
# loss layer (`hf_rlloss.loss`) imports no TRL and is not checked.

#: The environment variable that turns the error about an untested TRL release into a warning (`"1"`).
ALLOW_UNTESTED_TRL = "HF_RLLOSS_ALLOW_UNTESTED_TRL"


def tested_trl_range(requirements: list[str] | None = None) -> SpecifierSet | None:
    """The TRL releases the trainers are tested with: the specifier of the package's requirement on `trl`.

    Args:
        requirements (`list[str]`, *optional*): requirement strings as `importlib.metadata.requires` gives them;
            defaults to the installed `hf-rlloss` distribution's.

    Returns:
        `SpecifierSet` (e.g. `==1.16.0`), or `None` when the package metadata is not available (a source tree that
        was never installed) or names no unconditional `trl` requirement.
    """
    if requirements is None:
        try:
            requirements = importlib.metadata.requires("hf-rlloss")
        except importlib.metadata.PackageNotFoundError:
            return None
    for line in requirements or []:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) != "trl":
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            return requirement.specifier
    return None


def check_trl_version(installed: str | None = None, tested: SpecifierSet | None = None) -> None:
    """Refuse a TRL release outside the tested range (`tested_trl_range`) with an `ImportError` naming both and the
    escape hatch; with `HF_RLLOSS_ALLOW_UNTESTED_TRL=1`, warn instead. Nothing is checked without a tested range.

    Args:
        installed (`str`, *optional*): the TRL version; defaults to the installed distribution's (TRL is not imported).
        tested (`SpecifierSet`, *optional*): the tested range; defaults to `tested_trl_range()`.
    """
    tested = tested_trl_range() if tested is None else tested
    if tested is None:
        return
    installed = importlib.metadata.version("trl") if installed is None else installed
    if tested.contains(installed, prereleases=True):
        return
    message = (
        f"hf_rlloss's trainers are tested with trl{tested}, but trl {installed} is installed: they override private "
        f"methods of TRL's GRPOTrainer and AsyncGRPOTrainer, which change between TRL releases. Install a tested "
        f"release (pip install 'trl{tested}'), or set {ALLOW_UNTESTED_TRL}=1 to import them anyway (a warning "
        "instead of this error), and run the test suite against it before training"
    )
    if os.environ.get(ALLOW_UNTESTED_TRL) == "1":
        warnings.warn(message, UserWarning, stacklevel=2)
        return
    raise ImportError(message)


check_trl_version()  # before TRL is imported

from .common.vllm_cpu import silence_trl_vllm_version_warning  # noqa: E402

silence_trl_vllm_version_warning()  # before TRL is imported: it warns at import when vLLM 0.32 is installed

from .grpo_config import RLLossGRPOConfig  # noqa: E402
from .grpo_trainer import RLLossGRPOTrainer  # noqa: E402

_ASYNC = {"RLLossAsyncGRPOConfig": "async_grpo_config", "RLLossAsyncGRPOTrainer": "async_grpo_trainer"}


def __getattr__(name: str):
    if name in _ASYNC:
        import importlib

        return getattr(importlib.import_module(f".{_ASYNC[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RLLossAsyncGRPOConfig", "RLLossAsyncGRPOTrainer", "RLLossGRPOConfig", "RLLossGRPOTrainer"]
