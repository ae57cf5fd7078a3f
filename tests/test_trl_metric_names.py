"""TRL's metric names with the swap (issue 25): every key stock TRL 1.16's `GRPOTrainer` logs is logged by
`RLLossGRPOTrainer` too, with TRL's value where the quantity is the same.

Each test trains stock `GRPOTrainer` and `RLLossGRPOTrainer` with the same TRL options, tiny model and completions
(`FixedCompletions`), in TRL's parity layout (2 micro-batches per step, the second step off-policy so that ratios and
clipping move), then compares the two `log_history`s key by key. TRL appends its loss metrics once per micro-batch
and its `log` averages them over the logging window: so do we (`finalize_step_metrics`).
"""

from __future__ import annotations

import math

import pytest
import torch
from _tolerance import reordered_sum, step_tokens
from _trainer_utils import BASE_ARGS, make_model, make_tokenizer, train_fixed
from test_trl_parity import _tiny_moe
from trl import GRPOConfig, GRPOTrainer

from hf_rlloss.loss.metrics import METRICS, trl_metrics_table
from hf_rlloss.trainer import RLLossGRPOConfig

torch.set_num_threads(1)

COMMON = dict(
    max_steps=2, gradient_accumulation_steps=2, num_iterations=2, optim="sgd", learning_rate=0.05, max_grad_norm=0.0
)
# Each compared metric is a float32 reduction over the step's per-token terms, which TRL and the loss layer add in
# different orders (per micro-batch then averaged, against one normalization over the step): they differ by at most
# 2·γ_{n-1}·Σ|x| with n = 64 tokens, 7.5e-6 relative. The terms are of order 1 (log-ratios, entropies ≤ ln 256,
# normalized advantages), so the same bound holds absolutely for metrics near 0. The second step's parameters carry
# the first step's round-off times the learning rate, far below that. Measured: up to 1.0e-6 (AMD EPYC) and 1.8e-6
# (Intel Xeon with AMX, another BLAS blocking); a real difference of formula is ≥ 1e-3 here (one token of 64).
TOLERANCE = reordered_sum(step_tokens({**BASE_ARGS, **COMMON}))
# Logged by both but not comparable: wall-clock time.
TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _both(tok, tmp_path, model=None, **options):
    """Train stock TRL and the swap with the same options; return both log histories (step logs only)."""
    options = {**BASE_ARGS, **COMMON, **options}
    model = model or (lambda: make_model(tok))
    histories = []
    # Ours forwards the padded batch as TRL does: the default packed forward reorders float32 sums (about 1e-6
    # relative on a loss near 1), which is not what this test is about; packing's exactness is tests/test_packing.py.
    for name, config_cls, trainer_cls, extra in [
        ("trl", GRPOConfig, GRPOTrainer, {}),
        ("ours", RLLossGRPOConfig, None, {"packing": "off"}),
    ]:
        args = config_cls(output_dir=str(tmp_path / name), **options, **extra)
        trainer, _, _ = train_fixed(tok, args, model(), trainer_cls)
        histories.append([h for h in trainer.state.log_history if "train_runtime" not in h])
    return histories


def _compare(stock, ours, different=()):
    """Every key of every stock step log is in ours; equal to `TOLERANCE` unless in `different` (or `different` is
    "all": the runs' losses are normalized differently) or a timing. Returns the keys compared."""
    assert len(stock) == len(ours) > 0
    checked = set()
    for step, (theirs, mine) in enumerate(zip(stock, ours)):
        missing = sorted(set(theirs) - set(mine))
        assert not missing, f"step {step}: TRL's keys missing with the swap: {missing}"
        for key, value in theirs.items():
            if key in TIMING or key in different or different == "all" or value is None:
                continue
            assert math.isclose(mine[key], value, rel_tol=TOLERANCE, abs_tol=TOLERANCE), (step, key, mine[key], value)
            checked.add(key)
    return checked


def _saved_model(tok, tmp_path):
    """A model on disk: stock TRL with beta > 0 loads its reference from the policy's path."""
    path = tmp_path / "model"
    make_model(tok).save_pretrained(path)
    return lambda: str(path)


# TRL's loss types (and their sequence-level forms), each with the loss-specific keys it logs
LOSS_TYPES = {
    "dapo": ({"epsilon": 0.05}, ["clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean"]),
    "grpo": ({}, ["clip_ratio/low_min"]),
    # TRL's bnpo is a token mean per micro-batch, our token-mean one over the step: another update (docs/design.md)
    "bnpo": ({}, []),
    "dr_grpo": ({}, ["clip_ratio/region_mean"]),
    "luspo": ({}, ["clip_ratio/region_mean"]),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, ["clip_ratio/region_mean"]),
    "cispo": ({"epsilon_high": 1.02}, ["cispo_clip_ratio"]),
    "cispo_seq": ({"loss_type": "cispo", "epsilon_high": 1.02, "importance_sampling_level": "sequence"}, []),
    "sapo": ({}, []),
    # rows masked whole (truncated completions): TRL's sequence level still counts them
    "gspo_masked": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "mask_truncated_completions": True},
        ["clip_ratio/low_min", "clip_ratio/high_max"],
    ),
    "vespo_masked": ({"loss_type": "vespo", "mask_truncated_completions": True}, ["vespo/phi_seq_mean"]),
    "vespo": ({"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5}, ["vespo/phi_seq_mean"]),
}


@pytest.mark.parametrize("loss", list(LOSS_TYPES))
def test_loss_types(tok, tmp_path, loss):
    options, specific = LOSS_TYPES[loss]
    options = {"loss_type": loss, **options}
    # entropy_coef: TRL logs `policy_loss` only with an entropy bonus
    stock, ours = _both(tok, tmp_path, entropy_coef=0.01, **options)
    checked = _compare(stock, ours, "all" if loss == "bnpo" else ())
    if loss == "bnpo":
        return
    assert {"entropy", "policy_loss", "entropy_coef", "loss", "grad_norm", "reward"} <= checked
    assert set(specific) <= checked
    if loss in ("dapo", "cispo"):  # the off-policy step clips some tokens: the comparison is not of zeros
        assert max(log.get("clip_ratio/region_mean", log.get("cispo_clip_ratio", 0.0)) for log in stock) > 0


def test_kl_on(tok, tmp_path):
    stock, ours = _both(tok, tmp_path, model=_saved_model(tok, tmp_path), loss_type="grpo", beta=0.1)
    assert "kl" in _compare(stock, ours)
    assert stock[1]["kl"] > 1e-6  # the second step is off the reference


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_bias_corrected(tok, tmp_path, level):
    options = dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, importance_sampling_level=level)
    stock, ours = _both(tok, tmp_path, model=_saved_model(tok, tmp_path), **options)
    assert "kl" in _compare(stock, ours)


def test_entropy_bonus_adaptive(tok, tmp_path):
    options = dict(loss_type="dapo", entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=100.0)
    stock, ours = _both(tok, tmp_path, **options)
    assert {"entropy_coef", "policy_loss", "entropy"} <= _compare(stock, ours)


def test_moe_aux_loss(tok, tmp_path):
    stock, ours = _both(tok, tmp_path, model=lambda: _tiny_moe(tok, "qwen3_moe"), loss_type="dapo", max_steps=1)
    assert "aux_loss" in _compare(stock, ours)


def test_docs_table_is_the_spec_table():
    """docs/metrics.md's table of TRL keys is made from the metric specs (`MetricSpec.trl`)."""
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    assert trl_metrics_table() in docs
    assert len({spec.trl for spec in METRICS.values() if spec.trl}) == sum(1 for s in METRICS.values() if s.trl)


def test_step_and_micro_batch_values_in_closed_form():
    """Ours: token means over the step; TRL's: one value per micro-batch (a neutral extremum: none)."""
    from hf_rlloss.loss.metrics import finalize_step_metrics

    def micro_batch(tokens, entropy, clipped, seq_min, loss):
        return {
            "train_policy/valid_tokens": tokens,
            "train_policy/entropy_sum": entropy,
            "train_policy/entropy_tokens": tokens,
            "trl/units": tokens,
            "trl/clip_low_sum": clipped,
            "trl/clip_low_seq_min": seq_min,
            "trl/policy_loss": loss,
        }

    step, trl = finalize_step_metrics(
        [micro_batch(2.0, 4.0, 1.0, 0.5, 0.3), micro_batch(6.0, 6.0, 0.0, math.inf, 0.1)]
    )
    assert step["train_policy/entropy"] == 10.0 / 8.0 and step["train_policy/valid_tokens"] == 8.0
    assert trl == [
        {"entropy": 2.0, "clip_ratio/low_mean": 0.5, "clip_ratio/low_min": 0.5, "policy_loss": 0.3},
        {"entropy": 1.0, "clip_ratio/low_mean": 0.0, "policy_loss": 0.1},
    ]
