"""One-process launches of the shipped ZeRO-3 and FSDP2 accelerate configs on one CUDA GPU, each asserting the engine
that ran. Run by `make gpu-check` (`scripts/gpu_check.py`, its `engines_cuda` step).

    python scripts/gpu_engines.py --out outputs/gpu-check/engines_cuda.json
    python scripts/gpu_engines.py --device cpu --out /tmp/engines.json      # the rehearsal: gloo, DeepSpeed's CPU
                                                                            # accelerator, the test-only FSDP2 shim

Each engine trains `tests/engine_matrix_script.py` (the engine-matrix tests' run: a tiny in-memory model, KL to the
reference, rollout IS, SGD, fixed completions) for 2 steps under `accelerate launch --num_processes 1` with the shipped
config (on CUDA: `accelerate_configs/<engine>.yaml` with one process; on the CPU: the same config made to run there,
`benchmarks/shared/launch.cpu_accelerate_config`). The check, per engine: the launch exited 0, the engine ran (ZeRO
stage 3 for `zero3`; an FSDP state with DTensor parameters for `fsdp2`), the parameters lived on the device, the
process group's backend was NCCL on CUDA (gloo on the CPU), every logged loss was finite and the parameters moved.
Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("zero3", "fsdp2")


def command(engine: str, device: str, work: Path, out: Path) -> list[str]:
    """The `accelerate launch` of one engine on `device`."""
    from benchmarks.shared.launch import accelerate_launch, cpu_accelerate_config, shipped_accelerate_config

    if device == "cuda":
        path = shipped_accelerate_config(engine, work, "1gpu", num_processes=1)
    else:
        path = cpu_accelerate_config(engine, work, num_processes=1)
    # on the CPU, FSDP2 needs the test-only shim that gives Accelerate a real FSDP state (tests/_cpu_fsdp.py)
    script = (
        ROOT / "tests" / ("fsdp2_script.py" if engine == "fsdp2" and device == "cpu" else "engine_matrix_script.py")
    )
    args = ["--out", str(out), "--device", device, "--steps", "2", *(["--zero3-init"] if engine == "zero3" else [])]
    return accelerate_launch(path, script, *args)


def check(engine: str, device: str, record: dict | None) -> list[str]:
    """What is wrong with one engine's record (empty: it passed)."""
    if record is None:
        return [f"{engine}: the launch wrote no record"]
    info, problems = record["engine"], []
    if engine == "zero3" and info["zero_stage"] != 3:
        problems.append(f"zero3: ZeRO stage {info['zero_stage']} ran ({info['distributed_type']})")
    if engine == "fsdp2" and not (info["dtensor_params"] and "FSDP" in info["distributed_type"]):
        problems.append(f"fsdp2: {info['distributed_type']} ran, DTensor parameters: {info['dtensor_params']}")
    if info.get("param_device") != device:
        problems.append(f"{engine}: the parameters were on {info.get('param_device')}, not {device}")
    backend = "nccl" if device == "cuda" else "gloo"
    if info.get("backend") != backend:
        problems.append(f"{engine}: backend {info.get('backend')}, expected {backend}")
    losses = record["losses"]
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"{engine}: losses {losses}")
    if not record["moved"] > 0:
        problems.append(f"{engine}: the parameters did not move")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    parser.add_argument("--out", default="outputs/gpu-check/engines_cuda.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.shared.launch import run

    out = Path(args.out)
    work = out.parent / "engines"
    work.mkdir(parents=True, exist_ok=True)
    # the launcher's environment (one thread a process, offline), DeepSpeed on the device's accelerator
    env = {"DS_ACCELERATOR": args.device}
    results = {}
    for engine in args.engines:
        record_path = work / f"{engine}.pt"
        record_path.unlink(missing_ok=True)
        proc = run(command(engine, args.device, work, record_path), args.timeout, cwd=ROOT, env=env)
        record = None
        if proc.returncode == 0 and record_path.exists():
            record = torch.load(record_path, weights_only=False)["sp1"]
        problems = check(engine, args.device, record)
        results[engine] = {"returncode": proc.returncode, "problems": problems,
                           "stderr_tail": proc.stderr[-2000:] if problems else None}  # fmt: skip
        if record:
            results[engine].update(engine=record["engine"], losses=record["losses"], wall_s=record.get("wall_s"))
        print(f"[engines] {engine}: " + ("; ".join(problems) or f"ran ({record['engine']['distributed_type']})"))
    problems = [p for r in results.values() for p in r["problems"]]
    out.write_text(
        json.dumps({"device": args.device, "results": results, "problems": problems}, indent=1, default=str)
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
