"""Device-independent proxies of GPU cost, counted on any device: the operators a step dispatches and its host syncs.

On a GPU each dispatched operator is (at least) one kernel launch, and each host sync waits for every launched kernel
to finish before the Python program can go on: the pipeline drains. Both are properties of the code path, not of the
device, so they are counted here on the CPU with the same code a CUDA run takes.

`DispatchCounts` is a `TorchDispatchMode`: it sees every ATen operator that reaches a kernel (after autograd and the
composite decompositions; the backward's operators too, which run on the calling thread on the CPU), and counts

* `ops`: every operator, by name;
* `syncs`: the operators and tensor methods that read device memory back to the host, by name:
  - `aten._local_scalar_dense` (`.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`),
  - operators whose output shape depends on the data (`nonzero`, `masked_select`, `unique*`, `repeat_interleave`
    without `output_size`, and indexing with a boolean mask, which runs `nonzero`),
  - `Tensor.tolist`, `Tensor.cpu` and `Tensor.numpy`, which copy to the host (patched while counting: on a CPU they
    dispatch nothing).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNC_OPS", "DispatchCounts"]

#: ATen operators that read device memory back to the host, or size their output from the data.
SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
})  # fmt: skip
_HOST_COPIES = ("tolist", "cpu", "numpy")


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SYNC_OPS:
        return True
    if name == "aten.repeat_interleave.Tensor":
        return kwargs.get("output_size") is None  # the output's length is the sum of the repeats
    if name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


class DispatchCounts(TorchDispatchMode):
    """Counts the operators dispatched and the host syncs inside `with DispatchCounts() as counts:` (see the module
    docstring); `counts.ops` and `counts.syncs` are `collections.Counter`s by name, `counts.total_ops` and
    `counts.total_syncs` their totals."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self._patched: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops[name] += 1
        if _is_sync(name, args, kwargs):
            self.syncs[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for method in _HOST_COPIES:
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def counted(tensor, *args, _original=original, _name=f"Tensor.{method}", **kwargs):
                self.syncs[_name] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, original in self._patched.items():
                setattr(torch.Tensor, method, original)
            self._patched.clear()

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())
