"""Temporary changes around a call into TRL: attributes set for the call (`overridden`), and the deprecation warnings
TRL's own calls raise silenced for it (`trl_deprecated_aliases_silenced`), so that a user's own use still warns."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["overridden", "trl_deprecated_aliases_silenced"]


@contextlib.contextmanager
def overridden(obj: Any, **values: Any) -> Iterator[None]:
    """`obj`'s attributes set to `values` inside the block, restored on exit (also on an error)."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


# TRL 1.16 calls these deprecated aliases around generation and scoring, and PEFT's `get_peft_model` (called by TRL's
# __init__) reads one; transformers keeps them working until v6.
_TRL_DEPRECATED_ALIASES = r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)`"


@contextlib.contextmanager
def trl_deprecated_aliases_silenced() -> Iterator[None]:
    """transformers' deprecation warnings for the aliases TRL calls, silenced inside the block only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRL_DEPRECATED_ALIASES + " is deprecated", category=FutureWarning)
        yield
