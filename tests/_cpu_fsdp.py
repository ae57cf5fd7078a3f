"""TEST-ONLY shim: let Accelerate run real FSDP2 on CPU (gloo), so that the FSDP2 code paths are tested here.

Why it exists: `AcceleratorState.__init__` (accelerate/state.py) only turns `ACCELERATE_USE_FSDP` / an `fsdp_plugin`
into `DistributedType.FSDP` when the processes run on an accelerator (`MULTI_GPU`, `MULTI_XPU`, ...). On CPU the
distributed type is `MULTI_CPU`, so an FSDP config silently trains with DDP and no FSDP code path ever runs. torch's
`fully_shard` itself works on CPU with gloo, so after Accelerate's own initialization this shim switches the state to
`FSDP` with the plugin Accelerate built, exactly what the accelerator branch does (`distributed_type`, `fsdp_plugin`,
the plugin's mixed precision, and `PartialState`'s copy of the type). Everything else (the device `cpu`, the gloo
backend, `fsdp2_prepare_model`, saving) is Accelerate's, unmodified. Never import this outside tests.

Use `enable_cpu_fsdp()` before the `Accelerator` (the trainer) is built, or launch a script through this file:
`accelerate launch --config_file fsdp2_cpu.yaml tests/_cpu_fsdp.py SCRIPT [ARGS...]`.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType


def enable_cpu_fsdp() -> None:
    """Patch `AcceleratorState.__init__` so that an FSDP plugin on CPU gives `DistributedType.FSDP` (idempotent)."""
    init = AcceleratorState.__init__
    if getattr(init, "_cpu_fsdp_shim", False):
        return

    @functools.wraps(init)
    def patched(self, *args, fsdp_plugin=None, **kwargs):
        initialized = "_mixed_precision" in AcceleratorState._shared_state  # set by the first full initialization
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        use_fsdp = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if initialized or not use_fsdp or self.distributed_type != DistributedType.MULTI_CPU:
            return
        if fsdp_plugin is None:
            raise RuntimeError("cpu FSDP shim: ACCELERATE_USE_FSDP is set but the Accelerator built no fsdp_plugin")
        # The branch accelerate/state.py runs for MULTI_GPU & co., applied to MULTI_CPU.
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type
        print(f"cpu FSDP shim: rank {self.process_index} runs FSDP{fsdp_plugin.fsdp_version} on CPU", file=sys.stderr)

    patched._cpu_fsdp_shim = True
    AcceleratorState.__init__ = patched


def main() -> None:
    """`python tests/_cpu_fsdp.py SCRIPT [ARGS...]`: run SCRIPT as `__main__` with the shim installed."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: tests/_cpu_fsdp.py SCRIPT [ARGS...]")
    enable_cpu_fsdp()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
