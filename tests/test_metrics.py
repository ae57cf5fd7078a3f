"""Train-policy metrics: definitions, declared reductions, and the cross-process finalize."""

import math
import os

import pytest
import torch
from _dist import run_distributed

from hf_rlloss import (
    Reduction,
    accumulate_metrics,
    finalize_train_policy_metrics,
    reduce_metrics,
    register_metric,
    train_policy_metrics,
)


def test_definitions_on_hand_made_tensors():  # float32 inputs: compare at float32 precision
    lp = torch.tensor([-1.0, -2.0, -0.5])
    old = torch.tensor([-1.2, -1.9, -0.5])  # log r = [0.2, −0.1, 0]
    ind = {"clip_low": torch.tensor([False, True, False]), "clip_high": torch.tensor([True, False, False])}
    final = finalize_train_policy_metrics(train_policy_metrics(lp, old, ind, entropy=torch.tensor([1.0, 2.0, 3.0])))
    r = [math.exp(0.2), math.exp(-0.1), 1.0]
    assert final["train_policy/ratio_abs_dev_mean"] == pytest.approx(sum(abs(x - 1) for x in r) / 3, rel=1e-5)
    assert final["train_policy/kl1"] == pytest.approx(-(0.2 - 0.1) / 3, rel=1e-5)
    assert final["train_policy/kl3"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 3, rel=1e-5)
    assert final["train_policy/ratio_max"] == pytest.approx(r[0]) and final["train_policy/ratio_min"] == pytest.approx(
        r[1]
    )
    assert final["train_policy/clip_frac_low"] == pytest.approx(1 / 3)
    assert final["train_policy/clip_frac_high"] == pytest.approx(1 / 3)
    assert final["train_policy/entropy"] == pytest.approx(2.0)
    assert final["train_policy/valid_tokens"] == 3


def test_accumulate_uses_declared_reductions_not_names():
    a = {"train_policy/ratio_max": torch.tensor(2.0), "train_policy/ratio_min": torch.tensor(0.5), "x": 1}
    b = {"train_policy/ratio_max": torch.tensor(1.5), "train_policy/ratio_min": torch.tensor(0.7), "x": 2}
    total = accumulate_metrics(dict(a), b)
    assert total["train_policy/ratio_max"] == 2.0 and total["train_policy/ratio_min"] == 0.5 and total["x"] == 3
    register_metric("my/max_like_but_summed", Reduction.SUM)
    total = accumulate_metrics({"my/max_like_but_summed": 1.0}, {"my/max_like_but_summed": 2.0})
    assert total["my/max_like_but_summed"] == 3.0


def test_a_registered_finalizer_derives_a_logged_metric_from_the_reduced_sums(monkeypatch):
    """`register_finalizer` is public (importable from `hf_rlloss` and `hf_rlloss.loss`): a finalizer gets the
    step's reduced sums of keys declared without `logged_as` and logs what it derives from them."""
    import hf_rlloss.loss
    from hf_rlloss import register_finalizer
    from hf_rlloss.loss import metrics as metrics_module

    assert hf_rlloss.loss.register_finalizer is register_finalizer
    monkeypatch.setattr(metrics_module, "_FINALIZERS", list(metrics_module._FINALIZERS))  # this test's, then gone
    for key in ("my_acc/hits", "my_acc/total"):
        monkeypatch.delitem(metrics_module.METRICS, key, raising=False)  # undeclared again after the test
        register_metric(key, Reduction.SUM)

    @register_finalizer
    def hit_rate(reduced: dict[str, float]) -> dict[str, float]:
        if "my_acc/total" not in reduced:
            return {}
        return {"my/hit_rate": reduced["my_acc/hits"] / reduced["my_acc/total"]}

    valid = {"train_policy/valid_tokens": torch.tensor(3.0)}  # as every loss context emits it
    first = {**valid, "my_acc/hits": torch.tensor(1.0), "my_acc/total": torch.tensor(4.0)}
    step = accumulate_metrics(first, {**valid, "my_acc/hits": torch.tensor(2.0), "my_acc/total": torch.tensor(2.0)})
    final = finalize_train_policy_metrics(step)
    assert final["my/hit_rate"] == pytest.approx(0.5)  # (1 + 2) / (4 + 2): a ratio of the step's sums
    assert "my_acc/hits" not in final  # declared without logged_as: the finalizers' input only


def test_empty_step_gives_zeros_not_nan():
    metrics = train_policy_metrics(torch.zeros(0), torch.zeros(0), {})
    final = finalize_train_policy_metrics(metrics)
    assert final["train_policy/kl1"] == 0.0 and final["train_policy/ratio_max"] == 0.0
    assert all(not math.isnan(v) for v in final.values())


def test_without_valid_count_the_dict_passes_through():
    assert finalize_train_policy_metrics({"foo": 1.0}) == {"foo": 1.0}


def _finalize_worker(rank, world_size, out_dir):
    # rank 0: 2 tokens with ratio e^{±0.1}; rank 1: no valid token at all (it must still join every collective)
    if rank == 0:
        metrics = train_policy_metrics(torch.tensor([0.1, -0.1]), torch.zeros(2), {})
    else:
        metrics = train_policy_metrics(torch.zeros(0), torch.zeros(0), {})
    metrics["loss/policy"] = torch.tensor(1.0 + rank)
    calls = []
    original = torch.distributed.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return original(*args, **kwargs)

    torch.distributed.all_reduce = counting_all_reduce
    try:
        final = finalize_train_policy_metrics(metrics)
    finally:
        torch.distributed.all_reduce = original
    torch.save((final, len(calls)), f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_finalize_across_processes_one_collective_per_kind(tmp_path):
    run_distributed(_finalize_worker, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        final, calls = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert calls == 3  # SUM, MAX, MIN
        assert final["train_policy/valid_tokens"] == 2
        assert final["train_policy/ratio_max"] == pytest.approx(math.exp(0.1))
        assert final["train_policy/ratio_min"] == pytest.approx(math.exp(-0.1))
        assert final["train_policy/kl1"] == pytest.approx(0.0, abs=1e-7)
        assert final["loss/policy"] == pytest.approx(3.0)


def test_reduce_metrics_single_process_is_identity_on_declared_keys():
    out = reduce_metrics({"train_policy/valid_tokens": 4.0, "undeclared": 1.0})
    assert out == {"train_policy/valid_tokens": 4.0}


# ------------------------------------------------------------------------------------------------------------------
# One spec per key: the docs' metrics table, the neutral set and what the loss layer emits all come from `METRICS`


def test_docs_metrics_table_is_the_one_made_from_the_specs():
    from hf_rlloss.loss.metrics import metrics_table

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "rollout_is.md"), encoding="utf8").read()
    start, end = "<!-- metrics-table:start -->\n", "<!-- metrics-table:end -->"
    assert page.count(start) == 1 and page.count(end) == 1
    documented = page.split(start)[1].split(end)[0]
    assert documented == metrics_table(), "regenerate the table in docs/rollout_is.md with metrics_table()"
    for row in documented.splitlines()[2:]:
        assert row.count("|") == 4, f"a cell holds a pipe and breaks the table: {row}"


def test_every_emitted_key_is_declared_and_every_logged_key_documented():
    from hf_rlloss import GRPOLossConfig, GRPOLossContext
    from hf_rlloss.loss.metrics import DERIVED, METRICS, metrics_table

    torch.manual_seed(0)
    labels = torch.tensor([[1, 2, 3, -100], [2, 0, 1, 3]])
    old = -torch.rand(2, 4) - 0.5
    cfg = GRPOLossConfig(
        use_kl_loss=True,
        kl_loss_type="k3",
        off_policy_mask_threshold=0.5,
        entropy_coef=0.01,
        top_entropy_quantile=0.5,
        rollout_is={"mode": "both", "upper": 2.0, "veto_lower": 1e-4, "m2_threshold": 0.5},
    )
    data = {"shifted_labels": labels, "advantages": torch.tensor([1.0, -1.0]), "old_logprobs": old}
    data.update(ref_logprobs=old - 0.1, rollout_logprobs=old + 0.05, rollout_kept_logmass=torch.zeros(2, 4))
    ctx = cfg.build(data)
    ctx.compute_rollout_is()
    GRPOLossContext.build_batches([ctx])
    _, emitted = ctx(hidden_states=torch.randn(2, 4, 8), head_weight=torch.randn(5, 8))
    assert set(emitted) - {"loss/router_aux"} <= set(METRICS)  # router_aux: the trainer's, on MoE models
    logged = set(finalize_train_policy_metrics(emitted))
    table_keys = {row.split("`")[1] for row in metrics_table().splitlines()[2:]}
    assert logged <= table_keys
    expected_logged = {spec.logged_as for spec in METRICS.values() if spec.logged_as} | set(DERIVED)
    assert table_keys == expected_logged
    assert logged == expected_logged - {"loss/router_aux"}  # every feature on: every other key is logged


def test_a_context_without_tokens_emits_every_key_at_its_neutral_value():
    from hf_rlloss import GRPOLossConfig, GRPOLossContext
    from hf_rlloss.loss.metrics import METRICS

    cfg = GRPOLossConfig(use_kl_loss=True, kl_loss_type="k1", off_policy_mask_threshold=0.5)
    data = {"shifted_labels": torch.full((1, 3), -100), "advantages": torch.ones(1), "ref_logprobs": torch.zeros(1, 3)}
    ctx = cfg.build(data)
    GRPOLossContext.build_batches([ctx])
    _, metrics = ctx(logprobs=torch.zeros(1, 3, requires_grad=True))
    for key in ("train_policy/ref_kl_sum", "train_policy/opsm_masked_count", "loss/kl", "train_policy/ratio_max"):
        assert key in metrics
    for key, value in metrics.items():
        if key != "loss/total" and METRICS[key].emitted is not None:
            assert float(value) == METRICS[key].neutral, key
