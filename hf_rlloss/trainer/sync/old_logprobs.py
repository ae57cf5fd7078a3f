"""Old log-probs (π_old) and the rollout's recorded log-probs in the synchronous trainer.

With HF `generate`, the sampled tokens' log-probs are recorded during generation (`_generate_single_turn`, with
`common/rollout_recording.py`'s recorder) together with the probability mass top-k/top-p/min-p truncation kept
(`_add_recorded_kept_logmass`). π_old's log-probs are computed as the loss computes the current ones (chunked, from
hidden states: `_get_per_token_logps_and_entropies`), under replayed truncation with their own kept mass
(`_build_truncation_replay`), and added where rollout IS or its mismatch metrics need them and TRL did not compute
them (`_add_old_logps`); on-policy without rollout IS they come from the training forward instead
(`_old_logps_from_loss`). Under sequence parallelism TRL's old log-probs wait until the SP group has pooled its batch
(`_sp_old_logps`). `OldLogprobs` is mixed into `RLLossGRPOTrainer`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging

from ..common.engines import activation_checkpointing_disabled
from ..common.forwards import prompt_and_completion
from ..common.multimodal import multimodal_inputs
from ..common.rollout_recording import (
    REPLAYED_SETTINGS,
    SampledTokenLogprobs,
    kept_logmass_batch,
    recording_logprobs,
    truncation_replay,
)
from ..common.shared_prefill import shared_prompt_generation

__all__ = ["OldLogprobs"]

logger = logging.get_logger(__name__)


class OldLogprobs:
    """π_old's log-probs and the recorded rollout log-probs of `RLLossGRPOTrainer` (a `GRPOTrainer` mixin)."""

    def _setup_old_logprobs(self) -> None:
        """The state of this mixin, set by the trainer's setup (after `sp_mesh`)."""
        self._recorded_kept_logmass: list[list[torch.Tensor]] = []
        self._stashed_kept_logmass: torch.Tensor | None = None
        self._truncation_replay = self._build_truncation_replay()
        # Under SP, TRL's old log-probs wait until the group has pooled its batch: "compute" (when TRL asks),
        # "defer" (TRL is scoring this rank's share: skip them), "deferred" (skipped: compute them after pooling).
        self._sp_old_logps = "compute"

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
        shape = (input_ids.size(0), input_ids.size(1) - length, length)
        with (
            activation_checkpointing_disabled(self.model, self.args.activation_checkpointing_kwargs),
            self._routing_old_pass(*shape) as routes,  # MoE routing replay (common/routing_replay.py)
        ):
            logps = self.compute_per_token_logps(
                self.model, input_ids, attention_mask, length, batch_size, replay, multimodal_inputs(batch), routes
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

    # TRL override points

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # TRL override: with HF generate, each distinct prompt is prefilled once (`shared_prefill`) and the generating
        # model's `_get_logits_processor` is wrapped for the call so that the sampled tokens' log-probs are recorded
        # (`rollout_recording.recording_logprobs`).
        inputs = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        hf_generate = not self.use_vllm and not self.args.use_transformers_continuous_batching
        lm = self._causal_lm(self.accelerator.unwrap_model(self.model))
        # Routing replay records the prefill's routes row by row under "rollout" (said once, at setup): a prompt
        # prefilled once would have one row for G completions
        replay = getattr(self.args, "routing_replay", "off")
        share = hf_generate and self.args.shared_prompt_generation and replay != "rollout"
        generate = shared_prompt_generation(super()._generate_single_turn, lm, share)
        if not (hf_generate and self.args.record_rollout_logprobs):
            return self._routing_recorded_generate(lambda: generate(*inputs), prompt_ids)
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
            return self._routing_recorded_generate(lambda: generate(*inputs), prompt_ids)
        recorder = SampledTokenLogprobs()
        with recording_logprobs(lm, recorder):
            # MoE routing replay: the routers are recorded too (common/routing_replay.py)
            completion_ids, logprobs = self._routing_recorded_generate(lambda: generate(*inputs), prompt_ids)
        if logprobs is None:
            recorded = recorder.per_completion(completion_ids, self.args.rollout_logprobs_support)
            if recorded is not None:
                logprobs, kept_logmass = recorded
                self._recorded_kept_logmass.append(kept_logmass)
        return completion_ids, logprobs

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
        shape = (input_ids.size(0), input_ids.size(1) - logits_to_keep, logits_to_keep)
        with self._routing_old_pass(*shape) as routes:  # MoE routing replay (common/routing_replay.py)
            if self._truncation_replay is not None:  # the kept mass of the replayed truncation, from the same pass
                logps, self._stashed_kept_logmass = self.compute_per_token_logps(
                    *args, self._truncation_replay, vision, routes
                )
                return logps, None, None
            return self.compute_per_token_logps(*args, None, vision, routes), None, None
