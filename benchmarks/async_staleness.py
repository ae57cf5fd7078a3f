"""Staleness × rollout IS on the async arithmetic demo: reward and mismatch per step (issue 22).

    python benchmarks/async_staleness.py run --lags 0 2 4 --steps 40    # one recipe run per (lag, IS on/off)
    python benchmarks/async_staleness.py report                          # table (Markdown) and plot
    python benchmarks/async_staleness.py run --tag short --steps 8 -- --learning_rate 2e-5   # recipe flags after --

Staleness is forced with the CPU worker's `weight_lag`: it applies the trainer's weights `k` versions late, so its
samples lag the trainer by at least `k` policy versions (`async/version_lag_mean` says by how much they did).
`max_staleness` is `k + 2`, so the staleness filter drops nothing. IS off is the same `rl_loss` without `rollout_is`
(the decoupled objective, π_old from the trainer's pass, is kept in both: only the π_old/π_behavior weight differs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "async_staleness"
CONFIG = ROOT / "recipes" / "smollm2_135m" / "arithmetic" / "config_async.yaml"
LOSS = {
    "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
    "loss_agg_mode": "token-mean",
    "use_kl_loss": True,
    "kl_loss_type": "k3",
    "kl_loss_coef": 0.001,
}
IS = {"rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0}}
# the reward summed over the reward functions (TRL's `reward`), π_old vs π_behavior, the lag, the IS weight
KEYS = ("reward", "mismatch/mismatch_k3_kl", "async/version_lag_mean", "rollout_is/mean")


def run(lags: list[int], steps: int, tag: str, extra: list[str]) -> None:
    for lag in lags:
        for is_on in (True, False):
            out = OUT / tag / f"lag{lag}_is{'on' if is_on else 'off'}"
            rl_loss = {**LOSS, **(IS if is_on else {})}
            cmd = [
                "accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / "single_process.yaml"),
                str(ROOT / "recipes" / "grpo_async.py"), "--config", str(CONFIG), "--output_dir", str(out),
                "--max_steps", str(steps), "--weight_lag", str(lag), "--max_staleness", str(lag + 2),
                "--rl_loss", json.dumps(rl_loss), "--plot", "true", *extra,
            ]  # fmt: skip
            if (out / "metrics.jsonl").exists():
                (out / "metrics.jsonl").unlink()
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            for path in out.iterdir():  # keep the per-step metrics, not the saved model
                if path.is_file() and path.name != "metrics.jsonl":
                    path.unlink()


def _history(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if KEYS[0] in r]


def report(tag: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = OUT / tag
    paths = [p for p in sorted(folder.glob("lag*")) if (p / "metrics.jsonl").exists()]
    runs = {p.name: _history(p / "metrics.jsonl") for p in paths}
    print("| run | steps | version lag (mean) | reward, first 4 → last 4 steps | mismatch k3 KL (mean) |")
    print("|---|---|---|---|---|")
    for name, rows in runs.items():
        reward = [r[KEYS[0]] for r in rows]
        mismatch = [r[KEYS[1]] for r in rows if KEYS[1] in r]
        lag = [r[KEYS[2]] for r in rows if KEYS[2] in r]
        k = min(4, len(reward))
        print(
            f"| {name} | {len(rows)} | {sum(lag) / len(lag):.2f} | {sum(reward[:k]) / k:.3f} → "
            f"{sum(reward[-k:]) / k:.3f} | {sum(mismatch) / len(mismatch):.4f} |"
        )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        style = "-" if name.endswith("ison") else "--"
        for ax, key in zip(axes, KEYS[:2]):
            points = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*points), style, marker=".", label=name)
    for ax, key in zip(axes, KEYS[:2]):
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = ROOT / "docs" / f"async_staleness_{tag}.png"
    fig.savefig(path, dpi=90)
    print(f"\nplot: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("--lags", type=int, nargs="+", default=[0, 2, 4])
    run_parser.add_argument("--steps", type=int, default=40)
    run_parser.add_argument("--tag", default="demo", help="results go to benchmarks/results/async_staleness/<tag>")
    run_parser.add_argument("extra", nargs="*", help="recipe flags after --, e.g. -- --learning_rate 1e-5")
    report_parser = sub.add_parser("report")
    report_parser.add_argument("--tag", default="demo")
    args = parser.parse_args()
    if args.command == "run":
        run(args.lags, args.steps, args.tag, args.extra)
    else:
        report(args.tag)
    sys.exit(0)
