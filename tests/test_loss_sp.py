"""The loss layer under sequence parallelism: sp=2 and dp=2×sp=2 equal one process (loss, gradients, metrics)."""

import pytest
import torch
from _data import assert_equals_one_process, averaged_over_ranks, make_step
from _dist import run_distributed

from hf_rlloss import GRPOLossConfig, GRPOLossContext, accumulate_metrics, sp_split

CASES = [
    ("vanilla", "token-mean", None),
    ("vanilla", "seq-mean-token-mean", "token"),
    ("gspo", "seq-mean-token-mean", "sequence"),
    ("geo_mean", "seq-mean-token-sum", "geometric"),
    ("geo_mean", "seq-mean-token-mean", "token"),  # token IS weights folded into a geometric mean per sequence
    ("vespo", "token-mean", "token"),  # sequence sums of log-ratios and of folded IS weights, OPSM, KL × s_i
    ("cispo_seq", "seq-mean-token-mean", None),
    ("sapo", "seq-mean-token-sum-norm", "sequence"),  # empty sequences counted once, whole ones rejected by IS too
]
# TRL-mapped sequence terms (issue 12), per loss type: their per-sequence statistics are reduced over the SP group
_EXTRA = {
    "vespo": {"off_policy_mask_threshold": 0.0, "kl_bias_correction": "sequence"},
    "cispo_seq": {"kl_bias_correction": "token"},
    "sapo": {"count_empty_sequences": True, "loss_scale_factor": 6.0},
}
LENGTH = 7  # odd: not divisible by sp, so the last shard is padded


def _config(loss_type, mode, is_level):
    rollout_is = {"level": is_level, "mode": "both", "upper": 2.0, "lower": 0.5} if is_level else {}
    return GRPOLossConfig(
        rollout_is=rollout_is,
        policy_loss_cfg={"loss_type": loss_type, "cliprange_low": 0.1, "cliprange_high": 0.15},
        loss_agg_mode=mode,
        use_kl_loss=True,
        kl_loss_type="k3",
        kl_loss_coef=0.1,
        chunk_size=3,
        **_EXTRA.get(loss_type, {}),
    )


def _sp_worker(rank, world_size, sp, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size // sp, sp), mesh_dim_names=("dp", "sp"))
    sp_mesh, dp_rank = mesh["sp"], mesh["dp"].get_local_rank()
    results = {}
    for loss_type, mode, is_level in CASES:
        for path in ("logprobs", "hidden"):
            step = make_step(num_seqs=8, length=LENGTH)
            w = step["w"].clone().requires_grad_(True)
            rows = list(range(8))[dp_rank :: world_size // sp]
            contexts, hiddens = [], []
            for micro in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):  # gradient accumulation: 2 micro-batches
                data = {
                    "shifted_labels": step["labels"][micro],
                    "advantages": step["advantages"][micro],
                    "old_logprobs": step["old"][micro],
                    "ref_logprobs": step["ref"][micro],
                }
                if is_level:
                    data["rollout_logprobs"] = step["rollout"][micro]
                contexts.append(_config(loss_type, mode, is_level).build(data, sp_mesh=sp_mesh))
                if is_level:  # rejects tokens (or whole sequences, gathered over the SP group) before the denominator
                    contexts[-1].compute_rollout_is()
                hiddens.append(sp_split(step["h"][micro], sp_mesh, 1, 0.0))  # the model's local shard
            GRPOLossContext.build_batches(contexts)
            total, metrics = 0.0, {}
            for ctx, h in zip(contexts, hiddens):
                if path == "hidden":
                    loss, m = ctx(hidden_states=h, head_weight=w)
                else:
                    labels = ctx.loss_kwargs.shifted_labels
                    lp = torch.log_softmax(h @ w.t(), -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
                    loss, m = ctx(logprobs=lp)
                total = total + loss
                accumulate_metrics(metrics, m)
            (grad_w,) = torch.autograd.grad(total, w)
            results[(loss_type, mode, is_level, path)] = averaged_over_ranks(total, grad_w, metrics)
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,sp", [(2, 2), (4, 2)], ids=["sp2", "dp2xsp2"])
def test_sequence_parallel_equals_single_process(tmp_path, world_size, sp):
    run_distributed(_sp_worker, world_size, sp, str(tmp_path), timeout=240)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert len(results) == 2 * len(CASES)
    for (loss_type, mode, is_level, path), result in results.items():
        step = make_step(num_seqs=8, length=LENGTH)
        cfg = _config(loss_type, mode, is_level)
        ref_metrics = assert_equals_one_process(result, cfg, step, path, 1e-5, (loss_type, mode, path))
        assert any(k.startswith("rollout_is/") for k in ref_metrics) == (is_level is not None)
