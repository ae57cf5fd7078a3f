"""The tests' name for the launcher they share with the benchmarks (`benchmarks/shared/launch.py`): a free port, a
hard timeout, and every worker ended BY PID."""

from benchmarks.shared.launch import (  # noqa: F401
    LAUNCH_ENV,
    ROOT,
    accelerate_launch,
    accelerate_launch_machines,
    cpu_accelerate_config,
    free_port,
    kill_tree,
    launch_once,
    python_module,
    run,
    run_all,
    torchrun,
)
