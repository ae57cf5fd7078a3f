"""`RLLossAsyncGRPOConfig`: TRL's `AsyncGRPOConfig` plus the `rl_loss` block of the synchronous trainer.

TRL's async trainer has one loss: a token-level PPO clip (`epsilon`, `epsilon_high`) with the sampler's log-probs as
π_old. Without `rl_loss` that loss is **mapped** onto the loss layer (`async_trl_options_to_rl_loss`); with `rl_loss`,
`epsilon`/`epsilon_high` left at a non-default value must agree with it. `behavior_as_old_policy` keeps TRL's choice of
π_old (the sampler's log-probs, one forward fewer); by default π_old is the trainer's own no-grad pass at the start of
each batch and the sampler's log-probs are π_behavior (the decoupled objective, see docs/async.md).

Stale samples are never trained unprotected by default: in the decoupled objective rollout IS (π_old / π_behavior,
token level, truncated at 2: `DEFAULT_ROLLOUT_IS`) is on unless `rl_loss.rollout_is` says otherwise, and a loss with
neither an IS weight nor a binding clip (`num_mini_batches > 1`) is refused unless `allow_uncorrected_staleness`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..loss.config import BaseRLLossConfig, GRPOLossConfig
from .async_.staleness import check_weight_lag
from .common.routing_replay import ROUTING_REPLAY_MODES
from .common.transformers_compat import (
    RENAMED_CHECKPOINTING,
    checkpointing_field,
    to_new_checkpointing_names,
    to_old_checkpointing_names,
)
from .grpo_config import parse_rl_loss, refuse_quantized_loading, validate_rl_loss

__all__ = [
    "DEFAULT_ROLLOUT_IS",
    "RLLossAsyncGRPOConfig",
    "SCALE_REWARDS",
    "TREE_ATTENTION_BACKENDS",
    "async_trl_options_to_rl_loss",
]

# TRL's `GRPOConfig.scale_rewards` values: the group advantage divided by the group's std, the batch's, or not divided
SCALE_REWARDS = ("group", "batch", "none")

# "auto": TRL's FlashAttention-3 kernel on CUDA when `kernels` is installed, else hf_rlloss' exact SDPA tree attention
TREE_ATTENTION_BACKENDS = ("auto", "fa3", "sdpa")

# The rollout IS of the decoupled objective when `rl_loss` names none: token-level π_old / π_behavior, truncated at 2
# (TIS, as the async demo; AReaL and verl truncate token weights at 2 to 5)
DEFAULT_ROLLOUT_IS = {"level": "token", "mode": "truncate", "upper": 2.0}


def _async_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(AsyncGRPOConfig) if f.name == name)


def async_trl_options_to_rl_loss(args: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The `rl_loss` mapping equal to TRL's async loss, and for each key the TRL option it comes from.

    TRL's `AsyncGRPOTrainer.compute_loss` is a token-level PPO clip with bounds `1 − epsilon`, `1 + epsilon_high`
    (no dual clip), normalized by the tokens of each micro-batch over all ranks: `vanilla`, `clip_ratio_c=None`,
    `token-mean`. The loss layer normalizes over the whole optimizer step; with one micro-batch per step (or
    micro-batches of equal token counts) the two are the same.
    """
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    policy = {"loss_type": "vanilla", "cliprange_low": args.epsilon, "cliprange_high": epsilon_high}
    policy["clip_ratio_c"] = None
    source = {
        "policy_loss_cfg.cliprange_low": "epsilon",
        "policy_loss_cfg.cliprange_high": "epsilon_high" if args.epsilon_high is not None else "epsilon",
    }
    return {"policy_loss_cfg": policy, "loss_agg_mode": "token-mean"}, source


@dataclass
class RLLossAsyncGRPOConfig(AsyncGRPOConfig):
    r"""`AsyncGRPOConfig` for `RLLossAsyncGRPOTrainer`: the loss is the hf_rlloss loss layer, configured by `rl_loss`.

    Parameters:
        rl_loss (`dict` or `str`, *optional*):
            The loss configuration, exactly as `RLLossGRPOConfig.rl_loss` (policy loss, KL to a reference, rollout
            IS, OPSM, entropy bonus, aggregation). When unset, TRL's async loss (`epsilon`, `epsilon_high`) is mapped
            onto it (`async_trl_options_to_rl_loss`). Without a `rollout_is` key, the decoupled objective gets
            `DEFAULT_ROLLOUT_IS`.
        behavior_as_old_policy (`bool`, *optional*, defaults to `False`):
            `True`: TRL's behaviour, the sampler's log-probs are π_old (the PPO clip is taken against them; no extra
            forward; rollout IS is then refused, its weight would be 1). `False`: π_old is the trainer's no-grad pass
            at the start of each batch, the clip is taken against it, and rollout IS weighs by π_old / π_behavior
            (`DEFAULT_ROLLOUT_IS` when `rl_loss` has no `rollout_is`).
        num_mini_batches (`int`, *optional*, defaults to `1`):
            Optimizer steps per batch (AReaL's mini-batches): the trainer takes `num_mini_batches` optimizer steps'
            worth of micro-batches at once, computes π_old for all of them with the weights of the first step, and
            trains them in `num_mini_batches` steps, so that from the second step on π_θ ≠ π_old and the PPO clip
            binds. With 1, π_θ = π_old at the loss and the clip never binds: the IS weight is then the only
            protection against stale samples.
        allow_uncorrected_staleness (`bool`, *optional*, defaults to `False`):
            Allow the decoupled objective with neither rollout IS nor a binding clip (`num_mini_batches: 1`): stale
            samples then train with an unclipped, unweighted policy gradient. An ablation (verl calls it a common
            mistake), refused by default. With it, no default rollout IS is added.
        rollout_logprobs_support (`str`, *optional*, defaults to `"full"`):
            The support of the sampler's log-probs under top-k/top-p/min-p: `"full"` (whole vocabulary, as the CPU
            worker records them by default) or `"sampled"` (renormalized over the truncated support; π_old is then
            renormalized by the mass the replayed truncation keeps). Set it to what the sampler reports (vLLM:
            `--logprobs-mode`).
        tree_attention (`str`, *optional*, defaults to `"auto"`):
            The attention of TRL's packed rows: `"fa3"` (TRL's FlashAttention-3 kernel from the Hub, CUDA only),
            `"sdpa"` (`hf_rlloss.parallel.tree_attention`: exact, any device) or `"auto"` (FA3 on CUDA with the
            `kernels` package installed, else SDPA).
        cast_lm_head_to_fp32 (`bool`, *optional*, defaults to `False`):
            Run the chunked LM head in float32 (as `GRPOConfig.cast_lm_head_to_fp32`).
        routing_replay (`str`, *optional*, defaults to `"off"`):
            MoE routing replay (`RLLossGRPOConfig.routing_replay`, `async_/routing_replay.py`): `"rollout"` replays in
            every forward of a packed row (π_old, the reference, the loss) the experts `HFGenerateRolloutWorker`
            recorded during its HF `generate`, shipped with each sample (a token shared by several samples of a
            row replays the first one's); `"old_policy"` replays in the loss forward the experts of the row's π_old
            pass (not with `behavior_as_old_policy`, which has no such pass). See docs/routing_replay.md.
        max_consecutive_empty_steps (`int`, *optional*, defaults to `8`):
            Liveness bound. An optimizer step with no trained token (every sample too stale when trained, or every
            completion empty) is skipped (no optimizer step, counted in `async/skipped_empty_steps_total`); this many
            such steps in a row stop training with `NoTrainableSamplesError`, and so do `queue_maxsize` + the worker's
            batch + this many steps' worth of consecutive samples dropped as too stale when pulled. A run that can
            only drop samples (a rollout worker further behind than `max_staleness`, a policy that only emits EOS)
            then fails in seconds instead of spinning for ever; the queue's content plus 8 steps is more than a
            pause (a checkpoint, an evaluation) makes stale in a healthy run, where an empty step is rare and isolated.
            hf_rlloss' rollout workers stop with `NoRolloutSamplesError` after this many optimizer steps' worth of
            consecutive prompt groups dropped (`on_rollout_error="drop"`).
        scale_rewards (`str` or `bool`, *optional*, defaults to `"group"`):
            How hf_rlloss' rollout workers scale a group's advantages, with `GRPOConfig.scale_rewards`' meanings
            (`True` is `"group"`, `False` is `"none"`): the reward minus the group's mean, divided by the group's
            standard deviation + 1e-4 (`"group"`), by the standard deviation of the worker's batch + 1e-4
            (`"batch"`), or not divided (`"none"`); TRL's unbiased standard deviation, as in the synchronous trainer.
            (TRL's own asynchronous vLLM worker divides by the population standard deviation + 1e-8.)

    Refused at construction: a configuration under which samples can only be too stale to train
    (`ceil(num_mini_batches / weight_sync_steps) > max_staleness`: `staleness.least_trained_lag`).

    The validated loss configuration is `config.rl_loss_config`.
    """

    _VALID_DICT_FIELDS = AsyncGRPOConfig._VALID_DICT_FIELDS + ["rl_loss"]

    #: The loss configuration class `rl_loss` is validated into; subclasses may replace it.
    loss_config_class: ClassVar[type[BaseRLLossConfig]] = GRPOLossConfig

    rl_loss: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Loss-layer configuration (a mapping, or its JSON string), as RLLossGRPOConfig.rl_loss. When "
            "unset, TRL's async loss (epsilon, epsilon_high) is mapped onto it."
        },
    )
    behavior_as_old_policy: bool = field(
        default=False,
        metadata={
            "help": "True: TRL's behaviour (the sampler's log-probs are pi_old, one forward fewer). False: pi_old is "
            "the trainer's no-grad pass at the start of each batch; rollout IS weighs pi_old/pi_behavior."
        },
    )
    rollout_logprobs_support: str = field(
        default="full",
        metadata={"help": "Support of the sampler's log-probs under top-k/top-p/min-p: 'full' or 'sampled'."},
    )
    tree_attention: str = field(
        default="auto",
        metadata={"help": "Attention of the packed rows: 'auto', 'fa3' (TRL's CUDA kernel) or 'sdpa' (any device)."},
    )
    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "Run the chunked LM head in float32."})
    routing_replay: str = field(
        default="off",
        metadata={
            "help": "MoE routing replay: 'rollout' (the experts the rollout worker's HF generate chose, replayed in "
            "every forward), 'old_policy' (the pi_old pass's experts, replayed in the loss forward) or 'off'."
        },
    )
    num_mini_batches: int = field(
        default=1,
        metadata={
            "help": "Optimizer steps per batch (AReaL's mini-batches): pi_old is computed once per batch, so from the "
            "second step on the PPO clip binds."
        },
    )
    max_consecutive_empty_steps: int = field(
        default=8,
        metadata={
            "help": "Stop with NoTrainableSamplesError after this many consecutive optimizer steps without a trained "
            "token (all samples too stale, or all completions empty), or queue_maxsize + a worker batch + this many "
            "steps' worth of consecutive samples dropped as too stale; hf_rlloss' workers stop after this many steps' "
            "worth of consecutive groups dropped by on_rollout_error='drop'."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantage scaling of hf_rlloss' rollout workers, as GRPOConfig.scale_rewards: 'group' (the "
            "group's std), 'batch' (the worker batch's std) or 'none'."
        },
    )
    if not RENAMED_CHECKPOINTING:  # transformers < 5.23: the new names declared here (transformers_compat)
        activation_checkpointing: bool | None = checkpointing_field("activation_checkpointing")
        activation_checkpointing_kwargs: dict[str, Any] | str | None = checkpointing_field(
            "activation_checkpointing_kwargs"
        )
    allow_uncorrected_staleness: bool = field(
        default=False,
        metadata={
            "help": "Train stale samples with neither rollout IS nor a binding clip (pi_old recomputed, the behaviour "
            "policy ignored): an ablation, not a training setting."
        },
    )

    def __post_init__(self):
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 1:
            raise ValueError(
                f"max_staleness={self.max_staleness!r} must be an integer >= 1: the policy versions a sample may lag "
                "behind the trainer when it is trained. The dataloader takes each step's first micro-batch before the "
                "previous step's weights are synced, so an asynchronous sample is trained at least 1 version late "
                "(TRL's max_staleness=0, measured when the sample is queued, is max_staleness=1 here)"
            )
        if (
            not isinstance(self.num_mini_batches, int)
            or isinstance(self.num_mini_batches, bool)
            or (self.num_mini_batches < 1)
        ):
            raise ValueError(f"num_mini_batches={self.num_mini_batches!r} must be an integer >= 1")
        steps = self.max_consecutive_empty_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(
                f"max_consecutive_empty_steps={steps!r} must be an integer >= 1: the consecutive optimizer steps "
                "without a trained token after which training stops"
            )
        if self.tree_attention not in TREE_ATTENTION_BACKENDS:
            allowed = ", ".join(TREE_ATTENTION_BACKENDS)
            raise ValueError(f"tree_attention={self.tree_attention!r} must be one of {allowed}")
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            allowed = ", ".join(map(repr, ROUTING_REPLAY_MODES))
            raise ValueError(f"routing_replay={self.routing_replay!r}; expected one of {allowed}")
        if self.routing_replay == "old_policy" and self.behavior_as_old_policy:
            raise ValueError(
                "routing_replay='old_policy' replays the experts of the trainer's π_old pass, which "
                "behavior_as_old_policy=True skips (π_old is then the sampler's): set behavior_as_old_policy=False, "
                "or routing_replay='rollout' (the sampler's experts)"
            )
        if self.rollout_logprobs_support not in ("full", "sampled"):
            raise ValueError(f"rollout_logprobs_support={self.rollout_logprobs_support!r} must be 'full' or 'sampled'")
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards={self.scale_rewards!r}: allowed values are {SCALE_REWARDS} (or a bool)")
        to_old_checkpointing_names(self)
        super().__post_init__()
        to_new_checkpointing_names(self)
        check_weight_lag(0, self)
        refuse_quantized_loading(self.model_init_kwargs)
        self.rl_loss = parse_rl_loss(self.rl_loss)
        self.rl_loss_config = self._build_rl_loss_config()
        if self.behavior_as_old_policy and self.rl_loss_config.rollout_is.enabled:
            raise ValueError(
                "rl_loss.rollout_is with behavior_as_old_policy=True: π_old would be the sampler's own log-probs, so "
                "the IS weight π_old/π_behavior is 1. Set behavior_as_old_policy=False (π_old = the trainer's pass at "
                "the start of each batch), or leave rl_loss.rollout_is out with behavior_as_old_policy=True"
            )
        self._check_stale_samples_protected()

    def _check_stale_samples_protected(self) -> None:
        """The decoupled objective needs an IS weight or a binding clip, unless `allow_uncorrected_staleness`."""
        if self.behavior_as_old_policy or self.allow_uncorrected_staleness:
            return
        if self.rl_loss_config.rollout_is.enabled or self.num_mini_batches > 1:
            return
        raise ValueError(
            "rl_loss.rollout_is is off with behavior_as_old_policy=False and num_mini_batches=1: π_old is recomputed "
            "at the step, so π_θ = π_old at the loss, the PPO clip never binds and stale samples would train with an "
            "unclipped, unweighted policy gradient. Set rl_loss.rollout_is.upper (e.g. "
            f"{DEFAULT_ROLLOUT_IS}, the default when rl_loss has no rollout_is), num_mini_batches > 1 (the clip "
            "binds from the second mini-batch), behavior_as_old_policy=True (TRL: the clip is taken against the "
            "sampler), or allow_uncorrected_staleness=True for the ablation"
        )

    def _build_rl_loss_config(self) -> BaseRLLossConfig:
        mapped, source = async_trl_options_to_rl_loss(self)
        data = dict(mapped if self.rl_loss is None else self.rl_loss)
        if "rollout_is" not in data and not self.behavior_as_old_policy and not self.allow_uncorrected_staleness:
            data["rollout_is"] = dict(DEFAULT_ROLLOUT_IS)
        if self.rl_loss is None:
            return validate_rl_loss(self.loss_config_class, data)
        if data.get("loss_agg_mode") == "seq-mean-token-sum-norm" and data.get("loss_scale_factor") is None:
            data["loss_scale_factor"] = float(self.max_completion_length)
        cfg = validate_rl_loss(self.loss_config_class, data)
        for key, option in source.items():
            if getattr(self, option) == _async_default(option):
                continue
            expected = mapped["policy_loss_cfg"][key.split(".")[1]]
            actual = getattr(cfg.policy_loss_cfg, key.split(".")[1])
            if expected != actual:
                raise ValueError(
                    f"{option}={getattr(self, option)!r} conflicts with rl_loss (rl_loss.{key}={actual!r}): the loss "
                    f"layer replaces TRL's {option}; set rl_loss.{key} and leave {option} at its default "
                    f"({_async_default(option)!r})"
                )
        return cfg
