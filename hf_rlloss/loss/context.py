"""The loss context: what computes the loss of one micro-batch, the third stage of the loss layer (config → kwargs →
context). `BaseRLLossContext` holds what every loss shares: rollout IS on the micro-batch, the valid tokens, the
call from log-probs or from hidden states in chunks, the sequence-level terms; a subclass defines the step's
normalization (`build_batches`) and the loss of a chunk of tokens (`_objective`): `grpo_context.GRPOLossContext`.

The life of a context over one optimizer step:

1. ``cfg.build(data, sp_mesh)`` → context: validates shapes, expands per-sequence advantages, splits for SP
   (`kwargs.prepare_kwargs`).
2. The caller sets ``ctx.loss_kwargs.old_logprobs`` / ``ref_logprobs`` (local, already split) when it has them.
3. Optional rollout importance sampling rejects tokens and sets IS weights.
4. ``GRPOLossContext.build_batches(contexts)`` over all micro-batches of the step: one all-reduce of the global
   denominators, then per-token policy and KL weights.
5. ``loss, metrics = ctx(logprobs=...)`` or ``ctx(hidden_states=..., head_weight=...)`` per micro-batch, then
   ``loss.backward()``. Summed over micro-batches and averaged over ranks (as DDP/FSDP average gradients), the
   returned losses and their gradients equal the global loss of the step and its gradient.

`BaseRLLossKwargs`, `prepare_kwargs`, `GRPOLossContext` and `train_policy_metrics` are importable from here too.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.collectives import all_reduce, is_distributed, world_size
from ..parallel.sequence import sp_group, sp_world_size
from .chunked_logprobs import chunked_logprobs, chunked_objective
from .fields import LOSS_FIELDS
from .kl import kl_penalty
from .kwargs import BaseRLLossKwargs, prepare_kwargs
from .metrics import accumulate_metrics, neutral_metrics
from .rollout_is import compute_rollout_is
from .trl_metrics import finish as finish_trl_metrics
from .trl_metrics import trl_features

# and, read from `grpo_context` on first use (`__getattr__`): `GRPOLossContext`, `train_policy_metrics`
__all__ = ["BaseRLLossContext", "BaseRLLossKwargs", "prepare_kwargs"]


class BaseRLLossContext:
    """The loss of one micro-batch. Built by ``cfg.build``; made ready by ``build_batches``; called per micro-batch.

    Subclasses define ``build_batches`` (the step's normalization) and ``_objective`` (the loss of a chunk of tokens).
    """

    def __init__(self, loss_cfg, loss_kwargs: BaseRLLossKwargs, sp_mesh: DeviceMesh | None = None):
        self.loss_cfg = loss_cfg
        self.loss_kwargs = loss_kwargs
        self.sp_mesh = sp_mesh
        self.grad_scale: float | None = None  # set by build_batches
        self.seq_token_counts: torch.Tensor | None = None  # valid tokens per whole sequence, set by build_batches
        self.pending_metrics: dict[str, Any] = {}  # metrics of the preparation, emitted by the first call
        self.deferred_rollout_is_mask: torch.Tensor | None = None  # set by defer_rollout_is
        self.micro_batch: int | None = None  # index in the optimizer step, for error messages (see `cfg.build`)
        self.entropy_coef: float = getattr(loss_cfg, "entropy_coef", 0.0)  # the trainer's adaptive control sets it
        self.entropy_scale: float | None = None  # 1 / (tokens × micro-batches × grad_scale), set by build_batches
        self.entropy_keep_scale = 1.0  # valid / kept tokens under top_entropy_quantile
        self.process_group = None  # the step's ranks (set by build_batches): the entropy quantile is over them
        self.trl_policy_loss_scale = 1.0  # micro-batch share → TRL's `policy_loss` (set by build_batches)

    def label(self, position: int | None = None) -> str:
        """`"micro-batch i"` for messages: the index given to `cfg.build`, else the position in `build_batches`."""
        index = self.micro_batch if self.micro_batch is not None else position
        if index is None:
            return "this micro-batch (pass micro_batch=i to cfg.build to number it)"
        return f"micro-batch {index}"

    @property
    def mask(self) -> torch.Tensor:
        """`(B, T)` bool: the tokens that carry a loss."""
        return self.loss_kwargs.shifted_labels != self.loss_cfg.ignore_idx

    @classmethod
    def build_batches(cls, contexts: list[BaseRLLossContext], **kwargs) -> list[BaseRLLossContext]:
        raise NotImplementedError

    def compute_rollout_is(self) -> dict[str, torch.Tensor]:
        """Rollout importance sampling of this micro-batch: weights, rejection, mismatch metrics.

        Compares `old_logprobs` (the trainer's no-grad pass, before any update) with `rollout_logprobs` (the
        generation engine's). With `old_kept_logmass`, π_old is first renormalized over the sampled support
        (`old_logprobs − old_kept_logmass`), for rollout log-probs taken on that support (vLLM's processed log-probs,
        or `rollout_logprobs_support="sampled"`); the policy ratio keeps the full-vocabulary `old_logprobs`. The kept
        mass (`rollout_kept_logmass`, else `old_kept_logmass`) is reported as `mismatch/kept_mass_mean`. Rejected
        tokens get `ignore_idx` in a new labels tensor — so it must be called before `build_batches`, which then
        leaves them out of the denominator (calling it after is an error) — and the IS weights multiply any
        `rollout_is_weights` given with the data. Collective under SP (one all-reduce over the SP group).

        Returns:
            `dict`: the micro-batch's accumulable IS metrics; they are also emitted with the loss metrics of the
            next call, so `finalize_train_policy_metrics` reports the `mismatch/*` and `rollout_is/*` values.
        """
        kwargs = self.loss_kwargs
        if self.grad_scale is not None:
            raise RuntimeError(
                "compute_rollout_is() was called after build_batches(): the tokens it rejects would stay in the "
                "step's denominator. Call cfg.build(...), then ctx.compute_rollout_is() on each micro-batch, then "
                "build_batches(contexts) once"
            )
        if kwargs.rollout_logprobs is None:
            raise ValueError("compute_rollout_is needs rollout_logprobs (the generation engine's log-probs)")
        if kwargs.old_logprobs is None:
            raise ValueError("compute_rollout_is needs old_logprobs (log-probs of the policy before the update)")
        mask = self.mask
        if self.loss_cfg.nonfinite_inputs == "error":  # IS would silently reject them: report bad input first
            for name in ("old_logprobs", "old_kept_logmass"):
                value = getattr(kwargs, name)
                bad = 0 if value is None else int((mask & ~torch.isfinite(value)).sum())
                if bad:
                    raise ValueError(
                        f"{name} of {self.label()} has {bad} non-finite value(s) at valid tokens (set "
                        "nonfinite_inputs='mask' to drop such tokens instead)"
                    )
        weights, keep, metrics = self._rollout_is(kwargs.old_logprobs, mask)
        self._apply_rollout_is(mask & ~keep, weights)
        self.pending_metrics = accumulate_metrics(self.pending_metrics, metrics)
        return metrics

    def _apply_rollout_is(self, rejected: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Drop the `rejected` tokens and multiply the IS `weights` into any `rollout_is_weights` of the data."""
        self.drop_tokens(rejected)
        if weights is not None:
            kwargs = self.loss_kwargs
            weights = weights.to(torch.float32)
            kwargs.rollout_is_weights = (
                weights if kwargs.rollout_is_weights is None else weights * kwargs.rollout_is_weights
            )

    def drop_tokens(self, drop: torch.Tensor) -> None:
        """Give the `drop` tokens the `ignore_idx` label, in a new tensor (the caller's labels are left untouched)."""
        kwargs = self.loss_kwargs
        kwargs.shifted_labels = kwargs.shifted_labels.masked_fill(drop, self.loss_cfg.ignore_idx)

    def _rollout_is(self, old_logprobs: torch.Tensor, mask: torch.Tensor):
        """`compute_rollout_is` on this micro-batch, π_old renormalized by `old_kept_logmass` when it is given."""
        kwargs = self.loss_kwargs
        old = old_logprobs if kwargs.old_kept_logmass is None else old_logprobs - kwargs.old_kept_logmass
        kept_logmass = (
            kwargs.rollout_kept_logmass if kwargs.rollout_kept_logmass is not None else kwargs.old_kept_logmass
        )
        return compute_rollout_is(
            self.loss_cfg.rollout_is,
            old,
            kwargs.rollout_logprobs,
            mask,
            kwargs.seq_ids,
            kwargs.num_sequences,
            sp_mesh=self.sp_mesh,
            kept_logmass=kept_logmass,
        )

    def defer_rollout_is(self) -> None:
        """Metrics-only rollout IS of an on-policy micro-batch, with `old_logprobs` taken from the loss's own forward.

        When the micro-batch is trained on-policy (the policy has not been updated since generation), the old
        log-probs are the detached log-probs of the training forward: no separate no-grad pass is needed. The
        mismatch metrics are then computed by the loss call (`__call__`) from those log-probs, equal to what
        `compute_rollout_is` gives with the old log-probs of a no-grad pass. Tokens with a non-finite rollout log-prob
        are rejected now (before `build_batches`), as `compute_rollout_is` would. Needs `rollout_logprobs`, no
        `old_logprobs` and metrics-only IS (weights must exist before `build_batches`); under SP the loss call
        makes the IS all-reduce over the SP group.
        """
        kwargs = self.loss_kwargs
        if kwargs.rollout_logprobs is None:
            raise ValueError("defer_rollout_is needs rollout_logprobs (the generation engine's log-probs)")
        if kwargs.old_logprobs is not None:
            raise ValueError("defer_rollout_is is for micro-batches without old_logprobs: call compute_rollout_is")
        if self.loss_cfg.rollout_is.enabled:
            raise ValueError(
                "rollout IS with weights or rejection (rollout_is.upper set) needs old_logprobs before build_batches: "
                "compute them and call compute_rollout_is"
            )
        mask = self.mask
        self.deferred_rollout_is_mask = mask
        # Metrics-only IS rejects exactly the tokens with a non-finite log-prob; the loss's own are finite (or it
        # raises), so only the rollout's can be.
        self.drop_tokens(mask & ~torch.isfinite(kwargs.rollout_logprobs))

    def _deferred_rollout_is_metrics(self, index: torch.Tensor, token_logprobs: torch.Tensor) -> dict[str, Any]:
        """The metrics of `defer_rollout_is` from the `(N,)` detached log-probs at the flat valid positions `index`."""
        mask, self.deferred_rollout_is_mask = self.deferred_rollout_is_mask, None
        old = torch.full(mask.shape, float("nan"), dtype=token_logprobs.dtype, device=token_logprobs.device)
        old.view(-1)[index] = token_logprobs  # NaN only where the rollout's log-prob is non-finite too
        _, _, metrics = self._rollout_is(old, mask)
        return metrics

    def _objective(self, logprobs, chunk, entropy, tokens, seq_mean) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def _sequence_mean(self, statistic: torch.Tensor, seq_ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Per-token mean (or sum) of ``statistic`` over its whole sequence (across SP shards); detached."""
        sums = torch.zeros(self.loss_kwargs.num_sequences, dtype=torch.float64, device=statistic.device)
        sums.index_add_(0, seq_ids, statistic.detach().double())
        if sp_world_size(self.sp_mesh) > 1:  # a sequence's shards live on the ranks of its SP group
            all_reduce(sums, group=sp_group(self.sp_mesh))
        if reduction == "mean":
            sums = sums / self.seq_token_counts.double().clamp(min=1)
        return sums[seq_ids].to(statistic.dtype)

    def _valid_tokens(self) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """Flat indices of the valid tokens, and every per-token field gathered at them."""
        kwargs = self.loss_kwargs
        index = self.mask.reshape(-1).nonzero().squeeze(-1)
        tokens = {
            n: None if getattr(kwargs, n) is None else getattr(kwargs, n).reshape(-1)[index] for n in LOSS_FIELDS
        }
        return index, tokens

    def __call__(
        self,
        *,
        logprobs: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        head_weight: torch.Tensor | None = None,
        temperature: float = 1.0,
        matmul_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of this micro-batch, from per-token log-probs or from hidden states and the LM-head weight.

        Args:
            logprobs (`torch.Tensor`, *optional*): `(B, T)` log π_θ of the labels, carrying the gradient.
            hidden_states (`torch.Tensor`, *optional*): `(B, T, H)` last hidden states aligned with the labels; the
                log-probs are then computed in chunks of `chunk_size` tokens without materializing the logits.
            head_weight (`torch.Tensor`, *optional*): `(V, H)` LM-head weight (with `hidden_states`).
            temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it (the sampling temperature).
            matmul_dtype (`torch.dtype`, *optional*): dtype of the head GEMMs' operands (e.g. `torch.bfloat16` under
                bf16 mixed precision with float32 weights); defaults to the common dtype of `hidden_states` and
                `head_weight`. Gradients come back in their own dtypes (see `hf_rlloss.loss.chunked_logprobs`).

        Returns:
            `(loss, metrics)`: the scalar to call `backward()` on (already multiplied by the number of ranks that
            average gradients), and 0-dim detached metrics to merge with `accumulate_metrics` and reduce with
            `finalize_train_policy_metrics` once per optimizer step.
        """
        if self.grad_scale is None:
            raise RuntimeError("call build_batches() on the micro-batches of the optimizer step before the loss")
        if (logprobs is None) == (hidden_states is None):
            raise ValueError("pass exactly one of logprobs=... or hidden_states=... (with head_weight=...)")
        index, tokens = self._valid_tokens()
        if logprobs is not None:
            loss, metrics, detached = self._loss_from_logprobs(logprobs, index, tokens)
        else:
            head = {"temperature": temperature, "matmul_dtype": matmul_dtype}
            loss, metrics, detached = self._loss_from_hidden(hidden_states, head_weight, index, tokens, **head)
        metrics = accumulate_metrics(self._empty_metrics(hidden_states is not None, loss.device), metrics)
        num_sequences = self.loss_kwargs.num_sequences
        finish_trl_metrics(metrics, self.loss_cfg, len(index), num_sequences, self.seq_token_counts, self.sp_mesh)
        if self.deferred_rollout_is_mask is not None:
            accumulate_metrics(metrics, self._deferred_rollout_is_metrics(index, detached))
        if self.pending_metrics:
            accumulate_metrics(metrics, self.pending_metrics)
            self.pending_metrics = {}
        metrics["loss/total"] = loss.detach()
        if not torch.isfinite(loss.detach()):
            summary = {k: round(float(v), 6) for k, v in metrics.items()}
            raise FloatingPointError(f"the loss of this micro-batch is not finite ({float(loss)}); metrics: {summary}")
        return loss * self.grad_scale, metrics

    def _loss_from_logprobs(self, logprobs: torch.Tensor, index: torch.Tensor, tokens: dict[str, Any]):
        """`(loss, metrics, detached (N,) log-probs)` of `__call__(logprobs=...)`."""
        labels_shape = tuple(self.loss_kwargs.shifted_labels.shape)
        if getattr(self.loss_cfg, "top_entropy_quantile", 1.0) < 1.0:
            raise ValueError(
                f"top_entropy_quantile={self.loss_cfg.top_entropy_quantile}: the high-entropy mask needs the "
                "full-vocabulary entropies; compute the loss from hidden_states=... and head_weight=..."
            )
        if self.entropy_coef != 0.0:
            raise ValueError(
                f"entropy_coef={self.entropy_coef}: the entropy bonus needs the full-vocabulary distribution; "
                "compute the loss from hidden_states=... and head_weight=..."
            )
        if tuple(logprobs.shape) != labels_shape:
            raise ValueError(f"logprobs has shape {tuple(logprobs.shape)} but shifted_labels has shape {labels_shape}")
        token_logprobs = logprobs.reshape(-1)[index]
        token_logprobs = token_logprobs.to(torch.promote_types(token_logprobs.dtype, torch.float32))
        bad = int((~torch.isfinite(token_logprobs.detach())).sum())
        if bad:
            raise FloatingPointError(f"logprobs has {bad} non-finite value(s) at valid tokens")
        seq_mean = None
        if self._needs_sequence_pass():
            seq_mean = self._sequence_terms(token_logprobs.detach(), tokens)
        loss, metrics = self._objective(token_logprobs, slice(None), None, tokens, seq_mean)
        return loss, metrics, token_logprobs.detach()

    def _check_hidden(self, hidden_states: torch.Tensor, head_weight: torch.Tensor | None) -> None:
        labels_shape = tuple(self.loss_kwargs.shifted_labels.shape)
        if head_weight is None:
            raise ValueError("hidden_states=... needs head_weight=... (the (V, H) LM-head weight)")
        if hidden_states.dim() != 3 or tuple(hidden_states.shape[:2]) != labels_shape:
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}; expected (B, T, H) with (B, T) = "
                f"shifted_labels' shape {labels_shape}"
            )
        if head_weight.dim() != 2 or head_weight.shape[1] != hidden_states.shape[-1]:
            raise ValueError(
                f"head_weight has shape {tuple(head_weight.shape)}; expected (V, {hidden_states.shape[-1]})"
            )

    def _loss_from_hidden(
        self,
        hidden_states: torch.Tensor,
        head_weight: torch.Tensor | None,
        index: torch.Tensor,
        tokens: dict[str, Any],
        *,
        temperature: float,
        matmul_dtype: torch.dtype | None,
    ):
        """`(loss, metrics, detached (N,) log-probs or None)` of `__call__(hidden_states=..., head_weight=...)`."""
        self._check_hidden(hidden_states, head_weight)
        cfg = self.loss_cfg
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])[index]
        head = {
            "temperature": temperature,
            "chunk_size": cfg.chunk_size,
            "matmul_dtype": matmul_dtype,
            "compile_epilogue": cfg.compile_epilogue,
            "softcap": cfg.logit_softcapping,
        }
        seq_mean = None
        if self._needs_sequence_pass():
            # Per-sequence terms need every token's log-prob first: a no-grad pass, then the chunked one.
            token_logprobs, token_entropy = chunked_logprobs(
                hidden.detach(),
                head_weight.detach(),
                tokens["shifted_labels"],
                with_entropy=cfg.top_entropy_quantile < 1.0,
                **head,
            )
            if token_entropy is not None:
                tokens["entropy_keep"] = self._high_entropy_mask(token_entropy)
            seq_mean = self._sequence_terms(token_logprobs, tokens)

        deferred = self.deferred_rollout_is_mask is not None
        detached = torch.empty(index.shape, dtype=torch.float64, device=hidden.device) if deferred else None

        def objective(chunk_logprobs, chunk, entropy):
            if detached is not None:  # the old log-probs of an on-policy micro-batch (defer_rollout_is)
                detached[chunk] = chunk_logprobs.detach()
            return self._objective(chunk_logprobs, chunk, entropy, tokens, seq_mean)

        loss, metrics = chunked_objective(
            hidden,
            head_weight,
            tokens["shifted_labels"],
            objective,
            with_entropy=cfg.compute_entropy or self.entropy_coef != 0.0,
            entropy_grad=self.entropy_coef != 0.0,
            **head,
        )
        return loss, metrics, detached

    def _high_entropy_mask(self, entropy: torch.Tensor) -> torch.Tensor:
        """`(N,)` bool: the tokens whose entropy is ≥ the `1 − top_entropy_quantile` quantile of the micro-batch's
        valid tokens on all ranks of the step (TRL's `get_high_entropy_mask`: gathered, padded with a negative
        sentinel that no entropy can equal). Also rescales the entropy bonus to a mean over the kept tokens."""
        values = entropy.float()
        if is_distributed() and world_size(self.process_group) > 1:
            import torch.distributed as dist

            size = torch.tensor([values.numel()], device=values.device)
            sizes = [torch.zeros_like(size) for _ in range(world_size(self.process_group))]
            dist.all_gather(sizes, size, group=self.process_group)
            longest = int(max(int(s) for s in sizes))
            padded = torch.full((longest,), -1e9, device=values.device)
            padded[: values.numel()] = values
            gathered = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(gathered, padded, group=self.process_group)
            values = torch.cat(gathered)
            values = values[values != -1e9]
        if values.numel() == 0:
            return torch.zeros_like(entropy, dtype=torch.bool)
        keep = entropy.float() >= torch.quantile(values, 1.0 - self.loss_cfg.top_entropy_quantile)
        self.entropy_keep_scale = entropy.numel() / max(int(keep.sum()), 1)  # the bonus: a mean over kept tokens
        return keep

    def _needs_sequence_pass(self) -> bool:
        """Whether the loss needs per-sequence statistics of the current log-probs before any token's loss."""
        cfg = self.loss_cfg
        return (
            cfg.policy_loss_cfg.spec.sequence_statistic is not None
            or cfg.off_policy_mask_threshold is not None
            or cfg.kl_bias_correction == "sequence"
            or getattr(cfg, "top_entropy_quantile", 1.0) < 1.0
        )

    def _sequence_terms(
        self, token_logprobs: torch.Tensor, tokens: dict[str, torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Per-sequence statistics of the detached current log-probs `(N,)`, broadcast to tokens.

        Returns the policy loss's ``seq_mean`` (or `None`) and adds to ``tokens``: ``opsm_keep`` (the off-policy
        sequence mask), and for sequence-level KL bias correction ``kl_seq_ratio`` (``s_i``) and ``kl_seq_coupling``
        (``s_i · mean_t w_t·k_t``, the factor of the ratio's gradient; see `_kl_term`).
        """
        cfg = self.loss_cfg
        policy_cfg = cfg.policy_loss_cfg
        seq_ids = tokens["seq_ids"]
        old = tokens["old_logprobs"] if tokens["old_logprobs"] is not None else token_logprobs
        seq_mean = None
        if policy_cfg.spec.sequence_statistic is not None:
            extra = {"rollout_is_weights": tokens["rollout_is_weights"]} if policy_cfg.spec.absorbs_rollout_is else {}
            statistic = policy_cfg.spec.sequence_statistic(
                token_logprobs, old, tokens["advantages"], policy_cfg, **extra
            )
            seq_mean = self._sequence_mean(statistic, seq_ids, reduction=policy_cfg.spec.sequence_reduction)
        if cfg.off_policy_mask_threshold is not None:
            # DeepSeek-V3.2 OPSM as TRL: KL(rollout ‖ π_θ) estimated per sequence; tokens the rollout engine could
            # not score (NaN) give no evidence.
            behaviour = tokens["rollout_logprobs"] if tokens["rollout_logprobs"] is not None else old
            seq_kl = self._sequence_mean(torch.nan_to_num(behaviour - token_logprobs, nan=0.0), seq_ids)
            tokens["opsm_keep"] = (tokens["advantages"] >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)
        if cfg.kl_bias_correction == "sequence":
            ratio = self._sequence_mean(token_logprobs - old, seq_ids).exp()
            kl = kl_penalty(token_logprobs, tokens["ref_logprobs"], cfg.kl_loss_type)
            weighted_kl = kl * tokens["kl_loss_weight"]
            tokens["kl_seq_ratio"] = ratio
            tokens["kl_seq_coupling"] = ratio * self._sequence_mean(weighted_kl, seq_ids)
        return seq_mean

    def _empty_metrics(self, from_hidden: bool, device) -> dict[str, torch.Tensor]:
        """Every metric key this context emits, at its neutral value, so every rank reduces the same keys."""
        cfg = self.loss_cfg
        entropy = from_hidden and (cfg.compute_entropy or self.entropy_coef != 0.0)
        features = {
            "always": True,
            "kl": cfg.use_kl_loss,
            "opsm": cfg.off_policy_mask_threshold is not None,
            "entropy": entropy,
            "entropy_bonus": self.entropy_coef != 0.0,
            "entropy_kept": entropy and getattr(cfg, "top_entropy_quantile", 1.0) < 1.0,
            **dict.fromkeys(trl_features(cfg), True),
        }
        return neutral_metrics([name for name, on in features.items() if on], device)


def __getattr__(name: str) -> Any:
    """`GRPOLossContext` and `train_policy_metrics`, read from `grpo_context` on first use (it imports this module)."""
    if name in ("GRPOLossContext", "train_policy_metrics"):
        return getattr(importlib.import_module(f"{__package__}.grpo_context"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
