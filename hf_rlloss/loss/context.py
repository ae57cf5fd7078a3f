"""Loss kwargs (the per-micro-batch tensors) and loss contexts (what computes the loss of one micro-batch).

The life of a context over one optimizer step:

1. ``cfg.build(data, sp_mesh)`` → context: validates shapes, expands per-sequence advantages, splits for SP.
2. The caller sets ``ctx.loss_kwargs.old_logprobs`` / ``ref_logprobs`` (local, already split) when it has them.
3. Optional rollout importance sampling rejects tokens and sets IS weights.
4. ``GRPOLossContext.build_batches(contexts)`` over all micro-batches of the step: one all-reduce of the global
   denominators, then per-token policy and KL weights.
5. ``loss, metrics = ctx(logprobs=...)`` or ``ctx(hidden_states=..., head_weight=...)`` per micro-batch, then
   ``loss.backward()``. Summed over micro-batches and averaged over ranks (as DDP/FSDP average gradients), the
   returned losses and their gradients equal the global loss of the step and its gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.collectives import all_gather_1d, all_reduce, is_distributed, world_size
from ..parallel.sequence import sp_group, sp_rank, sp_split, sp_world_size
from .aggregation import aggregation_weights
from .chunked_logprobs import chunked_logprobs, chunked_objective
from .fields import CHECKED_FOR_NONFINITE, DATA_FIELDS, LOSS_FIELDS, PER_TOKEN, TOKEN_FIELDS
from .kl import kl_penalty
from .metrics import M2_ACC, M2_TOKENS, TRAIN_POLICY, VALID_TOKENS, accumulate_metrics, neutral_metrics
from .rollout_is import compute_rollout_is
from .second_moment import m2_keep_bound
from .trl_metrics import K3_TYPES, trl_features
from .trl_metrics import chunk_metrics as trl_chunk_metrics
from .trl_metrics import finish as finish_trl_metrics


class BaseRLLossKwargs(BaseModel):
    """The tensors of one micro-batch, all `(B, T)` local (after any SP split), checked on every assignment.

    Args:
        shifted_labels (`torch.Tensor`): int64 labels; position `t` holds the token predicted from position `t`.
        advantages (`torch.Tensor`): float32 per-token advantages.
        seq_ids (`torch.Tensor`): int64 index of each position's sequence in `[0, num_sequences)`, -1 for SP padding.
        num_sequences (`int`): sequences in the micro-batch (rows of a padded batch, or segments of a packed row).
        old_logprobs, ref_logprobs, rollout_logprobs (`torch.Tensor`, *optional*): per-token log-probs under the
            policy before the update, the reference, and the rollout engine.
        rollout_is_weights (`torch.Tensor`, *optional*): per-token rollout IS weights (constants).
        old_kept_logmass, rollout_kept_logmass (`torch.Tensor`, *optional*): per-token log of the probability mass
            that the sampling truncation (top-k/top-p/min-p) keeps under π_old (replayed by the trainer) and under the
            rollout engine; see `compute_rollout_is`.
        policy_loss_weight, kl_loss_weight (`torch.Tensor`, *optional*): set by `build_batches`.
        global_grad_tokens (`torch.Tensor`, *optional*): valid tokens of the whole step; set by `build_batches`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", validate_assignment=True)

    shifted_labels: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor
    num_sequences: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    old_kept_logmass: torch.Tensor | None = None
    rollout_kept_logmass: torch.Tensor | None = None
    policy_loss_weight: torch.Tensor | None = None
    kl_loss_weight: torch.Tensor | None = None
    global_grad_tokens: torch.Tensor | None = None

    # Field validators run before a value is stored, so a rejected assignment leaves the kwargs as they were.
    @field_validator("shifted_labels")
    @classmethod
    def _check_labels(cls, value: torch.Tensor) -> torch.Tensor:
        if value.dim() != 2:
            raise ValueError(f"shifted_labels must be 2-D (B, T); got shape {tuple(value.shape)}")
        return value

    @field_validator(*PER_TOKEN)
    @classmethod
    def _check_shape(cls, value: torch.Tensor | None, info: ValidationInfo) -> torch.Tensor | None:
        labels = info.data.get("shifted_labels")
        if value is not None and labels is not None and tuple(value.shape) != tuple(labels.shape):
            raise ValueError(
                f"{info.field_name} has shape {tuple(value.shape)} but shifted_labels has shape "
                f"{tuple(labels.shape)}; every per-token tensor must have exactly the labels' shape"
            )
        return value

    def to(self, device: torch.device | str) -> BaseRLLossKwargs:
        for name, value in self:
            if isinstance(value, torch.Tensor):
                self.__dict__[name] = value.to(device)
        return self


def _sequence_ids(labels: torch.Tensor, num_tokens: Any) -> tuple[torch.Tensor, int]:
    batch, length = labels.shape
    if num_tokens is None:
        return torch.arange(batch, device=labels.device).unsqueeze(1).expand(batch, length), batch
    num_tokens = torch.as_tensor(num_tokens, dtype=torch.long, device=labels.device).reshape(-1)
    if batch != 1:
        raise ValueError(f"num_tokens is for a packed row: shifted_labels must be (1, L); got {tuple(labels.shape)}")
    if int(num_tokens.sum()) != length or bool((num_tokens < 0).any()):
        raise ValueError(
            f"num_tokens {num_tokens.tolist()} must be non-negative and sum to the packed length {length}"
        )
    seq_ids = torch.repeat_interleave(torch.arange(len(num_tokens), device=labels.device), num_tokens)
    return seq_ids.unsqueeze(0), len(num_tokens)


def prepare_kwargs(data: dict[str, Any], ignore_idx: int, sp_mesh: DeviceMesh | None) -> BaseRLLossKwargs:
    """Validate the full-length data of one micro-batch, expand per-sequence advantages and split it for SP."""
    labels = data["shifted_labels"]
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"shifted_labels must be a 2-D (B, T) tensor; got {shape}")
    labels = labels.long()
    seq_ids, num_sequences = _sequence_ids(labels, data.get("num_tokens"))
    fields: dict[str, torch.Tensor] = {}
    for name in DATA_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        value = torch.as_tensor(value, device=labels.device).float()
        if name == "advantages" and value.dim() == 1:
            if value.shape[0] != num_sequences:
                raise ValueError(
                    f"advantages has shape {tuple(value.shape)}: per-sequence advantages need one value per "
                    f"sequence ({num_sequences}); per-token ones the labels' shape {tuple(labels.shape)}"
                )
            value = value[seq_ids]
        if tuple(value.shape) != tuple(labels.shape):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but shifted_labels has shape {tuple(labels.shape)}; "
                "every per-token tensor must have exactly the labels' shape"
            )
        fields[name] = value
    if sp_world_size(sp_mesh) > 1:
        labels = sp_split(labels, sp_mesh, 1, ignore_idx)
        seq_ids = sp_split(seq_ids, sp_mesh, 1, -1)
        fields = {name: sp_split(value, sp_mesh, 1, TOKEN_FIELDS[name].pad) for name, value in fields.items()}
    return BaseRLLossKwargs(shifted_labels=labels, seq_ids=seq_ids, num_sequences=num_sequences, **fields)


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

    def _name(self, position: int | None = None) -> str:
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
                        f"{name} of {self._name()} has {bad} non-finite value(s) at valid tokens (set "
                        "nonfinite_inputs='mask' to drop such tokens instead)"
                    )
        weights, keep, metrics = self._rollout_is(kwargs.old_logprobs, mask)
        self._apply_rollout_is(mask & ~keep, weights)
        self.pending_metrics = accumulate_metrics(self.pending_metrics, metrics)
        return metrics

    def _apply_rollout_is(self, rejected: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Drop the `rejected` tokens and multiply the IS `weights` into any `rollout_is_weights` of the data."""
        self._drop_tokens(rejected)
        if weights is not None:
            kwargs = self.loss_kwargs
            weights = weights.to(torch.float32)
            kwargs.rollout_is_weights = (
                weights if kwargs.rollout_is_weights is None else weights * kwargs.rollout_is_weights
            )

    def _drop_tokens(self, drop: torch.Tensor) -> None:
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
        self._drop_tokens(mask & ~torch.isfinite(kwargs.rollout_logprobs))

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
                raise ValueError(f"use_kl_loss=True but {ctx._name(i)} has no ref_logprobs")
        if cfg.rollout_is.m2_threshold is not None:
            cls._second_moment_mask(contexts, cfg.rollout_is.m2_threshold, process_group)

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

    @staticmethod
    def _second_moment_mask(contexts: list[BaseRLLossContext], threshold: float, process_group) -> None:
        """M2PO: reject the step's tokens with the largest `δ² = (log π_old − log μ)²` until the mean over the kept
        ones, on every micro-batch and rank, is ≤ `threshold` (`hf_rlloss.loss.second_moment`; one all-gather)."""
        deltas = []
        for i, ctx in enumerate(contexts):
            kwargs = ctx.loss_kwargs
            if kwargs.old_logprobs is None or kwargs.rollout_logprobs is None:
                raise ValueError(
                    f"rollout_is.m2_threshold needs old_logprobs and rollout_logprobs; {ctx._name(i)} lacks "
                    f"{'old_logprobs' if kwargs.old_logprobs is None else 'rollout_logprobs'}"
                )
            old = (
                kwargs.old_logprobs
                if kwargs.old_kept_logmass is None
                else kwargs.old_logprobs - kwargs.old_kept_logmass
            )
            deltas.append((old.double() - kwargs.rollout_logprobs.double()).square())  # (B, T)
        local = torch.cat([delta_sq[ctx.mask] for delta_sq, ctx in zip(deltas, contexts)])
        bound = m2_keep_bound(all_gather_1d(local, process_group), threshold)
        for ctx, delta_sq in zip(contexts, deltas):
            mask = ctx.mask
            values = delta_sq[mask]  # (N,)
            kept = values <= bound
            ctx._drop_tokens(mask & (delta_sq > bound))
            ctx.pending_metrics = accumulate_metrics(
                ctx.pending_metrics,
                {
                    M2_TOKENS: torch.tensor(float(values.numel()), dtype=torch.float64),
                    M2_ACC + "sum": values.sum(),
                    M2_ACC + "kept_sum": values[kept].sum(),
                    M2_ACC + "kept_tokens": kept.sum().double(),
                    M2_ACC + "masked_tokens": (~kept).sum().double(),
                },
            )

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
                    f"{name} of {self._name(index)} has {int(field_count)} non-finite value(s) at valid tokens "
                    "(set nonfinite_inputs='mask' to drop such tokens instead)"
                )
        if count:  # mask mode
            self._drop_tokens(bad)
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
