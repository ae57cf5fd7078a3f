"""The gradient-fidelity experiment (`python -m benchmarks.experiments.gradient_fidelity`): its pilot's sizing and its
results, each computed from the per-prompt rows of the results files (`gradient_fidelity/pilot.json`,
`gradient_fidelity/cell_*.json`) with the experiment's own functions."""

from __future__ import annotations

import functools

from .core import figure, plot, table

PILOT = "gradient_fidelity/pilot.json"


@functools.lru_cache(maxsize=2)
def _power(text: str) -> dict:
    import json

    from benchmarks.experiments import gradient_fidelity

    return gradient_fidelity.pilot_power(json.loads(text), gradient_fidelity.PROMPTS["late"])


def _pilot(r) -> dict:
    import json

    return _power(json.dumps(r(PILOT)))


@figure("gradient_fidelity.pilot")
def pilot(r) -> str:
    p = _pilot(r)
    return (
        f"over its {p['pilot_prompts']} prompts, the per-prompt difference C − B of the relative squared bias had a "
        f"mean of {p['mean_diff']:+.2f} and a standard deviation of {p['sd_diff']:.2f}; B's relative bias was "
        f"{p['relative_bias_none']:.2f}; a prompt took {p['seconds_per_prompt']:.0f} s"
    )


@figure("gradient_fidelity.power")
def power(r) -> str:
    p = _pilot(r)
    return (
        f"with {p['prompts']} prompts, the paired t-test of the per-prompt squared-bias differences detects a "
        f"difference of {p['mde_squared']:.2f} (relative squared bias) with 80 % power at α = 0.05, about "
        f"{p['mde_relative_bias']:.2f} on the relative-bias scale at the pilot's B; its power at the pilot's mean "
        f"difference is {p['power_at_pilot_mean']:.2f}"
    )


# ------------------------------------------------------------------------------------------------------------------
# The results, recomputed from the cells' per-prompt rows (`cell_<checkpoint>_lag<k>.json`) with the experiment's
# registered analysis; nothing is read from a stored aggregate.

CELL_FILES = tuple(f"gradient_fidelity/cell_{c}_lag{k}.json" for c, k in (
    ("late", 8), ("late", 0), ("early", 8), ("late", 4), ("late", 2), ("late", 1), ("late", 16)))  # fmt: skip


@functools.lru_cache(maxsize=2)
def _analysis_of(texts: tuple) -> dict:
    import json

    from benchmarks.experiments import gradient_fidelity

    cells = {}
    for text in texts:
        if text:
            cell = json.loads(text)
            cells[(cell["cell"]["checkpoint"], cell["cell"]["lag"])] = cell
    return gradient_fidelity.analysis(cells)


def _analysis(r) -> dict:
    import json

    from .core import RESULTS

    texts = tuple(json.dumps(r(name)) if (RESULTS / name).exists() else "" for name in CELL_FILES)
    return _analysis_of(texts)


DROP_RESAMPLES = 40_000  # enough that a decision at 0.05 does not move with the bootstrap's seed (holm_stability)
HOLM = "gradient_fidelity/holm_stability.json"


@functools.lru_cache(maxsize=8)
def _with_drop(text: str) -> dict:
    import json

    from benchmarks.experiments import gradient_fidelity

    return gradient_fidelity.cell_report(json.loads(text), DROP_RESAMPLES, drop=True)


def _drop_report(r, checkpoint: str, lag: int) -> dict:
    """A cell's diagnostic report with the zero update (not part of the registered analysis)."""
    import json

    return _with_drop(json.dumps(r(f"gradient_fidelity/cell_{checkpoint}_lag{lag}.json")))


def _stable(r, test: str) -> str:
    """Whether a secondary test's Holm decision holds over 20 bootstrap seeds at 40,000 resamples."""
    entry = r(HOLM)["by_resamples"][str(DROP_RESAMPLES)]["tests"].get(test)
    if entry is None:
        return "–"
    seeds = r(HOLM)["seeds"]
    rejects = entry["rejecting_seeds"]
    return {0: "no", seeds: "yes"}.get(rejects, f"in {rejects}/{seeds} seeds")


def _p4(p: float) -> str:
    return "< 0.0001" if p < 1e-4 else f"{p:.4f}"


def _ci(entry: dict, digits: int = 2) -> str:
    return f"{entry['value']:+.{digits}f} [{entry['ci_low']:+.{digits}f}, {entry['ci_high']:+.{digits}f}]"


def _plain(entry: dict, digits: int = 2) -> str:
    return f"{entry['value']:.{digits}f} [{entry['ci_low']:.{digits}f}, {entry['ci_high']:.{digits}f}]"


@figure("gradient_fidelity.primary")
def primary(r) -> str:
    a = _analysis(r)
    p = a["primary"]
    boot, t, sign = p["bootstrap"], p["paired_t_squared"], p["sign_test_squared"]
    report = a["cells"]["late_lag8"]["report"]["estimators"]
    if boot["rejects"]:
        verdict = "C closer to the on-policy gradient than B" if boot["value"] < 0 else "B closer than C"
    else:
        verdict = "no difference detected"
    from benchmarks.experiments import gradient_fidelity

    one, _, three = gradient_fidelity.leave_out(r(CELL_FILES[0]), "token_tis", "none", 3)
    return (
        f"r_C − r_B = {boot['value']:+.3f} (95 % bootstrap CI {boot['ci_low']:+.3f} to {boot['ci_high']:+.3f}, "
        f"bootstrap p = {boot['p']:.4f} over {boot['resamples']:,} resamples, Monte-Carlo error "
        f"{boot['p_mc_se']:.4f}) over {t['n']} prompts: {verdict}. It leans on few prompts: without prompt "
        f"{one['left_out'][0]} it is {one['value']:+.3f}, without prompts "
        f"{', '.join(map(str, three['left_out']))} {three['value']:+.3f}. B's relative bias "
        f"{_plain(report['none']['relative_bias'])}, C's {_plain(report['token_tis']['relative_bias'])}. On the "
        f"squared scale the per-prompt differences have mean {t['mean_diff']:+.3f} (95 % CI {t['ci'][0]:+.3f} to "
        f"{t['ci'][1]:+.3f}), t({t['df']}) = {t['t']:.2f}, p = {t['p']:.3f}; C below B on {sign['minus']} prompts, "
        f"above on {sign['plus']}, {sign['ties']} ties (sign test p = {sign['p']:.3f})"
    )


@table("gradient_fidelity.controls")
def controls(r) -> str:
    a = _analysis(r)
    floor = a["cells"]["late_lag8"]["report"]["estimators"]["noise_floor"]["relative_bias_sq"]
    rows = [
        "| control | what must hold | measured (relative squared bias [95 % CI]) | holds |",
        "|---|---|---|---|",
        f"| noise floor (split-half on-policy), late, lag 8 | its interval holds 0 | {_ci(floor)} | "
        f"{'yes' if floor['ci_low'] <= 0 <= floor['ci_high'] else 'no'} |",
    ]
    lag0 = a.get("control_lag0")
    if lag0 is None:
        rows.append("| lag 0: every estimator within the floor | not yet measured | – | – |")
    else:
        estimators = {n: e for n, e in lag0.items() if n != "noise_floor"}
        values = {round(e["value"], 9) for e in estimators.values()}
        one = next(iter(estimators.values()))
        holds = one["ci_low"] <= 0 <= one["ci_high"]
        same = (f"the {len(estimators)} estimators are one gradient here (every IS weight is 1): one test, not "
                f"{len(estimators)}" if len(values) == 1 else f"{len(values)} distinct values")  # fmt: skip
        rows.append(
            f"| lag 0 (θ_40 as its own behaviour, {a['cells']['late_lag0']['prompts']} prompts) | the estimator's "
            f"interval holds 0 | {_ci(one)}: a relative bias up to {max(one['ci_high'], 0) ** 0.5:.2f} is not "
            f"excluded | {'yes' if holds else 'no'}; {same} |"
        )
    inverted = a["control_inverted"]
    rows.append(
        f"| inverted IS weight μ/π, late, lag 8 | worse than B: `r_inv − r_B` above 0 | "
        f"{_ci(inverted)} (relative bias) | {'yes' if inverted['ci_low'] > 0 else 'no'} |"
    )
    return "\n".join(rows)


@table("gradient_fidelity.corrections")
def corrections(r) -> str:
    from hf_rlloss.recipe_support.gradient_fidelity import CORRECTIONS

    a = _analysis(r)
    report = a["cells"]["late_lag8"]["report"]
    with_drop = _drop_report(r, "late", 8)["differences"]
    secondary = a["secondary"]
    rows = [
        "| correction | relative bias [95 % CI] | cosine | relative variance per group | relative MSE, 16 samples | "
        "MSE − drop [95 % CI] | IS ESS | minus B: relative bias [95 % CI] | Holm p (registered) | rejects at "
        "40,000 resamples, 20 seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    c = report["estimators"]["token_tis"]
    for name, entry in report["estimators"].items():
        described = CORRECTIONS[name].description if name in CORRECTIONS else "noise floor: split-half on-policy"
        diff = report["differences"].get(f"{name} - none", {}).get("relative_bias")
        test = secondary.get(f"{name} - B, late, lag 8") or (
            a["primary"]["bootstrap"] if name == "token_tis" else None
        )
        holm = "primary" if name == "token_tis" else _holm(test)
        if name == "veto" and entry == c:
            holm += " (identical to C: the veto never fired, so this test repeats the primary)"
        stable = "primary" if name == "token_tis" else _stable(r, f"{name} - B, late, lag 8")
        mse = with_drop.get(f"{name} - drop", {}).get("relative_mse")
        ess = entry.get("ess")
        rows.append(
            f"| {described} | {_plain(entry['relative_bias'])} | {entry['cosine']['value']:.2f} | "
            f"{entry['relative_variance']['value']:.2f} | {entry['relative_mse']['value']:.2f} | "
            f"{_ci(mse) if mse else '–'} | {'–' if ess is None or ess != ess else f'{ess:.3f}'} | "
            f"{_ci(diff) if diff else '–'} | {holm} | {stable} |"
        )
    return "\n".join(rows)


def _holm(test: dict | None) -> str:
    """A secondary test's Holm-adjusted p, or its unadjusted p while the registered family is incomplete."""
    if test is None:
        return "–"
    if test["p_holm"] is None:
        return f"{test['p']:.3f} (unadjusted: family incomplete)"
    return "< 0.001" if test["p_holm"] < 0.001 else f"{test['p_holm']:.3f}"


@table("gradient_fidelity.lags")
def lags(r) -> str:
    from benchmarks.experiments import gradient_fidelity

    a = _analysis(r)
    drops = _c_minus_drop(r)
    rows = [
        "| checkpoint | lag | prompts | B: relative bias | C: relative bias | C − B [95 % CI] | Holm p | C's "
        "relative MSE − drop [95 % CI] | C beats dropping (Holm over the 6 cells) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for checkpoint, lag in (("late", 1), ("late", 2), ("late", 4), ("late", 8), ("late", 16), ("early", 8)):
        cell = a["cells"].get(f"{checkpoint}_lag{lag}")
        complete = f"{checkpoint}_lag{lag}" not in a["incomplete"]
        if cell is None or not complete:
            planned = gradient_fidelity.PROMPTS[checkpoint]
            rows.append(f"| {checkpoint} | {lag} | {planned} registered | not yet measured | | | | | |")
            continue
        est = cell["report"]["estimators"]
        diff = cell["report"]["differences"]["token_tis - none"]["relative_bias"]
        if (checkpoint, lag) == ("late", 8):
            holm = "primary"
        else:
            holm = _holm(a["secondary"].get(f"C - B, {checkpoint}, lag {lag}"))
        drop = drops[(checkpoint, lag)]
        rows.append(
            f"| {checkpoint} | {lag} | {cell['prompts']} | {_plain(est['none']['relative_bias'])} | "
            f"{_plain(est['token_tis']['relative_bias'])} | {_ci(diff)} | {holm} | {_ci(drop)} | "
            f"{'yes' if drop['p_holm'] < 0.05 and drop['value'] < 0 else 'not shown'} (Holm p {_p4(drop['p_holm'])}) |"
        )
    return "\n".join(rows)


def _c_minus_drop(r) -> dict:
    """C's relative MSE minus the zero update's in each cell (40,000 resamples), Holm-adjusted over the cells."""
    from hf_rlloss.recipe_support.fidelity_stats import holm

    keys = (("late", 1), ("late", 2), ("late", 4), ("late", 8), ("late", 16), ("early", 8))
    tests = {key: dict(_drop_report(r, *key)["differences"]["token_tis - drop"]["relative_mse"]) for key in keys}
    for test, p in zip(tests.values(), holm([t["p"] for t in tests.values()])):
        test["p_holm"] = p
    return tests


@plot("docs/gradient_fidelity.png")
def lag_curves(r):
    """Relative bias and cosine against the lag, one line per correction (late checkpoint), with 95 % intervals; the
    lags evenly spaced, the corrections side by side within a lag."""
    import matplotlib.pyplot as plt

    a = _analysis(r)
    lags_measured = [k for k in (1, 2, 4, 8, 16) if f"late_lag{k}" not in a["incomplete"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(a["cells"]["late_lag8"]["report"]["estimators"])
    colors = plt.get_cmap("tab20")(range(len(names)))
    for offset, (name, color) in enumerate(zip(names, colors)):
        for axis, key in zip(axes, ("relative_bias", "cosine")):
            if key == "cosine" and name == "noise_floor":
                continue  # the floor's cosine compares two noisy on-policy estimates: not a correction's
            points = [a["cells"][f"late_lag{k}"]["report"]["estimators"][name][key] for k in lags_measured]
            x = [i + 0.06 * (offset - len(names) / 2) for i in range(len(lags_measured))]
            y = [p["value"] for p in points]
            err = [
                [max(p["value"] - p["ci_low"], 0) for p in points],
                [max(p["ci_high"] - p["value"], 0) for p in points],
            ]
            style = "--" if name in ("noise_floor", "inverted_tis") else "-"
            axis.errorbar(x, y, yerr=err, fmt="o" + style, ms=3, lw=1, capsize=2, color=color, label=name)
    titles = ("relative bias ‖E ĝ − g_on‖ / ‖g_on‖", "cosine to the on-policy gradient")
    for axis, label in zip(axes, titles):
        axis.set(xlabel="lag (policy versions)", ylabel=label, xticks=range(len(lags_measured)))
        axis.set_xticklabels([str(k) for k in lags_measured])
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    meta = r(CELL_FILES[0])["meta"]
    fig.suptitle(f"late checkpoint θ_40 of the async demo; {meta['machine']['kind']}, {meta['date']}", fontsize=8)
    fig.tight_layout()
    return fig


@figure("gradient_fidelity.other_secondaries")
def other_secondaries(r) -> str:
    a = _analysis(r)["secondary"]
    mse, between = a["MSE at 16 samples, C - B, late, lag 8"], a["(C - B) late - early, lag 8"]
    return (
        f"the relative MSE at 16 samples, C − B at the primary cell: {_ci(mse)} (Holm p {_holm(mse)}); the late "
        f"checkpoint's C − B minus the early one's, at lag 8: {_ci(between)} (Holm p {_holm(between)})"
    )


FOLLOWUP_SIZING = "gradient_fidelity_followup/sizing.json"


@table("gradient_fidelity_followup.sizing")
def followup_sizing(r) -> str:
    """The follow-up's sizing: each registered test's per-prompt mean and SD in the first experiment, and a paired
    test's power by prompt count (`gradient_fidelity_followup.sizing`)."""
    tests = r(FOLLOWUP_SIZING)["tests"]
    counts = list(next(iter(tests.values()))["power"])
    rows = ["| test | mean | SD | " + " | ".join(f"power, {n} prompts (α 0.05 / α 0.0167)" for n in counts) + " |",
            "|---|---|---|" + "---|" * len(counts)]  # fmt: skip
    for name, t in tests.items():
        cells = " | ".join(f"{t['power'][n]['alpha_0.05']:.2f} / {t['power'][n]['alpha_0.0167']:.2f}" for n in counts)
        rows.append(f"| {name} | {t['mean']:+.2f} | {t['sd']:.2f} | {cells} |")
    return "\n".join(rows)


@figure("gradient_fidelity.against_drop")
def against_drop(r) -> str:
    """C (the default) against dropping the stale batch in each cell of the late checkpoint, and sequence IS at 16."""
    tests = _c_minus_drop(r)
    shown = [lag for (c, lag), t in tests.items() if c == "late" and t["p_holm"] < 0.05 and t["value"] < 0]
    parts = [f"lag {lag}: {_ci(tests[('late', lag)])}" for lag in (1, 2, 4, 8, 16)]
    seq = _drop_report(r, "late", 16)["differences"]["sequence_tis - drop"]["relative_mse"]
    return (
        f"C's relative MSE minus dropping's, late checkpoint, {'; '.join(parts)}; shown below dropping (Holm over "
        f"the 6 cells) at lags {', '.join(map(str, shown))}; sequence IS at lag 16: {_ci(seq)}"
    )


@figure("gradient_fidelity.zero_advantage")
def zero_advantage(r) -> str:
    """At the primary cell: the prompts whose stale groups had no advantage, and their share of C's squared bias."""
    report = _drop_report(r, "late", 8)
    share = report["estimators"]["token_tis"]["zero_advantage_bias_share"]
    return (
        f"at lag 8, {report['zero_advantage_prompts']} of the {report['prompts']} prompts are such prompts, and they "
        f"hold {share:.2f} of C's summed squared bias"
    )


# ------------------------------------------------------------------------------------------------------------------
# The registered follow-up (`gradient_fidelity_followup`), recomputed from its cells' rows, and the exact check

FOLLOWUP_CELLS = ("gradient_fidelity_followup/cell_lag1.json", "gradient_fidelity_followup/cell_lag16.json")
EXACT = "gradient_fidelity_exact.json"


@functools.lru_cache(maxsize=2)
def _followup_of(texts: tuple) -> dict:
    import json

    from benchmarks.experiments import gradient_fidelity_followup

    cells = {json.loads(t)["cell"]["lag"]: json.loads(t) for t in texts}
    return gradient_fidelity_followup.analysis(cells)


def _followup(r) -> dict:
    import json

    return _followup_of(tuple(json.dumps(r(name)) for name in FOLLOWUP_CELLS))


@table("gradient_fidelity_followup.tests")
def followup_tests(r) -> str:
    """The registered tests of the follow-up, Holm over the three, on the prompts measured at both lags."""
    a = _followup(r)
    rows = [
        f"Prompts measured at both lags: {a['prompts']} of the {a['planned']} planned.",
        "",
        "| test | value [95 % CI] | bootstrap p (Monte-Carlo error) | Holm p | rejects |",
        "|---|---|---|---|---|",
    ]
    for name, t in a["tests"].items():
        rows.append(
            f"| {name} | {_ci(t)} | {_p4(t['p'])} ({t['p_mc_se']:.4f}, {t['resamples']:,} resamples) | "
            f"{_p4(t['p_holm'])} | {'yes' if t['rejects_holm'] else 'no'} |"
        )
    return "\n".join(rows)


@table("gradient_fidelity_followup.report")
def followup_report(r) -> str:
    """Each follow-up cell's estimators: relative bias, cosine, relative MSE, against dropping, the zero-advantage
    share."""
    a = _followup(r)
    rows = [
        "| lag | estimator | relative bias [95 % CI] | cosine [95 % CI] | relative MSE, 16 samples [95 % CI] | "
        "MSE − drop [95 % CI] | share of squared bias from zero-advantage prompts |",
        "|---|---|---|---|---|---|---|",
    ]
    for lag, report in a["reports"].items():
        for name, e in report["estimators"].items():
            diff = report["differences"].get(f"{name} - drop", {}).get("relative_mse")
            share = e.get("zero_advantage_bias_share")
            cosine = "undefined" if e["cosine"]["value"] != e["cosine"]["value"] else _plain(e["cosine"])
            rows.append(
                f"| {lag} | {name} | {_plain(e['relative_bias'])} | {cosine} | "
                f"{_plain(e['relative_mse'])} | {_ci(diff) if diff else '–'} | "
                f"{'–' if share is None or share != share else f'{share:.2f}'} |"
            )
    return "\n".join(rows)


@table("gradient_fidelity_exact.agreement")
def exact_agreement(r) -> str:
    """Each correction's exact relative bias against the diagnostic's estimate, per behaviour perturbation."""
    data = r(EXACT)
    rows = [
        "| behaviour perturbation | estimator | exact relative bias | diagnostic, seed 0 [95 % CI] | inside | inside, "
        "over the seeds |",
        "|---|---|---|---|---|---|",
    ]
    for level, entry in data["levels"].items():
        for name, e in entry["agreement"]["corrections"].items():
            rows.append(
                f"| {level} | {name} | {e['exact']:.3f} | {_plain(e, 3)} | {'yes' if e['inside'] else 'no'} | "
                f"{entry['coverage'][name]}/{entry['seeds']} |"
            )
    return "\n".join(rows)


@table("gradient_fidelity_exact.objectives")
def exact_objectives(r) -> str:
    """Each correction's exact relative bias under the diagnostic's per-group objective and the trainer's."""
    data = r(EXACT)
    level, entry = next((k, v) for k, v in data["levels"].items() if "objectives" in v)
    names = list(next(iter(entry["objectives"].values())))
    rows = [f"| objective (behaviour perturbation {level}) | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names)]  # fmt: skip
    for objective, values in entry["objectives"].items():
        rows.append(f"| {objective} | " + " | ".join(f"{values[n]:.3f}" for n in names) + " |")
    return "\n".join(rows)
