"""The one place that bridges the transformers releases the package supports (`>=5.17`; see docs/compatibility.md).

transformers 5.23 renamed gradient checkpointing to activation checkpointing: the arguments
`TrainingArguments.gradient_checkpointing*` became `activation_checkpointing*`, and the model methods
`gradient_checkpointing_enable/disable` and `is_gradient_checkpointing` became `activation_checkpointing_*` and
`is_activation_checkpointing` (the old names warn from 5.23 on and go in v6). vLLM pins transformers below 5.21
(0.31: `<5.18`), so a vLLM user runs the old names.

transformers 5.24 renamed the cache argument of the forwards and of `generate` from `past_key_values` to `cache`
(`CACHE_ARGUMENT`: the installed release's name; the shared-prompt prefill hands its cache over under it).

Users and recipes write the new names on every release: on a transformers without them, both configs declare
`activation_checkpointing` and `activation_checkpointing_kwargs` themselves (`checkpointing_field`) and copy them onto
the old fields before `TrainingArguments.__post_init__` reads those (`to_old_checkpointing_names`). The trainers call
the model through `is_checkpointing`, `enable_checkpointing` and `disable_checkpointing`, never through either name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from transformers import TrainingArguments

__all__ = [
    "CACHE_ARGUMENT",
    "RENAMED_CHECKPOINTING",
    "checkpointing_argument",
    "checkpointing_field",
    "disable_checkpointing",
    "enable_checkpointing",
    "is_checkpointing",
    "to_new_checkpointing_names",
    "to_old_checkpointing_names",
    "transformers_at_least",
]


def transformers_at_least(release: str) -> bool:
    """Whether the installed transformers is `release` or newer (a feature or a model family that needs it)."""
    from packaging.version import Version
    from transformers import __version__

    return Version(__version__) >= Version(release)


def _cache_argument() -> str:
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


#: The keyword under which a forward and `generate` take a KV cache: `cache` from transformers 5.24 on.
CACHE_ARGUMENT = _cache_argument()

#: Whether this transformers has the 5.23 names (`TrainingArguments.activation_checkpointing`).
RENAMED_CHECKPOINTING = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}


def checkpointing_field(name: str) -> Any:
    """A new dataclass field for `name` (`activation_checkpointing` or `activation_checkpointing_kwargs`), which a
    config declares on a transformers without the new names, so that they work on every release."""
    what = {"activation_checkpointing": "Activation (gradient) checkpointing", "activation_checkpointing_kwargs":
            "Keyword arguments of activation checkpointing (`use_reentrant`, ...)"}[name]  # fmt: skip
    return dataclasses.field(default=None, metadata={"help": f"{what}: transformers 5.23's name, on older ones too."})


_PAIRS = (("activation_checkpointing", "gradient_checkpointing"),
          ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"))  # fmt: skip


def checkpointing_argument(on: bool) -> dict[str, bool]:
    """The keyword that turns activation checkpointing on or off in a stock `TrainingArguments` (TRL's configs) of
    the installed transformers: `{"activation_checkpointing": on}`, or before 5.23 `{"gradient_checkpointing": on}`."""
    return {"activation_checkpointing" if RENAMED_CHECKPOINTING else "gradient_checkpointing": on}


def to_old_checkpointing_names(args: Any) -> None:
    """Before `TrainingArguments.__post_init__` on a transformers without the new names: each new name that is set
    copied onto the old one, which transformers and TRL read there. The new name wins, as transformers >= 5.23 has it
    (there the old name is used only when the new one is unset), so a copy of the args that changes it takes effect."""
    if RENAMED_CHECKPOINTING:
        return
    for new, old in _PAIRS:
        if getattr(args, new) is not None:
            setattr(args, old, getattr(args, new))


def to_new_checkpointing_names(args: Any) -> None:
    """After `TrainingArguments.__post_init__` on a transformers without the new names: the new names mirror the old
    ones, so that code and saved configs read the new names on every release."""
    if not RENAMED_CHECKPOINTING:
        for new, old in _PAIRS:
            setattr(args, new, getattr(args, old))


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation checkpointing is on in `model` (a transformers model, or a PEFT model around one)."""
    return model.is_activation_checkpointing if RENAMED_CHECKPOINTING else model.is_gradient_checkpointing


def enable_checkpointing(model: nn.Module, kwargs: dict | None = None) -> None:
    """Turn activation checkpointing on in `model`, with transformers' `kwargs` (`use_reentrant`, ...)."""
    if RENAMED_CHECKPOINTING:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: nn.Module) -> None:
    """Turn activation checkpointing off in `model`."""
    if RENAMED_CHECKPOINTING:
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
