"""`RLLossGRPOConfig`: TRL's `GRPOConfig` plus the `rl_loss` mapping that configures the hf_rlloss loss layer.

The loss layer replaces TRL's loss, so the TRL options that configured it (`loss_type`, `epsilon`, `epsilon_high`,
`beta`, `importance_sampling_level`, `sapo_temperature_*`, …) are handled here, never silently ignored:

* without `rl_loss`, they are **mapped** onto an equivalent loss config (see `trl_options_to_rl_loss`);
* with `rl_loss`, any of them left at a non-default value must agree with `rl_loss`, otherwise construction fails
  with a message naming the `rl_loss` key to use;
* the TRL loss features the layer has no equivalent for yet are rejected (none at present: `_UNSUPPORTED`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import ValidationError
from trl import GRPOConfig

from ..loss.config import BaseRLLossConfig, GRPOLossConfig
from .common.packing import PACKING_CHOICES
from .common.routing_replay import ROUTING_REPLAY_MODES
from .common.transformers_compat import (
    RENAMED_CHECKPOINTING,
    checkpointing_field,
    to_new_checkpointing_names,
    to_old_checkpointing_names,
)
from .sync.vllm import check_vllm_config

logger = logging.getLogger(__name__)

# TRL's cispo has no lower bound on the IS weight; the loss layer's cispo clips it at `1 - cliprange_low` = 0.
CISPO_NO_LOWER_BOUND = 1.0

# TRL loss_type -> (policy loss of the loss layer, aggregation)
_TRL_LOSS_TYPES = {
    "dapo": ("vanilla", "token-mean"),
    "bnpo": ("vanilla", "token-mean"),
    "grpo": ("vanilla", "seq-mean-token-mean"),
    "dr_grpo": ("vanilla", "seq-mean-token-sum-norm"),
    "luspo": ("vanilla", "seq-mean-token-sum"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "vespo": ("vespo", "token-mean"),
}
# the sequence-level (importance_sampling_level="sequence") form of each policy loss
_SEQUENCE_LEVEL = {"vanilla": "gspo", "cispo": "cispo_seq", "sapo": "sapo_seq", "vespo": "vespo"}

# TRL loss features without an equivalent in the loss layer: option -> (is it in use?, what to do instead)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {}


def _trl_default(name: str) -> Any:
    for f in dataclasses.fields(GRPOConfig):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(name)


def _is_set(args: Any, name: str) -> bool:
    return getattr(args, name) != _trl_default(name)


def trl_options_to_rl_loss(args: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The `rl_loss` mapping equivalent to TRL's loss options, and for each of its keys the TRL option it comes from.

    | TRL | rl_loss |
    |---|---|
    | `loss_type="dapo"`/`"bnpo"` | `vanilla`, `token-mean` (global over the step; TRL's bnpo is per micro-batch) |
    | `loss_type="grpo"` | `vanilla`, `seq-mean-token-mean` |
    | `loss_type="dr_grpo"` | `vanilla`, `seq-mean-token-sum-norm`, `loss_scale_factor=max_completion_length` |
    | `loss_type="luspo"` | `vanilla`, `seq-mean-token-sum` |
    | `loss_type="grpo"`/`"dr_grpo"`/`"luspo"`/`"sapo"` | `count_empty_sequences=True` (TRL counts every row) |
    | `loss_type="cispo"` | `cispo`, `token-mean`, `cliprange_low=1` (no floor), `cliprange_high = epsilon_high − 1`
    (TRL's cap is absolute; a cap < 1 is accepted with a warning) |
    | `loss_type="sapo"` | `sapo` with `tau_pos/neg = sapo_temperature_pos/neg`, `seq-mean-token-mean` |
    | `loss_type="vespo"` | `vespo` with `vespo_k_pos/neg`, `vespo_lambda_pos/neg`, `token-mean` |
    | `importance_sampling_level="sequence"` | `gspo`, `cispo_seq`, `sapo_seq` instead of `vanilla`, `cispo`, `sapo` |
    | `epsilon`, `epsilon_high` | `policy_loss_cfg.cliprange_low`, `cliprange_high` |
    | `delta` | `policy_loss_cfg.delta` (PPO-clip losses; TRL ignores it for the others, so does the mapping) |
    | `off_policy_mask_threshold` | `off_policy_mask_threshold` |
    | `beta > 0` | `use_kl_loss=True`, `kl_loss_type="k3"`, `kl_loss_coef=beta` |
    | `use_bias_correction_kl` (with `beta > 0`) | `kl_bias_correction` = `importance_sampling_level` |
    | `top_entropy_quantile` | `top_entropy_quantile` (per micro-batch over all ranks, as TRL) |
    | `entropy_coef` | `entropy_coef` (TRL's per-micro-batch mean entropy; `use_adaptive_entropy`: the trainer's) |

    The PPO-clip (`vanilla`) mapping sets `clip_ratio_c=None`: TRL's losses have no dual clip.
    """
    loss_type = args.loss_type
    if loss_type not in _TRL_LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r} has no equivalent in the loss layer; set rl_loss.policy_loss_cfg.loss_type "
            f"(and rl_loss.loss_agg_mode) instead. Mappable TRL loss types: {', '.join(_TRL_LOSS_TYPES)}"
        )
    policy_loss, agg_mode = _TRL_LOSS_TYPES[loss_type]
    source = {"policy_loss_cfg.loss_type": "loss_type", "loss_agg_mode": "loss_type"}
    level = args.importance_sampling_level
    if level == "sequence":
        if policy_loss not in _SEQUENCE_LEVEL:
            raise ValueError(
                f"importance_sampling_level='sequence' with loss_type={loss_type!r} has no equivalent in the loss "
                "layer; use rl_loss.policy_loss_cfg.loss_type='gspo' (or 'geo_mean') instead"
            )
        if _SEQUENCE_LEVEL[policy_loss] != policy_loss:
            policy_loss = _SEQUENCE_LEVEL[policy_loss]
            source["policy_loss_cfg.loss_type"] = "importance_sampling_level"
    elif level != "token":
        raise ValueError(f"importance_sampling_level={level!r}; expected 'token' or 'sequence'")
    policy = _trl_policy_loss_cfg(args, policy_loss, source)
    rl_loss: dict[str, Any] = {"policy_loss_cfg": policy, "loss_agg_mode": agg_mode}
    if agg_mode == "seq-mean-token-sum-norm":
        rl_loss["loss_scale_factor"] = float(args.max_completion_length)
        source["loss_scale_factor"] = "max_completion_length"
    if agg_mode != "token-mean":  # TRL's sequence-mean losses count every row, masked (empty) ones included
        rl_loss["count_empty_sequences"] = True
        source["count_empty_sequences"] = "loss_type"
    if args.off_policy_mask_threshold is not None:
        rl_loss["off_policy_mask_threshold"] = args.off_policy_mask_threshold
        source["off_policy_mask_threshold"] = "off_policy_mask_threshold"
    if args.beta != 0.0:
        rl_loss.update(use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=args.beta)
        source.update({"use_kl_loss": "beta", "kl_loss_coef": "beta"})
        if args.use_bias_correction_kl:
            rl_loss["kl_bias_correction"] = level
            source["kl_bias_correction"] = "use_bias_correction_kl"
    if args.top_entropy_quantile != 1.0:  # out-of-range values are then refused by the field
        rl_loss["top_entropy_quantile"] = args.top_entropy_quantile
        source["top_entropy_quantile"] = "top_entropy_quantile"
    if args.entropy_coef != 0.0 and not args.use_adaptive_entropy:
        rl_loss["entropy_coef"] = args.entropy_coef
        source["entropy_coef"] = "entropy_coef"
    return rl_loss, source


def _trl_policy_loss_cfg(args: Any, policy_loss: str, source: dict[str, str]) -> dict[str, Any]:
    """`rl_loss.policy_loss_cfg` for the mapped `policy_loss` from TRL's clipping and loss options (each key's TRL
    option recorded in `source`)."""
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    high_source = "epsilon_high" if args.epsilon_high is not None else "epsilon"
    policy: dict[str, Any] = {"loss_type": policy_loss}
    if policy_loss in ("vanilla", "gspo"):
        policy["cliprange_low"] = args.epsilon
        policy["cliprange_high"] = epsilon_high
        source["policy_loss_cfg.cliprange_low"] = "epsilon"
        source["policy_loss_cfg.cliprange_high"] = high_source
        if policy_loss == "vanilla":
            policy["clip_ratio_c"] = None  # TRL's PPO-clip losses have no dual clip
        if args.delta is not None:
            policy["delta"] = args.delta
            source["policy_loss_cfg.delta"] = "delta"
    elif policy_loss in ("cispo", "cispo_seq"):
        policy["cliprange_low"] = CISPO_NO_LOWER_BOUND
        policy["cliprange_high"] = _cispo_cliprange_high(epsilon_high)
        source["policy_loss_cfg.cliprange_high"] = high_source
    elif policy_loss in ("sapo", "sapo_seq"):
        policy["tau_pos"] = args.sapo_temperature_pos
        policy["tau_neg"] = args.sapo_temperature_neg
        source["policy_loss_cfg.tau_pos"] = "sapo_temperature_pos"
        source["policy_loss_cfg.tau_neg"] = "sapo_temperature_neg"
    elif policy_loss == "vespo":
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            policy[name] = getattr(args, name)
            source[f"policy_loss_cfg.{name}"] = name
    if args.delta is not None and "delta" not in policy:
        logger.warning("delta=%s is ignored with loss_type=%r (as TRL does)", args.delta, args.loss_type)
    return policy


def _cispo_cliprange_high(epsilon_high: float) -> float:
    """TRL's absolute CISPO cap `epsilon_high` (ε_max) as the loss layer's relative `cliprange_high`."""
    if epsilon_high <= 0.0:
        raise ValueError(
            f"loss_type='cispo' caps the IS weight at epsilon_high={epsilon_high} (an absolute cap): it must be > 0, "
            "or every token's weight would be <= 0 and flip the sign of its advantage. ScaleRL uses 5.0"
        )
    if epsilon_high < 1.0:
        logger.warning(
            "loss_type='cispo' caps the IS weight at epsilon_high=%s (an absolute cap, as in TRL): below 1, every "
            "token with a ratio above it, on-policy ones included, is weighted %s. ScaleRL recommends 5.0.",
            epsilon_high,
            epsilon_high,
        )
    return epsilon_high - 1.0


def _get_dotted(cfg: BaseRLLossConfig, key: str) -> Any:
    if key == "loss_agg_mode":
        return cfg.agg_mode
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def format_validation_error(err: ValidationError, prefix: str = "rl_loss") -> str:
    """One line per error, each naming the full YAML key (e.g. ``rl_loss.policy_loss_cfg.cliprange_low``)."""
    lines = []
    for error in err.errors():
        loc = [str(part) for part in error["loc"]]
        msg = error["msg"].removeprefix("Value error, ")
        # Errors raised by a model validator are located at the model: name the field the message is about.
        match = re.match(r"(\w+)=", msg)
        if match and error["type"] == "value_error":
            loc.append(match.group(1))
        if error["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{'.'.join([prefix, *loc])}: {msg}")
    return "\n".join(lines)


def parse_rl_loss(value: Any) -> dict[str, Any] | None:
    """The `rl_loss` option as a mapping (or `None`): a JSON string (CLI) is parsed; anything else is refused."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"rl_loss: not a JSON mapping ({err})") from err
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"rl_loss must be a mapping; got {type(value).__name__}")
    return value


def validate_rl_loss(loss_config_class: type[BaseRLLossConfig], data: dict[str, Any]) -> BaseRLLossConfig:
    """`data` validated into `loss_config_class`; errors name the YAML key (`rl_loss.…`)."""
    try:
        return loss_config_class(**data)
    except ValidationError as err:
        raise ValueError(f"invalid rl_loss:\n{format_validation_error(err)}") from None
    except ValueError as err:  # raised outside pydantic's field machinery (e.g. an unknown loss_type lookup)
        raise ValueError(f"invalid rl_loss: {err}") from None


QUANTIZED_LOADING_KEYS = ("load_in_4bit", "load_in_8bit")


def refuse_quantized_loading(model_init_kwargs: dict[str, Any] | None, field_name: str = "model_init_kwargs") -> None:
    """Refuse `load_in_4bit` / `load_in_8bit` by name: transformers 5 no longer takes them as `from_pretrained`
    keywords (the model's `__init__` fails on them), and QLoRA with the loss layer is not tested.

    Example:

    ```python
    >>> refuse_quantized_loading({"load_in_4bit": True})
    Traceback (most recent call last):
    ValueError: model_init_kwargs['load_in_4bit']=True is not supported: ...
    ```
    """
    for key in QUANTIZED_LOADING_KEYS:
        if (model_init_kwargs or {}).get(key):
            raise ValueError(
                f"{field_name}[{key!r}]={model_init_kwargs[key]!r} is not supported: quantized loading "
                f"({', '.join(QUANTIZED_LOADING_KEYS)}) is not tested with the loss layer, which reads the LM head's "
                "weight directly. Load the model in bf16 (dtype: bfloat16), with LoRA for a small memory footprint"
            )


def precision_mismatch_warning(
    user_bf16: bool | None, fp16: bool, resolved: str, accelerate_mixed_precision: str | None
) -> str | None:
    """The warning to give when the training arguments' precision overrides the accelerate config's, else None.

    Args:
        user_bf16 (`bool` or `None`):
            `bf16` as the user set it (`None`: left unset, which TRL's `GRPOConfig` turns into `not fp16`).
        fp16 (`bool`):
            The `fp16` argument.
        resolved (`str`):
            The precision the training arguments resolved to (`TrainingArguments.mixed_precision`).
        accelerate_mixed_precision (`str` or `None`):
            The accelerate config's `mixed_precision` (`accelerate launch` exports it as
            `ACCELERATE_MIXED_PRECISION`); `None` when not launched with one, and then there is nothing to disagree.
    """
    if fp16:
        setting, asked = "fp16=True", "fp16"
    elif user_bf16 is None:
        setting, asked = "bf16=True (TRL's GRPOConfig default when bf16 is not set)", "bf16"
    else:
        setting, asked = f"bf16={user_bf16}", "bf16" if user_bf16 else "no"
    if accelerate_mixed_precision is None or accelerate_mixed_precision == asked:
        return None
    return (
        f"precision: the training arguments' {setting} and the accelerate config's "
        f"mixed_precision={accelerate_mixed_precision!r} disagree; training runs with mixed_precision={resolved!r} "
        "(under DeepSpeed the weights themselves are cast, under DDP/FSDP the forward is autocast). Set bf16/fp16 "
        "explicitly (bf16: false for fp32) and the accelerate config's mixed_precision to the same precision."
    )


@dataclass
class RLLossGRPOConfig(GRPOConfig):
    r"""`GRPOConfig` for `RLLossGRPOTrainer`: the loss is the hf_rlloss loss layer, configured by `rl_loss`.

    Parameters:
        rl_loss (`dict` or `str`, *optional*):
            The loss configuration: a mapping validated into `loss_config_class` (`GRPOLossConfig`: `policy_loss_cfg`,
            `use_kl_loss`, `kl_loss_coef`, `kl_loss_type`, `loss_agg_mode`, `loss_scale_factor`, `chunk_size`, …),
            or its JSON string (CLI). Errors name the YAML key (e.g. `rl_loss.policy_loss_cfg.cliprange_low`).
            `loss_scale_factor` defaults to `max_completion_length` for `seq-mean-token-sum-norm` (Dr. GRPO).
            When unset, TRL's loss options (`loss_type`, `epsilon`, `epsilon_high`, `beta`,
            `importance_sampling_level`, `sapo_temperature_*`) are mapped onto it (see `trl_options_to_rl_loss`);
            when set, those options must be left at their defaults or agree with it.
        sp_size (`int`, *optional*, defaults to `1`):
            Sequence-parallel (Ulysses) degree: consecutive groups of `sp_size` processes act as one data-parallel
            replica, each rank holding `1/sp_size` of every packed micro-batch (see docs/design.md). Must divide
            the number of processes. With `sp_size > 1`, `per_device_train_batch_size` is the number of sequences in
            a micro-batch of an SP group (not of a rank), and each rank generates `per_device_train_batch_size ×
            steps_per_generation / sp_size` completions per generation, so `generation_batch_size` is
            `per_device_train_batch_size × (processes / sp_size) × steps_per_generation`.

        skip_nonfinite_grad_steps (`int`, *optional*, defaults to `0`):
            `0`: off. `N > 0`: an optimizer step whose gradient norm is not finite is skipped (parameters, optimizer
            state and learning-rate schedule unchanged; `nonfinite_grad_skipped` logged), and the `N + 1`-th
            consecutive one raises `FloatingPointError` (see `hf_rlloss.trainer.sync.nonfinite_guard`). Not under
            DeepSpeed.

        packing (`str`, *optional*, defaults to `"auto"`):
            The layout of the training forwards (the loss forward, the old and reference log-prob passes,
            evaluation). `"auto"`: `"shared_prefix"`, except on CUDA without flash-attn's varlen kernel (or without
            bf16/fp16), where it is `"off"` (`hf_rlloss.trainer.common.packing.packing_for_device` says why, and the
            choice is logged). `"shared_prefix"`: each micro-batch as one row in which every common
            prefix (a prompt and its G completions) is forwarded once, attended segment by segment so that each token
            sees exactly its own sequence; `"padding_free"`: each sequence without padding, prompts repeated;
            `"off"`: the padded batch, as TRL. All three give the same update (to float round-off); a model or batch
            that cannot be packed exactly is forwarded padded, with a log line saying why (vision-language models;
            an MoE router loss turns `"shared_prefix"` into `"padding_free"`). See docs/packing.md.

        routing_replay (`str`, *optional*, defaults to `"off"`):
            MoE routing replay (`hf_rlloss.trainer.common.routing_replay`): the training forwards route each token
            through recorded experts, with gate weights recomputed from the live router scores at those experts (the
            router keeps its gradient). `"rollout"` (R3): the experts HF `generate` chose, replayed in every training
            forward (π_old, reference, loss); `"old_policy"` (R2): the experts of the π_old pass, replayed in the loss
            forward; `"off"`. A trainer option, not an `rl_loss` one: it changes the forwards, not the loss. See
            docs/routing_replay.md.

        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            DAPO's dynamic sampling: after scoring a generation batch, drop the groups whose rewards are all equal
            (zero advantage: no policy gradient) and generate further rounds from fresh prompts until a full
            generation batch of groups with signal is kept, or `dynamic_sampling_max_rounds` rounds were generated;
            the step then trains on the groups kept (fewer when short; none kept: the last round, unfiltered). The
            extra prompts come from a second shuffled stream over `train_dataset`, so a step consumes more prompts
            than `generation_batch_size / num_generations` while epochs still count the trainer's own batches. Logs
            `dynamic_sampling/{rounds,groups_generated,groups_kept,prompts_consumed,starved}`; see
            docs/dynamic_sampling.md.
        dynamic_sampling_max_rounds (`int`, *optional*, defaults to `3`):
            The most generation rounds per generation batch under `dynamic_sampling` (the first included); >= 1.

        activation_checkpointing (`bool`, *optional*, defaults to `True`):
            TRL's default for activation (gradient) checkpointing, under transformers 5's name; the deprecated
            `gradient_checkpointing` still works (with transformers' FutureWarning).

    The validated loss configuration is `config.rl_loss_config` (not a dataclass field: it is rebuilt from `rl_loss`
    and the TRL options on every construction, so saved and re-parsed configs give the same loss).
    Precision: as in TRL, `bf16` defaults to `True` unless `fp16` is set, and it overrides the accelerate config's
    `mixed_precision` (DDP then autocasts to bf16, while DeepSpeed casts the weights themselves to bf16); when the two
    disagree a warning names both (`precision_mismatch_warning`). Set `bf16` explicitly (`bf16: false` for fp32).
    Any batch layout TRL accepts works: when `steps_per_generation × num_iterations` is not a multiple of
    `gradient_accumulation_steps`, an optimizer step may span two generation batches and is normalized in groups
    (see docs/design.md, "Steps spanning two generations").
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["rl_loss"]

    #: The loss configuration class `rl_loss` is validated into; subclasses may replace it.
    loss_config_class: ClassVar[type[BaseRLLossConfig]] = GRPOLossConfig

    rl_loss: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Loss-layer configuration (a mapping, or its JSON string): policy_loss_cfg, use_kl_loss, "
            "kl_loss_coef, kl_loss_type, loss_agg_mode, loss_scale_factor, chunk_size, ... When unset, TRL's loss "
            "options (loss_type, epsilon, epsilon_high, beta, ...) are mapped onto it."
        },
    )
    record_rollout_logprobs: bool = field(
        default=True,
        metadata={
            "help": "With HF generate: record the log-probs of the sampled tokens (on the support chosen by "
            "rollout_logprobs_support), so that rollout importance sampling (rl_loss.rollout_is) and the "
            "training-inference mismatch metrics (mismatch/*, rollout_is/*) work. Costs one no-grad forward per "
            "generation batch when old log-probs are not needed anyway, unless training is on-policy "
            "(num_iterations=1, steps_per_generation=gradient_accumulation_steps) and rollout IS metrics-only: the "
            "metrics then use the training forward's log-probs. vLLM and rollout_func provide their own log-probs. "
            "Beam search and greedy decoding record nothing."
        },
    )
    shared_prompt_generation: bool = field(
        default=True,
        metadata={
            "help": "With HF generate: prefill each distinct prompt of a generation batch once and copy its KV cache "
            "to its num_generations rows, instead of prefilling every repeated row (the same completions and "
            "log-probs up to float round-off; hf_rlloss/trainer/common/shared_prefill.py). Calls that cannot "
            "share (beam search, VLM inputs, a static cache, ...) run as before, said once in the log."
        },
    )
    rollout_logprobs: bool | None = field(
        default=None,
        metadata={"help": "Deprecated: the former name of record_rollout_logprobs (a FutureWarning says so)."},
    )
    rollout_logprobs_support: str = field(
        default="full",
        metadata={
            "help": "The support on which rollout IS and the mismatch metrics compare the rollout's log-probs with "
            "the trainer's under truncated sampling (top_k/top_p/min_p): 'full' (the whole vocabulary: HF generate "
            "records the log-prob before truncation) or 'sampled' (the truncated support: the trainer's log-prob is "
            "renormalized by the mass its replayed truncation keeps). vLLM and rollout_func report log-probs on the "
            "sampled support, which is then always used. Without truncation both are the same."
        },
    )
    # transformers 5 renamed `gradient_checkpointing*` to `activation_checkpointing*` (the old names warn and go in
    # v6). TRL 1.16 defaults the old name to True, which warns on every construction; here it defaults to None and
    # `__post_init__` gives TRL's default to the new name, so only a user who sets the old name is warned. The old
    # name keeps working: transformers copies it to the new one, then mirrors the new one back (TRL reads the old).
    # On transformers < 5.23 the new names are declared here (transformers_compat), the old ones are the current ones.
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (which defaults to True here, as in TRL)."},
    )
    if not RENAMED_CHECKPOINTING:
        activation_checkpointing: bool | None = checkpointing_field("activation_checkpointing")
        activation_checkpointing_kwargs: dict[str, Any] | str | None = checkpointing_field(
            "activation_checkpointing_kwargs"
        )
    sp_size: int = field(
        default=1,
        metadata={
            "help": "Sequence-parallel (Ulysses) degree: groups of sp_size consecutive processes share each "
            "micro-batch, each holding 1/sp_size of its tokens. Must divide the number of processes. With "
            "sp_size > 1, per_device_train_batch_size counts the sequences of a micro-batch of an SP group."
        },
    )

    skip_nonfinite_grad_steps: int = field(
        default=0,
        metadata={
            "help": "0 (off) or N > 0: skip an optimizer step whose gradient norm is not finite (e.g. bf16 overflow; "
            "parameters, optimizer state and LR schedule are left as they were; logged as nonfinite_grad_skipped), "
            "and stop with an error at the (N+1)-th such step in a row. Not under DeepSpeed."
        },
    )

    packing: str = field(
        default="auto",
        metadata={
            "help": "Layout of the training forwards: 'auto' (shared_prefix, except on CUDA without flash-attn's "
            "varlen kernel: off), 'shared_prefix' (each common prefix, e.g. a prompt shared by its G completions, "
            "forwarded once; no padding), 'padding_free' (no padding, prompts repeated) or 'off' (padded, as TRL). "
            "Exact in every mode; see docs/packing.md.",
            "choices": list(PACKING_CHOICES),
        },
    )

    routing_replay: str = field(
        default="off",
        metadata={
            "help": "MoE routing replay: 'rollout' (the experts chosen during generation, replayed in every training "
            "forward), 'old_policy' (the experts of the pi_old pass, replayed in the loss forward) or 'off'. See "
            "docs/routing_replay.md.",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: drop the groups whose rewards are all equal and generate more rounds "
            "from fresh prompts until the generation batch is full of groups with signal, or "
            "dynamic_sampling_max_rounds is reached (see docs/dynamic_sampling.md)."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={"help": "The most generation rounds per generation batch under dynamic_sampling (>= 1)."},
    )

    def __post_init__(self):
        if not isinstance(self.skip_nonfinite_grad_steps, int) or self.skip_nonfinite_grad_steps < 0:
            raise ValueError(f"skip_nonfinite_grad_steps={self.skip_nonfinite_grad_steps!r} must be an integer >= 0")
        if self.packing not in PACKING_CHOICES:
            raise ValueError(f"packing={self.packing!r}; expected one of {', '.join(map(repr, PACKING_CHOICES))}")
        self._check_routing_replay()
        if not isinstance(self.shared_prompt_generation, bool):
            raise ValueError(f"shared_prompt_generation={self.shared_prompt_generation!r} must be true or false")
        rounds = self.dynamic_sampling_max_rounds
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            raise ValueError(f"dynamic_sampling_max_rounds={rounds!r} must be an integer >= 1")
        if self.rollout_logprobs is not None:
            warnings.warn(
                "RLLossGRPOConfig: rollout_logprobs is deprecated and will be removed; use record_rollout_logprobs "
                "(the same boolean: record the sampled tokens' log-probs under HF generate)",
                FutureWarning,
                stacklevel=3,
            )
            self.record_rollout_logprobs, self.rollout_logprobs = self.rollout_logprobs, None
        if not isinstance(self.sp_size, int) or isinstance(self.sp_size, bool) or self.sp_size < 1:
            raise ValueError(f"sp_size={self.sp_size!r} must be an integer >= 1")
        if self.sp_size > 1 and self.generation_batch_size is not None:
            raise ValueError(
                f"sp_size={self.sp_size}: set steps_per_generation instead of generation_batch_size (with sequence "
                "parallelism the generation batch is per_device_train_batch_size × (processes / sp_size) × "
                "steps_per_generation)"
            )
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default, under the current name (no FutureWarning)
        to_old_checkpointing_names(self)
        user_bf16 = self.bf16
        super().__post_init__()
        to_new_checkpointing_names(self)
        mismatch = precision_mismatch_warning(
            user_bf16, self.fp16, self.mixed_precision, os.environ.get("ACCELERATE_MIXED_PRECISION")
        )
        if mismatch:
            warnings.warn(mismatch, UserWarning, stacklevel=3)
        refuse_quantized_loading(self.model_init_kwargs)
        self.rl_loss = parse_rl_loss(self.rl_loss)
        if self.rollout_logprobs_support not in ("full", "sampled"):
            raise ValueError(f"rollout_logprobs_support={self.rollout_logprobs_support!r} must be 'full' or 'sampled'")
        if self.sp_size > 1:
            self._check_sequence_parallel()
        for name, (in_use, why) in _UNSUPPORTED.items():
            if in_use(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported with rl_loss: {why}")
        self.rl_loss_config = self._build_rl_loss_config()
        self._check_rollout_is_backend()
        check_vllm_config(self, self.rl_loss_config.rollout_is.enabled)

    def _check_sequence_parallel(self) -> None:
        """`sp_size > 1`: a multi-process launch it divides, a generation batch it can split, supported options."""
        sp, world = self.sp_size, self.world_size
        if world == 1:
            raise ValueError(
                f"sp_size={sp} needs {sp} or a multiple of {sp} processes, but this is a single process: launch with "
                f"`accelerate launch --num_processes {sp} ...` or `torchrun --nproc_per_node {sp} ...`"
            )
        if world % sp != 0:
            raise ValueError(f"sp_size={sp} must divide the number of processes ({world})")
        if self.use_transformers_continuous_batching or self.use_transformers_paged:
            raise ValueError(
                f"sp_size={sp} is not supported with use_transformers_continuous_batching (paged attention cannot "
                "wrap the Ulysses attention): use HF generate, vLLM or a rollout_func"
            )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                f"sp_size={sp} with use_vllm needs vllm_importance_sampling_correction=False: under sequence "
                "parallelism the old log-probs are computed after the SP group has pooled its completions, too late "
                "for TRL's correction. Use rl_loss.rollout_is (e.g. {'level': 'token', 'upper': 2.0}) instead"
            )
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy or self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"sp_size={sp} with the entropy bonus or mask (entropy_coef, use_adaptive_entropy, "
                "top_entropy_quantile): TRL's are per micro-batch over whole sequences, which one sequence-parallel "
                "shard does not see"
            )
        per_group = self.per_device_train_batch_size * self.steps_per_generation
        if per_group % sp != 0:
            raise ValueError(
                f"sp_size={sp}: per_device_train_batch_size × steps_per_generation ({self.per_device_train_batch_size}"
                f" × {self.steps_per_generation} = {per_group}) sequences per SP group and generation must be "
                f"divisible by sp_size, since each of the {sp} ranks of a group generates an equal share of them"
            )
        # TRL derived the generation batch from the number of processes; an SP group is one data-parallel replica.
        self.generation_batch_size = per_group * (world // sp)
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                f"sp_size={sp}: the generation batch (per_device_train_batch_size × processes / sp_size × "
                f"steps_per_generation = {self.generation_batch_size}) must be divisible by num_generations "
                f"({self.num_generations})"
            )

    def _check_routing_replay(self) -> None:
        mode = self.routing_replay
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay={mode!r}; expected one of {', '.join(map(repr, ROUTING_REPLAY_MODES))}")
        if mode == "off":
            return
        refusals = {}
        if mode == "rollout":
            # vLLM (0.32) returns each request's routed experts with enable_return_routed_experts=True
            # (CompletionOutput.routed_experts); TRL neither starts its engine with it nor returns them
            vllm = "use_vllm (TRL's vLLM generation returns no routed experts: vLLM's enable_return_routed_experts)"
            refusals[vllm] = self.use_vllm
            refusals["use_transformers_continuous_batching (no per-step router calls to record)"] = (
                self.use_transformers_continuous_batching
            )
        refused = [name for name, on in refusals.items() if on]
        if refused:
            raise ValueError(f"routing_replay={mode!r} is not supported with {', '.join(refused)}")

    def _check_rollout_is_backend(self) -> None:
        if not self.rl_loss_config.rollout_is.enabled:
            return
        if self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "rl_loss.rollout_is and TRL's vllm_importance_sampling_correction would both correct the rollout "
                "mismatch: set vllm_importance_sampling_correction=False (rl_loss.rollout_is replaces it)"
            )
        if not self.use_vllm and (self.use_transformers_continuous_batching or not self.record_rollout_logprobs):
            raise ValueError(
                "rl_loss.rollout_is needs the rollout's log-probs, which this generation backend does not yield: "
                "use HF generate with record_rollout_logprobs=True (and use_transformers_paged=False), vLLM, or a "
                "rollout_func that returns logprobs"
            )

    def _build_rl_loss_config(self) -> BaseRLLossConfig:
        if self.rl_loss is None:
            mapped, _ = trl_options_to_rl_loss(self)
            return self._validate_rl_loss(mapped)
        data = dict(self.rl_loss)
        if data.get("loss_agg_mode") == "seq-mean-token-sum-norm" and data.get("loss_scale_factor") is None:
            data["loss_scale_factor"] = float(self.max_completion_length)
        cfg = self._validate_rl_loss(data)
        self._check_trl_options_agree(cfg)
        return cfg

    def _validate_rl_loss(self, data: dict[str, Any]) -> BaseRLLossConfig:
        return validate_rl_loss(self.loss_config_class, data)

    def _check_trl_options_agree(self, cfg: BaseRLLossConfig) -> None:
        """TRL loss options left at a non-default value must say the same as `rl_loss`."""
        try:
            mapped, source = trl_options_to_rl_loss(self)
        except ValueError as err:
            raise ValueError(f"{err} (rl_loss is set: leave the TRL loss options at their defaults)") from None
        flat = {
            "policy_loss_cfg.loss_type": mapped["policy_loss_cfg"]["loss_type"],
            **{f"policy_loss_cfg.{k}": v for k, v in mapped["policy_loss_cfg"].items()},
            **{k: v for k, v in mapped.items() if k != "policy_loss_cfg"},
        }
        for key, option in source.items():
            if not _is_set(self, option) or option == "max_completion_length":
                continue
            expected, actual = flat[key], _get_dotted(cfg, key)
            if expected != actual:
                raise ValueError(
                    f"{option}={getattr(self, option)!r} conflicts with rl_loss ({'rl_loss.' + key}={actual!r}, while "
                    f"{option} means {key}={expected!r}). The loss layer replaces TRL's {option}: set "
                    f"rl_loss.{key} and leave {option} at its default ({_trl_default(option)!r})"
                )
