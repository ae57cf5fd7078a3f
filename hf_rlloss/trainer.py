"""`RLLossGRPOTrainer`: TRL's `GRPOTrainer` with its loss replaced by the hf_rlloss loss layer.

Generation, rewards, advantages, logging, checkpoints, PEFT and the model card are TRL's; what changes is how the loss
of an optimizer step is computed (see the class docstring).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_available, is_peft_model
from datasets import IterableDataset
from huggingface_hub import ModelCard
from torch import nn
from torch.distributed.fsdp import FSDPModule, StateDictType
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.models.utils import _ForwardRedirection
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import (
    create_model_from_path,
    disable_dropout_in_model,
    maybe_gather_lm_head_ctx,
    repeat_iterable_dataset,
    split_tensor_dict,
    use_adapter,
)

from .chunked_logprobs import chunked_kept_logmass, chunked_logprobs
from .config import BaseRLLossConfig
from .context import BaseRLLossContext
from .fields import FROM_TRL, pad_value
from .hub import complete_model_card
from .metrics import accumulate_metrics, finalize_train_policy_metrics
from .multimodal import (
    SP_REFUSAL,
    backbone_inputs,
    detach_token_suppression,
    multimodal_inputs,
    multimodal_rows,
    token_suppression_replay,
)
from .sequence_parallel import (
    build_sp_mesh,
    register_ulysses_attention,
    sp_gather,
    sp_shard_inputs,
    sp_split,
    ulysses_sequence_parallel,
)
from .trainer_config import RLLossGRPOConfig

if is_peft_available():  # peft is optional: without it no head can be wrapped
    from peft.utils.other import ModulesToSaveWrapper
else:
    ModulesToSaveWrapper = None

__all__ = ["RLLossGRPOConfig", "RLLossGRPOTrainer"]

logger = logging.get_logger(__name__)


@contextlib.contextmanager
def _overridden(obj: Any, **values: Any) -> Iterator[None]:
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextlib.contextmanager
def _activation_checkpointing_disabled(model: nn.Module, kwargs: dict | None) -> Iterator[None]:
    """TRL's `disable_gradient_checkpointing` with transformers 5's names (the `gradient_checkpointing*` ones warn)."""
    was_enabled = model.is_activation_checkpointing
    if was_enabled:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if was_enabled:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


# TRL 1.16 (pinned) calls these deprecated aliases around generation and scoring, and PEFT's `get_peft_model` (called
# by TRL's __init__) reads one; transformers keeps them working until v6. Silenced only inside those calls
# (`_trl_deprecated_aliases_silenced`), so a user's own use still warns.
_TRL_DEPRECATED_ALIASES = r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)`"


@contextlib.contextmanager
def _trl_deprecated_aliases_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRL_DEPRECATED_ALIASES + " is deprecated", category=FutureWarning)
        yield


def _with_model_softcapping(loss_cfg: BaseRLLossConfig, lm: nn.Module) -> BaseRLLossConfig:
    """The loss config with `logit_softcapping` set from the model's `final_logit_softcapping` (Gemma 2) when unset,
    so that the chunked head computes the logits the model's own forward does. A value that differs from the
    model's is left for `_check_model_supported` to refuse."""
    softcap = getattr(lm.config.get_text_config(), "final_logit_softcapping", None)
    if softcap is None or loss_cfg.logit_softcapping is not None:
        return loss_cfg
    return loss_cfg.model_copy(update={"logit_softcapping": float(softcap)})


def _sequences(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, P + C)` input ids and attention mask of a batch's left-padded prompts followed by its completions."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask


def _logit_scale(text_config: Any) -> float:
    """The factor the model multiplies its logits by before the softmax (1.0 for most models), as TRL reads it."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def _load_balancing_loss_func(lm: nn.Module):
    """The MoE load-balancing loss its causal-LM class computes in `forward` (transformers' per-model
    `load_balancing_loss_func`, e.g. Switch-Transformer style for Qwen3-MoE, Mixtral, GPT-OSS)."""
    fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if fn is None or not hasattr(lm, "num_experts") or not hasattr(lm, "num_experts_per_tok"):
        raise ValueError(
            f"{type(lm).__name__} declares output_router_logits but its module has no load_balancing_loss_func (or "
            "the model no num_experts / num_experts_per_tok): set router_aux_loss_coef=0.0 to train without the "
            "router auxiliary loss"
        )
    return fn


def _active_head(head: nn.Module) -> nn.Module:
    """The module a PEFT `ModulesToSaveWrapper` around the LM head forwards to now (mirroring its `forward`): the
    active adapter's trainable copy, or the original head while adapters are disabled; any other head as is."""
    if ModulesToSaveWrapper is None or not isinstance(head, ModulesToSaveWrapper):
        return head
    active = head.active_adapters
    if head.disable_adapters or not active or any(name not in head.modules_to_save for name in active):
        return head.original_module
    return head.modules_to_save[active[0]]


# Attention implementations the Ulysses attention can stand in for (it runs SDPA on whole sequences).
SP_WRAPPABLE_ATTENTION = ("sdpa", "eager", "ulysses_sdpa")


def _is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether `model`'s parameters are DeepSpeed ZeRO-3 shards (built under `deepspeed.zero.Init`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _zero3_sharded_copy(model: nn.Module) -> nn.Module:
    """A copy of a ZeRO-3-partitioned in-memory `model` that stays partitioned on every rank.

    `copy.deepcopy` would copy each rank's empty shard without DeepSpeed's bookkeeping (the copy then fails at its
    first forward). Instead the architecture is rebuilt from `model.config` by transformers' `_from_config`, which
    builds it under `deepspeed.zero.Init` when ZeRO-3 is enabled (as `from_pretrained` does, and so as TRL's
    reference is built), and the weights are copied one parameter at a time inside `GatheredParameters`: at most one
    full parameter exists at a time, and each rank keeps only its shard.
    """
    import deepspeed
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        raise ValueError(
            "rl_loss.use_kl_loss: the in-memory policy is partitioned by deepspeed.zero.Init, but transformers' "
            "DeepSpeed ZeRO-3 config is not active (create the RLLossGRPOConfig before the model, with an accelerate "
            "config that has zero_stage: 3), so its reference copy cannot be built sharded: pass ref_model=<path>"
        )
    dtype = next(model.parameters()).dtype
    copied = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    sources = dict(model.named_parameters())
    if sources.keys() != dict(copied.named_parameters()).keys():
        raise ValueError(f"cannot copy the ZeRO-3 partitioned {type(model).__name__}: it differs from its config's")
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, param in copied.named_parameters():
        # modifier_rank=0: on exit, rank 0's full copy is partitioned again over the ranks; the source is unchanged.
        gather_source = deepspeed.zero.GatheredParameters([sources[name]])
        with gather_source, deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(sources[name].data)
    for name, buffer in model.named_buffers():  # buffers are not partitioned
        copied.get_buffer(name).data.copy_(buffer.data)
    copied.set_attn_implementation(model.config._attn_implementation)
    return copied


class PackedRows(NamedTuple):
    """Rows of a padded prompt/completion batch packed into one row, for sequence parallelism.

    `input_ids`/`position_ids` are `(1, L)`: each sequence's prompt without its left padding followed by its completion
    without its right padding, positions restarting at 0 per sequence; `num_tokens` `(B,)` their lengths. Completion
    token `(rows[k], cols[k])` of the padded batch is predicted at packed position `label_index[k]` (the position
    before it), i.e. a `(B, C)` completion-aligned tensor `x` becomes `packed[0, label_index] = x[rows, cols]`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    num_tokens: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    label_index: torch.Tensor

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def pack(self, values: torch.Tensor, padding_value: float) -> torch.Tensor:
        """A `(B, C)` completion-aligned tensor in the packed `(1, L)` layout, `padding_value` elsewhere."""
        out = values.new_full((1, self.length), padding_value)
        out[0, self.label_index] = values[self.rows, self.cols]
        return out

    def unpack(self, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The inverse of `pack` for a `(1, L)` tensor: `(B, C)`, 0 where no completion token is."""
        out = packed.new_zeros(shape)
        out[self.rows, self.cols] = packed[0, self.label_index]
        return out


def pack_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> PackedRows:
    """Pack a left-padded prompt batch and a right-padded completion batch (masks: 1 = real token) into one row."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    keep = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    num_tokens = keep.sum(dim=1)
    starts = num_tokens.cumsum(0) - num_tokens
    position_ids = (keep.long().cumsum(dim=1) - 1)[keep].unsqueeze(0)
    packed_index = (keep.reshape(-1).long().cumsum(0) - 1).reshape(keep.shape)[:, prompt_ids.shape[1] :]
    rows, cols = completion_mask.bool().nonzero(as_tuple=True)
    label_index = packed_index[rows, cols] - 1
    has_context = label_index >= starts[rows]  # a sequence's first token is not predicted from anything
    rows, cols, label_index = rows[has_context], cols[has_context], label_index[has_context]
    return PackedRows(ids[keep].unsqueeze(0), position_ids, num_tokens, rows, cols, label_index)


# transformers' logits warpers that cut the support of the sampling distribution (removed tokens get -inf). What
# comes before them in the processor list (penalties, temperature) shapes the distribution the trainer compares with.
TRUNCATING_WARPERS = (
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


class _BeforeTruncation(LogitsProcessor):
    """Inserted before the first truncating warper: keeps the full-vocabulary log-softmax for the recorder."""

    def __init__(self, recorder: SampledTokenLogprobs):
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.recorder.full = torch.log_softmax(scores.float(), dim=-1)
        return scores


class SampledTokenLogprobs(LogitsProcessor):
    """Records, for each token sampled by HF ``generate``, its log-prob under the full-vocabulary sampling
    distribution and the log of the probability mass that top-k/top-p/min-p (…) truncation kept.

    Two hooks in the processor list (see `install`): `before_truncation` sits right before the first truncating
    warper, after the penalties and the temperature, so its log-softmax is the distribution over the whole vocabulary
    that the trainer's log-probs (with the same temperature) describe; the recorder itself comes last and sees the
    distribution the token is drawn from, whose finite entries are the kept support ``S``. Per row it keeps
    ``log p(v)`` `(B, V)` and ``log K = log Σ_{v∈S} p(v)`` `(B,)`; the token is only known at the next step, so each
    call records the previous step's values (one `(B, V)` block alive at a time) and `finish` records the last one.
    The log-prob on the sampled support is ``log p(o) − log K``.
    """

    def __init__(self):
        self.full: torch.Tensor | None = None  # (B, V) log-softmax before truncation, set by before_truncation
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None
        self.logprobs: list[torch.Tensor] = []
        self.kept_logmass: list[torch.Tensor] = []
        self.before_truncation = _BeforeTruncation(self)

    def install(self, processors: LogitsProcessorList) -> LogitsProcessorList:
        """Insert `before_truncation` before the first truncating warper and append the recorder (in place)."""
        cut = next((i for i, p in enumerate(processors) if isinstance(p, TRUNCATING_WARPERS)), len(processors))
        suppressions = detach_token_suppression(processors, cut)  # VLM: TRL's suppressed image token
        cut -= len(suppressions)
        if cut < len(processors) or suppressions:
            processors[cut:cut] = [self.before_truncation, *suppressions]
        processors.append(self)
        return processors

    def _record(self, tokens: torch.Tensor) -> None:
        full, kept_logmass = self.previous
        self.logprobs.append(full.gather(-1, tokens.to(full.device)[:, None]).squeeze(-1))
        self.kept_logmass.append(kept_logmass)
        self.previous = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self._record(input_ids[:, -1])
        full = self.full if self.full is not None else torch.log_softmax(scores.float(), dim=-1)
        cut = ~torch.isfinite(scores)
        kept_logmass = torch.logsumexp(full.masked_fill(cut, float("-inf")), dim=-1).clamp(max=0.0)
        # exactly 0 where nothing was cut (a float32 sum of the whole softmax is 1 only to about 1e-5 at 49k tokens)
        kept_logmass = torch.where(cut.any(dim=-1), kept_logmass, 0.0)
        self.previous, self.full = (full, kept_logmass), None
        return scores

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, generated)` full-vocabulary log-probs of the generated tokens and the kept log-masses, given the
        `(B,)` tokens sampled at the last step."""
        if self.previous is not None:
            self._record(last_tokens)
        if not self.logprobs:
            empty = torch.zeros(last_tokens.size(0), 0)
            return empty, empty
        return torch.stack(self.logprobs, dim=1), torch.stack(self.kept_logmass, dim=1)


class RLLossGRPOTrainer(GRPOTrainer):
    r"""`GRPOTrainer` whose loss is computed by the hf_rlloss loss layer (`args.rl_loss`, see `RLLossGRPOConfig`).

    Everything but the loss is TRL's: generation (HF `generate`, vLLM or a `rollout_func`), reward functions and
    weights, advantages, PEFT/LoRA, gradient checkpointing, mixed precision, checkpoints, the model card, logging.

    **Per optimizer step.** At the first micro-batch of each optimizer step the trainer builds the loss contexts of
    all of the step's micro-batches (`build_loss_context`) and calls `build_batches` on them once: one all-reduce
    gives the step's global denominators (valid tokens and sequences over every micro-batch of every rank). Each
    micro-batch's loss is then `ctx(hidden_states=..., head_weight=...)`: the backbone's last hidden states and the
    LM-head weight, projected in chunks by the loss layer (full logits are never materialized). The returned loss is
    already multiplied by the number of ranks, so with DDP/FSDP/DeepSpeed averaging gradients over ranks and
    gradient accumulation summing them over micro-batches, **each optimizer update is the gradient of the loss
    aggregated (e.g. token-mean) over the whole step** (the XTuner contract), whatever the number of micro-batches
    and ranks and however the tokens are spread over them.

    **How this differs from TRL's normalization.** TRL normalizes each micro-batch on its own (`grpo`, `bnpo`,
    `dr_grpo`, `luspo`: per micro-batch, divided by the accumulation steps) or by the token count of the whole
    *generation* batch (`dapo`, `cispo`: `num_items_in_batch / processes × GA / steps_per_generation`, which equals
    the step's global token mean only when micro-batches hold the same number of tokens on average). Here every
    aggregation mode is normalized over exactly the micro-batches of the optimizer step, on all ranks. With
    `steps_per_generation == gradient_accumulation_steps` and on-policy data, TRL's `dapo` and this trainer's
    `token-mean` give the same update.

    **Steps spanning two generations.** When `steps_per_generation × num_iterations` is not a multiple of
    `gradient_accumulation_steps` (e.g. 4 × 2 with 3), TRL lets an optimizer step take its last micro-batches from
    the next generation batch, which does not exist yet when the step's first micro-batch runs its backward. Such a
    step is normalized in *groups*: the micro-batches up to the end of the current generation batch form one group,
    normalized over its own micro-batches on all ranks (one `build_batches`), and the next group is built when the
    next generation batch arrives. A group of `k` of the step's `n` micro-batches is weighted `k / n`
    (`step_fraction`), so the step's loss is `Σ_g (k_g / n)·L_g`, `L_g` the group's aggregated loss. This equals the
    global normalization when the groups' micro-batches hold the same number of tokens (sequences) on average, and
    is exactly TRL's update for the sequence-normalized modes (`grpo`, `dr_grpo`, `luspo`, `sapo`: every
    micro-batch holds `per_device_train_batch_size` sequences).

    **Gradient-accumulation scaling.** `loss_is_scaled_for_ga = True` makes transformers' `Trainer.training_step`
    use the returned loss as is (it would otherwise divide by `current_gradient_accumulation_steps`), and the
    `Trainer` builds its `Accelerator` with `gradient_accumulation_steps=1`, so `accelerator.backward` does not divide
    either; the loss is nonetheless multiplied by `accelerator.gradient_accumulation_steps` (outside DeepSpeed, whose
    engine is told `scale_wrt_gas=False`) so that an accelerator configured otherwise cannot rescale it.

    **Log-probs.** Old log-probs (π_θ_old) are computed right after generation whenever a micro-batch can be
    trained off-policy (`num_iterations > 1` or `steps_per_generation > gradient_accumulation_steps`, TRL's own
    condition), reference log-probs whenever `rl_loss.use_kl_loss`, both without gradient from the backbone's hidden
    states with `chunked_logprobs`. The reference is `ref_model` if given (a model or a path), else the policy with
    its PEFT adapter disabled (or TRL's frozen `"ref"` adapter for a pre-trained `PeftModel`), else the model loaded
    from the path the policy was given as, else a copy of the in-memory policy taken before training (under ZeRO-3
    a sharded copy, see `_resolve_reference`). Rollout log-probs (`sampling_per_token_logps`, from vLLM or a
    `rollout_func`) are passed as `rollout_logprobs` and TRL's vLLM importance-sampling ratio as
    `rollout_is_weights`. With HF `generate` (and `args.rollout_logprobs`), the trainer records the log-probs of the
    sampled tokens (`SampledTokenLogprobs`), so rollout importance sampling and the mismatch metrics work on every
    backend; old log-probs are then computed, and `rl_loss.rollout_is` runs on each micro-batch before
    `build_batches` — except when every micro-batch is on-policy and rollout IS is metrics-only
    (`_old_logps_from_loss`): the old log-probs are then the detached log-probs of the training forward, and the
    mismatch metrics are computed in the loss from them, saving one no-grad forward per generation batch. Under
    top-k/top-p/min-p sampling both are compared on the same support (`args.rollout_logprobs_support`): the whole
    vocabulary (the recorder takes the log-prob before the truncating warpers) or the sampled support (the trainer
    replays the truncation on π_old and renormalizes by the kept mass, `old_kept_logmass`; always so for vLLM, whose
    log-probs are on the sampled support); the kept mass is logged as `mismatch/kept_mass_mean`. Beam search and
    greedy decoding record nothing. The trainer's forwards use the positions HF `generate` gives a left-padded batch
    (counted from the first real token).

    **Metrics.** The loss layer's metrics are accumulated over the micro-batches of a step and reduced once per
    optimizer step (one collective per reduction kind) into `train_policy/*` and `loss/*` next to TRL's metrics.

    **Sequence parallelism** (`args.sp_size > 1`, DeepSpeed-Ulysses). The processes form a `(dp, sp)` mesh whose SP
    groups are `sp_size` consecutive ranks (`self.sp_mesh`, the `"sp"` dimension); an SP group is one data-parallel
    replica. The policy (and a separate reference model) switch to the `"ulysses_sdpa"` attention, which is plain
    SDPA outside `ulysses_sequence_parallel` (so generation is unchanged) and Ulysses attention inside it.

    * *Batches.* `per_device_train_batch_size` is the number of sequences in a micro-batch of an SP group: each rank
      generates and scores its `1/sp_size` share of the group's generation batch (its dataloader yields
      `per_device_train_batch_size × steps_per_generation / sp_size` prompts; see `RLLossGRPOConfig.sp_size`), then
      the group all-gathers the scored batch (`_sp_all_gather_batch`), so each of its ranks holds the group's batch
      in the same order; the shuffle before splitting it into `steps_per_generation` micro-batches is drawn on the
      group's first rank and broadcast. TRL's reward and completion metrics are computed before this union, so no
      sequence is counted twice. Evaluation keeps TRL's batches (each rank generates `per_device_eval_batch_size`
      completions) and pools them over the group the same way.
    * *Forward.* Each micro-batch is packed into one row `(1, L)` (prompts without left padding, completions without
      right padding, `position_ids` restarting at 0 per sequence, see `pack_rows`), padded to a multiple of `sp_size`
      and split: every rank runs the backbone on a contiguous `L / sp_size` shard inside
      `ulysses_sequence_parallel(self.sp_mesh)` (all-to-all from sequence to head shards around SDPA, a block-causal
      mask per packed sequence), so activation memory per rank is about `1/sp_size` of the micro-batch's. The loss
      data (`build_loss_data`, completion-aligned `(B, C)`) is converted to the packed layout with `num_tokens` and
      given full-length to `rl_loss_config.build(data, sp_mesh=self.sp_mesh)`, which keeps this rank's shard; the
      loss layer counts every token and sequence once and reduces per-sequence statistics (GSPO, seq-mean
      aggregations, sequence-level rollout IS) over the SP group. The returned loss is multiplied by the world size
      and DDP averages gradients over all `dp × sp` ranks: the update is the gradient of the step's global loss.
      The backward (and gradient-checkpointing recomputation) runs inside the SP context (`training_step`).
    * *Log-probs.* The old and reference log-probs are computed by `compute_per_token_logps` on the same packed,
      sharded path (after the group has pooled its batch), gathered over the group and stored in TRL's padded
      `(B, C)` layout.
    * *Requirements* (checked at construction): a multi-process launch with `sp_size` dividing the number of
      processes; attention `sdpa`, `eager` or `ulysses_sdpa` (not FlashAttention, flex or paged attention); attention
      heads divisible by `sp_size` (key/value heads need not be: they are replicated); no sliding-window or linear
      attention layers; no TRL vLLM IS correction (use `rl_loss.rollout_is`); no continuous-batching generation.
      Accelerate's `ParallelismConfig` (DeepSpeed ALST) is not used: TRL's `GRPOConfig` rejects it, and its
      dataloader adapter and global `"sdpa"` patch do not fit GRPO's generation; use `sp_size` instead.

    **FSDP2** (`accelerate_configs/fsdp2.yaml`). Every loss and log-prob pass runs inside the root module's forward
    (`_call_through_wrapper`), so `fully_shard`'s hooks unshard every parameter (embeddings, final norm and LM head,
    tied or not, included) and reduce-scatter every gradient. The full LM-head weight exists only from a loss
    pass's forward to its backward (Accelerate keeps its unit unsharded in between; the chunked loss keeps its
    gradient, not the weight) and during a no-gradient pass, after which it is resharded at once. The reference is
    sharded like the policy (TRL's `prepare_fsdp`); for an in-memory policy it is a deep copy taken at construction,
    before the policy is sharded. `save_model` gathers a full state dict whatever `fsdp_state_dict_type` is, so the
    saved folder loads with `from_pretrained` (see `save_model`). `fully_shard` over all `dp × sp` ranks is what
    the loss contract needs under sequence parallelism: gradients are averaged over every rank.

    **Subclassing.** Override `build_loss_data` to add keys to the data given to `rl_loss_config.build` (or
    `build_loss_context` to modify the context), set `RLLossGRPOConfig.loss_config_class` to use another loss
    configuration class, and `compute_hidden_states` / `get_head_weight` for models with an unusual layout.

    **A PEFT-wrapped LM head.** A head trained in full through PEFT (`modules_to_save=["lm_head"]`, a
    `ModulesToSaveWrapper`) is read through its wrapper as its forward would: the active adapter's copy for the
    loss, the original head while the adapter is disabled (the reference, `use_adapter(model, None)`).

    **MoE router load-balancing loss.** When TRL enables it (`aux_loss_enabled`: the model declares
    `output_router_logits` and `router_aux_loss_coef` — TRL's, else the model config's — is non-zero), the backbone
    returns its router logits with the hidden states and the model's own `load_balancing_loss_func` (over the
    micro-batch's prompt and completion tokens) is added as TRL adds it: `router_aux_loss_coef × aux_loss /
    gradient_accumulation_steps` per micro-batch, averaged over ranks. It is logged as TRL's `aux_loss` and as
    `loss/router_aux`. Not with sequence parallelism (a shard does not see the micro-batch's routing statistics).

    **Entropy bonus** (TRL's `entropy_coef`, `use_adaptive_entropy`): `rl_loss.entropy_coef`, TRL's per-micro-batch
    mean entropy with its gradient from the chunk pass. Adaptive control keeps TRL's state (`entropy_coef`,
    `_last_world_entropy`), updated at each optimizer step's end from the step's entropy over all ranks' tokens, and
    saved/restored with checkpoints by TRL's own code. Not with sequence parallelism.

    **Final-logit softcapping** (Gemma 2's `final_logit_softcapping`) is read from the model config into
    `rl_loss.logit_softcapping`: the chunked head computes `c·tanh(z/c)` before the temperature, and its gradient.

    **Vision-language models** (a processor as `processing_class`, as in TRL): the backbone (vision tower, projector
    and language model, e.g. `Gemma3Model`, `Qwen2VLModel`) runs on the multimodal fields TRL builds (`pixel_values`,
    `image_grid_thw`, `token_type_ids`, …, see `hf_rlloss.multimodal`), cut by rows for the no-grad passes, and the
    chunked LM head computes the loss as for a text model. Backbones with M-RoPE (Qwen-VL) compute their positions
    from the image grid, as in generation. TRL's suppressed image token in HF generation is a cut of the sampling
    support: the rollout log-probs treat it as one (kept mass). Not with sequence parallelism (a shard of a packed
    row cannot place the image features of its sequences).

    **Not supported** (rejected at construction): an LM head with a bias or a LoRA adapter on the head itself,
    softcapping together with a logit scale, a vision-language model with sequence parallelism. A logit scale
    (`logit_scale`, `logits_scaling`, …) is folded into the temperature.
    """

    _tag_names = ["trl", "grpo", "hf-rlloss"]

    def __init__(
        self,
        model: str | PreTrainedModel | nn.Module,
        reward_funcs: Any = None,
        args: RLLossGRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
        ref_model: str | PreTrainedModel | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = RLLossGRPOConfig(f"{name.split('/')[-1]}-GRPO")
        if not isinstance(args, RLLossGRPOConfig):
            raise TypeError(
                f"RLLossGRPOTrainer needs an RLLossGRPOConfig (got {type(args).__name__}): its rl_loss field "
                "configures the loss"
            )
        loss_cfg: BaseRLLossConfig = args.rl_loss_config
        self.rl_loss_config = loss_cfg
        self._ref_source = self._resolve_reference(model, ref_model, peft_config, loss_cfg)

        # TRL must neither build a reference model (it would reload it from `config._name_or_path`, which fails for
        # in-memory models) nor compute reference log-probs: the KL is the loss layer's (rl_loss.use_kl_loss).
        with _overridden(args, beta=0.0, sync_ref_model=False), _trl_deprecated_aliases_silenced():
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
                tools=tools,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        self.beta = 0.0  # TRL's KL stays off; see rl_loss_config.use_kl_loss

        if self._is_vlm and args.sp_size > 1:  # VLM: see hf_rlloss/multimodal.py
            raise ValueError(SP_REFUSAL)
        if self.aux_loss_enabled and args.sp_size > 1:
            raise ValueError(
                f"sp_size={args.sp_size}: the MoE router load-balancing loss is a product of means over all tokens "
                "of a micro-batch, which one SP shard does not see; set router_aux_loss_coef=0.0 to train without it"
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.rl_loss_config = _with_model_softcapping(self.rl_loss_config, self._causal_lm(unwrapped))
        self._check_model_supported(unwrapped)
        if self.aux_loss_enabled:
            _load_balancing_loss_func(self._causal_lm(unwrapped))  # fails now, not at the first step
        text_config = unwrapped.config.get_text_config()
        self._loss_temperature = self.temperature / _logit_scale(text_config)

        self._forward_redirection = _ForwardRedirection()
        self._rl_pending: deque[BaseRLLossContext] = deque()
        self._rl_step_remaining = 0  # micro-batches of the current optimizer step without a context yet
        self._rl_step_size = 0
        self._rl_step_metrics: dict[str, Any] = {}
        self.sp_mesh = None
        self._sp_defer_logps = False  # set while TRL scores a generation batch under SP (see _generate_and_score...)
        self._sp_deferred_old_logps = False
        self._recorded_kept_logmass: list[list[torch.Tensor]] = []
        self._stashed_kept_logmass: torch.Tensor | None = None
        self._rl_micro_batch: int | None = None  # index in the optimizer step of the context being built
        self._truncation_replay = self._build_truncation_replay()
        if args.sp_size > 1:
            self._setup_sequence_parallel(unwrapped)
        self.ref_model = self._build_reference(self._ref_source)
        self._ref_source = None
        if args.sync_ref_model:
            if not loss_cfg.use_kl_loss:
                raise ValueError("sync_ref_model=True needs a reference: set rl_loss.use_kl_loss=true")
            if self.ref_model is None:
                raise NotImplementedError("sync_ref_model=True is not supported with PEFT (the reference is the base)")
            self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))

    # ------------------------------------------------------------------------------------------------------------
    # Reference model

    @staticmethod
    def _resolve_reference(model, ref_model, peft_config, loss_cfg: BaseRLLossConfig) -> Any:
        """Where the reference log-probs will come from, decided before TRL touches the policy.

        An in-memory policy (no path) is copied: with `copy.deepcopy`, or, when it is partitioned by DeepSpeed ZeRO-3's
        `zero.Init` (e.g. loaded by `from_pretrained` under an accelerate config with `zero3_init_flag: true`), by
        rebuilding it from its config under `zero.Init` and copying the weights one gathered parameter at a time
        (`_zero3_sharded_copy`), so that the reference stays sharded per rank. `_build_reference` then wraps it as
        TRL does its own reference (`prepare_deepspeed`: a ZeRO-3 inference engine under ZeRO-3, stage 0 otherwise).
        """
        if not loss_cfg.use_kl_loss:
            if ref_model is not None:
                raise ValueError("ref_model was given but rl_loss.use_kl_loss is false: nothing would use it")
            return None
        if ref_model is not None:
            return ref_model
        if peft_config is not None:
            return "adapter"
        if isinstance(model, str):  # the reference is loaded from the same path
            return model
        if is_peft_model(model):
            # As TRL does for beta != 0: a frozen copy of the pre-trained adapter is the reference.
            default_config = model.peft_config["default"]
            model.add_adapter("ref", default_config)
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
            return "adapter"
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            raise ValueError(
                "rl_loss.use_kl_loss needs a reference model, and a quantized in-memory policy cannot be copied: pass "
                "ref_model=... (a model or a path), or a peft_config (the reference is then the base model)"
            )
        if _is_zero3_partitioned(model):
            return _zero3_sharded_copy(model)
        return copy.deepcopy(model)  # the policy as given, before any training

    def _build_reference(self, source: Any) -> nn.Module | None:
        if source is None or source == "adapter":
            return None
        if isinstance(source, str):
            init_kwargs = dict(self.args.model_init_kwargs or {})
            init_kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
            init_kwargs.setdefault("dtype", self.model.dtype)
            init_kwargs.setdefault("attn_implementation", self.model.config._attn_implementation)
            # FSDP too: by now the state says FSDP (not MULTI_GPU), and "auto" would spread each rank's copy over
            # every GPU; `fully_shard` moves the CPU-loaded model to the rank's device.
            if self.args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED", "FSDP"]:
                init_kwargs["device_map"] = None
            source = create_model_from_path(source, **init_kwargs)
        self._check_model_supported(source)
        if self.sp_mesh is not None:
            self._use_ulysses_attention(source, "the reference model")
        source.requires_grad_(False)
        source.eval()
        if self.args.disable_dropout:
            disable_dropout_in_model(source)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(source, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(source, self.accelerator)
        return self.accelerator.prepare_model(source, evaluation_mode=True)

    # ------------------------------------------------------------------------------------------------------------
    # Rollout log-probs under truncated sampling

    def _records_hf_rollout_logprobs(self) -> bool:
        """Whether the rollout log-probs come from `SampledTokenLogprobs` (HF `generate` with sampling)."""
        hf_generate = not self.use_vllm and self.rollout_func is None
        return hf_generate and not self.args.use_transformers_continuous_batching and self.args.rollout_logprobs

    def _build_truncation_replay(self) -> LogitsProcessorList | None:
        """The truncating warpers (top-k, top-p, min-p) the trainer replays on π_old to get the mass they keep, or
        `None` when the rollout log-probs are compared as they are.

        HF `generate` records full-vocabulary log-probs (`rollout_logprobs_support="full"`: nothing to replay) or
        the log-probs on the sampled support (`"sampled"`: π_old is renormalized over the replayed support). vLLM
        (`processed_logprobs`) and a `rollout_func` report log-probs on the sampled support only, so with truncation
        they are always compared on that support, whatever `rollout_logprobs_support` says.
        """
        args = self.args
        if self._records_hf_rollout_logprobs():
            mode = self.generation_config.get_generation_mode()
            if self.rl_loss_config.rollout_is.enabled and mode != GenerationMode.SAMPLE:
                raise ValueError(
                    f"rl_loss.rollout_is needs sampled completions, but the generation mode is {mode.value!r} "
                    "(generation_kwargs num_beams/do_sample): there is no sampling distribution to correct for"
                )
            if args.rollout_logprobs_support == "full" or mode != GenerationMode.SAMPLE:
                return None
            config = self.generation_config
            settings = {name: getattr(config, name, None) for name in ("top_k", "top_p", "min_p")}
            others = {
                name: getattr(config, name, None)
                for name in ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
                if getattr(config, name, None) not in (None, 0.0, 1.0)
            }
        elif self.use_vllm or self.rollout_func is not None:
            # TRL passes top_k/top_p/min_p to vLLM; generation_kwargs may override them
            overrides = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
            settings = {name: overrides.get(name, getattr(self, name)) for name in ("top_k", "top_p", "min_p")}
            others = {}
        else:
            return None
        if others:
            raise ValueError(
                f"rollout_logprobs_support='sampled' replays top_k, top_p and min_p on the trainer's distribution, "
                "not "
                f"{', '.join(f'{k}={v}' for k, v in others.items())}: use rollout_logprobs_support='full'"
            )
        warpers = LogitsProcessorList()
        if self._records_hf_rollout_logprobs():
            warpers.extend(token_suppression_replay(self.generation_config))  # VLM: TRL's suppressed image token
        if settings["top_k"] is not None and settings["top_k"] > 0:
            warpers.append(TopKLogitsWarper(top_k=int(settings["top_k"])))
        if settings["top_p"] is not None and settings["top_p"] < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(settings["top_p"])))
        if settings["min_p"]:
            warpers.append(MinPLogitsWarper(min_p=float(settings["min_p"])))
        if not warpers:
            return None
        if not self._records_hf_rollout_logprobs():
            logger.warning_once(
                f"sampling is truncated ({', '.join(type(w).__name__ for w in warpers)}) and the rollout log-probs of "
                "vLLM / rollout_func are on the sampled support: rollout IS compares them with π_old renormalized "
                "over the replayed support (rollout_logprobs_support='full' needs HF generate)"
            )
        return warpers

    # ------------------------------------------------------------------------------------------------------------
    # Sequence parallelism: setup

    def _setup_sequence_parallel(self, unwrapped: nn.Module) -> None:
        sp = self.args.sp_size
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and (
            getattr(parallelism, "sp_enabled", False) or getattr(parallelism, "cp_enabled", False)
        ):
            raise ValueError(
                "sp_size > 1 is RLLossGRPOTrainer's own Ulysses sequence parallelism: do not also enable Accelerate's "
                "ParallelismConfig sp_size/cp_size (DeepSpeed ALST / context parallelism)"
            )
        if self.accelerator.num_processes % sp != 0:
            raise ValueError(f"sp_size={sp} must divide the number of processes ({self.accelerator.num_processes})")
        self._use_ulysses_attention(unwrapped, "the policy")
        self.sp_mesh = build_sp_mesh(sp, device_type=self.accelerator.device.type)

    def _use_ulysses_attention(self, model: nn.Module, what: str) -> None:
        """Check that `model` can run under Ulysses SP and switch it to the `"ulysses_sdpa"` attention."""
        sp = self.args.sp_size
        lm = self._causal_lm(model)
        name = type(lm).__name__
        config = lm.config.get_text_config()
        implementation = getattr(lm.config, "_attn_implementation", None) or "sdpa"
        if implementation not in SP_WRAPPABLE_ATTENTION:
            raise ValueError(
                f"sp_size={sp}: {what} ({name}) uses attn_implementation={implementation!r}, which the Ulysses "
                f"attention cannot wrap; load it with one of {', '.join(map(repr, SP_WRAPPABLE_ATTENTION))}"
            )
        heads = getattr(config, "num_attention_heads", None)
        if heads is not None and heads % sp != 0:
            raise ValueError(
                f"sp_size={sp}: {what} ({name}) has {heads} attention heads, not divisible by sp_size (Ulysses gives "
                "each rank of an SP group heads / sp_size of them); choose an sp_size that divides it"
            )
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention"} or getattr(config, "sliding_window", None) is not None:
            kinds = ", ".join(sorted(layer_types - {"full_attention"})) or "sliding_window"
            raise ValueError(
                f"sp_size={sp}: {what} ({name}) has attention layers other than full causal attention ({kinds}), "
                "which the Ulysses attention does not implement"
            )
        lm.set_attn_implementation(register_ulysses_attention())

    # ------------------------------------------------------------------------------------------------------------
    # Sequence parallelism: batches

    def get_train_dataloader(self):
        if self.args.sp_size == 1:
            return super().get_train_dataloader()
        # TRL's, with each rank loading its 1/sp share of its SP group's generation batch.
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            if self.shuffle_dataset:
                dataset = dataset.shuffle(seed=self.args.seed)
            dataset = repeat_iterable_dataset(
                dataset,
                mini_repeat_count=self.num_generations,
                batch_size=self.args.generation_batch_size // self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
            )
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation // self.args.sp_size,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_total_train_batch_size(self, args) -> int:
        # Sequences per optimizer step (logged, and used for throughput): an SP group is one data-parallel replica.
        return super().get_total_train_batch_size(args) // getattr(args, "sp_size", 1)

    def _sp_all_gather_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The generation batches of this rank's SP group, concatenated in rank order (the same on every rank).

        Per-row tensors are padded to the group's longest (prompts on the left, everything else on the right; gloo
        needs equal shapes) and all-gathered; 0-dim tensors and `None` are kept.
        """
        group = self.sp_mesh.get_group()
        rows = batch["prompt_ids"].shape[0]
        keys = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for key, value in batch.items():
            if key in keys:
                if value.shape[0] != rows:
                    raise ValueError(f"sequence parallelism: batch[{key!r}] has {value.shape[0]} rows, not {rows}")
            elif value is not None and not (isinstance(value, torch.Tensor) and value.dim() == 0):
                raise ValueError(
                    f"sequence parallelism cannot pool batch[{key!r}] ({type(value).__name__}) over the SP group"
                )
        device = batch["prompt_ids"].device
        lengths = torch.tensor([batch[k].shape[1] if batch[k].dim() > 1 else 0 for k in keys], device=device)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
        pad_id = self._tokenizer.pad_token_id
        out = dict(batch)
        for key, length in zip(keys, lengths.tolist()):
            value = batch[key]
            if value.dim() > 1 and value.shape[1] < length:
                fill = (
                    pad_id if key.endswith("_ids") else 1 if key in ("tool_mask", "importance_sampling_ratio") else 0
                )
                filler = value.new_full((rows, length - value.shape[1], *value.shape[2:]), fill)
                value = torch.cat([filler, value] if key.startswith("prompt_") else [value, filler], dim=1)
            value = value.contiguous()
            shards = [torch.empty_like(value) for _ in range(self.args.sp_size)]
            dist.all_gather(shards, value, group=group)
            out[key] = torch.cat(shards, dim=0)
        return out

    def _sp_buffered_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's `_prepare_inputs` (training) for an SP group: generate, pool, shuffle alike on the group, split."""
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)  # the SP group's pooled batch
            rows = batch["prompt_ids"].shape[0]
            permutation = torch.randperm(rows).to(batch["prompt_ids"].device)
            group = self.sp_mesh.get_group()
            dist.broadcast(permutation, src=dist.get_global_rank(group, 0), group=group)
            batch = {k: v[permutation] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
            self._buffered_inputs = split_tensor_dict(batch, spg)
        return self._buffered_inputs[self._step % spg]

    def _sp_pack_batch(self, inputs: dict[str, Any]) -> PackedRows:
        return pack_rows(
            inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
        )

    def _sp_hidden_states(self, unwrapped: nn.Module, packed: PackedRows) -> torch.Tensor:
        """`(1, L_local, H)`: this rank's shard of the backbone's last hidden states of a packed row (collective)."""
        input_ids, position_ids = sp_shard_inputs(
            packed.input_ids, packed.position_ids, self.sp_mesh, self._tokenizer.pad_token_id
        )
        with ulysses_sequence_parallel(self.sp_mesh):
            return self.compute_hidden_states(unwrapped, input_ids, None, position_ids=position_ids)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.sp_mesh is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # The backward, and the recomputation of gradient checkpointing in it, must run the Ulysses attention too;
        # generation and scoring (in `_prepare_inputs`) leave the SP context.
        with ulysses_sequence_parallel(self.sp_mesh):
            return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------------------------------------------------
    # Hidden states and the LM head

    @staticmethod
    def _causal_lm(unwrapped: nn.Module) -> nn.Module:
        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _check_model_supported(self, unwrapped: nn.Module) -> None:
        lm = self._causal_lm(unwrapped)
        name = type(lm).__name__
        text_config = lm.config.get_text_config()
        softcap = getattr(text_config, "final_logit_softcapping", None)
        if softcap != self.rl_loss_config.logit_softcapping:
            raise ValueError(
                f"{name} has final_logit_softcapping={softcap}, but the loss softcaps its logits with "
                f"rl_loss.logit_softcapping={self.rl_loss_config.logit_softcapping}: they must match (the policy and "
                "the reference are scored with the same head)"
            )
        if softcap is not None and _logit_scale(text_config) != 1.0:
            raise ValueError(
                f"{name} both scales ({_logit_scale(text_config)}) and softcaps its logits: the loss layer folds the "
                "scale into the temperature, which is exact only without softcapping"
            )
        if _logit_scale(text_config) <= 0:
            raise ValueError(f"{name} scales its logits by {_logit_scale(text_config)}: not supported")
        if getattr(lm, "base_model", lm) is lm:
            raise ValueError(f"{name} has no separate backbone (base_model): its last hidden states are not reachable")
        head = _active_head(lm.get_output_embeddings())
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{name}'s output embedding is {type(head).__name__}, not a plain nn.Linear LM head")
        if head.bias is not None:
            raise ValueError(f"{name}'s LM head has a bias, which the loss layer does not add")

    def compute_hidden_states(
        self,
        unwrapped: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        output_router_logits: bool = False,
        multimodal: dict[str, Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """`(B, L, H)` last hidden states of the backbone (after its final norm), under the accelerator's autocast;
        with `output_router_logits=True` (an MoE backbone), also its router logits: `(hidden, router_logits)`.

        Called inside the wrapped model's forward (see `_call_through_wrapper`), so DDP/FSDP hooks fire. Under
        sequence parallelism it gets this rank's shard of a packed row: `attention_mask=None` and the global
        `position_ids` of the shard (restarting at 0 at each packed sequence). A VLM's backbone also gets the
        batch's `multimodal` fields (`multimodal_inputs`: images and the fields TRL built), and computes its own
        positions where it derives them from the image grid (M-RoPE, see `backbone_inputs`).
        """
        backbone = self._causal_lm(unwrapped).base_model
        vision_inputs, our_positions = backbone_inputs(backbone, multimodal)  # VLM
        if position_ids is None and attention_mask is not None and our_positions:
            # The positions HF generate gives a left-padded batch (counted from the first real token), so that the
            # trainer's log-probs see the same positions as the rollout's (not offset by the left padding).
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        extra = {} if position_ids is None else {"position_ids": position_ids}
        if output_router_logits:
            extra["output_router_logits"] = True
        extra.update(vision_inputs)  # VLM
        with self.accelerator.autocast():
            outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        if output_router_logits:
            return outputs.last_hidden_state, outputs.router_logits
        return outputs.last_hidden_state

    def get_head_weight(self, unwrapped: nn.Module) -> torch.Tensor:
        """The `(V, H)` LM-head weight, read through a PEFT `modules_to_save` wrapper. Inside the root module's forward
        (`_call_through_wrapper`) FSDP2 has already unsharded it; a DTensor met elsewhere is gathered (`full_tensor()`,
        differentiable)."""
        weight = _active_head(self._causal_lm(unwrapped).get_output_embeddings()).weight
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return weight

    def _head_inputs(
        self, hidden: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype | None]:
        """The LM head's operands and the dtype its GEMMs run in: float32 with `cast_lm_head_to_fp32` (TRL's opt-in);
        the mixed-precision dtype under bf16/fp16 (the chunked kernel casts its operands, and the gradients come back
        in the dtypes of the hidden states and the weight, e.g. float32 master weights); otherwise their common dtype
        (float32 training is unchanged)."""
        if self.args.cast_lm_head_to_fp32:
            return hidden.float(), weight.float(), torch.float32
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.accelerator.mixed_precision))
        if half is not None:
            return hidden, weight, half
        if hidden.dtype != weight.dtype:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
            return hidden.to(dtype), weight.to(dtype), None
        return hidden, weight, None

    def _call_through_wrapper(self, model: nn.Module, fn, *args: Any) -> Any:
        """``fn(unwrapped, *args)``, run inside ``model``'s forward when it is a DDP/FSDP/DeepSpeed wrapper.

        An FSDP2 model is its own unwrapped module (`fully_shard` changes its class in place), yet it too must be
        called through its forward: the root's pre-forward hook initializes FSDP2 and unshards the parameters the
        root owns, the units inside (layers; the embeddings, final norm and LM head, which Accelerate shards as one
        unit, tied or not) are unsharded by their own hooks during the backbone's forward, and the backward ends with
        the root's callback that reduce-scatters every unit's gradients. Without gradients (old and reference
        log-probs, evaluation), the units FSDP2 keeps unsharded after a forward for the coming backward (the root,
        Accelerate's embeddings/norm/head unit) are resharded right away: no backward would do it, and the full
        `(V, H)` head would stay materialized until the next training step's backward.
        """
        unwrapped = self.accelerator.unwrap_model(model)
        if unwrapped is model and not isinstance(model, FSDPModule):
            return fn(unwrapped, *args)
        out = self._forward_redirection(model, unwrapped, fn, unwrapped, *args)
        if isinstance(model, FSDPModule) and not torch.is_grad_enabled():
            for module in model.modules():  # FSDPModule.reshard is per unit, not recursive
                if isinstance(module, FSDPModule):
                    module.reshard()
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Log-probs without gradient (old and reference)

    def _project_logprobs(
        self,
        unwrapped: nn.Module,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        truncation: LogitsProcessorList | None = None,
    ) -> torch.Tensor:
        """`(N,)` log-probs of `labels` from `(N, H)` hidden states through the LM head, chunked, without gradient;
        with `truncation`, `(N, 2)`: the log-probs and the log-mass that the replayed truncation keeps."""
        weight = self.get_head_weight(unwrapped)
        with maybe_gather_lm_head_ctx(weight):
            h, w, matmul_dtype = self._head_inputs(hidden, weight)
            chunk_size = self.rl_loss_config.chunk_size
            if truncation is not None:
                if matmul_dtype is not None:
                    h, w = h.to(matmul_dtype), w.to(matmul_dtype)
                logps, kept = chunked_kept_logmass(
                    h,
                    w,
                    labels,
                    truncation,
                    temperature=self._loss_temperature,
                    chunk_size=chunk_size,
                    softcap=self.rl_loss_config.logit_softcapping,
                )
                return torch.stack([logps, kept], dim=-1)
            logps, _ = chunked_logprobs(
                h,
                w,
                labels,
                temperature=self._loss_temperature,
                chunk_size=chunk_size,
                matmul_dtype=matmul_dtype,
                compile_epilogue=self.rl_loss_config.compile_epilogue,
                softcap=self.rl_loss_config.logit_softcapping,
            )
        return logps

    @torch.no_grad()
    def compute_per_token_logps(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        truncation: LogitsProcessorList | None = None,
        multimodal: dict[str, Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`(B, logits_to_keep)` float32 log-probs of the last `logits_to_keep` tokens, 0 where the mask is 0.

        Rows are processed `batch_size` at a time; only valid tokens are projected, `chunk_size` at a time. Under
        sequence parallelism every rank of the SP group must call it with the same rows (see `_sp_per_token_logps`).
        With `truncation` (logits warpers, see `chunked_kept_logmass`), returns `(log-probs, kept log-masses)`, both
        `(B, logits_to_keep)`, from the same pass. A VLM's `multimodal` fields are cut by rows with them.
        """
        batch_size = batch_size or input_ids.size(0)
        if self.sp_mesh is not None:
            out = self._sp_per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size, truncation)
        else:
            columns = 1 if truncation is None else 2
            out = torch.zeros(input_ids.size(0), logits_to_keep, columns, dtype=torch.float32, device=input_ids.device)

            def forward(unwrapped, ids, mask, vision):
                hidden = self.compute_hidden_states(unwrapped, ids, mask, multimodal=vision)
                hidden = hidden[:, -logits_to_keep - 1 : -1]
                valid = mask[:, -logits_to_keep:].bool()
                labels = ids[:, -logits_to_keep:][valid]
                return self._project_logprobs(unwrapped, hidden[valid], labels, truncation), valid

            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                vision = multimodal_rows(multimodal or {}, rows, input_ids.size(0))  # VLM
                ids, mask = input_ids[rows], attention_mask[rows]
                logps, valid = self._call_through_wrapper(model, forward, ids, mask, vision)
                block = out[rows]
                block[valid] = logps.float().reshape(-1, columns)
        return out[..., 0] if truncation is None else (out[..., 0], out[..., 1])

    @torch.no_grad()
    def _sp_per_token_logps(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size,
        truncation: LogitsProcessorList | None = None,
    ) -> torch.Tensor:
        """`compute_per_token_logps` under SP: `batch_size` rows at a time packed into one row, each rank projecting
        the tokens of its shard; the shards' values are gathered over the group and unpacked to `(B, C, columns)`."""
        ignore = self.rl_loss_config.ignore_idx
        columns = 1 if truncation is None else 2
        out = torch.zeros(input_ids.size(0), logits_to_keep, columns, dtype=torch.float32, device=input_ids.device)

        def forward(unwrapped, packed, labels):
            hidden = self._sp_hidden_states(unwrapped, packed)
            valid = labels != ignore
            return self._project_logprobs(unwrapped, hidden[valid], labels[valid], truncation), valid

        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            ids, mask = input_ids[rows], attention_mask[rows]
            completion_ids = ids[:, -logits_to_keep:]
            packed = pack_rows(
                ids[:, :-logits_to_keep], mask[:, :-logits_to_keep], completion_ids, mask[:, -logits_to_keep:]
            )
            labels = sp_split(packed.pack(completion_ids, ignore), self.sp_mesh, 1, ignore)
            logps, valid = self._call_through_wrapper(model, forward, packed, labels)
            local = torch.zeros(*labels.shape, columns, dtype=torch.float32, device=labels.device)
            local[valid] = logps.float().reshape(-1, columns)
            full = sp_gather(local, self.sp_mesh, dim=1)[:, : packed.length]
            for column in range(columns):
                out[rows, :, column] = packed.unpack(full[..., column], tuple(completion_ids.shape))
        return out

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        # TRL calls this for the old log-probs (no grad): compute them exactly as the loss computes the current ones.
        if self._sp_defer_logps and not torch.is_grad_enabled():
            # Under SP, TRL scores this rank's share of the group's batch; the old log-probs are computed after the
            # group has pooled it (`_generate_and_score_completions`), on the packed sharded path.
            self._sp_deferred_old_logps = True
            return None, None, None
        if torch.is_grad_enabled() or compute_entropy or compute_aux_loss:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size)
        vision = multimodal_inputs(multimodal)  # VLM
        if self._truncation_replay is not None:  # the kept mass of the replayed truncation, from the same pass
            logps, self._stashed_kept_logmass = self.compute_per_token_logps(*args, self._truncation_replay, vision)
            return logps, None, None
        return self.compute_per_token_logps(*args, None, vision), None, None

    @torch.no_grad()
    def compute_ref_per_token_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """Reference log-probs of a generation batch: the ref model, or the policy with its adapter disabled."""
        input_ids, attention_mask = _sequences(batch)
        logits_to_keep = batch["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if self.model.training else None
        args = (input_ids, attention_mask, logits_to_keep, batch_size, None, multimodal_inputs(batch))  # VLM
        if self.ref_model is not None:
            return self.compute_per_token_logps(self.ref_model, *args)
        peft_model = self.accelerator.unwrap_model(self.model)
        with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
            return self.compute_per_token_logps(self.model, *args)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        hf_generate = not self.use_vllm and not self.args.use_transformers_continuous_batching
        if not (hf_generate and self.args.rollout_logprobs):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        mode = self.generation_config.get_generation_mode()
        if mode != GenerationMode.SAMPLE:
            # Beam search (even with sampling), greedy, contrastive, ...: the tokens are not independent draws from
            # one per-token distribution (beams are re-ranked and re-ordered), so there is no log-prob to record.
            logger.warning_once(
                f"generation mode {mode.value!r} is not plain sampling, so its tokens have no sampling log-probs: no "
                "rollout log-probs are recorded (no mismatch metrics, and rl_loss.rollout_is cannot be used)"
            )
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        lm = self._causal_lm(self.accelerator.unwrap_model(self.model))  # the module whose generate() runs
        recorder = SampledTokenLogprobs()
        original = lm._get_logits_processor
        shadowed = vars(lm).get("_get_logits_processor")

        def get_logits_processor(*args, **kwargs) -> LogitsProcessorList:
            return recorder.install(original(*args, **kwargs))

        lm._get_logits_processor = get_logits_processor
        try:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            if shadowed is None:
                del lm._get_logits_processor
            else:
                lm._get_logits_processor = shadowed
        if logprobs is None and recorder.previous is not None:
            steps = len(recorder.logprobs) + 1
            # rows that ran to the last step hold its token; shorter rows (ended by EOS) never use that value
            last = torch.tensor([ids[steps - 1] if len(ids) >= steps else 0 for ids in completion_ids])
            full, kept_logmass = (t.cpu() for t in recorder.finish(last))
            if self.args.rollout_logprobs_support == "sampled":
                full = full - kept_logmass  # log-probs renormalized over the kept support
            logprobs = [full[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
            self._recorded_kept_logmass.append([kept_logmass[i, : len(ids)] for i, ids in enumerate(completion_ids)])
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        self._recorded_kept_logmass = []  # filled by _generate_single_turn (HF generate)
        self._stashed_kept_logmass = None  # filled with the old log-probs when TRL computes them
        old_logps_deferred = False
        if self.sp_mesh is None:
            with _trl_deprecated_aliases_silenced():
                batch = self._add_recorded_kept_logmass(super()._generate_and_score_completions(inputs))
        else:
            self._sp_deferred_old_logps = False
            with _overridden(self, _sp_defer_logps=True), _trl_deprecated_aliases_silenced():
                batch = self._add_recorded_kept_logmass(super()._generate_and_score_completions(inputs))
            batch = self._sp_all_gather_batch(batch)  # every rank of the SP group now holds the group's batch
            old_logps_deferred = self._sp_deferred_old_logps
        has_rollout_logps = batch.get("sampling_per_token_logps") is not None
        replay = self._truncation_replay if has_rollout_logps else None
        stashed, self._stashed_kept_logmass = self._stashed_kept_logmass, None
        if replay is not None and batch.get("old_per_token_logps") is not None and stashed is not None:
            batch["old_kept_logmass"] = stashed
        elif replay is not None or (
            (old_logps_deferred or (has_rollout_logps and not self._old_logps_from_loss))
            and batch.get("old_per_token_logps") is None
        ):
            # Rollout IS and the mismatch metrics compare the rollout's log-probs with the policy's before the update
            # (on the sampled support: with the mass the replayed truncation keeps, from the same pass).
            input_ids, attention_mask = _sequences(batch)
            batch_size = self.args.per_device_train_batch_size if self.model.training else None
            with _activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
                length = batch["completion_ids"].size(1)
                logps = self.compute_per_token_logps(
                    self.model, input_ids, attention_mask, length, batch_size, replay, multimodal_inputs(batch)
                )
            if replay is None:
                batch["old_per_token_logps"] = logps
            else:
                batch["old_per_token_logps"], batch["old_kept_logmass"] = logps
        if self.rl_loss_config.use_kl_loss:
            with _activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
                batch["ref_per_token_logps"] = self.compute_ref_per_token_logps(batch)
        return batch

    @property
    def _old_logps_from_loss(self) -> bool:
        """Whether the mismatch metrics take the old log-probs from the training forward instead of a no-grad pass.

        True when every micro-batch is trained on-policy (`num_iterations == 1` and `steps_per_generation ==
        gradient_accumulation_steps`: the policy is not updated between generation and the loss) and rollout IS is
        metrics-only: the old log-probs are then the detached log-probs of the training forward, and the loss context
        computes the metrics from them (`defer_rollout_is`), which saves one forward of the generation batch per step.
        Not under sequence parallelism (which keeps the no-grad pass).
        """
        return (
            self.sp_mesh is None
            and self.num_iterations == 1
            and self.args.steps_per_generation == self.args.gradient_accumulation_steps
            and not self.rl_loss_config.rollout_is.enabled
            and self._truncation_replay is None  # the sampled support needs π_old's kept mass: a no-grad pass
        )

    def _add_recorded_kept_logmass(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch["rollout_kept_logmass"]` `(B, C)` from the HF-generate recorder, when one generation call produced
        every row (with tool calls a row's tokens come from several calls: the kept mass is then not reported)."""
        recorded, self._recorded_kept_logmass = self._recorded_kept_logmass, []
        rows = batch["completion_ids"]
        if self.tools or len(recorded) != 1 or len(recorded[0]) != rows.size(0):
            return batch
        kept = torch.zeros(rows.shape, dtype=torch.float32)
        for i, values in enumerate(recorded[0]):
            kept[i, : len(values)] = values[: rows.size(1)]
        batch["rollout_kept_logmass"] = kept.to(rows.device)
        return batch

    # ------------------------------------------------------------------------------------------------------------
    # Loss contexts

    def build_loss_data(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The data of one micro-batch given to `rl_loss_config.build` (override to add keys).

        `shifted_labels` are the completion ids with `ignore_idx` where `completion_mask` (× `tool_mask`) is 0, so
        position `t` holds the token predicted from the hidden state of the position before it; `advantages` are
        per sequence; `old_logprobs`, `ref_logprobs`, `rollout_logprobs` and `rollout_is_weights` are added when
        the batch has them.
        """
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        labels = inputs["completion_ids"].masked_fill(mask == 0, self.rl_loss_config.ignore_idx)
        data: dict[str, Any] = {"shifted_labels": labels, "advantages": inputs["advantages"]}
        for key, name in FROM_TRL.items():
            if inputs.get(key) is not None:
                data[name] = inputs[key]
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is not None:
            if ratio.shape[-1] == 1 and self.rl_loss_config.policy_loss_cfg.spec.absorbs_rollout_is:
                # TRL's sequence-level ratio (B, 1) enters VESPO's Σ_t log w once: put it on each sequence's first
                # valid token, 1 elsewhere (the loss sums the log-weights over the sequence)
                valid = labels != self.rl_loss_config.ignore_idx
                first = valid & (valid.long().cumsum(dim=1) == 1)
                data["rollout_is_weights"] = torch.where(first, ratio, torch.ones_like(ratio))
            else:
                data["rollout_is_weights"] = ratio.expand_as(labels)
        return data

    def build_loss_context(self, inputs: dict[str, Any]) -> BaseRLLossContext:
        """The loss context of one micro-batch (before `build_batches`), after rollout IS when rollout log-probs
        exist (weights and rejected tokens per `rl_loss.rollout_is`; in any case the mismatch metrics)."""
        data = self.build_loss_data(inputs)
        if self.sp_mesh is not None:
            data = self._sp_pack_loss_data(data, self._sp_pack_batch(inputs), tuple(inputs["completion_ids"].shape))
        ctx = self.rl_loss_config.build(data, sp_mesh=self.sp_mesh, micro_batch=self._rl_micro_batch)
        if ctx is None:
            raise ValueError("build_loss_data must give shifted_labels and advantages")
        if ctx.loss_kwargs.rollout_logprobs is not None and ctx.loss_kwargs.old_logprobs is not None:
            ctx.compute_rollout_is()
        elif ctx.loss_kwargs.rollout_logprobs is not None and self._old_logps_from_loss:
            ctx.defer_rollout_is()  # on-policy: the mismatch metrics come from the loss's own forward
        return ctx

    def _sp_pack_loss_data(self, data: dict[str, Any], packed: PackedRows, shape: tuple[int, int]) -> dict[str, Any]:
        """The loss data in the packed layout: `(B, C)` tensors packed, `num_tokens` added, per-sequence ones kept."""
        out = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
                value = packed.pack(value, pad_value(key, self.rl_loss_config.ignore_idx))
            elif isinstance(value, torch.Tensor) and value.dim() > 1:
                raise ValueError(
                    f"sequence parallelism: loss data {key!r} has shape {tuple(value.shape)}; expected the "
                    f"completions' shape {shape} or one value per sequence"
                )
            out[key] = value
        out["num_tokens"] = packed.num_tokens
        return out

    def _build_step_contexts(self) -> None:
        """The contexts of the next group of micro-batches of the optimizer step, normalized together.

        A group is the rest of the step, or up to the end of the current generation batch if the step spans two
        (the next one is not generated yet). It is normalized on its own and weighted by its share `k / n` of the
        step's `n` micro-batches (`step_fraction`); a step within one generation is a single group.
        """
        if self._rl_step_remaining == 0:  # the first micro-batch of an optimizer step
            self._rl_step_size = self._rl_step_remaining = self.current_gradient_accumulation_steps
            self._rl_step_metrics = {}
        spg = self.args.steps_per_generation
        generate_every = spg * self.num_iterations
        # TRL's `_prepare_inputs` has already handed out (and `_step` not yet counted) the current micro-batch
        k = min(self._rl_step_remaining, generate_every - self._step % generate_every)
        first = self._rl_step_size - self._rl_step_remaining  # index in the step of the group's first micro-batch
        contexts = []
        for i in range(k):
            with _overridden(self, _rl_micro_batch=first + i):  # named by the errors about this micro-batch's data
                contexts.append(self.build_loss_context(self._buffered_inputs[(self._step + i) % spg]))
        type(contexts[0]).build_batches(
            contexts, grad_averaging_size=self.accelerator.num_processes, step_fraction=k / self._rl_step_size
        )
        self._rl_step_remaining -= k
        self._rl_pending = deque(contexts)

    def _prepare_inputs(self, generation_batch):
        if self.sp_mesh is None:
            inputs = super()._prepare_inputs(generation_batch)
        else:
            with ulysses_sequence_parallel(None):  # generation and scoring: no SP attention (see training_step)
                if self.model.training:
                    inputs = self._sp_buffered_inputs(generation_batch)
                else:
                    inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        if not self._rl_pending:
            self._build_step_contexts()
        inputs = dict(inputs)
        inputs["rl_loss_context"] = self._rl_pending.popleft()
        inputs["rl_loss_last_micro_batch"] = not self._rl_pending and self._rl_step_remaining == 0
        return inputs

    # ------------------------------------------------------------------------------------------------------------
    # Loss

    def _loss_forward(self, unwrapped: nn.Module, inputs: dict[str, Any], ctx: BaseRLLossContext):
        if self.sp_mesh is not None:  # this rank's shard of the packed micro-batch, aligned with ctx's labels
            hidden = self._sp_hidden_states(unwrapped, self._sp_pack_batch(inputs))
        else:
            input_ids, attention_mask = _sequences(inputs)
            length = inputs["completion_ids"].size(1)
            hidden = self.compute_hidden_states(
                unwrapped, input_ids, attention_mask, multimodal=multimodal_inputs(inputs)
            )[:, -length - 1 : -1]
        return self._head_loss(unwrapped, hidden, ctx)

    def _loss_forward_with_router_aux(self, unwrapped: nn.Module, inputs: dict[str, Any], ctx: BaseRLLossContext):
        """`_loss_forward` for an MoE policy whose router load-balancing loss is trained (`aux_loss_enabled`).

        The backbone returns its router logits with the hidden states; the loss is the model's own
        `load_balancing_loss_func` over the micro-batch's prompt and completion tokens, as the model's forward (and so
        TRL) computes it. Returns the loss layer's `(loss, metrics)` and the micro-batch's aux loss.
        """
        input_ids, attention_mask = _sequences(inputs)
        length = inputs["completion_ids"].size(1)
        hidden, router_logits = self.compute_hidden_states(
            unwrapped, input_ids, attention_mask, output_router_logits=True, multimodal=multimodal_inputs(inputs)
        )
        lm = self._causal_lm(unwrapped)
        aux_loss = _load_balancing_loss_func(lm)(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)
        loss, metrics = self._head_loss(unwrapped, hidden[:, -length - 1 : -1], ctx)
        return loss, metrics, aux_loss

    def _head_loss(self, unwrapped: nn.Module, hidden: torch.Tensor, ctx: BaseRLLossContext):
        """The micro-batch's `(loss, metrics)` from hidden states aligned with `ctx`'s labels, through the LM head."""
        weight = self.get_head_weight(unwrapped)
        with maybe_gather_lm_head_ctx(weight):
            hidden, weight, matmul_dtype = self._head_inputs(hidden, weight)
            return ctx(
                hidden_states=hidden, head_weight=weight, temperature=self._loss_temperature, matmul_dtype=matmul_dtype
            )

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        ctx = inputs.get("rl_loss_context")
        if ctx is None:  # evaluation: every batch is its own step
            ctx = self.build_loss_context(inputs)
            type(ctx).build_batches([ctx], grad_averaging_size=self.accelerator.num_processes)
        if self.use_adaptive_entropy:
            # TRL's gating: the coefficient (and whether it applies) from the end of the previous optimizer step
            ctx.entropy_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        if self.aux_loss_enabled:
            loss, metrics, aux_loss = self._call_through_wrapper(
                model, self._loss_forward_with_router_aux, inputs, ctx
            )
            loss, metrics = self._add_router_aux_loss(loss, metrics, aux_loss, mode)
        else:
            loss, metrics = self._call_through_wrapper(model, self._loss_forward, inputs, ctx)
        if mode == "train":
            self._rl_step_metrics = accumulate_metrics(self._rl_step_metrics, metrics)
            if inputs.get("rl_loss_last_micro_batch", True):
                self._log_rl_metrics("train", self._rl_step_metrics)
                self._rl_step_metrics = {}
                self._end_of_step_entropy_control()
        else:
            self._log_rl_metrics("eval", metrics)
        if self.accelerator.distributed_type != "DEEPSPEED":
            loss = loss * self.accelerator.gradient_accumulation_steps  # cancels accelerator.backward's division
        return loss

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        # Trainer averages the per-rank losses gathered with `gather_for_metrics`, which drops the values of the last
        # batch past the dataset's length; with GRPO's repeated prompts those are real completions (other ranks'
        # shares, or the last batch's), so `eval_loss` leaned towards rank 0 and the first batches. Report instead
        # the mean over evaluation batches of each batch's loss over all ranks (normalized like a training step):
        # the `loss/total` values already reduced across ranks by `_log_rl_metrics`.
        losses = self._metrics["eval"].get("loss/total")
        if losses:
            output.metrics[f"{metric_key_prefix}_loss"] = sum(losses) / len(losses)
        return output

    def _end_of_step_entropy_control(self) -> None:
        """TRL's entropy bookkeeping at an optimizer step's end: with `use_adaptive_entropy` (Skywork-OR1), move the
        coefficient by `entropy_coef_delta` towards more bonus when the step's mean entropy over all ranks' tokens is
        at or below `entropy_target`, less otherwise (clamped to `[entropy_coef_min, entropy_coef_max]`); log
        `entropy_coef` whenever the bonus is on. The coefficient and the last entropy are TRL's attributes
        (`entropy_coef`, `_last_world_entropy`), saved in each checkpoint and restored on resume by TRL's own
        `_save_checkpoint` / `_load_optimizer_and_scheduler` (`entropy_ctrl_state.json`)."""
        if self.use_adaptive_entropy:
            # over the tokens the entropy bonus acts on, as TRL: those top_entropy_quantile keeps, else all
            key = (
                "train_policy/entropy_kept"
                if self.rl_loss_config.top_entropy_quantile < 1.0
                else "train_policy/entropy"
            )
            entropies = self._metrics["train"].get(key)
            if not entropies:
                raise RuntimeError("use_adaptive_entropy needs the step's entropy: keep rl_loss.compute_entropy=True")
            world_entropy = entropies[-1]  # reduced over all ranks' tokens by _log_rl_metrics
            args = self.args
            if world_entropy <= args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            self._last_world_entropy = world_entropy
        if self._entropy_bonus_enabled:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

    def _add_router_aux_loss(self, loss, metrics, aux_loss, mode: str):
        """Add `router_aux_loss_coef × aux_loss / gradient_accumulation_steps` to the micro-batch's loss, as TRL.

        TRL adds it per micro-batch on every rank, and DDP averages over ranks: the term is not multiplied by the
        number of ranks (unlike the loss layer's, see `build_batches`). `loss/router_aux` (and `loss/total`) count
        it divided by the ranks, so that their sum over micro-batches and ranks is the step's loss; TRL's `aux_loss`
        metric (the micro-batch's load-balancing loss, averaged over ranks) is logged as TRL does.
        """
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        term = self.router_aux_loss_coef * aux_loss.to(loss.device) / accumulation
        metrics = dict(metrics)
        share = term.detach() / self.accelerator.num_processes
        metrics["loss/router_aux"] = share
        metrics["loss/total"] = metrics["loss/total"] + share
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        return loss + term, metrics

    def _log_rl_metrics(self, mode: str, metrics: dict[str, Any]) -> None:
        """Reduce the metrics of a step across ranks (collective) and append them to TRL's metric lists."""
        for key, value in finalize_train_policy_metrics(metrics, device=self.accelerator.device).items():
            self._metrics[mode][key].append(float(value))

    # ------------------------------------------------------------------------------------------------------------
    # Saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, writing a consolidated model under FSDP whatever `fsdp_state_dict_type` is.

        Under FSDP with `SHARDED_STATE_DICT` (what `accelerate_configs/fsdp2.yaml` ships), transformers' `save_model`
        writes no weights at all (the sharded model is written next to the optimizer state by `_save_checkpoint`, for
        resuming), so a final `save_model()` or `push_to_hub()` would leave a folder `from_pretrained` cannot load.
        Here it runs as with `FULL_STATE_DICT`: every rank joins one gather of the full state dict (offloaded to CPU)
        and the main process writes a normal HF folder (`model.safetensors`, or the adapter under PEFT). Checkpoints
        hold both, and resuming still reads the sharded files.
        """
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if not self.is_fsdp_enabled or plugin is None:
            return super().save_model(output_dir, _internal_call)
        with _overridden(plugin, state_dict_type=StateDictType.FULL_STATE_DICT):
            return super().save_model(output_dir, _internal_call)

    # ------------------------------------------------------------------------------------------------------------
    # Model card

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        base_model: str | None = None,
    ) -> None:
        """TRL's model card, completed for the Hub by `hf_rlloss.hub.complete_model_card`.

        Args:
            model_name (`str`, *optional*, defaults to the name of `output_dir`):
                The card's title.
            dataset_name (`str`, *optional*):
                The training dataset (the card's `datasets` metadata).
            tags (`str` or `list[str]`, *optional*):
                Tags added to `trl`, `grpo` and `hf-rlloss`.
            base_model (`str`, *optional*):
                The model trained from: its `base_model` metadata when it is a Hub id, else named in the text.
                Defaults to TRL's choice (the policy's `config._name_or_path` unless it is a local folder).
        """
        if not self.is_world_process_zero():
            return
        model_name = model_name or os.path.basename(os.path.normpath(self.args.output_dir))
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        local_path = None if self.hub_model_id else os.path.abspath(self.args.output_dir)
        card = complete_model_card(ModelCard.load(path), self.rl_loss_config.to_dict(), base_model, local_path)
        card.save(path)
