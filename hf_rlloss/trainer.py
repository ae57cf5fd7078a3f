"""`RLLossGRPOTrainer`: TRL's `GRPOTrainer` with its loss replaced by the hf_rlloss loss layer.

Generation, rewards, advantages, logging, checkpoints, PEFT and the model card are TRL's; what changes is how the loss
of an optimizer step is computed (see the class docstring).
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import is_peft_model
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.models.utils import _ForwardRedirection, disable_gradient_checkpointing
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import (
    create_model_from_path,
    disable_dropout_in_model,
    maybe_gather_lm_head_ctx,
    use_adapter,
)

from .chunked_logprobs import chunked_logprobs
from .config import BaseRLLossConfig
from .context import BaseRLLossContext
from .metrics import accumulate_metrics, finalize_train_policy_metrics
from .trainer_config import RLLossGRPOConfig

__all__ = ["RLLossGRPOConfig", "RLLossGRPOTrainer"]


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


class SampledTokenLogprobs(LogitsProcessor):
    """Records ``log p(sampled token)`` under the *processed* sampling distribution of HF ``generate``.

    Appended after every logits processor *and warper* (transformers merges user processors before the warpers, so
    the trainer appends it to the list `_get_logits_processor` builds), it sees the scores after penalties,
    temperature and top-k/top-p, i.e. exactly the distribution the token is drawn from. The token is only known at
    the next step, so each call records the previous step's value (one `(B, V)` block alive at a time); `finish`
    records the last one.
    """

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.values.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """`(B, generated)` log-probs of the generated tokens, given the `(B,)` tokens sampled at the last step."""
        if self.previous is not None:
            self.values.append(self.previous.gather(-1, last_tokens.to(self.previous.device)[:, None]).squeeze(-1))
            self.previous = None
        return torch.stack(self.values, dim=1) if self.values else torch.zeros(last_tokens.size(0), 0)


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
    from the path the policy was given as, else a deep copy of the in-memory policy taken before training. Rollout
    log-probs (`sampling_per_token_logps`, from vLLM or a `rollout_func`) are passed as `rollout_logprobs` and TRL's
    vLLM importance-sampling ratio as `rollout_is_weights`. With HF `generate` (and `args.rollout_logprobs`), the
    trainer records the log-probs of the sampled tokens under the processed sampling distribution
    (`SampledTokenLogprobs`), so rollout importance sampling and the mismatch metrics work on every backend; old
    log-probs are then always computed, and `rl_loss.rollout_is` runs on each micro-batch before `build_batches`.

    **Metrics.** The loss layer's metrics are accumulated over the micro-batches of a step and reduced once per
    optimizer step (one collective per reduction kind) into `train_policy/*` and `loss/*` next to TRL's metrics.

    **Subclassing.** Override `build_loss_data` to add keys to the data given to `rl_loss_config.build` (or
    `build_loss_context` to modify the context), set `RLLossGRPOConfig.loss_config_class` to use another loss
    configuration class, and `compute_hidden_states` / `get_head_weight` for models with an unusual layout.

    **Not supported** (rejected at construction): vision-language models, MoE router auxiliary losses, final-logit
    softcapping, an LM head with a bias or a PEFT adapter, sequence parallelism (`sp_size > 1`). A logit scale
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
        with _overridden(args, beta=0.0, sync_ref_model=False):
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
        if self.aux_loss_enabled:
            raise ValueError(
                "RLLossGRPOTrainer does not add the MoE router auxiliary loss; set router_aux_loss_coef=0.0 to train "
                "without it"
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        self._check_model_supported(unwrapped)
        text_config = unwrapped.config.get_text_config()
        self._loss_temperature = self.temperature / _logit_scale(text_config)

        self._forward_redirection = _ForwardRedirection()
        self._rl_pending: deque[BaseRLLossContext] = deque()
        self._rl_step_metrics: dict[str, Any] = {}
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
        """Where the reference log-probs will come from, decided before TRL touches the policy."""
        if not loss_cfg.use_kl_loss:
            if ref_model is not None:
                raise ValueError("ref_model was given but rl_loss.use_kl_loss is false: nothing would use it")
            return None
        if ref_model is not None:
            return ref_model
        if peft_config is not None:
            return "adapter"
        if is_peft_model(model):
            # As TRL does for beta != 0: a frozen copy of the pre-trained adapter is the reference.
            default_config = model.peft_config["default"]
            model.add_adapter("ref", default_config)
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
            return "adapter"
        if isinstance(model, str):
            return model
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            raise ValueError(
                "rl_loss.use_kl_loss needs a reference model, and a quantized in-memory policy cannot be copied: pass "
                "ref_model=... (a model or a path), or a peft_config (the reference is then the base model)"
            )
        return copy.deepcopy(model)  # the policy as given, before any training

    def _build_reference(self, source: Any) -> nn.Module | None:
        if source is None or source == "adapter":
            return None
        if isinstance(source, str):
            init_kwargs = dict(self.args.model_init_kwargs or {})
            init_kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
            init_kwargs.setdefault("dtype", self.model.dtype)
            init_kwargs.setdefault("attn_implementation", self.model.config._attn_implementation)
            if self.args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
                init_kwargs["device_map"] = None
            source = create_model_from_path(source, **init_kwargs)
        self._check_model_supported(source)
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
    # Hidden states and the LM head

    @staticmethod
    def _causal_lm(unwrapped: nn.Module) -> nn.Module:
        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _check_model_supported(self, unwrapped: nn.Module) -> None:
        lm = self._causal_lm(unwrapped)
        name = type(lm).__name__
        text_config = lm.config.get_text_config()
        if getattr(text_config, "final_logit_softcapping", None):
            raise ValueError(f"{name} softcaps its logits (final_logit_softcapping), which the loss layer does not do")
        if _logit_scale(text_config) <= 0:
            raise ValueError(f"{name} scales its logits by {_logit_scale(text_config)}: not supported")
        if getattr(lm, "base_model", lm) is lm:
            raise ValueError(f"{name} has no separate backbone (base_model): its last hidden states are not reachable")
        head = lm.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{name}'s output embedding is {type(head).__name__}, not a plain nn.Linear LM head")
        if head.bias is not None:
            raise ValueError(f"{name}'s LM head has a bias, which the loss layer does not add")

    def compute_hidden_states(
        self, unwrapped: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """`(B, L, H)` last hidden states of the backbone (after its final norm), under the accelerator's autocast.

        Called inside the wrapped model's forward (see `_call_through_wrapper`), so DDP/FSDP hooks fire.
        """
        backbone = self._causal_lm(unwrapped).base_model
        with self.accelerator.autocast():
            outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return outputs.last_hidden_state

    def get_head_weight(self, unwrapped: nn.Module) -> torch.Tensor:
        """The `(V, H)` LM-head weight (gathered when it is an FSDP2 DTensor)."""
        weight = self._causal_lm(unwrapped).get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        return weight

    def _head_inputs(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.args.cast_lm_head_to_fp32:
            return hidden.float(), weight.float()
        if hidden.dtype != weight.dtype:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
            return hidden.to(dtype), weight.to(dtype)
        return hidden, weight

    def _call_through_wrapper(self, model: nn.Module, fn, *args: Any) -> Any:
        """``fn(unwrapped, *args)``, run inside ``model``'s forward when it is a DDP/FSDP/DeepSpeed wrapper."""
        unwrapped = self.accelerator.unwrap_model(model)
        if unwrapped is model:
            return fn(unwrapped, *args)
        return self._forward_redirection(model, unwrapped, fn, unwrapped, *args)

    # ------------------------------------------------------------------------------------------------------------
    # Log-probs without gradient (old and reference)

    @torch.no_grad()
    def compute_per_token_logps(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
    ) -> torch.Tensor:
        """`(B, logits_to_keep)` float32 log-probs of the last `logits_to_keep` tokens, 0 where the mask is 0.

        Rows are processed `batch_size` at a time; only valid tokens are projected, `chunk_size` at a time.
        """
        batch_size = batch_size or input_ids.size(0)
        out = torch.zeros(input_ids.size(0), logits_to_keep, dtype=torch.float32, device=input_ids.device)

        def forward(unwrapped, ids, mask):
            hidden = self.compute_hidden_states(unwrapped, ids, mask)[:, -logits_to_keep - 1 : -1]
            valid = mask[:, -logits_to_keep:].bool()
            weight = self.get_head_weight(unwrapped)
            with maybe_gather_lm_head_ctx(weight):
                h, w = self._head_inputs(hidden[valid], weight)
                logps, _ = chunked_logprobs(
                    h,
                    w,
                    ids[:, -logits_to_keep:][valid],
                    temperature=self._loss_temperature,
                    chunk_size=self.rl_loss_config.chunk_size,
                )
            return logps, valid

        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            logps, valid = self._call_through_wrapper(model, forward, input_ids[rows], attention_mask[rows])
            block = out[rows]
            block[valid] = logps.float()
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
        return self.compute_per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size), None, None

    @torch.no_grad()
    def compute_ref_per_token_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """Reference log-probs of a generation batch: the ref model, or the policy with its adapter disabled."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logits_to_keep = batch["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if self.model.training else None
        if self.ref_model is not None:
            return self.compute_per_token_logps(self.ref_model, input_ids, attention_mask, logits_to_keep, batch_size)
        peft_model = self.accelerator.unwrap_model(self.model)
        with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
            return self.compute_per_token_logps(self.model, input_ids, attention_mask, logits_to_keep, batch_size)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        hf_generate = not self.use_vllm and not self.args.use_transformers_paged
        if not (hf_generate and self.args.rollout_logprobs):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        lm = self._causal_lm(self.accelerator.unwrap_model(self.model))  # the module whose generate() runs
        recorder = SampledTokenLogprobs()
        original = lm._get_logits_processor
        shadowed = vars(lm).get("_get_logits_processor")

        def get_logits_processor(*args, **kwargs) -> LogitsProcessorList:
            processors = original(*args, **kwargs)
            processors.append(recorder)  # after the warpers: the distribution actually sampled from
            return processors

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
            steps = len(recorder.values) + 1
            # rows that ran to the last step hold its token; shorter rows (ended by EOS) never use that value
            last = torch.tensor([ids[steps - 1] if len(ids) >= steps else 0 for ids in completion_ids])
            values = recorder.finish(last).cpu()
            logprobs = [values[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if batch.get("sampling_per_token_logps") is not None and batch.get("old_per_token_logps") is None:
            # Rollout IS and the mismatch metrics compare the rollout's log-probs with the policy's before the update.
            input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            batch_size = self.args.per_device_train_batch_size if self.model.training else None
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                batch["old_per_token_logps"] = self.compute_per_token_logps(
                    self.model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size
                )
        if self.rl_loss_config.use_kl_loss:
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                batch["ref_per_token_logps"] = self.compute_ref_per_token_logps(batch)
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
        optional = {
            "old_per_token_logps": "old_logprobs",
            "ref_per_token_logps": "ref_logprobs",
            "sampling_per_token_logps": "rollout_logprobs",
        }
        for key, name in optional.items():
            if inputs.get(key) is not None:
                data[name] = inputs[key]
        if inputs.get("importance_sampling_ratio") is not None:
            data["rollout_is_weights"] = inputs["importance_sampling_ratio"].expand_as(labels)
        return data

    def build_loss_context(self, inputs: dict[str, Any]) -> BaseRLLossContext:
        """The loss context of one micro-batch (before `build_batches`), after rollout IS when rollout log-probs
        exist (weights and rejected tokens per `rl_loss.rollout_is`; in any case the mismatch metrics)."""
        ctx = self.rl_loss_config.build(self.build_loss_data(inputs))
        if ctx is None:
            raise ValueError("build_loss_data must give shifted_labels and advantages")
        if ctx.loss_kwargs.rollout_logprobs is not None and ctx.loss_kwargs.old_logprobs is not None:
            ctx.compute_rollout_is()
        return ctx

    def _build_step_contexts(self) -> None:
        """At the first micro-batch of an optimizer step: the contexts of all its micro-batches, normalized once."""
        n = self.current_gradient_accumulation_steps
        spg = self.args.steps_per_generation
        generate_every = spg * self.num_iterations
        if any((self._step + i) % generate_every == 0 for i in range(1, n)):
            raise RuntimeError(
                f"optimizer step at micro-step {self._step} would span two generations (gradient accumulation "
                f"{n}, steps_per_generation × num_iterations = {generate_every})"
            )
        contexts = [self.build_loss_context(self._buffered_inputs[(self._step + i) % spg]) for i in range(n)]
        type(contexts[0]).build_batches(contexts, grad_averaging_size=self.accelerator.num_processes)
        self._rl_pending = deque(contexts)
        self._rl_step_metrics = {}

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        if not self._rl_pending:
            self._build_step_contexts()
        inputs = dict(inputs)
        inputs["rl_loss_context"] = self._rl_pending.popleft()
        inputs["rl_loss_last_micro_batch"] = not self._rl_pending
        return inputs

    # ------------------------------------------------------------------------------------------------------------
    # Loss

    def _loss_forward(self, unwrapped: nn.Module, inputs: dict[str, Any], ctx: BaseRLLossContext):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        length = completion_ids.size(1)
        hidden = self.compute_hidden_states(unwrapped, input_ids, attention_mask)[:, -length - 1 : -1]
        weight = self.get_head_weight(unwrapped)
        with maybe_gather_lm_head_ctx(weight):
            hidden, weight = self._head_inputs(hidden, weight)
            return ctx(hidden_states=hidden, head_weight=weight, temperature=self._loss_temperature)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        ctx = inputs.get("rl_loss_context")
        if ctx is None:  # evaluation: every batch is its own step
            ctx = self.build_loss_context(inputs)
            type(ctx).build_batches([ctx], grad_averaging_size=self.accelerator.num_processes)
        loss, metrics = self._call_through_wrapper(model, self._loss_forward, inputs, ctx)
        if mode == "train":
            self._rl_step_metrics = accumulate_metrics(self._rl_step_metrics, metrics)
            if inputs.get("rl_loss_last_micro_batch", True):
                self._log_rl_metrics("train", self._rl_step_metrics)
                self._rl_step_metrics = {}
        else:
            self._log_rl_metrics("eval", metrics)
        if self.accelerator.distributed_type != "DEEPSPEED":
            loss = loss * self.accelerator.gradient_accumulation_steps  # cancels accelerator.backward's division
        return loss

    def _log_rl_metrics(self, mode: str, metrics: dict[str, Any]) -> None:
        """Reduce the metrics of a step across ranks (collective) and append them to TRL's metric lists."""
        for key, value in finalize_train_policy_metrics(metrics, device=self.accelerator.device).items():
            self._metrics[mode][key].append(float(value))
