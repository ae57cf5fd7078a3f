"""Rollout importance sampling: worked numbers, layout and process invariance, bad input.

Expected values come from XTuner's worked example (spec §6.6, with its padding-row bugs fixed) and from
``_reference``, an independent float64 re-statement of the formulas in plain Python over lists of sequences.
"""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import time

import pytest
import torch
from _launch import free_port, kill_tree
from pydantic import ValidationError

from hf_rlloss.loss.metrics import accumulate_metrics
from hf_rlloss.loss.rollout_is import RolloutImportanceSampling, compute_rollout_is, finalize_rollout_is_metrics

NAN, INF = float("nan"), float("inf")

# A sequence is a list of (old_logprob, rollout_logprob, valid) per position.
# Spec §6.6: num_tokens [4, 3, 2], the last sequence is padding (all masked).
SEQ_A = [(-9.0, 0.0, 0), (-0.5, -0.7, 1), (-1.0, -0.4, 1), (-0.2, -0.2, 1)]  # δ = 0.2, -0.6, 0.0
SEQ_B = [(-9.0, 0.0, 0), (-0.3, -0.3, 1), (-2.0, -2.5, 1)]  # δ = 0.0, 0.5
SEQ_PAD = [(0.0, 0.0, 0), (0.0, 0.0, 0)]
SPEC = [SEQ_A, SEQ_B, SEQ_PAD]
# Extra sequences: a single valid token (ρ = e^1.2 ≈ 3.32, above the upper veto 3.0), and a long one with one token
# of ρ = e^-1.5 ≈ 0.22 (below the lower veto 0.25).
SEQ_ONE = [(-7.0, -1.0, 0), (-0.4, -1.6, 1)]
SEQ_LONG = [(-0.9, -0.8, 1), (-0.2, -0.5, 1), (-2.0, -0.5, 1), (-0.05, -0.1, 1), (-1.0, -1.2, 1)]
EXTENDED = [SEQ_A, SEQ_B, SEQ_PAD, SEQ_ONE, SEQ_LONG]

BOUNDS = {"lower": 0.6, "upper": 1.5}
VETO = {"veto_lower": 0.25, "veto_upper": 3.0}
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "both")


# ------------------------------------------------------------------------------------------------------------------
# Layouts


def _packed(seqs):
    """(1, L) tensors and seq_ids from the per-sequence lengths."""
    old = torch.tensor([[o for s in seqs for o, _, _ in s]], dtype=torch.float32)
    roll = torch.tensor([[r for s in seqs for _, r, _ in s]], dtype=torch.float32)
    mask = torch.tensor([[bool(v) for s in seqs for _, _, v in s]])
    lengths = torch.tensor([len(s) for s in seqs])
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), lengths).unsqueeze(0)
    return old, roll, mask, seq_ids, len(seqs)


def _padded(seqs, extra_rows=1):
    """(B, T) right-padded tensors, one row per sequence plus `extra_rows` all-masked rows; seq_ids = row index."""
    rows = len(seqs) + extra_rows
    width = max(len(s) for s in seqs) + 1
    old = torch.full((rows, width), -5.0)
    roll = torch.full((rows, width), -3.0)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        for j, (o, r, v) in enumerate(seq):
            old[i, j], roll[i, j], mask[i, j] = o, r, bool(v)
    seq_ids = torch.arange(rows).unsqueeze(1).expand(rows, width)
    return old, roll, mask, seq_ids, rows


def _per_sequence(tensor, seqs, layout):
    """The values of `tensor` at each sequence's positions, as a list of lists."""
    if layout == "packed":
        flat = tensor.reshape(-1).tolist()
        out, start = [], 0
        for s in seqs:
            out.append(flat[start : start + len(s)])
            start += len(s)
        return out
    return [tensor[i, : len(s)].tolist() for i, s in enumerate(seqs)]


def _run(cfg, seqs, layout="packed"):
    old, roll, mask, seq_ids, n = (_packed if layout == "packed" else _padded)(seqs)
    weights, keep, metrics = compute_rollout_is(cfg, old, roll, mask, seq_ids, n)
    w = None if weights is None else _per_sequence(weights, seqs, layout)
    return w, _per_sequence(keep, seqs, layout), finalize_rollout_is_metrics(metrics)


# ------------------------------------------------------------------------------------------------------------------
# Independent reference (plain Python, float64)


def _exp_bounded(x):
    return math.exp(min(max(x, -20.0), 20.0))


def _reference(seqs, **kw):
    """Weights, keep and finalized metrics, per sequence, straight from the formulas of the module docstring."""
    level, mode = kw.get("level", "token"), kw.get("mode", "truncate")
    upper = kw.get("upper")
    lower = kw.get("lower", None if upper is None else 1 / upper)
    mask_lo, mask_hi = kw.get("mask_lower", lower), kw.get("mask_upper", upper)
    veto_lo, veto_hi = kw.get("veto_lower"), kw.get("veto_upper")
    has_veto = veto_lo is not None or veto_hi is not None
    masking = upper is not None and mode != "truncate"
    truncating = upper is not None and mode != "mask"

    weights, keeps = [], []
    tok = {"delta": [], "rho_token": [], "rho": [], "masked": [], "cat": []}
    seq = {k: [] for k in ("old", "roll", "s", "sum_delta", "masked", "vetoed")}
    for s in seqs:
        valid = [(o, r) for o, r, v in s if v]
        n = len(valid)
        deltas = [o - r for o, r in valid]
        rho_token = [_exp_bounded(d) for d in deltas]
        if level == "token":
            rho = rho_token
        elif level == "sequence":
            rho = [_exp_bounded(sum(deltas))] * n
        else:
            rho = [_exp_bounded(sum(deltas) / n)] * n if n else []
        outside = [masking and not (mask_lo <= x <= mask_hi) for x in rho]
        cat = [
            (veto_lo is not None and d < math.log(veto_lo)) or (veto_hi is not None and d > math.log(veto_hi))
            for d in deltas
        ]
        vetoed = any(cat)
        w_row, k_row, j = [], [], 0
        for _, _, v in s:
            if not v:
                w_row.append(0.0)
                k_row.append(False)
                continue
            kept = not outside[j] and not vetoed
            w = rho[j]
            if truncating:
                w = min(w, upper)
                if kw.get("truncate_lower"):
                    w = max(w, lower)
            w_row.append(w if kept else 0.0)
            k_row.append(kept)
            j += 1
        weights.append(w_row)
        keeps.append(k_row)
        tok["delta"] += deltas
        tok["rho_token"] += rho_token
        tok["rho"] += rho
        tok["masked"] += outside
        tok["cat"] += cat
        if n:
            seq["old"].append(sum(o for o, _ in valid) / n)
            seq["roll"].append(sum(r for _, r in valid) / n)
            seq["s"].append(sum(rho) / n)
            seq["sum_delta"].append(sum(deltas))
            seq["masked"].append(any(outside))
            seq["vetoed"].append(vetoed)

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    rho = tok["rho"]
    clamped = rho if upper is None else [min(max(x, lower), upper) for x in rho]
    d = [r - o for o, r in zip(seq["old"], seq["roll"])]  # log_ppl_diff per sequence
    s = seq["s"]
    nonempty = bool(s)
    m = {
        "mismatch/mismatch_training_ppl": mean([math.exp(-x) for x in seq["old"]]),
        "mismatch/mismatch_training_log_ppl": mean([-x for x in seq["old"]]),
        "mismatch/mismatch_rollout_ppl": mean([math.exp(-x) for x in seq["roll"]]),
        "mismatch/mismatch_rollout_log_ppl": mean([-x for x in seq["roll"]]),
        "mismatch/mismatch_log_ppl_diff": mean(d),
        "mismatch/mismatch_log_ppl_abs_diff": mean([abs(x) for x in d]),
        "mismatch/mismatch_log_ppl_diff_max": max(d) if d else 0.0,
        "mismatch/mismatch_log_ppl_diff_min": min(d) if d else 0.0,
        "mismatch/mismatch_ppl_ratio": mean([_exp_bounded(x) for x in d]),
        "mismatch/mismatch_kl": mean([-x for x in tok["delta"]]),
        "mismatch/mismatch_k3_kl": mean([_exp_bounded(x) - max(min(x, 20), -20) - 1 for x in tok["delta"]]),
        "mismatch/mismatch_logprob_abs_diff": mean([abs(x) for x in tok["delta"]]),
        "mismatch/mismatch_chi2_token": mean([x * x for x in tok["rho_token"]]) - 1 if rho else 0.0,
        "mismatch/mismatch_chi2_seq": mean([_exp_bounded(x) ** 2 for x in seq["sum_delta"]]) - 1 if s else 0.0,
        "rollout_is/mean": mean(rho),
        "rollout_is/std": statistics.pstdev(clamped) if rho else 0.0,
        "rollout_is/eff_sample_size": mean(clamped) ** 2 / mean([x * x for x in clamped]) if rho else 0.0,
        "rollout_is/max": max(rho) if rho else 0.0,
        "rollout_is/min": min(rho) if rho else 0.0,
        "rollout_is/seq_mean": mean(s),
        "rollout_is/seq_std": statistics.stdev(s) if len(s) > 1 else 0.0,
        "rollout_is/seq_max": max(s) if nonempty else 0.0,
        "rollout_is/seq_min": min(s) if nonempty else 0.0,
        "rollout_is/seq_max_deviation": max(abs(x - 1) for x in s) if nonempty else 0.0,
        "rollout_is/nonfinite_tokens": 0.0,
    }
    n_mask = sum(bool(v) for sq in seqs for _, _, v in sq)
    n_kept = sum(k for row in keeps for k in row)
    m["rollout_is/rejected_token_fraction"] = (n_mask - n_kept) / n_mask if n_mask else 0.0
    if upper is not None:
        m["rollout_is/fraction_high"] = mean([float(x > upper) for x in rho])
        m["rollout_is/fraction_low"] = mean([float(x < lower) for x in rho])
        m["rollout_is/seq_fraction_high"] = mean([float(x > upper) for x in s])
        m["rollout_is/seq_fraction_low"] = mean([float(x < lower) for x in s])
    if masking:
        m["rollout_is/masked_fraction"] = mean([float(x) for x in tok["masked"]])
        m["rollout_is/seq_masked_fraction"] = mean([float(x) for x in seq["masked"]])
    if has_veto:
        m["rollout_is/catastrophic_token_fraction"] = mean([float(x) for x in tok["cat"]])
        m["rollout_is/veto_fraction"] = mean([float(x) for x in seq["vetoed"]])
    return (weights if upper is not None else None), keeps, m


def _assert_metrics(actual, expected, rel=1e-6, abs_=1e-6):
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert math.isfinite(actual[key]), key
        assert actual[key] == pytest.approx(value, rel=rel, abs=abs_), key


def _assert_weights(actual, expected, tol=1e-6):
    assert (actual is None) == (expected is None)
    if expected is not None:
        for row_a, row_e in zip(actual, expected, strict=True):
            assert row_a == pytest.approx(row_e, rel=tol, abs=tol)


# ------------------------------------------------------------------------------------------------------------------
# Worked numbers


def test_spec_example_token_truncate_xtuner_parity():
    """§6.6 token/truncate with XTuner's two-sided clamp: every number of the spec (none is padding-affected)."""
    cfg = RolloutImportanceSampling(level="token", mode="truncate", **BOUNDS, truncate_lower=True)
    weights, keep, m = _run(cfg, SPEC)
    flat = [x for row in weights for x in row]
    assert flat == pytest.approx([0, 1.2214, 0.6, 1.0, 0, 1.0, 1.5, 0, 0], abs=1e-4)
    assert [x for row in keep for x in row] == [False, True, True, True, False, True, True, False, False]
    expected = {
        "rollout_is/mean": 1.08379,
        "rollout_is/fraction_high": 0.2,
        "rollout_is/fraction_low": 0.2,
        "rollout_is/max": 1.64872,
        "rollout_is/min": 0.54881,
        "rollout_is/std": 0.29609,
        "rollout_is/eff_sample_size": 0.92816,
        "rollout_is/seq_mean": 1.12388,
        "rollout_is/seq_std": 0.28352,
        "rollout_is/seq_max": 1.32436,
        "rollout_is/seq_min": 0.9234,
        "rollout_is/seq_max_deviation": 0.32436,
        "rollout_is/seq_fraction_high": 0.0,
        "rollout_is/seq_fraction_low": 0.0,
        # token-weighted mismatch metrics are the same per pack and per sequence
        "mismatch/mismatch_kl": -0.02,
        "mismatch/mismatch_k3_kl": 0.06379,
        "mismatch/mismatch_logprob_abs_diff": 0.26,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-5), key
    # Per-sequence mismatch metrics (XTuner computes them per pack): seqA mean old -17/30, rollout -13/30; seqB
    # -1.15, -1.4.
    assert m["mismatch/mismatch_training_ppl"] == pytest.approx((math.exp(17 / 30) + math.exp(1.15)) / 2)
    assert m["mismatch/mismatch_rollout_log_ppl"] == pytest.approx((13 / 30 + 1.4) / 2)
    assert m["mismatch/mismatch_log_ppl_diff_max"] == pytest.approx(4 / 30)
    assert m["mismatch/mismatch_log_ppl_diff_min"] == pytest.approx(-0.25)
    assert m["mismatch/mismatch_ppl_ratio"] == pytest.approx((math.exp(4 / 30) + math.exp(-0.25)) / 2)
    assert m["mismatch/mismatch_chi2_seq"] == pytest.approx((math.exp(-0.8) + math.exp(1.0)) / 2 - 1)


def test_spec_example_upper_only_truncation_is_default():
    cfg = RolloutImportanceSampling(**BOUNDS)
    weights, _, _ = _run(cfg, SPEC)
    assert weights[0] == pytest.approx([0, math.exp(0.2), math.exp(-0.6), 1.0])  # 0.5488 is not raised to 0.6
    assert weights[1] == pytest.approx([0, 1.0, 1.5])


def test_spec_example_padding_bugs_fixed():
    """The values XTuner dilutes with the padding row (0.667, 0.333) are over real sequences here."""
    _, keep, m = _run(RolloutImportanceSampling(mode="mask", **BOUNDS), SPEC)
    assert keep[:2] == [[False, True, False, True], [False, True, False]]
    assert m["rollout_is/masked_fraction"] == pytest.approx(0.4)
    assert m["rollout_is/seq_masked_fraction"] == pytest.approx(1.0)  # XTuner: 0.66667

    weights, keep, m = _run(RolloutImportanceSampling(level="sequence", mode="mask", **BOUNDS), SPEC)
    assert weights[0] == pytest.approx([0, 0.67032, 0.67032, 0.67032], abs=1e-5) and weights[1] == [0, 0, 0]
    assert m["rollout_is/seq_masked_fraction"] == pytest.approx(0.5)  # XTuner: 0.33333
    assert m["rollout_is/masked_fraction"] == pytest.approx(0.4)
    assert m["rollout_is/fraction_high"] == pytest.approx(0.4)  # token-weighted; XTuner row-weighted 0.33333
    assert m["rollout_is/seq_fraction_high"] == pytest.approx(0.5)
    assert (m["rollout_is/max"], m["rollout_is/min"]) == pytest.approx((1.64872, 0.67032), abs=1e-5)
    assert m["rollout_is/mean"] == pytest.approx(1.06168, abs=1e-5)
    assert m["rollout_is/std"] == pytest.approx(0.40646, abs=1e-5)
    assert m["rollout_is/eff_sample_size"] == pytest.approx(0.85875, abs=1e-5)
    assert m["rollout_is/seq_std"] == pytest.approx(0.69183, abs=1e-5)

    cfg = RolloutImportanceSampling(level="geometric", lower=0.9, upper=1.1, truncate_lower=True)
    weights, _, m = _run(cfg, SPEC)
    assert weights[0][1:] == pytest.approx([0.9] * 3) and weights[1][1:] == pytest.approx([1.1] * 2)
    spec = {"max": 1.28403, "min": 0.87517, "mean": 1.03871, "std": 0.09798, "eff_sample_size": 0.9901}
    for key, value in spec.items():
        assert m["rollout_is/" + key] == pytest.approx(value, abs=1e-5), key
    assert (m["rollout_is/seq_fraction_high"], m["rollout_is/seq_fraction_low"]) == (0.5, 0.5)


def test_spec_example_token_both_with_veto():
    cfg = RolloutImportanceSampling(mode="both", **BOUNDS, veto_lower=0.5, veto_upper=1.6, truncate_lower=True)
    weights, keep, m = _run(cfg, SPEC)
    assert keep[:2] == [[False, True, False, True], [False, False, False]]  # seqB vetoed (ρ = 1.6487 > 1.6)
    assert weights[0] == pytest.approx([0, math.exp(0.2), 0, 1.0]) and weights[1] == [0, 0, 0]
    assert m["rollout_is/veto_fraction"] == pytest.approx(0.5)
    assert m["rollout_is/catastrophic_token_fraction"] == pytest.approx(0.2)
    assert m["rollout_is/rejected_token_fraction"] == pytest.approx(0.6)


@pytest.mark.parametrize("veto", [False, True], ids=["no_veto", "veto"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", LEVELS)
def test_every_level_and_mode_matches_reference(level, mode, veto):
    """Padding row, all-masked sequence, single-token sequence, vetoed sequences; packed and padded layouts."""
    kw = {"level": level, "mode": mode, **BOUNDS, **(VETO if veto else {})}
    cfg = RolloutImportanceSampling(**kw)
    exp_w, exp_keep, exp_m = _reference(EXTENDED, **kw)
    for layout in ("packed", "padded"):
        weights, keep, m = _run(cfg, EXTENDED, layout)
        _assert_weights(weights, exp_w)
        assert keep == exp_keep
        _assert_metrics(m, exp_m)
    if veto:  # SEQ_ONE (ρ 3.32) and SEQ_LONG (a token of ρ 0.22) are vetoed at every level
        assert not any(keep[3]) and not any(keep[4])
        assert m["rollout_is/veto_fraction"] == pytest.approx(0.5)
        assert m["rollout_is/catastrophic_token_fraction"] == pytest.approx(2 / 11)


def test_truncate_lower_and_mask_band_overrides_match_reference():
    kw = {"level": "geometric", "mode": "both", "upper": 1.2, "mask_lower": 0.3, "mask_upper": 3.0}
    for extra in ({}, {"truncate_lower": True}):
        exp_w, exp_keep, exp_m = _reference(EXTENDED, **kw, **extra)
        weights, keep, m = _run(RolloutImportanceSampling(**kw, **extra), EXTENDED)
        _assert_weights(weights, exp_w)
        assert keep == exp_keep
        _assert_metrics(m, exp_m)


def test_metrics_only_mode():
    cfg = RolloutImportanceSampling()
    assert not cfg.enabled and cfg.bounds is None
    old, roll, mask, seq_ids, n = _packed(EXTENDED)
    weights, keep, metrics = compute_rollout_is(cfg, old, roll, mask, seq_ids, n)
    assert weights is None and torch.equal(keep, mask)
    _, _, exp_m = _reference(EXTENDED)
    _assert_metrics(finalize_rollout_is_metrics(metrics), exp_m)


# ------------------------------------------------------------------------------------------------------------------
# Layout and micro-batch invariance


@pytest.mark.parametrize("level", LEVELS)
def test_packed_padded_and_micro_batches_agree(level):
    cfg = RolloutImportanceSampling(level=level, mode="both", **BOUNDS, **VETO)
    packed = _run(cfg, EXTENDED, "packed")
    padded = _run(cfg, EXTENDED, "padded")
    # Micro-batches: [A, B, PAD] packed, [ONE] padded, [LONG] packed, and an empty micro-batch.
    accumulated, weights, keep = {}, [], []
    for seqs, layout in (([SEQ_A, SEQ_B, SEQ_PAD], "packed"), ([SEQ_ONE], "padded"), ([SEQ_LONG], "packed")):
        old, roll, mask, seq_ids, n = (_packed if layout == "packed" else _padded)(seqs)
        w, k, m = compute_rollout_is(cfg, old, roll, mask, seq_ids, n)
        weights += _per_sequence(w, seqs, layout)
        keep += _per_sequence(k, seqs, layout)
        accumulate_metrics(accumulated, m)
    empty = torch.zeros(1, 3)
    _, _, m = compute_rollout_is(cfg, empty, empty, empty.bool(), torch.zeros(1, 3, dtype=torch.long), 1)
    accumulate_metrics(accumulated, m)
    micro = (weights, keep, finalize_rollout_is_metrics(accumulated))
    for other in (padded, micro):
        _assert_weights(other[0], packed[0], tol=1e-12)
        assert other[1] == packed[1]
        _assert_metrics(other[2], packed[2], rel=1e-12, abs_=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lower": 2.0, "upper": 1.5}, "lower"),
        ({"lower": 1.5, "upper": 1.5}, "lower"),
        ({"lower": 0.0, "upper": 1.5}, "lower"),
        ({"upper": -2.0}, "upper"),
        ({"upper": 0.8}, "upper"),  # lower would default to 1/upper > upper
        ({"lower": 0.5}, "upper"),
        ({"mode": "mask", "upper": 2.0, "mask_lower": 3.0}, "mask_lower"),
        ({"mode": "mask", "upper": 2.0, "mask_upper": -1.0}, "mask_upper"),
        ({"mode": "truncate", "upper": 2.0, "mask_upper": 3.0}, "mask_upper"),
        ({"upper": 2.0, "veto_lower": 5.0, "veto_upper": 4.0}, "veto_lower"),
        ({"upper": 2.0, "veto_lower": 0.0}, "veto_lower"),
        ({"veto_lower": 1e-4}, "veto_lower"),
        ({"upper": float("inf")}, "upper"),
        ({"level": "tokens"}, "level"),
        ({"threshold": (1.5, 0.5)}, "threshold"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        RolloutImportanceSampling(**kwargs)


def test_config_defaults_and_assignment_validation():
    cfg = RolloutImportanceSampling(mode="both", upper=2.0)
    assert cfg.enabled and cfg.bounds == (0.5, 2.0) and cfg.mask_bounds == (0.5, 2.0) and not cfg.has_veto
    assert RolloutImportanceSampling(mode="mask", **BOUNDS, mask_upper=3.0).mask_bounds == (0.6, 3.0)
    with pytest.raises(ValidationError, match="lower"):
        cfg.lower = 3.0
    xt = RolloutImportanceSampling.from_xtuner("sequence", "both", (5, 0.5), (5, 0.5), (20, 0))
    assert (xt.level, xt.mode, xt.lower, xt.upper, xt.truncate_lower) == ("sequence", "both", 0.5, 5, True)
    assert (xt.veto_lower, xt.veto_upper) == (None, 20)
    assert RolloutImportanceSampling(**RolloutImportanceSampling(**BOUNDS, **VETO).model_dump()).has_veto


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
def test_nonfinite_rollout_logprobs_are_rejected_and_counted(level, bad):
    """Bad tokens are dropped as if masked, counted, and never leak into weights or metrics."""
    kw = {"level": level, "mode": "both", **BOUNDS, **VETO}
    cfg = RolloutImportanceSampling(**kw)
    poisoned = [list(s) for s in EXTENDED]
    poisoned[0][2] = (-1.0, bad, 1)  # a valid token of SEQ_A
    poisoned[1][0] = (NAN, bad, 0)  # a masked position: ignored, not counted
    poisoned[4][3] = (NAN, -0.1, 1)  # a NaN old log-prob too
    cleaned = [list(s) for s in poisoned]
    cleaned[0][2] = (0.0, 0.0, 0)
    cleaned[1][0] = (0.0, 0.0, 0)
    cleaned[4][3] = (0.0, 0.0, 0)
    for layout in ("packed", "padded"):
        old, roll, mask, seq_ids, n = (_packed if layout == "packed" else _padded)(poisoned)
        weights, keep, metrics = compute_rollout_is(cfg, old, roll, mask, seq_ids, n)
        assert torch.isfinite(weights).all() and not any(torch.isnan(v) for v in metrics.values())
        m = finalize_rollout_is_metrics(metrics)
        assert all(math.isfinite(v) for v in m.values())
        assert m["rollout_is/nonfinite_tokens"] == 2.0
        assert not _per_sequence(keep, poisoned, layout)[0][2] and not _per_sequence(keep, poisoned, layout)[4][3]
        exp_w, exp_keep, exp_m = _reference(cleaned, **kw)
        _assert_weights(_per_sequence(weights, poisoned, layout), exp_w)
        assert _per_sequence(keep, poisoned, layout) == exp_keep
        exp_m["rollout_is/nonfinite_tokens"] = 2.0
        n_mask = sum(v for s in poisoned for _, _, v in s)
        exp_m["rollout_is/rejected_token_fraction"] = (n_mask - sum(map(sum, exp_keep))) / n_mask
        _assert_metrics(m, exp_m)


def test_extreme_log_ratios_stay_finite():
    seqs = [[(-0.1, -900.0, 1), (-0.2, -0.1, 1)], [(-250.0, -0.1, 1)]]  # exp(899.9) overflows even float64
    for level in LEVELS:
        for kw in ({}, {"mode": "mask", "upper": 2.0}, {"upper": 2.0}):
            weights, keep, m = _run(RolloutImportanceSampling(level=level, **kw), seqs)
            assert weights is None or all(math.isfinite(x) for row in weights for x in row)
            assert all(math.isfinite(v) for v in m.values()), (level, kw, m)
            assert m["rollout_is/max"] == pytest.approx(math.exp(20.0))
            exp_w, exp_keep, exp_m = _reference(seqs, level=level, **kw)  # the ±20 safety bound, k3 included
            _assert_weights(weights, exp_w)
            assert keep == exp_keep
            _assert_metrics(m, exp_m)


def test_empty_micro_batch_gives_zero_metrics():
    cfg = RolloutImportanceSampling(mode="both", **BOUNDS, **VETO)
    for num_sequences, shape in ((0, (1, 0)), (2, (2, 3))):
        zeros = torch.zeros(shape)
        seq_ids = torch.arange(shape[0]).unsqueeze(1).expand(shape)
        weights, keep, metrics = compute_rollout_is(cfg, zeros, zeros, zeros.bool(), seq_ids, num_sequences)
        assert not keep.any() and (weights == 0).all()
        m = finalize_rollout_is_metrics(metrics)
        assert m and all(v == 0.0 for v in m.values()), m
    assert finalize_rollout_is_metrics({"train_policy/valid_tokens": torch.tensor(3.0)}) == {}


def test_inputs_are_not_modified_and_outputs_detached():
    cfg = RolloutImportanceSampling(level="sequence", mode="both", **BOUNDS, **VETO)
    old, roll, mask, seq_ids, n = _padded(EXTENDED)
    old = old.double().requires_grad_()
    copies = [t.detach().clone() for t in (old, roll, mask, seq_ids)]
    weights, keep, metrics = compute_rollout_is(cfg, old, roll, mask, seq_ids, n)
    for before, after in zip(copies, (old, roll, mask, seq_ids)):
        assert torch.equal(before, after.detach())
    assert not weights.requires_grad and weights.dtype == torch.float64 and keep.dtype == torch.bool
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_bad_shapes_and_ids_raise():
    cfg = RolloutImportanceSampling(upper=2.0)
    old, roll, mask, seq_ids, n = _packed(SPEC)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_rollout_is(cfg, old, roll[:, :-1], mask, seq_ids, n)
    with pytest.raises(ValueError, match="bool"):
        compute_rollout_is(cfg, old, roll, mask.float(), seq_ids, n)
    with pytest.raises(ValueError, match="num_sequences"):
        compute_rollout_is(cfg, old, roll, mask, seq_ids, 1)


# ------------------------------------------------------------------------------------------------------------------
# Two processes (gloo): data parallel and sequence parallel

# Sequence-parallel order: SEQ_LONG straddles the two shards of the 17-token row (padded to 18).
SP_ORDER = [SEQ_A, SEQ_ONE, SEQ_LONG, SEQ_B, SEQ_PAD + [(0.0, 0.0, 0)]]
DP_SPLIT = ([[SEQ_A, SEQ_B, SEQ_PAD]], [[SEQ_ONE], [SEQ_LONG]])  # rank 0: one micro-batch; rank 1: two


def _dist_cfgs():
    return [RolloutImportanceSampling(level=level, mode="both", **BOUNDS, **VETO) for level in LEVELS] + [
        RolloutImportanceSampling(level="sequence")
    ]


def _dist_worker(rank, world_size, port, out_dir):
    faulthandler.dump_traceback_later(100, exit=True)  # a mismatched collective dumps stacks instead of hanging
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_rlloss.parallel.sequence import sp_gather, sp_split

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {"dp": [], "sp": []}
        for cfg in _dist_cfgs():
            accumulated, weights, keep = {}, [], []
            for seqs in DP_SPLIT[rank]:
                w, k, m = compute_rollout_is(cfg, *_packed(seqs))
                weights += _per_sequence(w, seqs, "packed") if w is not None else []
                keep += _per_sequence(k, seqs, "packed")
                accumulate_metrics(accumulated, m)
            results["dp"].append((weights, keep, finalize_rollout_is_metrics(accumulated)))

        mesh = init_device_mesh("cpu", (world_size,))
        old, roll, mask, seq_ids, n = _packed(SP_ORDER)
        length = old.shape[1]
        local = (
            sp_split(old, mesh, 1, 0.0),
            sp_split(roll, mesh, 1, 0.0),
            sp_split(mask.long(), mesh, 1, 0).bool(),
            sp_split(seq_ids, mesh, 1, -1),
        )
        assert local[0].shape[1] * world_size == length + 1  # padded
        for cfg in _dist_cfgs():
            w, k, m = compute_rollout_is(cfg, *local, n, sp_mesh=mesh)
            full_w = None if w is None else sp_gather(w, mesh)[:, :length]
            full_k = sp_gather(k.long(), mesh)[:, :length].bool()
            results["sp"].append((full_w, full_k, finalize_rollout_is_metrics(m)))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.distributed
def test_two_processes_data_and_sequence_parallel(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_dist_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        kill_tree(p.pid)
        p.join()
    assert not hung, "distributed workers hung (killed after 120 s)"
    assert [p.exitcode for p in procs] == [0, 0]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    for i, cfg in enumerate(_dist_cfgs()):
        # Data parallel: per-token weights of each rank's sequences and the global metrics, as in one process.
        single_w, single_k, single_m = _run(cfg, EXTENDED)
        dp_w = results[0]["dp"][i][0] + results[1]["dp"][i][0]
        dp_k = results[0]["dp"][i][1] + results[1]["dp"][i][1]
        if single_w is not None:
            _assert_weights(dp_w, single_w, tol=1e-12)
        assert dp_k == single_k
        for rank in range(2):
            _assert_metrics(results[rank]["dp"][i][2], single_m, rel=1e-12, abs_=1e-12)

        # Sequence parallel: the gathered shards and the metrics equal the full row in one process.
        old, roll, mask, seq_ids, n = _packed(SP_ORDER)
        w, k, m = compute_rollout_is(cfg, old, roll, mask, seq_ids, n)
        single_m = finalize_rollout_is_metrics(m)
        for rank in range(2):
            sp_w, sp_k, sp_m = results[rank]["sp"][i]
            assert torch.equal(sp_k, k)
            assert (sp_w is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(sp_w, w, rtol=1e-6, atol=1e-7)
            _assert_metrics(sp_m, single_m, rel=1e-12, abs_=1e-12)
