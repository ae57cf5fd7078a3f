"""Loss configurations: pydantic models validated at construction that build loss contexts from data.

This is what the YAML's `rl_loss:` block fills: `RLLossGRPOConfig` (in `hf_rlloss/trainer/grpo_config.py`, the TRL
`GRPOConfig` subclass that holds every other training option; `RLLossAsyncGRPOConfig` in `async_grpo_config.py` for the
asynchronous trainer) validates that mapping into `GRPOLossConfig` (its `loss_config_class`) and keeps it as
`args.rl_loss_config`. Used on its own, the loss layer needs only this module: `GRPOLossConfig(...).build(data)` makes
the loss kwargs of one micro-batch (`hf_rlloss.loss.kwargs`) and its loss context (`hf_rlloss.loss.context`, the GRPO
one in `hf_rlloss.loss.grpo_context`): config → kwargs → context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.distributed.device_mesh import DeviceMesh

from .fields import DATA_FIELDS
from .kl import KL_TYPES
from .policy_losses import AGG_MODES, PolicyLossSpec, get_policy_loss, registered_policy_losses
from .rollout_is import RolloutImportanceSampling

if TYPE_CHECKING:
    from .context import BaseRLLossContext

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+"]
assert set(AggMode.__args__) == set(AGG_MODES) and set(KLType.__args__) == set(KL_TYPES)


_CISPO_LOSSES = ("cispo", "cispo_seq")
_DELTA_LOSSES = ("vanilla", "gspo")


class PolicyLossConfig(BaseModel):
    """Parameters of the policy loss (``BaseRLLossConfig.policy_loss_cfg``; a plain dict is accepted there).

    Args:
        loss_type (`str`, *optional*, defaults to `"vanilla"`): a registered loss (`vanilla`, `gspo`, `cispo`,
            `cispo_seq`, `gpg`, `sapo`, `sapo_seq`, `geo_mean`, `vespo`, or one added with `register_policy_loss`) or
            a dotted import path to a loss function.
        cliprange_low (`float`, *optional*): lower clip range ε_low, in `[0, 1)` (`[0, 1]` for CISPO, where 1 removes
            the lower bound); the ratio is clipped at `1 − ε_low` (in log space for `geo_mean`). Defaults to the
            loss's own default (0.2; GSPO 3e-4; GMPO 0.4).
        cliprange_high (`float`, *optional*): upper clip range ε_high ≥ 0 (DAPO's clip-higher uses 0.28); for CISPO
            the cap `1 + ε_high` of the IS weight only needs to be positive (and ≥ the floor `1 − ε_low`), so
            `ε_high > −1`. Defaults to the loss's own default (0.2; GSPO 4e-4; GMPO 0.4).
        clip_ratio_c (`float`, *optional*, defaults to `3.0`): dual-clip bound `c > 1` for negative advantages
            (`vanilla`); `None` disables the dual clip (as TRL's losses).
        delta (`float`, *optional*): INTELLECT-2's two-sided clip (TRL's `delta`) for `vanilla` and `gspo`: the
            unclipped branch uses `min(r, δ)`, so `ℓ = −min(min(r, δ)·A, clip(r)·A)`. Must be > 1 (a bound ≤ 1 would
            remove the gradient of every positive-advantage token at `r = 1`); TRL recommends `δ > 1 + ε_high`.
        vespo_k_pos, vespo_lambda_pos (`float`, *optional*, defaults to `2.0`, `3.0`): VESPO's gamma-kernel exponent
            `k ≥ 0` and decay `λ > 0` for `A ≥ 0` (TRL's `vespo_k_pos`, `vespo_lambda_pos`).
        vespo_k_neg, vespo_lambda_neg (`float`, *optional*, defaults to `3.0`, `2.0`): the same for `A < 0`.
        log_prob_diff_min (`float`, *optional*, defaults to `-20.0`): lower clamp of `log π_θ − log π_old`.
        log_prob_diff_max (`float`, *optional*, defaults to `20.0`): upper clamp of `log π_θ − log π_old`.
        tau_pos (`float`, *optional*, defaults to `1.0`): SAPO gate temperature for positive advantages.
        tau_neg (`float`, *optional*, defaults to `1.05`): SAPO gate temperature for non-positive advantages.

    A loss given by import path may take extra keys; a registered loss rejects unknown ones.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    loss_type: str = "vanilla"
    cliprange_low: float | None = None
    cliprange_high: float | None = None
    clip_ratio_c: float | None = 3.0
    delta: float | None = None
    vespo_k_pos: float = Field(2.0, ge=0)
    vespo_lambda_pos: float = Field(3.0, gt=0)
    vespo_k_neg: float = Field(3.0, ge=0)
    vespo_lambda_neg: float = Field(2.0, gt=0)
    log_prob_diff_min: float = -20.0
    log_prob_diff_max: float = 20.0
    tau_pos: float = Field(1.0, gt=0)
    tau_neg: float = Field(1.05, gt=0)

    @model_validator(mode="after")
    def _validate(self) -> PolicyLossConfig:
        spec = get_policy_loss(self.loss_type)
        if self.model_extra and self.loss_type in registered_policy_losses():
            allowed = ", ".join(type(self).model_fields)
            raise ValueError(
                f"unknown key(s) {sorted(self.model_extra)} for loss_type={self.loss_type!r}; allowed: {allowed}"
            )
        for key, value in {"cliprange_low": 0.2, "cliprange_high": 0.2, **spec.defaults}.items():
            if getattr(self, key, None) is None:
                self.__dict__[key] = value  # bypass validate_assignment: we are inside the validator
        is_cispo = self.loss_type in _CISPO_LOSSES
        if is_cispo:  # CISPO clips a constant IS weight: a floor of 0 and any positive cap above it are meaningful
            if not 0.0 <= self.cliprange_low <= 1.0:
                raise ValueError(
                    f"cliprange_low={self.cliprange_low} must be in [0, 1] for {self.loss_type} (1: no lower bound)"
                )
            if self.cliprange_high <= -1.0 or self.cliprange_high < -self.cliprange_low:
                raise ValueError(
                    f"cliprange_high={self.cliprange_high} must be > -1 and >= -cliprange_low for {self.loss_type}: "
                    "the cap 1 + cliprange_high of the IS weight must be positive and not below the floor"
                )
        else:
            if not 0.0 <= self.cliprange_low < 1.0:
                raise ValueError(
                    f"cliprange_low={self.cliprange_low} must be in [0, 1): the lower clip bound 1 - cliprange_low "
                    "is > 0"
                )
            if self.cliprange_high < 0:
                raise ValueError(f"cliprange_high={self.cliprange_high} must be >= 0")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound), or None (no dual clip)")
        if self.delta is not None:
            if self.delta <= 1.0:
                raise ValueError(
                    f"delta={self.delta} must be > 1: the two-sided clip min(r, delta) at delta <= 1 removes the "
                    "gradient of every positive-advantage token at r = 1"
                )
            if self.loss_type in registered_policy_losses() and self.loss_type not in _DELTA_LOSSES:
                raise ValueError(
                    f"delta={self.delta} is the two-sided clip of the PPO-clip losses ({', '.join(_DELTA_LOSSES)}); "
                    f"loss_type={self.loss_type!r} does not use it"
                )
        if self.log_prob_diff_min >= self.log_prob_diff_max:
            raise ValueError(
                f"log_prob_diff_min={self.log_prob_diff_min} must be < log_prob_diff_max={self.log_prob_diff_max}"
            )
        return self

    @property
    def spec(self) -> PolicyLossSpec:
        return get_policy_loss(self.loss_type)

    def __getitem__(self, key: str) -> Any:  # XTuner-style ``policy_loss_cfg["loss_type"]``
        try:
            return getattr(self, key)
        except AttributeError as err:
            raise KeyError(key) from err

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


DATA_KEYS = ("shifted_labels", "num_tokens", *DATA_FIELDS)  # what `build` reads from `data`


class BaseRLLossConfig(BaseModel):
    """Configuration of an RL loss: policy loss, KL to a reference, aggregation, and how the loss is computed.

    Args:
        policy_loss_cfg (`PolicyLossConfig` or `dict`, *optional*, defaults to vanilla dual-clip PPO): the policy loss.
        use_kl_loss (`bool`, *optional*, defaults to `False`): add a KL-to-reference penalty (needs `ref_logprobs`).
        kl_loss_coef (`float`, *optional*, defaults to `0.001`): its coefficient, ≥ 0.
        kl_loss_type (`str`, *optional*): the estimator, one of `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`,
            `k1+`, `k3+` (see `hf_rlloss.loss.kl`); required when `use_kl_loss=True`.
        kl_bias_correction (`str`, *optional*): multiply each token's KL estimate by the policy ratio `π_θ/π_old`,
            differentiable (TRL's `use_bias_correction_kl`, DeepSeek-V3.2): `"token"` uses the token's ratio,
            `"sequence"` the sequence's `exp(mean_t log r_t)` (TRL with `importance_sampling_level="sequence"`).
            Needs `use_kl_loss`. Defaults to no correction.
        off_policy_mask_threshold (`float`, *optional*): DeepSeek-V3.2's off-policy sequence mask (OPSM, TRL's
            `off_policy_mask_threshold`, ≥ 0): the policy loss of a sequence with a negative advantage is dropped
            when `mean_t (log π_rollout − log π_θ)` over the sequence exceeds it (`π_rollout`: `rollout_logprobs`,
            else `old_logprobs`, else the current policy, i.e. nothing is dropped). The KL term and the
            denominators are unchanged. Defaults to no mask.
        loss_agg_mode (`str`, *optional*): `token-mean`, `seq-mean-token-mean`, `seq-mean-token-sum` or
            `seq-mean-token-sum-norm`; defaults to the policy loss's own (`token-mean`, or `seq-mean-token-mean` for
            GSPO, GMPO and SAPO). Every mode is normalized over the whole optimizer step on all ranks.
        loss_scale_factor (`float`, *optional*): the constant `C` of `seq-mean-token-sum-norm` (Dr. GRPO), typically
            the maximum completion length; required by that mode.
        count_empty_sequences (`bool`, *optional*, defaults to `False`): whether the sequence count `S` of the
            `seq-mean-*` modes includes the step's empty sequences (no valid token: a completion masked out whole, e.g.
            by TRL's `mask_truncated_completions`, or one whose every token was dropped by rollout IS or
            `nonfinite_inputs="mask"`). Off, `S` counts the non-empty sequences, so the sequences that train are
            averaged; on, `S` counts every sequence of the step (each row, or each `num_tokens` segment of a packed
            row, so a padding segment counts too; SP padding is no sequence), as TRL's `grpo`, `sapo`, `luspo` and
            `dr_grpo` count every row: masking a sequence then shrinks the update instead of re-weighting the others.
            `RLLossGRPOTrainer` turns it on when it maps those TRL loss types. Not with `token-mean` (no `S`).
        ignore_idx (`int`, *optional*, defaults to `-100`): label of positions without loss.
        chunk_size (`int`, *optional*): tokens per chunk when the loss is computed from hidden states; peak extra
            memory is about `chunk_size × vocab` logits (4 bytes each, 2 in half precision). Defaults to a power of
            two keeping that near 128 MB (float32: 512 tokens at a 49k vocabulary, 256 at 152k; half precision: twice
            that; see `default_chunk_size`).
        compile_epilogue (`bool`, *optional*): `torch.compile` the elementwise passes of the chunked loss (softmax
            statistics, logits' gradient) into fused kernels. Defaults to on when the head GEMMs run in bf16/fp16
            (where those passes dominate) and in float32 from a 100k vocabulary (measured faster there, not at 49k);
            falls back to eager kernels with a warning if
            compilation fails. The first call compiles (seconds to a minute on CPU).
        compute_entropy (`bool`, *optional*, defaults to `True`): log the full-vocabulary entropy when the loss is
            computed from hidden states.
        entropy_coef (`float`, *optional*, defaults to `0.0`): entropy bonus `−coef · H̄` (TRL's `entropy_coef`), with
            `H̄` the mean full-vocabulary entropy of each micro-batch's valid tokens, divided by the number of
            micro-batches of the step (TRL's per-micro-batch mean, not the step's global mean). Its gradient
            `∂H/∂z = −p (log p + H)` is taken in the chunk pass: the loss must be computed from hidden states. A
            context's `entropy_coef` attribute overrides it for that micro-batch (`RLLossGRPOTrainer`'s adaptive
            control). Not with sequence parallelism.
        top_entropy_quantile (`float`, *optional*, defaults to `1.0`): train the policy loss only on the
            high-entropy tokens (TRL's `top_entropy_quantile` ρ ∈ [0, 1], "Beyond the 80/20 rule"): a token keeps
            its policy loss when its full-vocabulary entropy under the current policy is ≥ the `1 − ρ` quantile
            (`torch.quantile`, linear interpolation) of the entropies of the micro-batch's valid tokens **on all
            ranks** (TRL's choice: per micro-batch, gathered over processes; not over the whole step). The
            denominators and the KL term are unchanged; the entropy bonus acts on the kept tokens. Costs a no-grad
            head pass for the entropies; hidden-state path only; not with sequence parallelism. 1.0 keeps every token.
        logit_softcapping (`float`, *optional*): final-logit softcapping `c > 0` of the hidden-state path: the logits
            are `c·tanh((hidden @ Wᵀ)/c)` before the temperature, as Gemma 2 computes them
            (`final_logit_softcapping`; `RLLossGRPOTrainer` reads it from the model config). Defaults to none.
        nonfinite_inputs (`str`, *optional*, defaults to `"error"`): what to do with NaN/±inf at valid tokens of
            `advantages`, `old_logprobs`, `ref_logprobs` or `rollout_is_weights`: `"error"` raises, naming the field,
            the micro-batch and the count; `"mask"` drops those tokens (before the denominator is computed) and counts
            them in `train_policy/nonfinite_masked_tokens`.
        rollout_is (`RolloutImportanceSampling` or `dict`, *optional*, defaults to metrics only): rollout importance
            sampling, the correction of the mismatch between the rollout engine and the trained policy (see
            `hf_rlloss.loss.rollout_is`). Its metrics are computed whenever `rollout_logprobs` are given.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    policy_loss_cfg: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KLType | None = None
    kl_bias_correction: Literal["token", "sequence"] | None = None
    off_policy_mask_threshold: float | None = Field(None, ge=0, allow_inf_nan=False)
    loss_agg_mode: AggMode | None = None
    loss_scale_factor: float | None = Field(None, gt=0)
    count_empty_sequences: bool = False
    ignore_idx: int = -100
    chunk_size: int | None = Field(None, gt=0)
    compile_epilogue: bool | None = None
    compute_entropy: bool = True
    logit_softcapping: float | None = Field(None, gt=0, allow_inf_nan=False)
    entropy_coef: float = Field(0.0, allow_inf_nan=False)
    top_entropy_quantile: float = Field(1.0, ge=0.0, le=1.0)
    nonfinite_inputs: Literal["error", "mask"] = "error"
    rollout_is: RolloutImportanceSampling = Field(default_factory=RolloutImportanceSampling)

    @model_validator(mode="after")
    def _validate(self) -> BaseRLLossConfig:
        if self.use_kl_loss and self.kl_loss_type is None:
            raise ValueError(f"use_kl_loss=True needs kl_loss_type, one of: {', '.join(KL_TYPES)}")
        spec = self.policy_loss_cfg.spec
        if spec.absorbs_rollout_is and self.rollout_is.enabled and self.rollout_is.level != "token":
            raise ValueError(
                f"rollout_is.level={self.rollout_is.level!r} with loss_type={self.policy_loss_cfg.loss_type!r}: this "
                "loss folds the rollout IS weights into its sequence weight as a sum of per-token log-weights, which "
                "would count a sequence-level weight once per token; use rollout_is.level='token'"
            )
        if self.kl_bias_correction is not None and not self.use_kl_loss:
            raise ValueError(f"kl_bias_correction={self.kl_bias_correction!r} needs use_kl_loss=True")
        if self.count_empty_sequences and self.agg_mode == "token-mean":
            raise ValueError(
                "count_empty_sequences=True counts sequences in the denominator of the seq-mean-* modes; "
                "loss_agg_mode='token-mean' has none (set a seq-mean-* loss_agg_mode, or leave it False)"
            )
        if self.agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor (e.g. the max completion length)"
            )
        return self

    @property
    def agg_mode(self) -> str:
        """The aggregation in effect: ``loss_agg_mode``, or the policy loss's default when unset."""
        return self.loss_agg_mode or self.policy_loss_cfg.spec.default_agg_mode

    @property
    def loss_ctx_cls(self) -> type[BaseRLLossContext]:
        raise NotImplementedError(f"{type(self).__name__} must define loss_ctx_cls")

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML/JSON-serializable dict that `type(self)(**d)` turns back into an equal config."""
        return self.model_dump(mode="json")

    def build(
        self, data: dict[str, Any], sp_mesh: DeviceMesh | None = None, micro_batch: int | None = None
    ) -> BaseRLLossContext | None:
        """Build the loss context of one micro-batch.

        Args:
            data (`dict`): `shifted_labels` `(B, T)` (or a packed row `(1, L)` with `num_tokens`, the per-sequence
                lengths summing to `L`) and `advantages` (per sequence `(S,)` or per token, the labels' shape) are
                required; `old_logprobs`, `ref_logprobs`, `rollout_logprobs`, `rollout_is_weights`,
                `old_kept_logmass` and `rollout_kept_logmass` are optional per-token tensors of the labels' shape.
                All are full-length (before any SP split). `old_kept_logmass` (log of the mass of π_old that the
                sampling truncation keeps) makes rollout IS compare π_old renormalized over the sampled support with
                `rollout_logprobs` (which must then be on that support); `rollout_kept_logmass` (the same under the
                rollout engine) is only reported, as `mismatch/kept_mass_mean` (see `hf_rlloss.loss.rollout_is`).
            sp_mesh (`DeviceMesh`, *optional*): the sequence-parallel mesh; every per-token tensor is split over it.
            micro_batch (`int`, *optional*): the index of this micro-batch in the optimizer step, named by the
                errors about its data (defaults to its position in the list given to `build_batches`).

        Returns:
            The context, or `None` when `shifted_labels` or `advantages` is missing (nothing to train on).
        """
        from .kwargs import prepare_kwargs

        unknown = set(data) - set(DATA_KEYS)
        if unknown:
            raise ValueError(f"unknown data key(s) {sorted(unknown)}; allowed: {', '.join(DATA_KEYS)}")
        if "shifted_labels" not in data or "advantages" not in data:
            return None
        if self.rollout_is.enabled and data.get("rollout_logprobs") is None:
            raise ValueError(
                "rollout_is is enabled (rollout_is.upper is set) but data has no rollout_logprobs: pass the "
                "log-probs of the sampled tokens under the generation engine (vLLM's sampling log-probs, or those "
                "RLLossGRPOTrainer computes for HF generate), or unset rollout_is.upper for no correction"
            )
        kwargs = prepare_kwargs(data, self.ignore_idx, sp_mesh)
        ctx = self.loss_ctx_cls(self, kwargs, sp_mesh)
        ctx.micro_batch = micro_batch
        return ctx


class GRPOLossConfig(BaseRLLossConfig):
    """GRPO-family loss: any registered policy loss, optional KL, global normalization.

    Example:

    ```python
    >>> cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28})
    >>> ctx = cfg.build({"shifted_labels": labels, "advantages": advantages})
    >>> GRPOLossContext.build_batches([ctx])
    >>> loss, metrics = ctx(logprobs=logprobs)
    ```
    """

    @property
    def loss_ctx_cls(self) -> type[BaseRLLossContext]:
        from .grpo_context import GRPOLossContext

        return GRPOLossContext
