"""The GRPO-family loss context (`GRPOLossContext`): the configured policy loss (× rollout IS weights) plus an
optional KL penalty, normalized over the whole optimizer step.

`build_batches` makes a step's micro-batches ready: non-finite inputs handled, M2PO's second-moment mask applied
(`second_moment.second_moment_mask`), then one all-reduce of the step's token and sequence counts, from which every
token's policy and KL weight follows (`aggregation.aggregation_weights`). The loss of a chunk of tokens (`_objective`)
is the policy loss (`policy_losses`), its KL term (`kl`) with TRL's bias corrections, TRL's metrics (`trl_metrics`)
and `train_policy_metrics`.
"""

from __future__ import annotations

import torch

from ..parallel.collectives import all_reduce, world_size
from ..parallel.sequence import sp_group, sp_rank, sp_world_size
from .aggregation import aggregation_weights
from .context import BaseRLLossContext
from .fields import CHECKED_FOR_NONFINITE
from .kl import kl_penalty
from .metrics import TRAIN_POLICY, VALID_TOKENS, accumulate_metrics
from .second_moment import second_moment_mask
from .trl_metrics import K3_TYPES
from .trl_metrics import chunk_metrics as trl_chunk_metrics

__all__ = ["GRPOLossContext", "train_policy_metrics"]


class GRPOLossContext(BaseRLLossContext):
    """GRPO-family loss of one micro-batch: the configured policy loss (× rollout IS weights) plus optional KL."""

    @classmethod
    def build_batches(
        cls,
        contexts: list[BaseRLLossContext],
        *,
        process_group=None,
        grad_averaging_size: int | None = None,
        step_fraction: float = 1.0,
    ) -> list[BaseRLLossContext]:
        """Make the micro-batches of one optimizer step ready: global denominators and per-token weights.

        Collective when distributed (one all-reduce over `process_group`, plus one over the SP group for
        per-sequence token counts under SP). Call it after rollout IS has rejected tokens, so that they are not
        counted.

        Args:
            contexts (`list`): this rank's micro-batches of the step (at least one; an empty micro-batch is fine).
            process_group (`ProcessGroup`, *optional*): every rank of the step (data × sequence parallel); defaults to
                the whole world.
            grad_averaging_size (`int`, *optional*): how many ranks average the gradients (DDP/FSDP); each returned
                loss is multiplied by it. Defaults to the size of `process_group`.
            step_fraction (`float`, *optional*, defaults to `1.0`): the share of the optimizer step these
                micro-batches stand for, when a step is normalized in groups (a step spanning two generation batches,
                see `RLLossGRPOTrainer`): every policy and KL weight is multiplied by it.
        """
        cls._prepare_step(contexts, step_fraction, process_group)
        cfg = contexts[0].loss_cfg
        sp_mesh = contexts[0].sp_mesh
        flat_counts = cls._sequence_token_counts(contexts)
        counts = list(torch.split(flat_counts, [ctx.loss_kwargs.num_sequences for ctx in contexts]))
        if cfg.policy_loss_cfg.spec.rollout_is_per_sequence:
            for ctx, seq_counts in zip(contexts, counts):
                ctx._fold_rollout_is_per_sequence(seq_counts)

        device = contexts[0].mask.device
        ctx_tokens = torch.stack([ctx.mask.sum() for ctx in contexts]).double()  # (micro-batches,)
        # Sequences live on every rank of their SP group: count them once, on its first rank. `flat_counts` has one
        # entry per sequence (SP padding, seq_id -1, is none), already summed over the SP shards.
        step_sequences = (
            torch.full((), len(flat_counts), dtype=torch.float64, device=device)
            if cfg.count_empty_sequences
            else (flat_counts > 0).sum().double()
        )
        local_sequences = step_sequences if sp_rank(sp_mesh) == 0 else torch.zeros_like(step_sequences)
        totals = torch.stack([ctx_tokens.sum(), local_sequences])
        all_reduce(totals, group=process_group)
        global_tokens, global_sequences, *ctx_tokens = torch.cat([totals, ctx_tokens]).tolist()  # one host read
        grad_scale = grad_averaging_size if grad_averaging_size is not None else world_size(process_group)

        for ctx, seq_counts, tokens in zip(contexts, counts, ctx_tokens):
            kwargs = ctx.loss_kwargs
            weights = step_fraction * aggregation_weights(
                ctx.mask,
                kwargs.seq_ids,
                seq_counts,
                cfg.agg_mode,
                global_tokens,
                global_sequences,
                cfg.loss_scale_factor,
            )
            policy_weight = weights
            if kwargs.rollout_is_weights is not None and not cfg.policy_loss_cfg.spec.absorbs_rollout_is:
                policy_weight = weights * kwargs.rollout_is_weights
            kwargs.policy_loss_weight = torch.where(ctx.mask, policy_weight, 0.0)
            kwargs.kl_loss_weight = weights * cfg.kl_loss_coef if cfg.use_kl_loss else None
            kwargs.global_grad_tokens = torch.tensor(global_tokens, device=weights.device)
            ctx.seq_token_counts = seq_counts
            ctx.grad_scale = float(grad_scale)
            ctx.process_group = process_group
            # TRL's entropy bonus: a per-micro-batch token mean over the step's micro-batches (after × grad_scale)
            ctx.entropy_scale = step_fraction / (len(contexts) * max(tokens, 1.0) * float(grad_scale))
            # TRL logs a sequence-aggregated micro-batch's own loss (its share × the step's micro-batches), and under
            # token-mean (dapo, cispo, vespo) its share of the step's loss
            sequence_agg = cfg.agg_mode != "token-mean"
            ctx.trl_policy_loss_scale = len(contexts) / step_fraction if sequence_agg else 1.0
        return contexts

    @classmethod
    def _prepare_step(cls, contexts: list[BaseRLLossContext], step_fraction: float, process_group) -> None:
        """`build_batches`' checks of the step's micro-batches, then what drops tokens before the denominators:
        non-finite inputs (`nonfinite_inputs`) and M2PO's second-moment mask."""
        if not 0.0 < step_fraction <= 1.0:
            raise ValueError(f"step_fraction={step_fraction} must be in (0, 1]")
        if not contexts:
            raise ValueError("build_batches needs the micro-batches of the step (got an empty list)")
        cfg = contexts[0].loss_cfg
        if sp_world_size(contexts[0].sp_mesh) > 1:
            if any(ctx.entropy_coef != 0.0 for ctx in contexts):
                raise ValueError(
                    "entropy_coef is not supported with sequence parallelism (a shard's token mean differs)"
                )
            if cfg.top_entropy_quantile < 1.0:
                raise ValueError("top_entropy_quantile < 1 is not supported with sequence parallelism")
        for i, ctx in enumerate(contexts):
            ctx._handle_nonfinite(i)
            if cfg.use_kl_loss and ctx.loss_kwargs.ref_logprobs is None:
                raise ValueError(f"use_kl_loss=True but {ctx.label(i)} has no ref_logprobs")
        if cfg.rollout_is.m2_threshold is not None:
            second_moment_mask(contexts, cfg.rollout_is.m2_threshold, process_group)

    @staticmethod
    def _sequence_token_counts(contexts: list[BaseRLLossContext]) -> torch.Tensor:
        """`(Σ S,)` float64: the valid tokens of each whole sequence of every micro-batch, in order; a sequence split
        over SP ranks is counted on all of its shards (one all-reduce over the SP group)."""
        # every token added with its mask as weight (a masked token, seq_id -1 on SP padding, adds 0 to sequence 0):
        # no data-dependent shape, no host read
        counts = [
            torch.zeros(ctx.loss_kwargs.num_sequences, dtype=torch.float64, device=ctx.mask.device).index_add_(
                0, ctx.loss_kwargs.seq_ids.clamp(min=0).reshape(-1), ctx.mask.reshape(-1).double()
            )
            for ctx in contexts
        ]
        flat_counts = torch.cat(counts)
        sp_mesh = contexts[0].sp_mesh
        if sp_world_size(sp_mesh) > 1:
            all_reduce(flat_counts, group=sp_group(sp_mesh))
        return flat_counts

    def _fold_rollout_is_per_sequence(self, seq_counts: torch.Tensor) -> None:
        """Replace token-level rollout IS weights by one weight per sequence, their geometric mean over the valid
        tokens of the whole sequence (across SP shards): ``w_i = exp(Σ_t log w_t / n_i)``, as verl's GMPO.

        A weight constant over a sequence (sequence or geometric level, TRL's `(B, 1)` ratio) is left as it is.
        Weights are floored at 1e-10 before the log (verl adds 1e-10), so a zero weight gives a near-zero ``w_i``.
        """
        kwargs = self.loss_kwargs
        if kwargs.rollout_is_weights is None:
            return
        mask = self.mask
        log_w = kwargs.rollout_is_weights.double().clamp(min=1e-10).log()[mask]  # (N,)
        sums = torch.zeros(kwargs.num_sequences, dtype=torch.float64, device=log_w.device)
        sums.index_add_(0, kwargs.seq_ids[mask], log_w)
        if sp_world_size(self.sp_mesh) > 1:  # a sequence's shards live on the ranks of its SP group
            all_reduce(sums, group=sp_group(self.sp_mesh))
        seq_weight = (sums / seq_counts.clamp(min=1)).exp()  # (S,)
        per_token = seq_weight[kwargs.seq_ids.clamp(min=0)].to(kwargs.rollout_is_weights.dtype)  # (B, T)
        kwargs.rollout_is_weights = torch.where(mask, per_token, kwargs.rollout_is_weights)

    def _handle_nonfinite(self, index: int) -> None:
        kwargs = self.loss_kwargs
        mask = self.mask
        names = [name for name in CHECKED_FOR_NONFINITE if getattr(kwargs, name) is not None]
        fields_bad = [mask & ~torch.isfinite(getattr(kwargs, name)) for name in names]  # each (B, T)
        bad = torch.stack(fields_bad).any(dim=0) if fields_bad else torch.zeros_like(mask)
        *field_counts, count = torch.stack([*(b.sum() for b in fields_bad), bad.sum()]).tolist()  # one host read
        for name, field_count in zip(names, field_counts):
            if field_count and self.loss_cfg.nonfinite_inputs == "error":
                raise ValueError(
                    f"{name} of {self.label(index)} has {int(field_count)} non-finite value(s) at valid tokens "
                    "(set nonfinite_inputs='mask' to drop such tokens instead)"
                )
        if count:  # mask mode
            self.drop_tokens(bad)
        self.pending_metrics = accumulate_metrics(
            self.pending_metrics,
            {TRAIN_POLICY + "nonfinite_masked_tokens": torch.tensor(float(count), device=mask.device)},
        )

    def _objective(self, logprobs, chunk, entropy, tokens, seq_mean):
        cfg = self.loss_cfg
        policy_cfg = cfg.policy_loss_cfg
        old = tokens["old_logprobs"][chunk] if tokens["old_logprobs"] is not None else logprobs.detach()
        advantages = tokens["advantages"][chunk]
        per_token, indicators = policy_cfg.spec.fn(
            logprobs, old, advantages, policy_cfg, seq_mean=None if seq_mean is None else seq_mean[chunk]
        )
        weight = tokens["policy_loss_weight"][chunk]
        metrics = train_policy_metrics(
            logprobs.detach(), old, indicators, None if entropy is None else entropy.detach()
        )
        if "opsm_keep" in tokens:
            keep = tokens["opsm_keep"][chunk]
            weight = torch.where(keep, weight, 0.0)
            metrics[TRAIN_POLICY + "opsm_masked_count"] = (~keep).float().sum()
        if "entropy_keep" in tokens:
            weight = torch.where(tokens["entropy_keep"][chunk], weight, 0.0)
            if entropy is not None:
                kept_entropy = torch.where(tokens["entropy_keep"][chunk], entropy.detach(), 0.0)
                metrics[TRAIN_POLICY + "entropy_kept_sum"] = kept_entropy.float().sum()
                metrics[TRAIN_POLICY + "entropy_kept_tokens"] = tokens["entropy_keep"][chunk].float().sum()
        # Zero-weight tokens must not leak NaN/inf from their loss value: select rather than multiply.
        policy = torch.where(weight != 0, per_token * weight, 0.0).sum()
        metrics["loss/policy"] = policy.detach()
        total = policy
        trl_kl = None
        if cfg.use_kl_loss:
            kl, kl_loss = self._kl_term(logprobs, old, chunk, tokens)
            total = total + kl_loss
            metrics["loss/kl"] = kl_loss.detach()
            metrics[TRAIN_POLICY + "ref_kl_sum"] = kl.detach().sum()
            if cfg.kl_loss_type in K3_TYPES:
                trl_kl = kl.detach() * self._kl_bias_ratio(logprobs.detach(), old, chunk, tokens)
        metrics.update(
            trl_chunk_metrics(
                cfg,
                indicators,
                advantages,
                tokens["seq_ids"][chunk],
                self.seq_token_counts,
                self.loss_kwargs.num_sequences,
                total.detach(),
                self.trl_policy_loss_scale,
                trl_kl,
            )
        )
        if self.entropy_coef != 0.0:
            kept = (
                entropy if "entropy_keep" not in tokens else torch.where(tokens["entropy_keep"][chunk], entropy, 0.0)
            )
            bonus = -self.entropy_coef * self.entropy_scale * self.entropy_keep_scale * kept.sum()
            total = total + bonus
            metrics["loss/entropy_bonus"] = bonus.detach()
        return total, metrics

    def _kl_bias_ratio(self, logprobs, old, chunk, tokens) -> torch.Tensor | float:
        """The IS ratio ``ρ_t`` of `kl_bias_correction` (see `_kl_term`), 1 without it."""
        cfg = self.loss_cfg
        if cfg.kl_bias_correction == "token":
            policy_cfg = cfg.policy_loss_cfg
            return (logprobs - old).clamp(policy_cfg.log_prob_diff_min, policy_cfg.log_prob_diff_max).exp()
        if cfg.kl_bias_correction == "sequence":
            return tokens["kl_seq_ratio"][chunk]
        return 1.0

    def _kl_term(self, logprobs, old, chunk, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token KL estimate ``k_t`` and the weighted KL loss of a chunk.

        With ``kl_bias_correction`` (TRL's ``use_bias_correction_kl``) the loss is ``Σ_t w_t·k_t·ρ_t`` with a
        differentiable ratio ``ρ``: ``"token"``, ``ρ_t = r_t``; ``"sequence"``, ``ρ_t = s_i = exp(mean_u log r_u)``,
        whose gradient couples the tokens of a sequence. That term is written per token as
        ``s_i·w_t·k_t + sg(s_i·mean_u w_u·k_u)·(log π_t − sg(log π_t))``: summed over the sequence, the value is
        ``s_i·Σ_t w_t·k_t`` and the gradient ``s_i·Σ_t w_t·∇k_t + s_i·(Σ_u w_u·k_u)·mean_t ∇log π_t``, exactly.
        """
        cfg = self.loss_cfg
        weight = tokens["kl_loss_weight"][chunk]
        kl = kl_penalty(logprobs, tokens["ref_logprobs"][chunk], cfg.kl_loss_type)
        if cfg.kl_bias_correction == "token":
            return kl, (kl * self._kl_bias_ratio(logprobs, old, chunk, tokens) * weight).sum()
        if cfg.kl_bias_correction == "sequence":
            coupling = tokens["kl_seq_coupling"][chunk] * (logprobs - logprobs.detach())
            return kl, (tokens["kl_seq_ratio"][chunk] * kl * weight + coupling).sum()
        return kl, (kl * weight).sum()


def train_policy_metrics(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    indicators: dict[str, torch.Tensor],
    entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Sums, counts and extrema over valid tokens of how far the policy moved from the old one (detached).

    ``kl1 = log π_old − log π_θ`` and ``kl3 = r − 1 − log r`` estimate KL(π_old‖π_θ) on the sampled tokens
    (``r = π_θ/π_old``, ``log r`` clamped to ±20). Clip counts are the tokens where the clipped branch was chosen
    (``clip_low``: ``A < 0`` and ``r < 1 − ε_low``; ``clip_high``: ``A > 0`` and ``r > 1 + ε_high``), and
    ``dual_clip`` where the dual-clip bound was.
    """
    log_ratio = logprobs - old_logprobs
    clamped = log_ratio.clamp(-20.0, 20.0)
    ratio = clamped.exp()
    n = log_ratio.numel()
    metrics = {
        VALID_TOKENS: torch.tensor(float(n), device=logprobs.device),
        TRAIN_POLICY + "ratio_abs_dev_sum": (ratio - 1).abs().sum(),
        TRAIN_POLICY + "kl1_sum": (-log_ratio).sum(),
        TRAIN_POLICY + "kl3_sum": (ratio - 1 - clamped).sum(),
        TRAIN_POLICY + "ratio_max": ratio.max() if n else torch.full((), float("-inf"), device=logprobs.device),
        TRAIN_POLICY + "ratio_min": ratio.min() if n else torch.full((), float("inf"), device=logprobs.device),
    }
    for name in ("clip_low", "clip_high", "dual_clip"):
        if name in indicators:
            metrics[TRAIN_POLICY + f"{name}_count"] = indicators[name].float().sum()
    if entropy is not None:
        metrics[TRAIN_POLICY + "entropy_sum"] = entropy.sum()
        metrics[TRAIN_POLICY + "entropy_tokens"] = torch.tensor(float(n), device=logprobs.device)
    return metrics
