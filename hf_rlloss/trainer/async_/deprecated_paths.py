"""The import paths of the rollout process' modules before they had a subpackage of their own (`async_/rollout/`),
kept for one release: importing one warns once (`DeprecationWarning`, naming where its names are now), and each of
its names is the object at its new path.

`MOVED` maps each old module to the modules its names are read from, in order; `MovedPathsFinder` (installed by
`async_/__init__.py`) makes each old path a module whose attributes are read from them on access.

Example:

```python
>>> import warnings
>>> from hf_rlloss.trainer.async_ import rollout
>>> with warnings.catch_warnings(record=True):
...     from hf_rlloss.trainer.async_ import cpu_rollout  # the previous release's path
>>> cpu_rollout.HFGenerateRolloutWorker is rollout.HFGenerateRolloutWorker
True
```
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "MovedPathsFinder", "install"]

_ASYNC = "hf_rlloss.trainer.async_"
_ROLLOUT = f"{_ASYNC}.rollout"

# old module → the modules its names are now read from (the first is the one the warning names first)
MOVED: dict[str, tuple[str, ...]] = {
    f"{_ASYNC}.cpu_rollout": (
        _ROLLOUT,
        f"{_ROLLOUT}.hf_generate",
        f"{_ASYNC}.staleness",
        "hf_rlloss.trainer.common.advantages",
    ),
    f"{_ASYNC}.vllm_rollout": (f"{_ROLLOUT}.vllm",),
    f"{_ASYNC}.worker": (f"{_ROLLOUT}.worker",),
    f"{_ASYNC}.worker_loop": (f"{_ROLLOUT}.loop", f"{_ASYNC}.staleness"),
    f"{_ASYNC}.process": (f"{_ROLLOUT}.process",),
    f"{_ASYNC}.channel": (f"{_ROLLOUT}.channel",),
    f"{_ASYNC}.episodes": (f"{_ROLLOUT}.tool_calling.episodes",),
    f"{_ASYNC}.scoring": (
        f"{_ROLLOUT}.scoring",
        f"{_ROLLOUT}.tool_calling.episodes",
        "hf_rlloss.trainer.common.advantages",
    ),
    f"{_ASYNC}.multiturn": (
        f"{_ROLLOUT}.tool_calling.rollouts",
        f"{_ROLLOUT}.tool_calling",
        f"{_ROLLOUT}.tool_calling.episodes",
    ),
    f"{_ASYNC}.tool_calls": (f"{_ROLLOUT}.tool_calling.runner",),
    f"{_ASYNC}.trl_tool_loop": (f"{_ROLLOUT}.tool_calling.trl_loop",),
    f"{_ASYNC}.routing": (f"{_ASYNC}.routing_replay",),
}


def _reader(old: str, sources: list[ModuleType]):
    """The old module's `__getattr__`: each name read from the first of `sources` that has it."""

    def __getattr__(name: str) -> Any:
        for source in sources:
            if name in vars(source):
                return vars(source)[name]
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__


class MovedPathsFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder and loader of the `MOVED` paths: the module it makes warns once, when it is first imported,
    and reads each name from the new modules."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        old, new = module.__name__, MOVED[module.__name__]
        warnings.warn(
            f"`{old}` is deprecated and will be removed in the next release: import its names from "
            + " or ".join(f"`{n}`" for n in new),
            DeprecationWarning,
            stacklevel=2,  # the importing line (the import system's frames are skipped)
        )
        sources = [importlib.import_module(n) for n in new]
        module.__getattr__ = _reader(old, sources)
        module.__doc__ = f"Deprecated: the names of `{new[0]}`."


def install() -> None:
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, MovedPathsFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedPathsFinder())
