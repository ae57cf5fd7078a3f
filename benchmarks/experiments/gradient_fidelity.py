"""The pre-registered gradient-fidelity experiment (`docs/gradient_fidelity_preregistration.md`): each stale-sample
correction's gradient against the on-policy gradient, on checkpoints of a real async demo run (SmolLM2-135M).

    python -m benchmarks.experiments.gradient_fidelity trajectory  # the async demo run, every step's weights saved
    python -m benchmarks.experiments.gradient_fidelity record-trajectory  # its rewards and checkpoints' SHA-256
    python -m benchmarks.experiments.gradient_fidelity pilot       # the pilot the registration is sized from
    python -m benchmarks.experiments.gradient_fidelity run         # the registered cells, resumable, prompt by prompt
    python -m benchmarks.experiments.gradient_fidelity analyze     # the registered tests: analysis.json, the plot
    python -m benchmarks.experiments.gradient_fidelity holm-stability  # the Holm decisions over 20 bootstrap seeds
    python -m benchmarks.experiments.gradient_fidelity report      # the diagnostic's output on every cell, with the
                                                                   # zero update (drop) and the zero-advantage share

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

import numpy as np

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
CELLS = [("late", 8), ("late", 0), ("early", 8), ("late", 4), ("late", 2), ("late", 1), ("late", 16)]
LAG_SLOT = {0: 0, 1: 1, 2: 2, 4: 3, 8: 4, 16: 5}  # the seeds of a lag's stale groups (independent across lags)
PROMPTS = {"late": 48, "early": 32}
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


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _steps_used() -> list[int]:
    return sorted({CHECKPOINTS[c] - lag for c, lag in CELLS} | set(CHECKPOINTS.values()) - {0})


def record_trajectory() -> int:
    """`trajectory.json`: the run's per-step reward and lag (from its `metrics.jsonl`) and the SHA-256 of every
    checkpoint the cells read, so that a resumed run can check it reads the same trajectory."""
    rows = [json.loads(line) for line in (TRAJECTORY / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "rewards/accuracy_reward" in r]
    record = {
        "meta": {
            **provenance(),
            "trajectory_command": " ".join(
                [
                    "accelerate launch --config_file",
                    "accelerate_configs/single_process.yaml",
                    *RECIPE,
                    "--output_dir",
                    str(TRAJECTORY.relative_to(ROOT)),
                    "--save_strategy steps --save_steps 1 --save_only_model true",
                ]
            ),
        },  # fmt: skip
        "reward": [r["rewards/accuracy_reward"] for r in steps],
        "staleness_mean": [r.get("sample/staleness_mean") for r in steps],
        "checkpoints_sha256": {
            str(k): _sha256(TRAJECTORY / f"checkpoint-{k}" / "model.safetensors") for k in _steps_used()
        },
    }
    (OUT / "trajectory.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {OUT / 'trajectory.json'}")
    return 0


def check_trajectory(steps: list[int]) -> None:
    """Refuse to add prompts to a cell from another trajectory than the one `trajectory.json` records (a new run of
    the asynchronous demo is not the same run: its lags depend on timing)."""
    recorded = json.loads((OUT / "trajectory.json").read_text())["checkpoints_sha256"]
    for step in steps:
        if step and _sha256(TRAJECTORY / f"checkpoint-{step}" / "model.safetensors") != recorded[str(step)]:
            raise SystemExit(
                f"checkpoint-{step} under {TRAJECTORY} is not the one trajectory.json records: the cells' prompts so "
                "far come from another run; continuing would mix trajectories (report it as a departure)"
            )


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


def append_row(path: Path, new: dict, row: dict) -> None:
    """Add one prompt's row to a cell's results file, under a lock (several workers may fill one cell): the file is
    re-read, the row added, and the file replaced whole, so an interrupted run resumes where it stopped."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(path.read_text()) if path.exists() else new
        if all(r["prompt_index"] != row["prompt_index"] for r in results["prompts"]):
            results["prompts"].append(row)
        results["meta"]["finished_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        path.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
        path.with_suffix(".tmp").rename(path)


def row_code(meta: dict) -> str:
    """The code that measured a row: its process' commit, `+dirty` when the working tree had uncommitted changes (a
    worker started later than the cell's first row records its own, not the file's)."""
    return str(meta.get("git_commit")) + ("+dirty" if meta.get("git_dirty") else "")


def _claim(path: Path, i: int) -> bool:
    """Whether this worker takes prompt `i` of the cell (a claim file created exclusively; see `run`)."""
    import os

    RAW.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(RAW / f"{path.stem}_prompt{i:03d}.claim", os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def _clear_claims() -> None:
    """Forget the prompt claims of an earlier, interrupted run: once per fresh run, before its workers start."""
    for claim in RAW.glob("*.claim"):
        claim.unlink()


def measure_cell(checkpoint: str, lag: int, count: int, seed: int, path: Path, threads: int, corrections=None) -> None:
    """The prompts of a cell not yet in its results file, each added when it is measured (`append_row`); prompts are
    claimed one by one, so that `run --jobs N` workers share a cell."""
    import torch
    from tqdm.auto import tqdm

    from hf_rlloss.recipe_support.fidelity_stats import floor_terms

    step = CHECKPOINTS[checkpoint]
    new = {"meta": provenance(), "cell": {"checkpoint": checkpoint, "step": step, "lag": lag,
           "behaviour_step": step - lag, "prompt_seed": seed}, "prompts": []}  # fmt: skip
    done = {row["prompt_index"] for row in json.loads(path.read_text())["prompts"]} if path.exists() else set()
    todo = [i for i in range(count) if i not in done]
    if not todo:
        return
    if path.parent == OUT and path.name != "pilot.json":
        check_trajectory([step, step - lag])
    fidelity, rows = _fidelity(step, threads, corrections), _rows(count, seed)
    behavior = fidelity.policy if lag == 0 else _model(step - lag)
    for i in tqdm(todo, desc=f"{checkpoint} θ_{step}, lag {lag}"):
        if not _claim(path, i):
            continue
        started, index = time.time(), seed * 10_000 + i
        cache = RAW / f"{checkpoint}_seed{seed}_prompt{i:03d}_on.pt"  # the on-policy groups serve every lag
        if cache.exists():
            on, on_rewards = torch.load(cache, weights_only=False)
        else:
            on, on_rewards = fidelity.on_policy(rows[i], index)
            torch.save((on, on_rewards), cache)
        stale = fidelity.stale(rows[i], on, str(lag), behavior, index, LAG_SLOT[lag])
        append_row(path, new, {
            "prompt_index": i, "prompt": rows[i]["prompt"][-1]["content"], "floor": floor_terms(on),
            **stale, "rewards": {**on_rewards, **stale["rewards"]}, "seconds": round(time.time() - started, 1),
            "code": row_code(new["meta"]),
        })  # fmt: skip


def pilot(threads: int) -> int:
    """The pilot the registration is sized from: 6 prompts of their own seed, the early checkpoint at lag 8."""
    path = OUT / "pilot.json"
    _clear_claims()
    measure_cell(PILOT["checkpoint"], PILOT["lag"], PILOT["prompts"], PILOT["seed"], path, threads,
                 PILOT["corrections"])  # fmt: skip
    print(f"wrote {path}")
    return 0


def run(threads: int, only: str | None, jobs: int = 1, worker: bool = False) -> int:
    """The registered cells in order. With `jobs` > 1, that many worker processes (`worker`) share each cell, prompts
    claimed one by one; a fresh run first clears the claims of an earlier, interrupted one (start one `run` at a
    time)."""
    if not worker:
        _clear_claims()
        if jobs > 1:
            command = [sys.executable, "-m", "benchmarks.experiments.gradient_fidelity", "run", "--threads",
                       str(threads)]  # fmt: skip
            processes = [subprocess.Popen(command + (["--only", only] if only else []) + ["--worker"], cwd=ROOT)
                         for _ in range(jobs)]  # fmt: skip
            return max(process.wait() for process in processes)
    for checkpoint, lag in CELLS:
        if only and f"{checkpoint}_lag{lag}" != only:
            continue
        measure_cell(checkpoint, lag, _planned(checkpoint, lag), PROMPT_SEED[checkpoint], cell_file(checkpoint, lag),
                     threads)  # fmt: skip
    return 0


# ------------------------------------------------------------------------------------------------------------------
# The registered analysis


SECONDARY_LAGS = (1, 2, 4, 16)
OTHER_CORRECTIONS = ("sampler_clip", "sequence_tis", "geometric_tis", "token_mis", "veto", "opsm", "m2po")


def per_prompt_rows(cell: dict) -> list[dict]:
    """A cell file's prompts in the form `fidelity_report` reads (one behaviour, labelled by the lag), the noise
    floor's cross term from independent groups (`floor_with_independent_cross_term`: the cells of the first
    experiment stored one that paired each group with itself)."""
    from hf_rlloss.recipe_support.fidelity_stats import floor_with_independent_cross_term

    label = str(cell["cell"]["lag"])
    rows = sorted(cell["prompts"], key=lambda row: row["prompt_index"])
    return [{"floor": floor_with_independent_cross_term(r["floor"]), "terms": {label: r["terms"]},
             "weights": {label: r["weights"]}, "rewards": r["rewards"]} for r in rows]  # fmt: skip


def cell_report(cell: dict, resamples: int = 4000, drop: bool = False, seed: int = 0) -> dict:
    """One cell's `fidelity_report`: as registered (without the zero update), or with it (`drop`, the diagnostic's
    output since: not part of the registered analysis)."""
    from hf_rlloss.recipe_support.gradient_fidelity import CORRECTIONS, fidelity_report

    names = list(cell["prompts"][0]["terms"]) if cell["prompts"] else list(CORRECTIONS)
    rows = per_prompt_rows(cell)
    report = fidelity_report(rows, names, batch_groups=2, resamples=resamples, drop=drop, seed=seed)
    return report[str(cell["cell"]["lag"])]


def report(resamples: int) -> int:
    """The diagnostic's table of every measured cell, the zero update and the zero-advantage share included, and per
    cell the corrections shown to beat dropping the stale batch (Holm over every cell and correction but lag 0)."""
    from hf_rlloss.recipe_support.gradient_fidelity import format_report, format_verdicts, verdicts

    reports = {}
    for (checkpoint, lag), cell in load_cells().items():
        print(f"## {checkpoint} checkpoint, lag {lag}\n")
        reports[f"{checkpoint} checkpoint, lag {lag}"] = cell_report(cell, resamples, drop=True)
        print(format_report({str(lag): reports[f"{checkpoint} checkpoint, lag {lag}"]}))
    print(format_verdicts(verdicts({k: v for k, v in reports.items() if not k.endswith("lag 0")})))
    return 0


def squared_bias_differences(cell: dict, x: str, y: str) -> list[float]:
    """Per prompt, ``(b_x − b_y) / n̄``: the difference of the squared biases relative to the mean on-policy norm."""
    rows = sorted(cell["prompts"], key=lambda row: row["prompt_index"])
    norm = sum(r["floor"]["n"] for r in rows) / len(rows)
    return [(r["terms"][x]["b"] - r["terms"][y]["b"]) / norm for r in rows]


def relative_bias_difference(rows: list[dict], x: str, y: str) -> float:
    """``r_x − r_y`` of a cell's prompts (`per_prompt_rows`): relative biases from the prompt means of the terms."""
    label = next(iter(rows[0]["terms"]))
    n = np.mean([r["floor"]["n"] for r in rows])

    def r(name: str) -> float:
        return float(np.sqrt(max(np.mean([row["terms"][label][name]["b"] for row in rows]), 0.0) / n))

    return r(x) - r(y)


def leave_out(cell: dict, x: str, y: str, count: int = 3) -> list[dict]:
    """How much of ``r_x − r_y`` rests on single prompts: the prompts left out one by one, each time the one whose
    removal moves the difference most towards 0; per step the prompts left out (their `prompt_index`) and the
    difference over the rest."""
    rows = per_prompt_rows(cell)
    index = [r["prompt_index"] for r in sorted(cell["prompts"], key=lambda row: row["prompt_index"])]
    out, kept = [], list(range(len(rows)))
    sign = np.sign(relative_bias_difference(rows, x, y))
    for _ in range(count):
        values = {i: relative_bias_difference([rows[j] for j in kept if j != i], x, y) for i in kept}
        worst = max(values, key=lambda i: -sign * values[i])
        kept.remove(worst)
        out.append({"left_out": [index[i] for i in range(len(rows)) if i not in kept], "value": values[worst]})
    return out


def pilot_power(pilot_cell: dict, prompts: int) -> dict:
    """The registration's sizing: the pilot's per-prompt differences C − B of the relative squared bias, and what a
    paired t over `prompts` prompts detects with 80 % power at α 0.05 (also on the relative-bias scale, through the
    pilot's B: ``Δr ≈ Δq / (2 r_B)``)."""
    from benchmarks.shared import stats

    diffs = squared_bias_differences(pilot_cell, "token_tis", "none")
    sd = float(np.std(diffs, ddof=1))
    mde = stats.min_detectable_difference(sd, prompts)
    r_b = cell_report(pilot_cell, resamples=200)["estimators"]["none"]["relative_bias"]["value"]
    return {"pilot_prompts": len(diffs), "mean_diff": float(np.mean(diffs)), "sd_diff": sd, "prompts": prompts,
            "mde_squared": mde, "relative_bias_none": r_b, "mde_relative_bias": mde / (2 * r_b) if r_b else None,
            "power_at_pilot_mean": stats.paired_t_power(abs(float(np.mean(diffs))), sd, prompts),
            "seconds_per_prompt": float(np.mean([r["seconds"] for r in pilot_cell["prompts"]]))}  # fmt: skip


def _test(report: dict, x: str, y: str, statistic: str = "relative_bias") -> dict:
    entry = report["differences"][f"{x} - {y}"][statistic]
    return {**entry, "rejects": not entry["ci_low"] <= 0 <= entry["ci_high"]}


def analysis(cells: dict[tuple[str, int], dict], resamples: int = 4000, seed: int = 0) -> dict:
    """The registered tests from the cell files: the primary (C − B relative bias, late checkpoint, lag 8: paired
    bootstrap interval, with the paired t and sign test of the per-prompt squared-bias differences), the controls,
    and the Holm-corrected secondary family; cells not (fully) measured are listed, never tested. `seed` offsets every
    bootstrap's seed (0: the registered analysis)."""
    from benchmarks.shared import stats

    complete = {key: c for key, c in cells.items() if len(c["prompts"]) >= _planned(*key)}
    reports = {key: cell_report(c, resamples, seed=seed) for key, c in cells.items() if len(c["prompts"]) >= 3}
    out = {"cells": {f"{k}_lag{lag}": {"prompts": len(c["prompts"]), "planned": _planned(k, lag),
                                       "report": reports.get((k, lag))} for (k, lag), c in cells.items()},
           "incomplete": [f"{k}_lag{lag}" for k, lag in CELLS if (k, lag) not in complete]}  # fmt: skip
    checkpoint, lag, c_name, b_name = PRIMARY
    if (checkpoint, lag) in complete:
        cell = complete[(checkpoint, lag)]
        diffs = squared_bias_differences(cell, c_name, b_name)
        out["primary"] = {
            "bootstrap": _test(reports[(checkpoint, lag)], c_name, b_name),
            "paired_t_squared": stats.paired_t(diffs, [0.0] * len(diffs)),
            "sign_test_squared": stats.sign_test(diffs, [0.0] * len(diffs)),
        }
    secondary = {}
    for k in SECONDARY_LAGS:
        if ("late", k) in complete:
            secondary[f"C - B, late, lag {k}"] = _test(reports[("late", k)], c_name, b_name)
    if ("early", 8) in complete:
        secondary["C - B, early, lag 8"] = _test(reports[("early", 8)], c_name, b_name)
        if (checkpoint, lag) in complete:
            secondary["(C - B) late - early, lag 8"] = _between_checkpoints(complete, resamples, seed)
    if (checkpoint, lag) in complete:
        for name in OTHER_CORRECTIONS:
            if name in reports[(checkpoint, lag)]["estimators"]:
                secondary[f"{name} - B, late, lag 8"] = _test(reports[(checkpoint, lag)], name, b_name)
        secondary["MSE at 16 samples, C - B, late, lag 8"] = _test(reports[(checkpoint, lag)], c_name, b_name,
                                                                    "relative_mse")  # fmt: skip
    # Holm over the whole registered family only: over the tests done so far it would adjust too little
    family_complete = len(secondary) == len(SECONDARY_LAGS) + 2 + len(OTHER_CORRECTIONS) + 1
    adjusted = stats.holm([t["p"] for t in secondary.values()]) if family_complete else [None] * len(secondary)
    for test, p in zip(secondary.values(), adjusted):
        test["p_holm"], test["rejects_holm"] = p, (None if p is None else p < 0.05)
    out["secondary"], out["secondary_family_complete"] = secondary, family_complete
    if ("late", 0) in complete:
        report = reports[("late", 0)]
        floor = report["estimators"]["noise_floor"]["relative_bias_sq"]
        out["control_lag0"] = {name: {**e["relative_bias_sq"], "within_floor": e["relative_bias_sq"]["ci_low"] <=
                                      floor["ci_high"] and floor["ci_low"] <= e["relative_bias_sq"]["ci_high"]}
                               for name, e in report["estimators"].items()}  # fmt: skip
    if (checkpoint, lag) in reports and "inverted_tis" in reports[(checkpoint, lag)]["estimators"]:
        out["control_inverted"] = _test(reports[(checkpoint, lag)], "inverted_tis", b_name)
    return out


def _planned(checkpoint: str, lag: int) -> int:
    return CONTROL_PROMPTS if lag == 0 else PROMPTS[checkpoint]


def _between_checkpoints(cells: dict, resamples: int, seed: int = 0) -> dict:
    """(r_C − r_B) on the late checkpoint minus that on the early one, at lag 8: independent prompts, so each
    checkpoint's prompts are resampled on their own (bootstrap, `resamples` each, seeds 2·seed and 2·seed + 1)."""
    from hf_rlloss.recipe_support.fidelity_stats import bootstrap_p, bootstrap_p_error

    draws = []
    for offset, key in enumerate((("late", 8), ("early", 8))):
        rows = per_prompt_rows(cells[key])
        rng = np.random.default_rng(2 * seed + offset)
        index = np.stack([np.arange(len(rows))] + [rng.integers(0, len(rows), len(rows)) for _ in range(resamples)])
        draws.append(_delta_r(rows, str(key[1]), index))
    delta = draws[0] - draws[1]
    low, high = np.nanpercentile(delta[1:], [2.5, 97.5])
    p, p_mc_se = bootstrap_p(delta[1:]), bootstrap_p_error(delta[1:])
    return {"value": float(delta[0]), "ci_low": float(low), "ci_high": float(high), "p": p, "p_mc_se": p_mc_se,
            "resamples": resamples, "rejects": not low <= 0 <= high}  # fmt: skip


def _delta_r(rows: list[dict], label: str, index: np.ndarray) -> np.ndarray:
    """``r_C − r_B`` (relative biases) of each resample of the prompts, `index` `(resamples, P)`."""
    n = np.array([row["floor"]["n"] for row in rows])[index].mean(axis=1)
    n = np.where(n > 0, n, np.nan)
    r = {name: np.sqrt(np.maximum(np.array([row["terms"][label][name]["b"] for row in rows])[index].mean(axis=1),
                                  0.0) / n) for name in ("token_tis", "none")}  # fmt: skip
    return r["token_tis"] - r["none"]


def load_cells(out: Path = OUT) -> dict[tuple[str, int], dict]:
    cells = {}
    for checkpoint, lag in CELLS:
        path = cell_file(checkpoint, lag, out)
        if path.exists():
            cells[(checkpoint, lag)] = json.loads(path.read_text())
    return cells


def analyze(resamples: int) -> int:
    pilot_cell = json.loads((OUT / "pilot.json").read_text())
    result = {"meta": provenance(), "pilot_power": pilot_power(pilot_cell, PROMPTS["late"]),
              **analysis(load_cells(), resamples)}  # fmt: skip
    (OUT / "analysis.json").write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps({k: result[k] for k in ("incomplete", "primary") if k in result}, indent=1, default=float))
    return 0


def holm_stability(resamples: list[int], seeds: int) -> int:
    """The registered analysis' Holm decisions over `seeds` bootstrap seeds at each count of `resamples`: per
    secondary test, how many seeds reject, its Holm-adjusted p-values' range and the largest Monte-Carlo error of its
    p. Writes `holm_stability.json`; exit 0 (a description, not a test)."""
    cells = load_cells()
    result = {"meta": provenance(), "seeds": seeds, "by_resamples": {}}
    for count in resamples:
        runs = [analysis(cells, count, seed)["secondary"] for seed in range(seeds)]
        tests = {}
        for name in runs[0]:
            holm = [run[name]["p_holm"] for run in runs]
            tests[name] = {"rejecting_seeds": sum(bool(run[name]["rejects_holm"]) for run in runs),
                           "p_holm_min": min(holm), "p_holm_max": max(holm),
                           "p_mc_se_max": max(run[name].get("p_mc_se") or 0.0 for run in runs)}  # fmt: skip
        stable = all(t["rejecting_seeds"] in (0, seeds) for t in tests.values())
        result["by_resamples"][str(count)] = {"tests": tests, "every_decision_stable": stable}
        print(f"{count} resamples: every Holm decision the same over {seeds} seeds: {stable}")
        for name, t in tests.items():
            print(f"  {name}: rejects in {t['rejecting_seeds']}/{seeds} seeds, Holm p {t['p_holm_min']:.4f}"
                  f"-{t['p_holm_max']:.4f}")  # fmt: skip
    (OUT / "holm_stability.json").write_text(json.dumps(result, indent=1, default=float))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("trajectory", help="the async demo run with every step's weights saved")
    sub.add_parser("record-trajectory", help="trajectory.json: the run's rewards and its checkpoints' SHA-256")
    for name in ("pilot", "run"):
        p = sub.add_parser(name)
        p.add_argument("--threads", type=int, default=2)
    cells = [f"{c}_lag{k}" for c, k in CELLS]
    sub.choices["run"].add_argument("--only", choices=cells, help="one cell")
    sub.choices["run"].add_argument("--jobs", type=int, default=1, help="worker processes sharing each cell")
    sub.choices["run"].add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p_analyze = sub.add_parser("analyze", help="the registered tests: analysis.json and the plot")
    p_analyze.add_argument("--resamples", type=int, default=4000)
    p_holm = sub.add_parser("holm-stability", help="the Holm decisions over bootstrap seeds: holm_stability.json")
    p_holm.add_argument("--resamples", type=int, nargs="+", default=[4000, 40000])
    p_holm.add_argument("--seeds", type=int, default=20)
    p_report = sub.add_parser("report", help="the diagnostic's output on every cell, with the zero update")
    p_report.add_argument("--resamples", type=int, default=4000)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.command == "trajectory":
        return trajectory()
    if args.command == "record-trajectory":
        return record_trajectory()
    if args.command == "pilot":
        return pilot(args.threads)
    if args.command == "run":
        return run(args.threads, args.only, args.jobs, args.worker)
    if args.command == "report":
        return report(args.resamples)
    if args.command == "holm-stability":
        return holm_stability(args.resamples, args.seeds)
    return analyze(args.resamples)


if __name__ == "__main__":
    sys.exit(main())
