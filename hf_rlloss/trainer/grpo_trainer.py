"""`RLLossGRPOTrainer`: TRL's `GRPOTrainer` with its loss replaced by the hf_rlloss loss layer.

Generation, rewards, advantages, logging, checkpoints, PEFT and the model card are TRL's; what changes is how the loss
of an optimizer step is computed. The design (per-step normalization, log-probs, engines, sequence parallelism) is
described in `docs/design.md`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from huggingface_hub import ModelCard
from torch import nn
from torch.distributed.fsdp import StateDictType
from transformers import LogitsProcessorList, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models.utils import _ForwardRedirection
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import (
    create_model_from_path,
    split_tensor_dict,
)

from ..loss.config import BaseRLLossConfig
from ..loss.context import BaseRLLossContext
from ..loss.fields import FROM_TRL
from ..loss.metrics import finalize_step_metrics
from ..parallel.packed_attention import use_packed_attention
from ..parallel.sequence import build_sp_mesh
from ..parallel.ulysses import ulysses_sequence_parallel, use_ulysses_attention
from ..recipe_support.hub import base_model_license, complete_model_card, dataset_example_prompt, quick_start_folder
from .checkpoints import CompleteCheckpoints
from .dynamic_sampling import DynamicSampling
from .engines import (
    activation_checkpointing_disabled,
    prepare_reference,
    reference_source,
)
from .forwards import LossLayerForwards, prompt_and_completion
from .grpo_config import RLLossGRPOConfig
from .lm_head import (
    causal_lm,
    check_model_supported,
    load_balancing_loss_func,
    logit_scale,
    with_model_softcapping,
)
from .multimodal import SP_REFUSAL, multimodal_inputs
from .nonfinite_guard import NonFiniteGradGuard
from .rollout_recording import (
    REPLAYED_SETTINGS,
    SampledTokenLogprobs,
    kept_logmass_batch,
    recording_logprobs,
    truncation_replay,
)
from .sp_batch import SPMicroBatch, pool_over_group, shared_permutation
from .vllm_rollouts import check_vllm_logprobs_mode, prepare_vllm_engine

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


# TRL 1.16 (pinned) calls these deprecated aliases around generation and scoring, and PEFT's `get_peft_model` (called
# by TRL's __init__) reads one; transformers keeps them working until v6. Silenced only inside those calls
# (`_trl_deprecated_aliases_silenced`), so a user's own use still warns.
_TRL_DEPRECATED_ALIASES = r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)`"


@contextlib.contextmanager
def _trl_deprecated_aliases_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRL_DEPRECATED_ALIASES + " is deprecated", category=FutureWarning)
        yield


def _trl_is_ratio_per_token(ratio: torch.Tensor, labels: torch.Tensor, ignore_idx: int, absorbs: bool) -> torch.Tensor:
    """`(B, C)` rollout IS weights from TRL's `importance_sampling_ratio` (`(B, C)` or sequence-level `(B, 1)`).

    A sequence-level ratio enters a loss that absorbs the IS weights (VESPO: `Σ_t log w`) once: it is put on each
    sequence's first valid token, 1 elsewhere; otherwise it is broadcast over the tokens.
    """
    if ratio.shape[-1] == 1 and absorbs:
        valid = labels != ignore_idx
        first = valid & (valid.long().cumsum(dim=1) == 1)
        return torch.where(first, ratio, torch.ones_like(ratio))
    return ratio.expand_as(labels)


def _adapted_entropy_coef(coef: float, entropy: float, args: RLLossGRPOConfig) -> float:
    """TRL's adaptive entropy control (Skywork-OR1): move the coefficient by `entropy_coef_delta` towards more bonus
    when the step's entropy is at or below `entropy_target`, less otherwise, within `[entropy_coef_min, _max]`."""
    if entropy <= args.entropy_target:
        return min(coef + args.entropy_coef_delta, args.entropy_coef_max)
    return max(coef - args.entropy_coef_delta, args.entropy_coef_min)


class RLLossGRPOTrainer(CompleteCheckpoints, NonFiniteGradGuard, LossLayerForwards, DynamicSampling, GRPOTrainer):
    r"""
    Trainer for GRPO whose loss is computed by the hf_rlloss loss layer: TRL's [`~trl.GRPOTrainer`] with generation,
    rewards, advantages, PEFT, logging and checkpoints unchanged, and each optimizer update the gradient of the loss
    configured by `args.rl_loss` (policy loss, KL, rollout importance sampling, aggregation), normalized over all the
    micro-batches and ranks of the step. Sequence parallelism (`args.sp_size`), DDP, FSDP2 and DeepSpeed ZeRO are
    supported; how, and how the normalization differs from TRL's, is in `docs/design.md`.

    Example:

    ```python
    >>> from datasets import Dataset
    >>> from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer

    >>> dataset = Dataset.from_dict({"prompt": ["What is 2 + 3?", "What is 7 + 5?"] * 8})

    >>> def reward_short(completions, **kwargs):
    ...     return [-float(len(completion)) for completion in completions]

    >>> args = RLLossGRPOConfig(
    ...     output_dir="grpo-out",
    ...     rl_loss={
    ...         "policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
    ...         "loss_agg_mode": "token-mean",
    ...         "use_kl_loss": True,
    ...         "kl_loss_coef": 0.001,
    ...     },
    ... )
    >>> trainer = RLLossGRPOTrainer(
    ...     model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_short, args=args, train_dataset=dataset
    ... )
    >>> trainer.train()
    ```

    Args:
        model (`str`, [`~transformers.PreTrainedModel`] or [`~peft.PeftModel`]):
            The policy: a model id or path (loaded with `args.model_init_kwargs`), or a causal language model whose
            backbone (`base_model`) and plain `nn.Linear` LM head the loss layer reads. Vision-language models, an
            LM head with a bias and softcapping together with a logit scale are rejected.
        reward_funcs (`RewardFunc` or `list[RewardFunc]`, *optional*):
            As in TRL: reward functions, reward model ids or models, summed with `args.reward_weights`.
        args ([`RLLossGRPOConfig`], *optional*):
            The configuration; its `rl_loss` configures the loss (without it, TRL's loss options are mapped onto
            it). Defaults to `RLLossGRPOConfig` named after the model.
        train_dataset ([`~datasets.Dataset`] or [`~datasets.IterableDataset`], *optional*):
            Prompts (a `"prompt"` column), as in TRL.
        eval_dataset ([`~datasets.Dataset`] or `dict[str, Dataset]`, *optional*):
            Evaluation prompts; `eval_loss` is the loss of each evaluation batch over all ranks, averaged.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`], *optional*):
            The tokenizer (left padding), as in TRL.
        reward_processing_classes (`PreTrainedTokenizerBase` or `list[PreTrainedTokenizerBase]`, *optional*):
            Tokenizers of reward models, as in TRL.
        callbacks (`list[TrainerCallback]`, *optional*):
            Extra callbacks, as in TRL.
        optimizers (`tuple[Optimizer, LambdaLR]`, *optional*, defaults to `(None, None)`):
            Optimizer and scheduler, as in TRL.
        quantization_config, peft_config, tools, rollout_func, environment_factory (*optional*):
            As in TRL. With a `peft_config` the reference is the base model (the adapter disabled).
        ref_model (`str` or [`~transformers.PreTrainedModel`], *optional*):
            The reference model of `rl_loss.use_kl_loss` (a model or a path). Defaults to the policy with its adapter
            disabled under PEFT, else the model loaded from the policy's path, else a copy of the in-memory policy
            taken before training (sharded under ZeRO-3). An error when `use_kl_loss` is false.

    Subclassing: override `build_loss_data` to add keys to the data given to `rl_loss_config.build` (or
    `build_loss_context` to modify the context), set `RLLossGRPOConfig.loss_config_class` to use another loss
    configuration class, and `compute_hidden_states` / `get_head_weight` for models with an unusual layout.
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
        self.rl_loss_config: BaseRLLossConfig = args.rl_loss_config
        reference = reference_source(model, ref_model, peft_config, self.rl_loss_config.use_kl_loss)
        prepare_vllm_engine(args)  # before TRL builds a colocated engine (see vllm_rollouts.py)

        # TRL override: TRL must neither build a reference model (it would reload it from `config._name_or_path`,
        # which fails for in-memory models) nor compute reference log-probs: the KL is the loss layer's.
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

        if self._is_vlm and args.sp_size > 1:  # VLM: see hf_rlloss/trainer/multimodal.py
            raise ValueError(SP_REFUSAL)
        self._setup_loss_layer(args, reference)
        check_vllm_logprobs_mode(self, self.rl_loss_config.rollout_is.enabled)

    # ------------------------------------------------------------------------------------------------------------
    # Setup

    def _setup_loss_layer(self, args: RLLossGRPOConfig, reference: Any) -> None:
        """Check the policy, read its head's settings, and build the state of the loss, SP and the reference."""
        if self.aux_loss_enabled and args.sp_size > 1:
            raise ValueError(
                f"sp_size={args.sp_size}: the MoE router load-balancing loss is a product of means over all tokens "
                "of a micro-batch, which one SP shard does not see; set router_aux_loss_coef=0.0 to train without it"
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.rl_loss_config = with_model_softcapping(self.rl_loss_config, self._causal_lm(unwrapped))
        check_model_supported(unwrapped, self.rl_loss_config.logit_softcapping)
        if self.aux_loss_enabled:
            load_balancing_loss_func(self._causal_lm(unwrapped))  # fails now, not at the first step
        self._loss_temperature = self.temperature / logit_scale(unwrapped.config.get_text_config())

        self._forward_redirection = _ForwardRedirection()
        self._rl_pending: deque[BaseRLLossContext] = deque()
        self._rl_step_remaining = 0  # micro-batches of the current optimizer step without a context yet
        self._rl_step_size = 0
        self._rl_step_metrics: list[dict[str, Any]] = []  # the metrics of each micro-batch of the step so far
        self._rl_micro_batch: int | None = None  # index in the optimizer step of the context being built
        self._recorded_kept_logmass: list[list[torch.Tensor]] = []
        self._stashed_kept_logmass: torch.Tensor | None = None
        self._truncation_replay = self._build_truncation_replay()
        self.sp_mesh = None
        # Under SP, TRL's old log-probs wait until the group has pooled its batch: "compute" (when TRL asks),
        # "defer" (TRL is scoring this rank's share: skip them), "deferred" (skipped: compute them after pooling).
        self._sp_old_logps = "compute"
        if args.sp_size > 1:
            self._setup_sequence_parallel(unwrapped)
        self._setup_packing(args, unwrapped)
        self.ref_model = self._build_reference(reference)
        self._setup_dynamic_sampling()
        if args.sync_ref_model:
            if not self.rl_loss_config.use_kl_loss:
                raise ValueError("sync_ref_model=True needs a reference: set rl_loss.use_kl_loss=true")
            if self.ref_model is None:
                raise NotImplementedError("sync_ref_model=True is not supported with PEFT (the reference is the base)")
            self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))

    def _build_reference(self, source: Any) -> nn.Module | None:
        """The reference model from `engines.reference_source`'s answer (`None` when it is the policy's adapter)."""
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
        check_model_supported(source, self.rl_loss_config.logit_softcapping)
        if self.sp_mesh is not None:
            use_ulysses_attention(causal_lm(source), self.args.sp_size, "the reference model")
        if self._packing != "off":
            use_packed_attention(causal_lm(source))
        return prepare_reference(source, self)

    def _build_truncation_replay(self) -> LogitsProcessorList | None:
        """The truncation the trainer replays on π_old (see `rollout_recording.truncation_replay`)."""
        args = self.args
        hf_generate = not self.use_vllm and self.rollout_func is None and not args.use_transformers_continuous_batching
        external = None
        if self.use_vllm or self.rollout_func is not None:
            # TRL passes top_k/top_p/min_p to vLLM; generation_kwargs may override them
            overrides = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
            external = {name: overrides.get(name, getattr(self, name)) for name in REPLAYED_SETTINGS}
        return truncation_replay(
            hf_generate and args.record_rollout_logprobs,
            external,
            getattr(self, "generation_config", None),  # TRL builds none with vLLM
            args.rollout_logprobs_support,
            self.rl_loss_config.rollout_is.enabled,
        )

    def _setup_packing(self, args: RLLossGRPOConfig, unwrapped: nn.Module) -> None:
        """`self._packing`, the layout of the training forwards (`args.packing` unless it cannot be exact for this
        model, logged), and the policy on the `"tree_or_<its attention>"` attention when a layout is packed."""
        mode, reason = args.packing, None
        config = unwrapped.config.get_text_config()
        if mode == "off" or self.sp_mesh is not None:
            mode = "off"  # under SP every micro-batch is packed, as args.packing says, by _sp_layout (SPMicroBatch)
        elif self._is_vlm:
            mode, reason = "off", "a vision-language model's forward places image features by sequence"
        elif getattr(config, "attention_dropout", 0.0):  # a float the attention reads (TRL's disable_dropout keeps it)
            mode, reason = "off", f"attention_dropout={config.attention_dropout} (the tree attention has none)"
        elif self.aux_loss_enabled and mode == "shared_prefix":
            # A shared prompt would count once in the router's token means instead of G times (docs/packing.md)
            mode, reason = "padding_free", "the MoE router loss counts every row's prompt tokens, as TRL's"
        if reason is not None:
            logger.warning(f"packing={args.packing!r} -> {mode!r}: {reason}")
        self._packing = mode
        if mode != "off":
            use_packed_attention(self._causal_lm(unwrapped))

    def _setup_sequence_parallel(self, unwrapped: nn.Module) -> None:
        """The policy on the Ulysses attention and `self.sp_mesh` (processes % sp_size: `RLLossGRPOConfig`'s check)."""
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and (
            getattr(parallelism, "sp_enabled", False) or getattr(parallelism, "cp_enabled", False)
        ):
            raise ValueError(
                "sp_size > 1 is RLLossGRPOTrainer's own Ulysses sequence parallelism: do not also enable Accelerate's "
                "ParallelismConfig sp_size/cp_size (DeepSpeed ALST / context parallelism)"
            )
        use_ulysses_attention(causal_lm(unwrapped), self.args.sp_size, "the policy")
        self.sp_mesh = build_sp_mesh(self.args.sp_size, device_type=self.accelerator.device.type)

    # ------------------------------------------------------------------------------------------------------------
    # TRL override points. Each overrides the `GRPOTrainer` (or `Trainer`) method of the same name.

    def get_train_dataloader(self):
        # TRL override: under SP each rank loads its 1/sp_size share of its SP group's generation batch.
        get_dataloader, shadowed = self._get_dataloader, vars(self).get("_get_dataloader")

        def share(**kwargs):
            return get_dataloader(**{**kwargs, "batch_size": kwargs["batch_size"] // self.args.sp_size})

        self._get_dataloader = share
        try:
            return super().get_train_dataloader()
        finally:
            if shadowed is None:
                del self._get_dataloader
            else:
                self._get_dataloader = shadowed

    def get_total_train_batch_size(self, args) -> int:
        # TRL override: sequences per optimizer step (logged, throughput); an SP group is one data-parallel replica.
        return super().get_total_train_batch_size(args) // getattr(args, "sp_size", 1)

    def _prepare_inputs(self, generation_batch):
        # TRL override: TRL's look-ahead buffer `_buffered_inputs` holds the generation batch's micro-batches; at an
        # optimizer step's first micro-batch the contexts of the step's micro-batches are built from it together
        # (`_build_step_contexts`), and each reaches `_compute_loss` through `inputs["rl_loss_context"]`.
        dynamic = self.args.dynamic_sampling and self.model.training  # see dynamic_sampling.py
        if self.sp_mesh is None:
            inputs = (
                self._dynamic_sampling_inputs(generation_batch)
                if dynamic
                else super()._prepare_inputs(generation_batch)
            )
        else:
            with ulysses_sequence_parallel(None):  # generation and scoring: no SP attention (see training_step)
                if dynamic:
                    inputs = self._dynamic_sampling_inputs(generation_batch)
                elif self.model.training:
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

    def training_step(self, model, inputs, num_items_in_batch=None):
        # TRL override: under SP the backward, and the recomputation of gradient checkpointing in it, must run the
        # Ulysses attention too; generation and scoring (in `_prepare_inputs`) leave the SP context.
        if self.sp_mesh is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with ulysses_sequence_parallel(self.sp_mesh):
            return super().training_step(model, inputs, num_items_in_batch)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # TRL override: with HF generate, the generating model's `_get_logits_processor` is wrapped for the call so
        # that the sampled tokens' log-probs are recorded (`rollout_recording.recording_logprobs`).
        generate = super()._generate_single_turn
        inputs = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        hf_generate = not self.use_vllm and not self.args.use_transformers_continuous_batching
        if not (hf_generate and self.args.record_rollout_logprobs):
            return generate(*inputs)
        mode = self.generation_config.get_generation_mode()
        if mode != GenerationMode.SAMPLE:
            # Beam search (even with sampling), greedy, contrastive, ...: the tokens are not independent draws from
            # one per-token distribution (beams are re-ranked and re-ordered), so there is no log-prob to record.
            # Said in training only: an evaluation may decode greedily (the recipes' held-out accuracy).
            if self.model.training:
                logger.warning_once(
                    f"generation mode {mode.value!r} is not plain sampling, so its tokens have no sampling log-probs: "
                    "no rollout log-probs are recorded (no mismatch metrics, and rl_loss.rollout_is cannot be used)"
                )
            return generate(*inputs)
        recorder = SampledTokenLogprobs()
        with recording_logprobs(self._causal_lm(self.accelerator.unwrap_model(self.model)), recorder):
            completion_ids, logprobs = generate(*inputs)
        if logprobs is None:
            recorded = recorder.per_completion(completion_ids, self.args.rollout_logprobs_support)
            if recorded is not None:
                logprobs, kept_logmass = recorded
                self._recorded_kept_logmass.append(kept_logmass)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        # TRL override: adds the recorded kept mass; under SP pools the group's batch (TRL's old log-probs wait for
        # it); computes the old log-probs rollout IS needs and the reference log-probs of the loss layer's KL.
        self._recorded_kept_logmass = []  # filled by _generate_single_turn (HF generate)
        self._stashed_kept_logmass = None  # filled with the old log-probs when TRL computes them
        self._sp_old_logps = "compute" if self.sp_mesh is None else "defer"
        try:
            with _trl_deprecated_aliases_silenced():
                batch = self._add_recorded_kept_logmass(super()._generate_and_score_completions(inputs))
            old_logps_deferred = self._sp_old_logps == "deferred"
        finally:
            self._sp_old_logps = "compute"
        if self.sp_mesh is not None:  # every rank of the SP group now holds the group's batch
            batch = pool_over_group(batch, self.sp_mesh, self._tokenizer.pad_token_id)
        self._add_old_logps(batch, old_logps_deferred)
        if self.rl_loss_config.use_kl_loss:
            with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
                batch["ref_per_token_logps"] = self.compute_ref_per_token_logps(batch)
        return batch

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
        # TRL override: TRL calls it for the old log-probs (no grad): they are computed as the loss computes the
        # current ones (chunked, from hidden states); under SP they wait for the pooled batch.
        if self._sp_old_logps != "compute" and not torch.is_grad_enabled():
            self._sp_old_logps = "deferred"
            return None, None, None
        if torch.is_grad_enabled() or compute_entropy or compute_aux_loss:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size)
        vision = multimodal_inputs(multimodal)  # VLM
        if self._truncation_replay is not None:  # the kept mass of the replayed truncation, from the same pass
            logps, self._stashed_kept_logmass = self.compute_per_token_logps(*args, self._truncation_replay, vision)
            return logps, None, None
        return self.compute_per_token_logps(*args, None, vision), None, None

    def _compute_loss(self, model, inputs):
        # TRL override: the loss of the micro-batch's context (built in `_prepare_inputs`, or here in evaluation).
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
            self._rl_step_metrics.append(metrics)
            if inputs.get("rl_loss_last_micro_batch", True):
                self._log_rl_metrics("train", self._rl_step_metrics)
                self._rl_step_metrics = []
                self._end_of_step_entropy_control()
        else:
            self._log_rl_metrics("eval", [metrics])
        if self.accelerator.distributed_type != "DEEPSPEED":
            loss = loss * self.accelerator.gradient_accumulation_steps  # cancels accelerator.backward's division
        return loss

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        # Trainer override: Trainer averages the per-rank losses of `gather_for_metrics`, which drops the last
        # batch's values past the dataset's length (with GRPO's repeated prompts, real completions), so `eval_loss`
        # leaned towards rank 0. It is instead the mean over batches of each batch's loss over all ranks.
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        losses = self._metrics["eval"].get("loss/total")
        if losses:
            output.metrics[f"{metric_key_prefix}_loss"] = sum(losses) / len(losses)
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, writing a consolidated model under FSDP whatever `fsdp_state_dict_type` is.

        Trainer override: under FSDP with `SHARDED_STATE_DICT` (`accelerate_configs/fsdp2.yaml`), transformers'
        `save_model` writes no weights (the sharded model goes next to the optimizer state, for resuming), so a final
        `save_model()` or `push_to_hub()` would leave a folder `from_pretrained` cannot load. Here every rank joins
        one gather of the full state dict and the main process writes a normal HF folder.
        """
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if not self.is_fsdp_enabled or plugin is None:
            return super().save_model(output_dir, _internal_call)
        with _overridden(plugin, state_dict_type=StateDictType.FULL_STATE_DICT):
            return super().save_model(output_dir, _internal_call)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        base_model: str | None = None,
        example_prompt: str | None = None,
    ) -> None:
        """TRL override: TRL's model card, completed for the Hub by `hf_rlloss.recipe_support.hub.complete_model_card`.

        Its quick start loads the Hub repository when there is one (`hub_model_id`, `push_to_hub`), else the output
        folder relative to the working directory, and asks one of the training prompts; its front matter has the base
        model's license when its card can be read offline.

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
            example_prompt (`str`, *optional*, defaults to the first training prompt):
                The quick start's question.
        """
        if not self.is_world_process_zero():
            return
        model_name = model_name or os.path.basename(os.path.normpath(self.args.output_dir))
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        local_path = None if self.hub_model_id else quick_start_folder(self.args.output_dir)
        source = getattr(self.model.config, "_name_or_path", None)
        card = complete_model_card(
            ModelCard.load(path),
            self.rl_loss_config.to_dict(),
            base_model,
            local_path,
            example_prompt or dataset_example_prompt(self.train_dataset),
            base_model_license(source) or base_model_license(base_model),
        )
        card.save(path)

    # ------------------------------------------------------------------------------------------------------------
    # Extension points: the loss data and context of a micro-batch (hidden states, the LM head and the log-probs
    # are `LossLayerForwards`')

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
        ignore = self.rl_loss_config.ignore_idx
        labels = inputs["completion_ids"].masked_fill(mask == 0, ignore)
        data: dict[str, Any] = {"shifted_labels": labels, "advantages": inputs["advantages"]}
        for key, name in FROM_TRL.items():
            if inputs.get(key) is not None:
                data[name] = inputs[key]
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is not None:
            absorbs = self.rl_loss_config.policy_loss_cfg.spec.absorbs_rollout_is
            data["rollout_is_weights"] = _trl_is_ratio_per_token(ratio, labels, ignore, absorbs)
        return data

    def build_loss_context(self, inputs: dict[str, Any]) -> BaseRLLossContext:
        """The loss context of one micro-batch (before `build_batches`), after rollout IS when rollout log-probs
        exist (weights and rejected tokens per `rl_loss.rollout_is`; in any case the mismatch metrics).

        Under SP the micro-batch is packed once (`SPMicroBatch`): its loss data go to `build`, and it is kept in
        `inputs["sp_micro_batch"]` for the loss forward, whose input shard lines up with the context's labels.
        """
        data = self.build_loss_data(inputs)
        if self.sp_mesh is not None:
            shape = tuple(inputs["completion_ids"].shape)
            micro_batch = self._sp_pack_batch(inputs).with_loss_data(data, shape, self.rl_loss_config.ignore_idx)
            inputs["sp_micro_batch"], data = micro_batch, micro_batch.loss_data
        ctx = self.rl_loss_config.build(data, sp_mesh=self.sp_mesh, micro_batch=self._rl_micro_batch)
        if ctx is None:
            raise ValueError("build_loss_data must give shifted_labels and advantages")
        if ctx.loss_kwargs.rollout_logprobs is not None and ctx.loss_kwargs.old_logprobs is not None:
            ctx.compute_rollout_is()
        elif ctx.loss_kwargs.rollout_logprobs is not None and self._old_logps_from_loss:
            ctx.defer_rollout_is()  # on-policy: the mismatch metrics come from the loss's own forward
        return ctx

    # ------------------------------------------------------------------------------------------------------------
    # Optimizer steps: the contexts of a step's micro-batches, built and normalized together

    def _build_step_contexts(self) -> None:
        """The contexts of the next group of micro-batches of the optimizer step, normalized together: the rest of
        the step, or up to the end of the current generation batch if the step spans two, weighted by its share
        `k / n` of the step's micro-batches (`step_fraction`; see docs/design.md)."""
        if self._rl_step_remaining == 0:  # the first micro-batch of an optimizer step
            self._rl_step_size = self._rl_step_remaining = self.current_gradient_accumulation_steps
            self._rl_step_metrics = []
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

    def _end_of_step_entropy_control(self) -> None:
        """TRL's entropy bookkeeping at an optimizer step's end (`_adapted_entropy_coef` from the step's entropy
        over all ranks' tokens); TRL's own checkpointing saves and restores `entropy_coef`, `_last_world_entropy`."""
        if self.use_adaptive_entropy:
            # over the tokens the entropy bonus acts on, as TRL: those top_entropy_quantile keeps, else all
            quantile = self.rl_loss_config.top_entropy_quantile < 1.0
            entropies = self._metrics["train"].get("train_policy/entropy_kept" if quantile else "train_policy/entropy")
            if not entropies:
                raise RuntimeError("use_adaptive_entropy needs the step's entropy: keep rl_loss.compute_entropy=True")
            self._last_world_entropy = entropies[-1]  # reduced over all ranks' tokens by _log_rl_metrics
            self.entropy_coef = _adapted_entropy_coef(self.entropy_coef, self._last_world_entropy, self.args)
        if self._entropy_bonus_enabled:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

    def _log_rl_metrics(self, mode: str, micro_batches: list[dict[str, Any]]) -> None:
        """Reduce the metrics of a step's micro-batches across ranks (collective) and append them to TRL's metric
        lists: ours once per step, TRL's keys (`kl`, `entropy`, `clip_ratio/*`, `policy_loss`, ...) once per
        micro-batch, as TRL appends them (its `log` averages each list over the logging window)."""
        step, trl_per_micro_batch = finalize_step_metrics(micro_batches, device=self.accelerator.device)
        for key, value in step.items():
            self._metrics[mode][key].append(float(value))
        for trl_metrics in trl_per_micro_batch:
            for key, value in trl_metrics.items():
                self._metrics[mode][key].append(float(value))

    # ------------------------------------------------------------------------------------------------------------
    # Old log-probs and the recorded rollout

    @property
    def _old_logps_from_loss(self) -> bool:
        """Whether the mismatch metrics take the old log-probs from the training forward (detached) instead of a
        no-grad pass: every micro-batch on-policy, rollout IS metrics-only, no replayed truncation, no SP."""
        return (
            self.sp_mesh is None
            and self.num_iterations == 1
            and self.args.steps_per_generation == self.args.gradient_accumulation_steps
            and not self.rl_loss_config.rollout_is.enabled
            and self._truncation_replay is None  # the sampled support needs π_old's kept mass: a no-grad pass
        )

    def _add_old_logps(self, batch: dict[str, Any], deferred: bool) -> None:
        """Old log-probs (and under replayed truncation their kept mass) where rollout IS or SP needs them and TRL did
        not compute them: rollout IS and the mismatch metrics compare the rollout's log-probs with the policy's."""
        has_rollout_logps = batch.get("sampling_per_token_logps") is not None
        replay = self._truncation_replay if has_rollout_logps else None
        stashed, self._stashed_kept_logmass = self._stashed_kept_logmass, None
        if replay is not None and batch.get("old_per_token_logps") is not None and stashed is not None:
            batch["old_kept_logmass"] = stashed
            return
        needed = deferred or (has_rollout_logps and not self._old_logps_from_loss)
        if replay is None and not (needed and batch.get("old_per_token_logps") is None):
            return
        input_ids, attention_mask = prompt_and_completion(batch)
        batch_size = self.args.per_device_train_batch_size if self.model.training else None
        length = batch["completion_ids"].size(1)
        with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
            logps = self.compute_per_token_logps(
                self.model, input_ids, attention_mask, length, batch_size, replay, multimodal_inputs(batch)
            )
        if replay is None:
            batch["old_per_token_logps"] = logps
        else:
            batch["old_per_token_logps"], batch["old_kept_logmass"] = logps

    def _add_recorded_kept_logmass(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch["rollout_kept_logmass"]` `(B, C)` from the HF-generate recorder, when one generation call produced
        every row (with tool calls a row's tokens come from several calls: the kept mass is then not reported)."""
        recorded, self._recorded_kept_logmass = self._recorded_kept_logmass, []
        kept = None if self.tools else kept_logmass_batch(recorded, batch["completion_ids"])
        if kept is not None:
            batch["rollout_kept_logmass"] = kept
        return batch

    # ------------------------------------------------------------------------------------------------------------
    # Sequence parallelism: the group's batch and its packed micro-batches (see sp_batch.py)

    def _sp_buffered_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's `_prepare_inputs` (training) for an SP group: generate, pool, shuffle alike on the group, split."""
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)  # the SP group's pooled batch
            permutation = shared_permutation(batch["prompt_ids"].shape[0], self.sp_mesh, batch["prompt_ids"].device)
            batch = {k: v[permutation] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
            self._buffered_inputs = split_tensor_dict(batch, spg)
        return self._buffered_inputs[self._step % spg]

    def _sp_pack_batch(self, inputs: dict[str, Any]) -> SPMicroBatch:
        """This rank's view of a micro-batch packed into one row (see `SPMicroBatch`)."""
        return SPMicroBatch.from_layout(self._sp_layout(inputs), self.sp_mesh, self._tokenizer.pad_token_id)
