"""The mismatch of the arithmetic demo sampled by HF `generate` and by vLLM, rollout IS on and off: a Markdown table
of the runs' mismatch metrics (means over the training steps) and one plot of the per-token mismatch per step.

    python -m benchmarks.experiments.vllm_demo_mismatch --out docs/vllm_demo_mismatch.png \\
        "HF generate, IS off=outputs/hf-is-off" "HF generate, IS on=outputs/hf-is-on" \\
        "vLLM, IS off=outputs/vllm-is-off" "vLLM, IS on=outputs/vllm-is-on"

Each run is a `recipes/grpo.py` output folder (its `metrics.jsonl`): `config_demo.yaml` (HF generate) and
`config_demo_vllm.yaml` (vLLM), with `rl_loss.rollout_is` set or unset (see docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os

COLUMNS = {
    "mismatch/mismatch_logprob_abs_diff": "mean \\|Δ log p\\|",
    "mismatch/mismatch_k3_kl": "k3 KL(μ‖π_old)",
    "mismatch/mismatch_log_ppl_abs_diff": "\\|Δ log ppl\\|",
    "rollout_is/mean": "ρ mean",
    "rollout_is/max": "ρ max",
    "rewards/accuracy_reward/mean": "accuracy reward",
}


def read_run(folder: str) -> tuple[list[dict], dict]:
    """The training step records of a run (those with the loss) and its last evaluation record."""
    steps, evals = [], []
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "mismatch/mismatch_logprob_abs_diff" in record:
                steps.append(record)
            elif any(key.startswith("eval_") for key in record):
                evals.append(record)
    return steps, (evals[-1] if evals else {})


def table(runs: dict[str, list[dict]]) -> str:
    header = "| run | steps | " + " | ".join(COLUMNS.values()) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, steps in runs.items():
        cells = []
        for key in COLUMNS:
            values = [s[key] for s in steps if key in s]
            cells.append(f"{sum(values) / len(values):.3g}" if values else "–")
        lines.append(f"| {name} | {len(steps)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, steps in runs.items():
        x = [s["step"] for s in steps]
        axes[0].plot(x, [s["mismatch/mismatch_logprob_abs_diff"] for s in steps], "o-", label=name)
        axes[1].plot(x, [s.get("rewards/accuracy_reward/mean", float("nan")) for s in steps], "o-", label=name)
    axes[0].set(title="rollout mismatch: mean |Δ log p| per token", xlabel="step", yscale="log")
    axes[1].set(title="accuracy reward", xlabel="step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=FOLDER")
    parser.add_argument("--out", required=True, help="the plot's path (PNG)")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        name, folder = spec.split("=", 1)
        runs[name], _ = read_run(folder)
    print(table(runs))
    plot(runs, args.out)


if __name__ == "__main__":
    main()
