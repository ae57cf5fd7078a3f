"""Shared test data: one optimizer step of random sequences, a runner that splits it into micro-batches, and the
comparison of a multi-process run of it with one process."""

from __future__ import annotations

import pytest
import torch

from hf_rlloss import GRPOLossContext, accumulate_metrics, finalize_train_policy_metrics

IGNORE = -100


def make_step(num_seqs=8, length=6, vocab=13, hidden=5, seed=0, dtype=torch.float64):
    """Labels with ragged masks (including a fully masked sequence), advantages, old/ref log-probs, h, W."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (num_seqs, length), generator=g)
    lengths = torch.randint(1, length + 1, (num_seqs,), generator=g)
    lengths[num_seqs // 2] = 0  # a sequence without any valid token
    positions = torch.arange(length).expand(num_seqs, length)
    labels = labels.masked_fill(positions >= lengths[:, None], IGNORE)
    h = torch.randn(num_seqs, length, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    lp = logprobs_of(h, w, labels).detach()
    return {
        "labels": labels,
        "advantages": torch.randn(num_seqs, generator=g),
        "old": (lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=dtype)).float(),
        "ref": (lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=dtype)).float(),
        "rollout": (lp + 0.2 * torch.randn(lp.shape, generator=g, dtype=dtype)).float(),
        "h": h,
        "w": w,
    }


def logprobs_of(h, w, labels):
    logits = h @ w.t()
    return torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def run_step(cfg, step, micro_batches, path="logprobs", build_kwargs=None):
    """Loss summed over micro-batches and gradients w.r.t. (h, W); ``micro_batches`` are lists of row indices."""
    h = step["h"].clone().requires_grad_(True)
    w = step["w"].clone().requires_grad_(True)
    contexts = []
    for rows in micro_batches:
        data = {"shifted_labels": step["labels"][rows], "advantages": step["advantages"][rows]}
        data["old_logprobs"] = step["old"][rows]
        if cfg.use_kl_loss:
            data["ref_logprobs"] = step["ref"][rows]
        if cfg.rollout_is.enabled:
            data["rollout_logprobs"] = step["rollout"][rows]
        contexts.append(cfg.build(data))
        if cfg.rollout_is.enabled:
            contexts[-1].compute_rollout_is()
    GRPOLossContext.build_batches(contexts, **(build_kwargs or {}))
    total, metrics = 0.0, {}
    for rows, ctx in zip(micro_batches, contexts):
        if path == "logprobs":
            loss, m = ctx(logprobs=logprobs_of(h[rows], w, step["labels"][rows]))
        else:
            loss, m = ctx(hidden_states=h[rows], head_weight=w)
        total = total + loss
        accumulate_metrics(metrics, m)
    grad_h, grad_w = torch.autograd.grad(total, (h, w))
    return total.detach(), grad_h, grad_w, metrics


def split(rows: list[int], parts: int) -> list[list[int]]:
    size = len(rows) // parts
    return [rows[i * size : (i + 1) * size] for i in range(parts)]


def averaged_over_ranks(loss, grad_w, metrics):
    """In a worker: what data parallelism reports for this rank's (loss, ∂/∂W, metrics) of a step: the loss and the
    gradient averaged over the ranks (as DDP/FSDP average gradients), the metrics finalized over all ranks."""
    world_size = torch.distributed.get_world_size()
    loss, grad_w = loss.detach().clone(), grad_w.clone()
    torch.distributed.all_reduce(loss)
    torch.distributed.all_reduce(grad_w)
    return loss / world_size, grad_w / world_size, finalize_train_policy_metrics(metrics)


def assert_equals_one_process(result, cfg, step, path, metrics_abs=1e-6, label=()):
    """`result` = `averaged_over_ranks(...)` of a multi-process run equals the whole `step` as one micro-batch in
    one process: loss and ∂/∂W within 1e-6, the same metric keys, each metric within `metrics_abs` (`label` names
    the case in a failure). Returns the reference metrics."""
    loss, grad_w, metrics = result
    ref_loss, _, ref_grad_w, ref_metrics = run_step(cfg, step, [list(range(step["labels"].shape[0]))], path)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_w, ref_grad_w, atol=1e-6, rtol=0)
    ref_metrics = finalize_train_policy_metrics(ref_metrics)
    assert metrics.keys() == ref_metrics.keys()
    for key in ref_metrics:
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=metrics_abs), (*label, key)
    return ref_metrics
