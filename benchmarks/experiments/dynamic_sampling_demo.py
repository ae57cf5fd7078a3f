"""Compare two runs of the demo recipe, without and with dynamic sampling: a markdown table and a plot.

    accelerate launch --config_file accelerate_configs/single_process.yaml recipes/grpo.py \\
        --config recipes/smollm2_135m/arithmetic/config_demo.yaml --output_dir outputs/ds-off --dynamic_sampling false
    ... --output_dir outputs/ds-on --dynamic_sampling true
    python -m benchmarks.experiments.dynamic_sampling_demo outputs/ds-off outputs/ds-on \\
        --plot docs/dynamic_sampling_demo.png

Each run directory holds the recipe's `metrics.jsonl`; an optional `time.txt` next to it holds
`TIME user=<s> sys=<s> elapsed=<s>` (GNU time's `-f "TIME user=%U sys=%S elapsed=%e"`) for the whole launch.
"""

from __future__ import annotations

import argparse
import json
import os
import re

from hf_rlloss.recipe_support.callbacks import heldout_value, moving_average

K = 8  # steps averaged at the start and the end, as the run summary


def load(run_dir: str) -> dict:
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in records if "step_time" in r]
    heldout = [(r["step"], heldout_value(r)) for r in records if heldout_value(r) is not None]
    # minutes of training and evaluation (step times + eval runtimes; no start-up) when each evaluation ended
    clock, heldout_minutes = 0.0, []
    for r in records:
        clock += r.get("step_time", 0.0) + r.get("eval_runtime", 0.0)
        if heldout_value(r) is not None:
            heldout_minutes.append(clock / 60)
    group = 8  # num_generations of the demo
    generated = [int(r.get("dynamic_sampling/groups_generated", 2)) * group for r in steps]
    out = {
        "steps": [r["step"] for r in steps],
        "reward": [r["rewards/accuracy_reward/mean"] for r in steps],
        "zero_std": [r["frac_reward_zero_std"] for r in steps],
        "completions": [sum(generated[: i + 1]) for i in range(len(generated))],
        "kept": [r.get("dynamic_sampling/groups_kept") for r in steps],
        "step_time": sum(r["step_time"] for r in steps),
        "heldout": heldout,
        "heldout_minutes": heldout_minutes,
    }
    time_file = os.path.join(run_dir, "time.txt")
    if os.path.exists(time_file):
        found = dict(re.findall(r"(user|sys|elapsed)=([\d.]+)", open(time_file).read()))
        out["cpu"] = float(found["user"]) + float(found["sys"])
        out["elapsed"] = float(found["elapsed"])
    return out


def row(name: str, run: dict) -> str:
    k = min(K, len(run["reward"]))
    first, last = sum(run["reward"][:k]) / k, sum(run["reward"][-k:]) / k
    evals = ", ".join(f"{h:.2f} (step {s}, {m:.0f} min)" for (s, h), m in zip(run["heldout"], run["heldout_minutes"]))
    kept = [x for x in run["kept"] if x is not None]
    kept_text = f"{int(sum(kept))}/{len(kept) * 2}" if kept else "–"
    timing = f"{run['elapsed'] / 60:.1f} / {run['cpu'] / 60:.1f}" if "cpu" in run else "–"
    return (
        f"| {name} | {evals} | {first:.2f} → {last:.2f} | {run['completions'][-1]} | "
        f"{sum(run['zero_std']) / len(run['zero_std']):.2f} | {kept_text} | {run['step_time'] / 60:.1f} | {timing} |"
    )


def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, run in runs.items():
        (line,) = axes[0].plot(run["steps"], moving_average(run["reward"], K), label=name)
        axes[1].plot(run["completions"], moving_average(run["reward"], K), label=name, color=line.get_color())
        steps, values = zip(*run["heldout"])
        axes[2].plot(steps, values, marker="D", label=name, color=line.get_color())
    axes[0].set(title=f"training accuracy reward ({K}-step mean)", xlabel="optimizer step")
    axes[1].set(title=f"training accuracy reward ({K}-step mean)", xlabel="completions generated")
    axes[2].set(title="held-out accuracy (greedy, 64 prompts)", xlabel="optimizer step", ylim=(0, 1))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("off", help="the run without dynamic sampling")
    parser.add_argument("on", help="the run with dynamic sampling")
    parser.add_argument("--plot", help="write the comparison plot here (PNG)")
    cli = parser.parse_args()
    runs = {"without dynamic sampling": load(cli.off), "with dynamic sampling": load(cli.on)}
    print(
        "| run | held-out accuracy (step, minutes of steps + evaluations) | training accuracy, first 8 → last 8 "
        "steps | completions generated | mean frac_reward_zero_std | groups kept / needed | sum of step times (min) "
        "| wall / CPU time (min) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        print(row(name, run))
    if cli.plot:
        plot(runs, cli.plot)


if __name__ == "__main__":
    main()
