"""`RLLossGRPOTrainer`: TRL's `GRPOTrainer` with its loss replaced by the hf_rlloss loss layer.

Generation, rewards, advantages, logging, checkpoints, PEFT and the model card are TRL's; what changes is how the loss
of an optimizer step is computed (see the class docstring).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from datasets import IterableDataset
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
    maybe_gather_lm_head_ctx,
    repeat_iterable_dataset,
    split_tensor_dict,
    use_adapter,
)

from .config import BaseRLLossConfig
from .context import BaseRLLossContext
from .engines import (
    activation_checkpointing_disabled,
    call_through_wrapper,
    head_operands,
    prepare_reference,
    reference_source,
)
from .fields import FROM_TRL
from .hub import complete_model_card
from .lm_head import (
    active_head,
    causal_lm,
    check_model_supported,
    head_logprobs,
    load_balancing_loss_func,
    logit_scale,
    with_model_softcapping,
)
from .metrics import accumulate_metrics, finalize_train_policy_metrics
from .rollout_recording import (
    REPLAYED_SETTINGS,
    SampledTokenLogprobs,
    kept_logmass_batch,
    recording_logprobs,
    truncation_replay,
)
from .sequence_parallel import (
    build_sp_mesh,
    ulysses_sequence_parallel,
    use_ulysses_attention,
)
from .sp_batch import SPMicroBatch, pool_over_group, shared_permutation
from .trainer_config import RLLossGRPOConfig

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


def _sequences(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, P + C)` input ids and attention mask of a batch's left-padded prompts followed by its completions."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask


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

    **Not supported** (rejected at construction): vision-language models, an LM head with a bias or a LoRA adapter
    on the head itself, softcapping together with a logit scale. A logit scale (`logit_scale`, `logits_scaling`, …)
    is folded into the temperature.
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
        self._ref_source = reference_source(model, ref_model, peft_config, loss_cfg.use_kl_loss)

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

        if self._is_vlm:
            raise ValueError("RLLossGRPOTrainer does not support vision-language models yet")
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
        text_config = unwrapped.config.get_text_config()
        self._loss_temperature = self.temperature / logit_scale(text_config)

        self._forward_redirection = _ForwardRedirection()
        self._rl_pending: deque[BaseRLLossContext] = deque()
        self._rl_step_remaining = 0  # micro-batches of the current optimizer step without a context yet
        self._rl_step_size = 0
        self._rl_step_metrics: dict[str, Any] = {}
        self.sp_mesh = None
        # Under SP, TRL's old log-probs wait until the group has pooled its batch: "compute" (when TRL asks),
        # "defer" (TRL is scoring this rank's share: skip them), "deferred" (skipped: compute them after pooling).
        self._sp_old_logps = "compute"
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
        check_model_supported(source, self.rl_loss_config.logit_softcapping)
        if self.sp_mesh is not None:
            use_ulysses_attention(causal_lm(source), self.args.sp_size, "the reference model")
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
            hf_generate and args.rollout_logprobs,
            external,
            self.generation_config,
            args.rollout_logprobs_support,
            self.rl_loss_config.rollout_is.enabled,
        )

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
        use_ulysses_attention(causal_lm(unwrapped), sp, "the policy")  # processes % sp_size: RLLossGRPOConfig's check
        self.sp_mesh = build_sp_mesh(sp, device_type=self.accelerator.device.type)

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
        return SPMicroBatch.from_batch(inputs, self.sp_mesh, self._tokenizer.pad_token_id)

    def _sp_hidden_states(self, unwrapped: nn.Module, micro_batch: SPMicroBatch) -> torch.Tensor:
        """`(1, L_local, H)`: this rank's shard of the backbone's last hidden states of a packed row (collective)."""
        with ulysses_sequence_parallel(self.sp_mesh):
            return self.compute_hidden_states(
                unwrapped, micro_batch.input_ids, None, position_ids=micro_batch.position_ids
            )

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.sp_mesh is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # The backward, and the recomputation of gradient checkpointing in it, must run the Ulysses attention too;
        # generation and scoring (in `_prepare_inputs`) leave the SP context.
        with ulysses_sequence_parallel(self.sp_mesh):
            return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------------------------------------------------
    # Hidden states and the LM head

    _causal_lm = staticmethod(causal_lm)

    def compute_hidden_states(
        self,
        unwrapped: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        output_router_logits: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """`(B, L, H)` last hidden states of the backbone (after its final norm), under the accelerator's autocast;
        with `output_router_logits=True` (an MoE backbone), also its router logits: `(hidden, router_logits)`.

        Called inside the wrapped model's forward (see `_call_through_wrapper`), so DDP/FSDP hooks fire. Under
        sequence parallelism it gets this rank's shard of a packed row: `attention_mask=None` and the global
        `position_ids` of the shard (restarting at 0 at each packed sequence).
        """
        backbone = self._causal_lm(unwrapped).base_model
        if position_ids is None and attention_mask is not None:
            # The positions HF generate gives a left-padded batch (counted from the first real token), so that the
            # trainer's log-probs see the same positions as the rollout's (not offset by the left padding).
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        extra = {} if position_ids is None else {"position_ids": position_ids}
        if output_router_logits:
            extra["output_router_logits"] = True
        with self.accelerator.autocast():
            outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        if output_router_logits:
            return outputs.last_hidden_state, outputs.router_logits
        return outputs.last_hidden_state

    def get_head_weight(self, unwrapped: nn.Module) -> torch.Tensor:
        """The `(V, H)` LM-head weight, read through a PEFT `modules_to_save` wrapper. Inside the root module's forward
        (`_call_through_wrapper`) FSDP2 has already unsharded it; a DTensor met elsewhere is gathered (`full_tensor()`,
        differentiable)."""
        weight = active_head(self._causal_lm(unwrapped).get_output_embeddings()).weight
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return weight

    def _head_inputs(self, hidden: torch.Tensor, weight: torch.Tensor):
        """The LM head's operands and the dtype its GEMMs run in (see `engines.head_operands`)."""
        return head_operands(hidden, weight, self.args.cast_lm_head_to_fp32, self.accelerator.mixed_precision)

    def _call_through_wrapper(self, model: nn.Module, fn, *args: Any) -> Any:
        """``fn(unwrapped, *args)`` inside ``model``'s forward (see `engines.call_through_wrapper`)."""
        return call_through_wrapper(self.accelerator, self._forward_redirection, model, fn, *args)

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
            return head_logprobs(h, w, labels, self.rl_loss_config, self._loss_temperature, matmul_dtype, truncation)

    @torch.no_grad()
    def compute_per_token_logps(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        truncation: LogitsProcessorList | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`(B, logits_to_keep)` float32 log-probs of the last `logits_to_keep` tokens, 0 where the mask is 0.

        Rows are processed `batch_size` at a time; only valid tokens are projected, `chunk_size` at a time. Under
        sequence parallelism every rank of the SP group must call it with the same rows (see `_block_logps`).
        With `truncation` (logits warpers, see `chunked_kept_logmass`), returns `(log-probs, kept log-masses)`, both
        `(B, logits_to_keep)`, from the same pass.
        """
        batch_size = batch_size or input_ids.size(0)
        columns = 1 if truncation is None else 2
        out = torch.zeros(input_ids.size(0), logits_to_keep, columns, dtype=torch.float32, device=input_ids.device)
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            out[rows] = self._block_logps(model, input_ids[rows], attention_mask[rows], logits_to_keep, truncation)
        return out[..., 0] if truncation is None else (out[..., 0], out[..., 1])

    def _block_logps(self, model, ids, mask, logits_to_keep: int, truncation) -> torch.Tensor:
        """`(b, logits_to_keep, columns)` log-probs (and kept log-masses) of one block of rows. Under SP the block is
        packed into one row, each rank projects the tokens of its shard, and the shards are gathered and unpacked."""
        completion_ids, completion_mask = ids[:, -logits_to_keep:], mask[:, -logits_to_keep:]
        if self.sp_mesh is None:

            def forward(unwrapped):
                hidden = self.compute_hidden_states(unwrapped, ids, mask)[:, -logits_to_keep - 1 : -1]
                return self._valid_logps(unwrapped, hidden, completion_ids, completion_mask.bool(), truncation)

            return self._call_through_wrapper(model, forward)
        ignore = self.rl_loss_config.ignore_idx
        micro_batch = SPMicroBatch.from_tensors(
            ids[:, :-logits_to_keep], mask[:, :-logits_to_keep], completion_ids, completion_mask, self.sp_mesh,
            self._tokenizer.pad_token_id,
        )  # fmt: skip
        labels = micro_batch.shard(completion_ids, ignore)  # (1, L_local), aligned with the input shard

        def sp_forward(unwrapped):
            hidden = self._sp_hidden_states(unwrapped, micro_batch)
            return self._valid_logps(unwrapped, hidden, labels, labels != ignore, truncation)

        return micro_batch.gather(self._call_through_wrapper(model, sp_forward), tuple(completion_ids.shape))

    def _valid_logps(self, unwrapped, hidden, labels, valid, truncation) -> torch.Tensor:
        """`(*valid.shape, columns)` float32: `_project_logprobs` of `labels[valid]` from `hidden[valid]`, else 0."""
        columns = 1 if truncation is None else 2
        out = torch.zeros(*valid.shape, columns, dtype=torch.float32, device=labels.device)
        logps = self._project_logprobs(unwrapped, hidden[valid], labels[valid], truncation)
        out[valid] = logps.float().reshape(-1, columns)
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
        if self._sp_old_logps != "compute" and not torch.is_grad_enabled():
            # Under SP, TRL scores this rank's share of the group's batch; the old log-probs are computed after the
            # group has pooled it (`_generate_and_score_completions`), on the packed sharded path.
            self._sp_old_logps = "deferred"
            return None, None, None
        if (
            torch.is_grad_enabled()
            or compute_entropy
            or compute_aux_loss
            or any(v is not None for v in multimodal.values())
        ):
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
        if self._truncation_replay is not None:  # the kept mass of the replayed truncation, from the same pass
            logps, self._stashed_kept_logmass = self.compute_per_token_logps(
                model, input_ids, attention_mask, logits_to_keep, batch_size, truncation=self._truncation_replay
            )
            return logps, None, None
        return self.compute_per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size), None, None

    @torch.no_grad()
    def compute_ref_per_token_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """Reference log-probs of a generation batch: the ref model, or the policy with its adapter disabled."""
        input_ids, attention_mask = _sequences(batch)
        logits_to_keep = batch["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if self.model.training else None
        if self.ref_model is not None:
            return self.compute_per_token_logps(self.ref_model, input_ids, attention_mask, logits_to_keep, batch_size)
        peft_model = self.accelerator.unwrap_model(self.model)
        with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
            return self.compute_per_token_logps(self.model, input_ids, attention_mask, logits_to_keep, batch_size)

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
        with recording_logprobs(lm, recorder):
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        recorded = (
            None
            if logprobs is not None
            else recorder.per_completion(completion_ids, self.args.rollout_logprobs_support)
        )
        if recorded is not None:
            logprobs, kept_logmass = recorded
            self._recorded_kept_logmass.append(kept_logmass)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        self._recorded_kept_logmass = []  # filled by _generate_single_turn (HF generate)
        self._stashed_kept_logmass = None  # filled with the old log-probs when TRL computes them
        old_logps_deferred = False
        if self.sp_mesh is None:
            with _trl_deprecated_aliases_silenced():
                batch = self._add_recorded_kept_logmass(super()._generate_and_score_completions(inputs))
        else:
            self._sp_old_logps = "defer"
            try:
                with _trl_deprecated_aliases_silenced():
                    batch = self._add_recorded_kept_logmass(super()._generate_and_score_completions(inputs))
                old_logps_deferred = self._sp_old_logps == "deferred"
            finally:
                self._sp_old_logps = "compute"
            # every rank of the SP group now holds the group's batch
            batch = pool_over_group(batch, self.sp_mesh, self._tokenizer.pad_token_id)
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
            with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
                logps = self.compute_per_token_logps(
                    self.model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size, replay
                )
            if replay is None:
                batch["old_per_token_logps"] = logps
            else:
                batch["old_per_token_logps"], batch["old_kept_logmass"] = logps
        if self.rl_loss_config.use_kl_loss:
            with activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs):
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
        kept = None if self.tools else kept_logmass_batch(recorded, batch["completion_ids"])
        if kept is not None:
            batch["rollout_kept_logmass"] = kept
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
            micro_batch = self._sp_pack_batch(inputs)
            shape = tuple(inputs["completion_ids"].shape)
            micro_batch = micro_batch.with_loss_data(data, shape, self.rl_loss_config.ignore_idx)
            # The loss forward runs on this object's input shard (`_loss_forward`): one packing for both.
            inputs["sp_micro_batch"], data = micro_batch, micro_batch.loss_data
        ctx = self.rl_loss_config.build(data, sp_mesh=self.sp_mesh, micro_batch=self._rl_micro_batch)
        if ctx is None:
            raise ValueError("build_loss_data must give shifted_labels and advantages")
        if ctx.loss_kwargs.rollout_logprobs is not None and ctx.loss_kwargs.old_logprobs is not None:
            ctx.compute_rollout_is()
        elif ctx.loss_kwargs.rollout_logprobs is not None and self._old_logps_from_loss:
            ctx.defer_rollout_is()  # on-policy: the mismatch metrics come from the loss's own forward
        return ctx

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
            hidden = self._sp_hidden_states(unwrapped, inputs["sp_micro_batch"])
        else:
            input_ids, attention_mask = _sequences(inputs)
            length = inputs["completion_ids"].size(1)
            hidden = self.compute_hidden_states(unwrapped, input_ids, attention_mask)[:, -length - 1 : -1]
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
            unwrapped, input_ids, attention_mask, output_router_logits=True
        )
        lm = self._causal_lm(unwrapped)
        aux_loss = load_balancing_loss_func(lm)(router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)
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
