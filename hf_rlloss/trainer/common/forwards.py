"""The forwards of `RLLossGRPOTrainer` through the model and its LM head (mixed into the trainer).

The loss layer never sees logits: it gets the backbone's last hidden states and the LM-head weight and projects them
in chunks. This module holds every forward the trainer runs for that: the training loss forward (`_loss_forward`,
with the MoE router loss `_loss_forward_with_router_aux`), the no-gradient log-prob passes (old and reference
log-probs, `compute_per_token_logps`; under sequence parallelism packed and sharded, `_block_logps`), and the
extension points for models with an unusual layout (`compute_hidden_states`, `get_head_weight`). Each forward runs
inside the wrapped model's forward (`_call_through_wrapper`), so that DDP/FSDP/DeepSpeed hooks fire. Outside sequence
parallelism every forward goes through `_completion_hidden_states`, which lays the batch out as
`RLLossGRPOConfig.packing` says (one packed row, or the padded batch; `packing.py`) and returns the `(B, C, H)`
completion-aligned hidden states the loss and the chunked head take either way. The padded batch of a model whose
layers read the row from its first position (`ModelLayouts.row_start`: a state, a convolution, a compressor) is
forwarded right-aligned (`_row_aligned`, `right_aligned`): each row rolled left by its prompt's padding, so that its
sequence starts at position 0 as it would alone, and the hidden states rolled back.

`LossLayerForwards` is a mixin: it reads the trainer's `accelerator`, `args`, `model`, `ref_model`,
`rl_loss_config`, `sp_mesh`, `_loss_temperature`, `_tokenizer`, `_forward_redirection` and TRL's metric lists.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessorList
from transformers.utils import logging
from trl.trainer.utils import maybe_gather_lm_head_ctx, use_adapter

from ...loss.context import BaseRLLossContext
from ...parallel.packed_attention import packed_forward
from ...parallel.sequence import on_first_sp_rank
from ...parallel.ulysses import ulysses_sequence_parallel
from .engines import call_through_wrapper, head_operands
from .lm_head import active_head, causal_lm, head_logprobs, load_balancing_loss_func
from .multimodal import backbone_inputs, multimodal_inputs, multimodal_rows
from .packing import PackedLayout, build_layout, layout_fallback_reason, pack_padding_free, packing_metrics
from .routing_replay import get_batch_routes, routed_forward, set_batch_routes
from .sp_batch import SPMicroBatch

__all__ = ["LossLayerForwards", "prompt_and_completion", "right_aligned"]

logger = logging.get_logger(__name__)


def prompt_and_completion(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, P + C)` input ids and attention mask of a batch's left-padded prompts followed by its completions."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask


def right_aligned(batch: dict[str, Any], *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`(B, P + C)` rows of a batch (its `prompt_and_completion` ids and mask, or `(B, P + C, H)` states) with each
    row rolled left by its prompt's left padding: the sequence from position 0, the padding after its completion
    (`roll_rows(batch, row, -1)` rolls a row back)."""
    return tuple(roll_rows(batch, row, 1) for row in rows)


def roll_rows(batch: dict[str, Any], row: torch.Tensor, direction: int) -> torch.Tensor:
    """Roll each row of `row` (dim 1) left (`direction=1`) or back right (`-1`) by its prompt's left padding."""
    prompt_mask = batch["prompt_mask"]
    padding = prompt_mask.size(1) - prompt_mask.sum(dim=1)  # (B,) TRL left-pads each prompt
    length = row.size(1)
    index = (torch.arange(length, device=row.device).unsqueeze(0) + direction * padding.unsqueeze(1)) % length
    if row.dim() == 3:
        index = index.unsqueeze(-1).expand(-1, -1, row.size(-1))
    return row.gather(1, index.to(row.device))


def _padded_tokens(batch: dict[str, Any]) -> int:
    """`B × (P + C)`: the positions the padded forward of a batch processes."""
    return batch["prompt_ids"].numel() + batch["completion_ids"].numel()


class LossLayerForwards:
    """Hidden states, the LM head, log-probs without gradient and the loss forward of `RLLossGRPOTrainer`."""

    _causal_lm = staticmethod(causal_lm)
    _packing = "off"  # the layout of the training forwards (`RLLossGRPOConfig.packing`, as the trainer resolves it)
    _row_aligned = False  # the padded forward right-aligned (a model whose layers read the row from its start)
    _routing = None  # MoE routing replay's hooks (`routing_replay.RoutingReplay`), when `routing_replay` is on
    _routing_mode = "off"

    def _routing_loss_metrics(self, device) -> dict[str, torch.Tensor]:  # `RoutingReplayTrainer` overrides it
        return {}

    def compute_hidden_states(
        self,
        unwrapped: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        output_router_logits: bool = False,
        multimodal: dict[str, Any] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """`(B, L, H)` last hidden states of the backbone (after its final norm), under the accelerator's autocast;
        with `output_router_logits=True` (an MoE backbone), also its router logits: `(hidden, router_logits)`.

        Called inside the wrapped model's forward (see `_call_through_wrapper`), so DDP/FSDP hooks fire. Under
        sequence parallelism it gets this rank's shard of a packed row: `attention_mask=None` and the global
        `position_ids` of the shard (restarting at 0 at each packed sequence). A VLM's backbone also gets the
        batch's `multimodal` fields (`multimodal_inputs`: images and the fields TRL built), and computes its own
        positions where it derives them from the image grid (M-RoPE, see `backbone_inputs`). A packed row
        (`RLLossGRPOConfig.packing`) comes as `(1, N)` ids and positions with `attention_mask=None` and the tree
        attention's `attention_kwargs` (`PackedLayout.attention_kwargs`), to pass on to the backbone.
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
        extra.update(attention_kwargs or {})  # packed row: the tree attention's layout
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
        routed_experts: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`(B, logits_to_keep)` float32 log-probs of the last `logits_to_keep` tokens, 0 where the mask is 0.

        Rows are processed `batch_size` at a time; only valid tokens are projected, `chunk_size` at a time. Under
        sequence parallelism every rank of the SP group must call it with the same rows (see `_block_logps`).
        With `truncation` (logits warpers, see `chunked_kept_logmass`), returns `(log-probs, kept log-masses)`, both
        `(B, logits_to_keep)`, from the same pass. A VLM's `multimodal` fields are cut by rows with them, and so are
        the `(B, L, layers, k)` `routed_experts` an MoE forward replays (`routing_replay`).
        """
        batch_size = batch_size or input_ids.size(0)
        columns = 1 if truncation is None else 2
        out = torch.zeros(input_ids.size(0), logits_to_keep, columns, dtype=torch.float32, device=input_ids.device)
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            vision = multimodal_rows(multimodal or {}, rows, input_ids.size(0))  # VLM
            ids, mask = input_ids[rows], attention_mask[rows]
            routes = None if routed_experts is None else routed_experts[rows]
            out[rows] = self._block_logps(model, ids, mask, logits_to_keep, truncation, vision, routes)
        return out[..., 0] if truncation is None else (out[..., 0], out[..., 1])

    @torch.no_grad()
    def compute_ref_per_token_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """Reference log-probs of a generation batch: the ref model, or the policy with its adapter disabled."""
        input_ids, attention_mask = prompt_and_completion(batch)
        logits_to_keep = batch["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if self.model.training else None
        routes = get_batch_routes(batch) if self._routing_mode == "rollout" else None  # MoE: R3 replays them
        args = (input_ids, attention_mask, logits_to_keep, batch_size, None, multimodal_inputs(batch), routes)
        if self.ref_model is not None:
            return self.compute_per_token_logps(self.ref_model, *args)
        peft_model = self.accelerator.unwrap_model(self.model)
        with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
            return self.compute_per_token_logps(self.model, *args)

    def _call_through_wrapper(self, model: nn.Module, fn, *args: Any) -> Any:
        """``fn(unwrapped, *args)`` inside ``model``'s forward (see `engines.call_through_wrapper`)."""
        return call_through_wrapper(self.accelerator, self._forward_redirection, model, fn, *args)

    def _head_inputs(self, hidden: torch.Tensor, weight: torch.Tensor):
        """The LM head's operands and the dtype its GEMMs run in (see `engines.head_operands`)."""
        return head_operands(hidden, weight, self.args.cast_lm_head_to_fp32, self.accelerator.mixed_precision)

    def _completion_hidden_states(
        self, unwrapped: nn.Module, batch: dict[str, Any], output_router_logits: bool = False, count: bool = False
    ) -> tuple[torch.Tensor, Any, torch.Tensor | None, int]:
        """The `(B, C, H)` completion-aligned hidden states of a batch (`out[b, c]` predicts completion token
        `(b, c)`), from one forward laid out as `self._packing` says (`packing.py`: one packed row,
        or the padded `(B, P + C)` batch).

        Returns:
            `(hidden, router_logits, router_mask, forwarded)`: the hidden states; with `output_router_logits` the
            router logits (else `None`) and the attention mask over their tokens (`None` for a packed row, where
            every position is a token); the number of positions forwarded.

        An MoE policy under `routing_replay` routes the forward through the batch's routes (or captures its
        routes in a π_old pass; `routing_replay.routed_forward`); `count`: the loss forward counts the disagreement.
        """
        vision = multimodal_inputs(batch)  # VLM: never packed (see RLLossGRPOTrainer._setup_packing)
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        mode = "off" if vision else self._packing
        # the router loss counts the prompt tokens of rows whose completion is fully masked, as TRL's padded forward
        layout = build_layout(mode, prompt_ids, prompt_mask, completion_ids, completion_mask, output_router_logits)
        if layout is None:
            input_ids, attention_mask = prompt_and_completion(batch)
            aligned = self._row_aligned and not vision
            if aligned:  # each sequence from position 0, as alone (`right_aligned`)
                input_ids, attention_mask = right_aligned(batch, input_ids, attention_mask)
            with routed_forward(self._routing, batch, None, count=count):
                out = self.compute_hidden_states(
                    unwrapped, input_ids, attention_mask, output_router_logits=output_router_logits, multimodal=vision
                )
            hidden, router_logits = out if output_router_logits else (out, None)
            if aligned:
                hidden = roll_rows(batch, hidden, -1)
            length = completion_ids.size(1)
            return hidden[:, -length - 1 : -1], router_logits, attention_mask, input_ids.numel()
        with packed_forward(), routed_forward(self._routing, batch, layout, count=count):
            out = self.compute_hidden_states(
                unwrapped, layout.input_ids, None, position_ids=layout.position_ids,
                output_router_logits=output_router_logits, attention_kwargs=layout.attention_kwargs,
            )  # fmt: skip
        hidden, router_logits = out if output_router_logits else (out, None)
        return layout.completion_hidden(hidden), router_logits, None, layout.forwarded_tokens

    def _loss_forward(self, unwrapped: nn.Module, inputs: dict[str, Any], ctx: BaseRLLossContext):
        if self.sp_mesh is not None:  # this rank's loss terms of the packed micro-batch, aligned with ctx's labels
            micro_batch = inputs["sp_micro_batch"]
            hidden = micro_batch.term_hidden(self._sp_hidden_states(unwrapped, micro_batch, inputs, count=True))
            loss, metrics = self._head_loss(unwrapped, hidden, ctx)
            counts = micro_batch.layout.metrics(loss.device)  # the SP group's row: counted on its first rank
            counts = {k: on_first_sp_rank(v, self.sp_mesh) for k, v in counts.items()}
            return loss, {**metrics, **counts, **self._routing_loss_metrics(loss.device)}
        hidden, _, _, forwarded = self._completion_hidden_states(unwrapped, inputs, count=True)
        loss, metrics = self._head_loss(unwrapped, hidden, ctx)
        metrics = {**metrics, **packing_metrics(_padded_tokens(inputs), forwarded, loss.device)}
        return loss, {**metrics, **self._routing_loss_metrics(loss.device)}

    def _loss_forward_with_router_aux(self, unwrapped: nn.Module, inputs: dict[str, Any], ctx: BaseRLLossContext):
        """`_loss_forward` for an MoE policy whose router loss is trained (`aux_loss_enabled`): also the model's own
        `load_balancing_loss_func` over the micro-batch's prompt and completion tokens, as TRL computes it (packed
        rows repeat each prompt here: `_setup_packing` turns `"shared_prefix"` into `"padding_free"`)."""
        hidden, router_logits, mask, forwarded = self._completion_hidden_states(
            unwrapped, inputs, output_router_logits=True, count=True
        )
        lm = self._causal_lm(unwrapped)
        if router_logits:
            aux_loss = load_balancing_loss_func(lm)(router_logits, lm.num_experts, lm.num_experts_per_tok, mask)
        else:  # no MoE layer recorded a router (a dense Doge, MoE layers switched off): no load to balance
            aux_loss = hidden.new_zeros(())
        loss, metrics = self._head_loss(unwrapped, hidden, ctx)
        metrics = {**metrics, **packing_metrics(_padded_tokens(inputs), forwarded, loss.device)}
        return loss, {**metrics, **self._routing_loss_metrics(loss.device)}, aux_loss

    def _head_loss(self, unwrapped: nn.Module, hidden: torch.Tensor, ctx: BaseRLLossContext):
        """The micro-batch's `(loss, metrics)` from hidden states aligned with `ctx`'s labels, through the LM head."""
        weight = self.get_head_weight(unwrapped)
        with maybe_gather_lm_head_ctx(weight):
            hidden, weight, matmul_dtype = self._head_inputs(hidden, weight)
            return ctx(
                hidden_states=hidden, head_weight=weight, temperature=self._loss_temperature, matmul_dtype=matmul_dtype
            )

    def _block_logps(
        self, model, ids, mask, logits_to_keep: int, truncation, vision=None, routes=None
    ) -> torch.Tensor:
        """`(b, logits_to_keep, columns)` log-probs (and kept log-masses) of one block of rows. Under SP the block is
        packed into one row, each rank projects the tokens of its shard, and the shards are gathered and unpacked."""
        completion_ids, completion_mask = ids[:, -logits_to_keep:], mask[:, -logits_to_keep:]
        batch = {"prompt_ids": ids[:, :-logits_to_keep], "prompt_mask": mask[:, :-logits_to_keep]}
        batch.update(completion_ids=completion_ids, completion_mask=completion_mask, **(vision or {}))
        if routes is not None:
            set_batch_routes(batch, routes)
        if self.sp_mesh is None:

            def forward(unwrapped):
                hidden = self._completion_hidden_states(unwrapped, batch)[0]
                return self._valid_logps(unwrapped, hidden, completion_ids, completion_mask.bool(), truncation)

            return self._call_through_wrapper(model, forward)
        ignore = self.rl_loss_config.ignore_idx
        micro_batch = SPMicroBatch.from_layout(self._sp_layout(batch), self.sp_mesh, self._tokenizer.pad_token_id)
        labels = completion_ids.masked_fill(completion_mask == 0, ignore)
        labels = micro_batch.shard(labels, ignore)  # (1, M_local): this rank's terms

        def sp_forward(unwrapped):
            hidden = micro_batch.term_hidden(self._sp_hidden_states(unwrapped, micro_batch, batch))
            return self._valid_logps(unwrapped, hidden, labels, labels != ignore, truncation)

        return micro_batch.gather(self._call_through_wrapper(model, sp_forward), tuple(completion_ids.shape))

    def _valid_logps(self, unwrapped, hidden, labels, valid, truncation) -> torch.Tensor:
        """`(*valid.shape, columns)` float32: the log-probs of `labels[valid]` from `hidden[valid]` through the LM head
        (chunked, no gradient), 0 elsewhere; with `truncation`, also the log-mass the replayed truncation keeps."""
        columns = 1 if truncation is None else 2
        out = torch.zeros(*valid.shape, columns, dtype=torch.float32, device=labels.device)
        weight = self.get_head_weight(unwrapped)
        with maybe_gather_lm_head_ctx(weight):
            h, w, matmul_dtype = self._head_inputs(hidden[valid], weight)
            logps = head_logprobs(
                h, w, labels[valid], self.rl_loss_config, self._loss_temperature, matmul_dtype, truncation
            )
        out[valid] = logps.float().reshape(-1, columns)
        return out

    def _sp_layout(self, batch: dict[str, Any]) -> PackedLayout:
        """The packed row of a micro-batch under sequence parallelism, which always shards a packed row:
        `args.packing`'s layout (`"off"` packs padding-free, as SP did before `packing` existed; `"auto"` shares
        prefixes); a batch that
        `layout_fallback_reason` rejects is packed padding-free (a row without prompt: its first token is not
        predicted), logged once per reason where that changes the layout."""
        mode = {"off": "padding_free", "auto": "shared_prefix"}.get(self.args.packing, self.args.packing)
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        reason = layout_fallback_reason(prompt_mask, completion_mask)
        if reason is None:
            return build_layout(mode, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if mode != "padding_free":
            logger.warning_once(f"packing={mode!r}: {reason}, so this micro-batch is packed padding-free under SP")
        if not bool(completion_mask.any()):  # every completion masked (e.g. truncated): the group still runs the
            # same forward and collectives, on one term whose label the loss data and `_block_logps` mask out
            completion_mask = torch.zeros_like(completion_mask)
            completion_mask[0, 0] = 1
        return pack_padding_free(prompt_ids, prompt_mask, completion_ids, completion_mask)

    def _sp_hidden_states(
        self, unwrapped: nn.Module, micro_batch: SPMicroBatch, batch: dict[str, Any] | None = None, count: bool = False
    ) -> torch.Tensor:
        """`(1, N_local, H)`: this rank's shard of the backbone's last hidden states of a packed row (collective);
        the Ulysses attention gets the whole row's tree layout. An MoE policy under `routing_replay` replays (or, in
        a π_old pass, records) the routes of `batch`'s tokens on the shard (`routing_replay.routed_forward`)."""
        routing = None if batch is None else self._routing
        with (
            ulysses_sequence_parallel(self.sp_mesh),
            routed_forward(routing, batch or {}, micro_batch.layout, count, self.sp_mesh),
        ):
            return self.compute_hidden_states(
                unwrapped, micro_batch.input_ids, None, position_ids=micro_batch.position_ids,
                attention_kwargs=micro_batch.attention_kwargs,
            )  # fmt: skip

    def _add_router_aux_loss(self, loss, metrics, aux_loss, mode: str):
        """Add `router_aux_loss_coef × aux_loss / gradient_accumulation_steps` to the micro-batch's loss, as TRL: per
        micro-batch on every rank, not multiplied by the ranks (DDP averages). `loss/router_aux` counts it divided by
        the ranks, so that its sum over micro-batches and ranks is the step's; TRL's `aux_loss` metric as TRL's."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        term = self.router_aux_loss_coef * aux_loss.to(loss.device) / accumulation
        metrics = dict(metrics)
        share = term.detach() / self.accelerator.num_processes
        metrics["loss/router_aux"] = share
        metrics["loss/total"] = metrics["loss/total"] + share
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        return loss + term, metrics
