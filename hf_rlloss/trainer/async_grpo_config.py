"""`RLLossAsyncGRPOConfig`: TRL's `AsyncGRPOConfig` plus the `rl_loss` block of the synchronous trainer.

TRL's async trainer has one loss: a token-level PPO clip (`epsilon`, `epsilon_high`) with the sampler's log-probs as
π_old. Without `rl_loss` that loss is **mapped** onto the loss layer (`async_trl_options_to_rl_loss`); with `rl_loss`,
`epsilon`/`epsilon_high` left at a non-default value must agree with it. `behavior_as_old_policy` keeps TRL's choice of
π_old (the sampler's log-probs, one forward fewer); by default π_old is the trainer's own no-grad pass at the start of
each optimizer step and the sampler's log-probs are π_behavior (the decoupled objective, see docs/async.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..loss.config import BaseRLLossConfig, GRPOLossConfig
from .grpo_config import parse_rl_loss, validate_rl_loss

__all__ = ["RLLossAsyncGRPOConfig", "TREE_ATTENTION_BACKENDS", "async_trl_options_to_rl_loss"]

# "auto": TRL's FlashAttention-3 kernel on CUDA when `kernels` is installed, else hf_rlloss' exact SDPA tree attention
TREE_ATTENTION_BACKENDS = ("auto", "fa3", "sdpa")


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
            onto it (`async_trl_options_to_rl_loss`).
        behavior_as_old_policy (`bool`, *optional*, defaults to `False`):
            `True`: TRL's behaviour, the sampler's log-probs are π_old (the PPO clip is taken against them; no extra
            forward; rollout IS is then refused, its weight would be 1). `False`: π_old is the trainer's no-grad pass
            at the start of the optimizer step, the clip is taken against it, and rollout IS weighs by
            π_old / π_behavior.
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
            MoE routing replay (`RLLossGRPOConfig.routing_replay`) is not supported by the asynchronous trainer yet:
            its samples carry no routed experts (neither the CPU worker nor TRL's vLLM worker returns them) and its
            packed forwards have no replay layout; any other value than `"off"` is refused.

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
            "the trainer's no-grad pass at the start of each optimizer step; rollout IS weighs pi_old/pi_behavior."
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
        metadata={"help": "MoE routing replay: only 'off' here (RLLossGRPOConfig.routing_replay: the sync trainer)."},
    )

    def __post_init__(self):
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ValueError(
                f"max_staleness={self.max_staleness!r} must be an integer >= 0 (the policy versions a sample may lag "
                "behind the trainer; 0 trains only on samples of the current policy)"
            )
        if self.tree_attention not in TREE_ATTENTION_BACKENDS:
            allowed = ", ".join(TREE_ATTENTION_BACKENDS)
            raise ValueError(f"tree_attention={self.tree_attention!r} must be one of {allowed}")
        if self.routing_replay != "off":
            raise ValueError(
                f"routing_replay={self.routing_replay!r} is not supported by RLLossAsyncGRPOTrainer: its samples "
                "carry no routed experts (neither the CPU worker nor TRL's vLLM worker returns them); use 'off', or "
                "RLLossGRPOTrainer, whose routing_replay supports 'rollout' and 'old_policy'"
            )
        if self.rollout_logprobs_support not in ("full", "sampled"):
            raise ValueError(f"rollout_logprobs_support={self.rollout_logprobs_support!r} must be 'full' or 'sampled'")
        super().__post_init__()
        self.rl_loss = parse_rl_loss(self.rl_loss)
        self.rl_loss_config = self._build_rl_loss_config()
        if self.behavior_as_old_policy and self.rl_loss_config.rollout_is.enabled:
            raise ValueError(
                "rl_loss.rollout_is with behavior_as_old_policy=True: π_old would be the sampler's own log-probs, so "
                "the IS weight π_old/π_behavior is 1. Set behavior_as_old_policy=False (π_old = the trainer's pass at "
                "the start of each optimizer step) or unset rl_loss.rollout_is.upper"
            )

    def _build_rl_loss_config(self) -> BaseRLLossConfig:
        mapped, source = async_trl_options_to_rl_loss(self)
        if self.rl_loss is None:
            return validate_rl_loss(self.loss_config_class, mapped)
        data = dict(self.rl_loss)
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
