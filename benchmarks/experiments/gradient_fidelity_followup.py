"""The registered follow-up of the gradient-fidelity experiment (`docs/gradient_fidelity_followup.md`): on fresh
prompts and a checkpoint of a new run of the asynchronous demo, the default correction against dropping the stale
batch at the demo's lag, sequence-level IS against the default at lag 16, and whether B's bias grows with the lag.

    python -m benchmarks.experiments.gradient_fidelity_followup sizing    # sizing.json, from the first experiment
    python -m benchmarks.experiments.gradient_fidelity_followup run       # the cells, prompt by prompt, resumable
    python -m benchmarks.experiments.gradient_fidelity_followup analyze   # the registered tests: analysis.json

The run is the asynchronous demo as the README runs it, seed 42, every step's model saved
(`python -m benchmarks.experiments.demo_seeds --demo async --seeds 42 --set save_strategy=steps --set save_steps=1
--set save_only_model=true --runs-dir outputs/async-demo-seeds --out benchmarks/results/async_demo_seeds.json`): one
row of the asynchronous demo's seed sweep. Each prompt is measured at every lag before the next prompt starts, and
each prompt's row is appended to its cell's file (`cell_lag<k>.json`) as soon as it is measured; the run stops before
a prompt that would start after the registered deadline, or after `PLANNED` prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.experiments.gradient_fidelity import append_row, per_prompt_rows, row_code
from benchmarks.shared.provenance import ROOT, provenance

OUT = ROOT / "benchmarks" / "results" / "gradient_fidelity_followup"
FIRST = ROOT / "benchmarks" / "results" / "gradient_fidelity"
RUN = ROOT / "outputs" / "async-demo-seeds" / "seed42"  # the new demo run, every step saved

# The registered design (docs/gradient_fidelity_followup.md)
STEP = 24  # θ_t: a checkpoint of the new run
LAGS = (1, 16)  # the demo's lag (its samples are trained at lag 1 in the steady state), and the longest lag
CORRECTIONS = ("none", "token_tis", "sequence_tis")  # B, C (the default), sequence-level IS
PROMPT_SEED = 3  # fresh prompts: arithmetic_dataset(PLANNED, seed=3, max_operand=20) (the first used seeds 1, 2, 99)
PLANNED = 48
DEADLINE_UTC = "2026-12-08 01:20"  # no prompt starts after it (a rule that reads no result)
RESAMPLES = 40_000
TESTS = {  # name -> (lag, x, y, statistic): the family Holm adjusts, the trend test apart (`trend`)
    "(a) C - drop, relative MSE, lag 1": (1, "token_tis", "drop", "relative_mse"),
    "(b) sequence IS - C, relative MSE, lag 16": (16, "sequence_tis", "token_tis", "relative_mse"),
}
TREND = "(c) B's relative squared bias, lag 16 - lag 1"
MEASURES = ("hf_rlloss/recipe_support/gradient_fidelity.py", "hf_rlloss/recipe_support/fidelity_stats.py",
            "hf_rlloss/recipe_support/grad_sketch.py", "hf_rlloss/loss")  # fmt: skip


def cell_file(lag: int) -> Path:
    return OUT / f"cell_lag{lag}.json"


def checkpoint(step: int) -> Path:
    return RUN / f"checkpoint-{step}"


def _model(step: int):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint(step), dtype=torch.float32)


def measured(lag: int) -> set[int]:
    path = cell_file(lag)
    return {row["prompt_index"] for row in json.loads(path.read_text())["prompts"]} if path.exists() else set()


def run(threads: int) -> int:
    """The prompts not yet measured at every lag, in order, each at every lag; stops at the deadline."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hf_rlloss.recipe_support.fidelity_stats import floor_terms
    from hf_rlloss.recipe_support.gradient_fidelity import CORRECTIONS as ALL
    from hf_rlloss.recipe_support.gradient_fidelity import GradientFidelity, Settings
    from hf_rlloss.recipe_support.rewards import accuracy_reward
    from hf_rlloss.recipe_support.tasks import arithmetic_dataset

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    deadline = time.mktime(time.strptime(DEADLINE_UTC, "%Y-%m-%d %H:%M")) - time.timezone
    tokenizer = AutoTokenizer.from_pretrained(checkpoint(STEP))
    settings = Settings(corrections={name: ALL[name] for name in CORRECTIONS})
    fidelity = GradientFidelity(_model(STEP), tokenizer, [accuracy_reward], settings)
    behaviours = {lag: _model(STEP - lag) for lag in LAGS}
    rows = list(arithmetic_dataset(PLANNED, seed=PROMPT_SEED, max_operand=20))
    meta = provenance()
    for i in range(PLANNED):
        todo = [lag for lag in LAGS if i not in measured(lag)]
        if not todo:
            continue
        if time.time() > deadline:
            print(f"the deadline {DEADLINE_UTC} UTC has passed: stopped before prompt {i}", flush=True)
            break
        started, index = time.time(), PROMPT_SEED * 10_000 + i
        on, on_rewards = fidelity.on_policy(rows[i], index)
        for slot, lag in enumerate(LAGS):
            if lag not in todo:
                continue
            stale = fidelity.stale(rows[i], on, str(lag), behaviours[lag], index, slot)
            new = {"meta": meta, "cell": {"step": STEP, "lag": lag, "behaviour_step": STEP - lag,
                   "prompt_seed": PROMPT_SEED, "run": str(RUN.relative_to(ROOT))}, "prompts": []}  # fmt: skip
            append_row(cell_file(lag), new, {
                "prompt_index": i, "prompt": rows[i]["prompt"][-1]["content"], "floor": floor_terms(on), **stale,
                "rewards": {**on_rewards, **stale["rewards"]}, "seconds": round(time.time() - started, 1),
                "code": row_code(meta),
            })  # fmt: skip
        print(f"prompt {i}: {time.time() - started:.0f} s", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------------------
# Sizing (from the first experiment) and the registered analysis


def _mse_differences(cell: dict, x: str, y: str, batch_groups: int = 2) -> np.ndarray:
    """Per prompt, the difference of the relative MSEs' numerators ``(b + v / batch)`` of `x` and `y` over the mean
    on-policy norm (the linearization a paired test of the relative MSE sizes from; `drop`: ``b = n``, ``v = 0``)."""
    rows = sorted(cell["prompts"], key=lambda row: row["prompt_index"])
    norm = np.mean([r["floor"]["n"] for r in rows])

    def numerator(r: dict, name: str) -> float:
        if name == "drop":
            return r["floor"]["n"]
        return r["terms"][name]["b"] + r["terms"][name]["v"] / batch_groups

    return np.array([(numerator(r, x) - numerator(r, y)) / norm for r in rows])


def _bias_differences(low: dict, high: dict, name: str = "none") -> np.ndarray:
    """Per prompt (the prompts both cells hold), ``(b_high − b_low) / n̄``: the change of the relative squared bias."""
    a = {r["prompt_index"]: r for r in low["prompts"]}
    b = {r["prompt_index"]: r for r in high["prompts"]}
    shared = sorted(set(a) & set(b))
    norm = np.mean([a[i]["floor"]["n"] for i in shared])
    return np.array([(b[i]["terms"][name]["b"] - a[i]["terms"][name]["b"]) / norm for i in shared])


def sizing() -> int:
    """`sizing.json`: each test's per-prompt mean and SD in the first experiment (late checkpoint), and the power of
    a paired test at α 0.05 two-sided (and at α / 3, Holm's smallest threshold) over 16 to `PLANNED` prompts."""
    from benchmarks.experiments.gradient_fidelity import cell_file as first_cell
    from benchmarks.shared import stats

    cells = {lag: json.loads(first_cell("late", lag).read_text()) for lag in (1, 16)}
    diffs = {name: _mse_differences(cells[lag], x, y) for name, (lag, x, y, _) in TESTS.items()}
    diffs[TREND] = _bias_differences(cells[1], cells[16])
    out = {"meta": provenance(), "source": "benchmarks/results/gradient_fidelity (late checkpoint)", "tests": {}}
    for name, d in diffs.items():
        mean, sd = float(d.mean()), float(d.std(ddof=1))
        out["tests"][name] = {"prompts": len(d), "mean": mean, "sd": sd, "power": {
            str(n): {"alpha_0.05": stats.paired_t_power(abs(mean), sd, n),
                     "alpha_0.0167": stats.paired_t_power(abs(mean), sd, n, alpha=0.05 / 3)}
            for n in (16, 24, 32, PLANNED)}}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sizing.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["tests"], indent=1))
    return 0


def _shared(cells: dict[int, dict]) -> dict[int, dict]:
    """Each cell restricted to the prompts every cell holds (the stopping rule can leave one prompt at one lag)."""
    common = set.intersection(*({r["prompt_index"] for r in c["prompts"]} for c in cells.values()))
    return {lag: c | {"prompts": [r for r in c["prompts"] if r["prompt_index"] in common]} for lag, c in cells.items()}


def trend_test(low: dict, high: dict, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """B's relative squared bias at the high lag minus the low (``b̄ / n̄`` each, the prompts resampled together, so
    the shared on-policy groups are paired): its bootstrap interval and two-sided p."""
    from hf_rlloss.recipe_support.fidelity_stats import bootstrap_p, bootstrap_p_error

    a = sorted(low["prompts"], key=lambda r: r["prompt_index"])
    b = sorted(high["prompts"], key=lambda r: r["prompt_index"])
    n = np.array([r["floor"]["n"] for r in a])
    ba, bb = (np.array([r["terms"]["none"]["b"] for r in rows]) for rows in (a, b))
    rng = np.random.default_rng(seed)
    index = np.vstack([np.arange(len(a)), rng.integers(0, len(a), (resamples, len(a)))])
    delta = (bb[index].mean(axis=1) - ba[index].mean(axis=1)) / n[index].mean(axis=1)
    low_ci, high_ci = np.percentile(delta[1:], [2.5, 97.5])
    return {"value": float(delta[0]), "ci_low": float(low_ci), "ci_high": float(high_ci), "p": bootstrap_p(delta[1:]),
            "p_mc_se": bootstrap_p_error(delta[1:]), "resamples": resamples}  # fmt: skip


def analysis(cells: dict[int, dict], resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """The registered tests on the prompts every cell holds: (a) and (b) paired bootstrap differences of the relative
    MSE (`fidelity_statistics`, the zero update an estimator), (c) `trend_test`; Holm over the three. Each cell's
    `fidelity_report` (the diagnostic's table, with the zero-advantage share) is kept beside them."""
    from benchmarks.shared import stats
    from hf_rlloss.recipe_support.fidelity_stats import DROP, FLOOR, drop_terms, fidelity_statistics
    from hf_rlloss.recipe_support.gradient_fidelity import fidelity_report

    cells = _shared(cells)
    reports, tests = {}, {}
    for lag, cell in cells.items():
        rows, label = per_prompt_rows(cell), str(lag)
        reports[label] = fidelity_report(rows, list(CORRECTIONS), batch_groups=2, resamples=resamples, drop=True,
                                         seed=seed)[label]  # fmt: skip
        terms = {FLOOR: [r["floor"] for r in rows], DROP: [drop_terms(r["floor"]) for r in rows]}
        terms |= {name: [r["terms"][label][name] for r in rows] for name in CORRECTIONS}
        pairs = {name: (x, y) for name, (at, x, y, _) in TESTS.items() if at == lag}
        differences = fidelity_statistics(terms, 2, resamples, seed=seed, differences=pairs)["differences"]
        tests |= {name: differences[name][TESTS[name][3]] for name in pairs}
    tests = {name: tests[name] for name in TESTS}
    tests[TREND] = trend_test(cells[LAGS[0]], cells[LAGS[-1]], resamples, seed)
    for test, p in zip(tests.values(), stats.holm([t["p"] for t in tests.values()])):
        test["p_holm"], test["rejects_holm"] = p, p < 0.05
    return {"prompts": len(next(iter(cells.values()))["prompts"]), "planned": PLANNED, "tests": tests,
            "reports": reports}  # fmt: skip


def load_cells() -> dict[int, dict]:
    return {lag: json.loads(cell_file(lag).read_text()) for lag in LAGS if cell_file(lag).exists()}


def analyze(resamples: int) -> int:
    cells = load_cells()
    if len(cells) < len(LAGS):
        raise SystemExit(f"cells measured: {sorted(cells)}; the analysis needs every lag of {LAGS}")
    result = {"meta": provenance(), **analysis(cells, resamples)}
    (OUT / "analysis.json").write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps(result["tests"], indent=1, default=float))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sizing", help="sizing.json: each test's power, from the first experiment's per-prompt rows")
    p_run = sub.add_parser("run", help="the cells, prompt by prompt, until the deadline or PLANNED prompts")
    p_run.add_argument("--threads", type=int, default=2)
    p_analyze = sub.add_parser("analyze", help="the registered tests: analysis.json")
    p_analyze.add_argument("--resamples", type=int, default=RESAMPLES)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.command == "sizing":
        return sizing()
    if args.command == "run":
        return run(args.threads)
    return analyze(args.resamples)


if __name__ == "__main__":
    raise SystemExit(main())
