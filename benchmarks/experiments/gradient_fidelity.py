"""The pre-registered gradient-fidelity experiment (`docs/gradient_fidelity_preregistration.md`): each stale-sample
correction's gradient against the on-policy gradient, on checkpoints of a real async demo run (SmolLM2-135M).

    python -m benchmarks.experiments.gradient_fidelity trajectory  # the async demo run, every step's weights saved
    python -m benchmarks.experiments.gradient_fidelity pilot       # the pilot the registration is sized from
    python -m benchmarks.experiments.gradient_fidelity run         # the registered cells, resumable, prompt by prompt
    python -m benchmarks.experiments.gradient_fidelity analyze     # the registered tests: analysis.json, the plot

The diagnostic is the package's (`hf_rlloss.recipe_support.gradient_fidelity`): for each prompt, four on-policy
groups of the current checkpoint θ_t and two groups from the behaviour checkpoint θ_{t−k}, every correction's
gradient through the loss layer, sketched to 8192 numbers. Each cell's results file
(`benchmarks/results/gradient_fidelity/cell_<checkpoint>_lag<k>.json`) holds, per prompt, the inner products the
statistics are made of (`fidelity_stats.prompt_terms`), the IS-weight sums and the rewards, so that every statistic
can be recomputed from the repository; the sketched on-policy vectors are cached under `outputs/gradient_fidelity/`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shared.provenance import ROOT, provenance

OUT = ROOT / "benchmarks" / "results" / "gradient_fidelity"
WORK = ROOT / "outputs" / "gradient_fidelity"
TRAJECTORY = WORK / "trajectory"
RAW = WORK / "raw"
PLOT = ROOT / "docs" / "gradient_fidelity.png"
RECIPE = ["recipes/grpo_async.py", "--config", "recipes/smollm2_135m/arithmetic/config_async.yaml"]

# The registered design (docs/gradient_fidelity_preregistration.md). A cell is (checkpoint, lag); cells run in this
# order, the primary first; each prompt's row is appended to the cell's results file as soon as it is measured.
CHECKPOINTS = {"late": 40, "early": 16}
CELLS = [("late", 8), ("early", 8), ("late", 1), ("late", 2), ("late", 4), ("late", 16), ("late", 0)]
LAG_SLOT = {0: 0, 1: 1, 2: 2, 4: 3, 8: 4, 16: 5}  # the seeds of a lag's stale groups (independent across lags)
PROMPTS = {"late": 32, "early": 32}
CONTROL_PROMPTS = 16  # lag 0 (the policy as its own behaviour), the control, on the first prompts only
PROMPT_SEED = {"late": 1, "early": 2}  # the prompts of a checkpoint: arithmetic_dataset(P, seed, max_operand=20)
PILOT = {"checkpoint": "early", "lag": 8, "prompts": 6, "seed": 99,
         "corrections": ["none", "token_tis", "sequence_tis", "inverted_tis"]}  # fmt: skip
PRIMARY = ("late", 8, "token_tis", "none")  # checkpoint, lag, C, B
MEASURES = ("hf_rlloss/recipe_support/gradient_fidelity.py", "hf_rlloss/recipe_support/fidelity_stats.py",
            "hf_rlloss/recipe_support/grad_sketch.py", "hf_rlloss/loss")  # fmt: skip


def checkpoint_path(step: int) -> str:
    """θ_step of the trajectory (step 0: the demo's initial model)."""
    if step == 0:
        from hf_rlloss.recipe_support.assets import resolve_model

        return resolve_model("builtin:smollm2-135m-instruct")
    return str(TRAJECTORY / f"checkpoint-{step}")


def trajectory() -> int:
    """The async demo, as the README runs it, with every step's model saved (TRL's `save_only_model`)."""
    command = ["accelerate", "launch", "--config_file", "accelerate_configs/single_process.yaml", *RECIPE,
               "--output_dir", str(TRAJECTORY.relative_to(ROOT)), "--save_strategy", "steps", "--save_steps", "1",
               "--save_only_model", "true"]  # fmt: skip
    print(" ".join(command), flush=True)
    return subprocess.call(command, cwd=ROOT)


def _model(step: int):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_path(step), dtype=torch.float32)


def _fidelity(step: int, threads: int, corrections=None):
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hf_rlloss.recipe_support.gradient_fidelity import CORRECTIONS, GradientFidelity, Settings
    from hf_rlloss.recipe_support.rewards import accuracy_reward

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(TRAJECTORY)
    settings = Settings(corrections={n: CORRECTIONS[n] for n in corrections or CORRECTIONS})
    return GradientFidelity(_model(step), tokenizer, [accuracy_reward], settings)


def _rows(count: int, seed: int) -> list[dict]:
    from hf_rlloss.recipe_support.tasks import arithmetic_dataset

    return list(arithmetic_dataset(count, seed=seed, max_operand=20))


def cell_file(checkpoint: str, lag: int, out: Path = OUT) -> Path:
    return out / f"cell_{checkpoint}_lag{lag}.json"


def measure_cell(checkpoint: str, lag: int, count: int, seed: int, path: Path, threads: int, corrections=None) -> None:
    """The prompts of a cell not yet in its results file, appended one by one (the file is rewritten whole after
    each prompt, so an interrupted run resumes where it stopped)."""
    import torch
    from tqdm.auto import tqdm

    from hf_rlloss.recipe_support.fidelity_stats import prompt_terms

    step = CHECKPOINTS[checkpoint]
    results = json.loads(path.read_text()) if path.exists() else None
    if results is None:
        results = {"meta": provenance(), "cell": {"checkpoint": checkpoint, "step": step, "lag": lag,
                   "behaviour_step": step - lag, "prompt_seed": seed}, "prompts": []}  # fmt: skip
    done = {row["prompt_index"] for row in results["prompts"]}
    todo = [i for i in range(count) if i not in done]
    if not todo:
        return
    fidelity, rows = _fidelity(step, threads, corrections), _rows(count, seed)
    behavior = fidelity.policy if lag == 0 else _model(step - lag)
    RAW.mkdir(parents=True, exist_ok=True)
    for i in tqdm(todo, desc=f"{checkpoint} θ_{step}, lag {lag}"):
        started, index = time.time(), seed * 10_000 + i
        cache = RAW / f"{checkpoint}_seed{seed}_prompt{i:03d}_on.pt"  # the on-policy groups serve every lag
        if cache.exists():
            on, on_rewards = torch.load(cache, weights_only=False)
        else:
            on, on_rewards = fidelity.on_policy(rows[i], index)
            torch.save((on, on_rewards), cache)
        stale = fidelity.stale(rows[i], on, str(lag), behavior, index, LAG_SLOT[lag])
        results["prompts"].append({
            "prompt_index": i, "prompt": rows[i]["prompt"][-1]["content"], "floor": prompt_terms(on, on[2:]),
            **stale, "rewards": {**on_rewards, **stale["rewards"]}, "seconds": round(time.time() - started, 1),
        })  # fmt: skip
        results["meta"]["finished_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
        path.with_suffix(".tmp").rename(path)


def pilot(threads: int) -> int:
    """The pilot the registration is sized from: 6 prompts of their own seed, the early checkpoint at lag 8."""
    path = OUT / "pilot.json"
    measure_cell(PILOT["checkpoint"], PILOT["lag"], PILOT["prompts"], PILOT["seed"], path, threads,
                 PILOT["corrections"])  # fmt: skip
    print(f"wrote {path}")
    return 0


def run(threads: int, only: str | None) -> int:
    for checkpoint, lag in CELLS:
        if only and f"{checkpoint}_lag{lag}" != only:
            continue
        count = CONTROL_PROMPTS if lag == 0 else PROMPTS[checkpoint]
        measure_cell(checkpoint, lag, count, PROMPT_SEED[checkpoint], cell_file(checkpoint, lag), threads)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("trajectory", help="the async demo run with every step's weights saved")
    for name in ("pilot", "run"):
        p = sub.add_parser(name)
        p.add_argument("--threads", type=int, default=2)
    cells = [f"{c}_lag{k}" for c, k in CELLS]
    sub.choices["run"].add_argument("--only", choices=cells, help="one cell")
    p_analyze = sub.add_parser("analyze", help="the registered tests: analysis.json and the plot")
    p_analyze.add_argument("--resamples", type=int, default=4000)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.command == "trajectory":
        return trajectory()
    if args.command == "pilot":
        return pilot(args.threads)
    if args.command == "run":
        return run(args.threads, args.only)
    raise SystemExit("analyze: registered in docs/gradient_fidelity_preregistration.md; written with the results")


if __name__ == "__main__":
    sys.exit(main())
