"""The architecture matrix: tiny random causal LMs of every family, each laid out as the trainer lays it out.

`tiny_model(family)` builds a 2-layer model of a few hundred thousand parameters in memory (transformers' config for
the family, shrunk by `TINY` and the family's own overrides in `FAMILIES`). `run_cell(model, mode)` runs one forward
and backward of a hand-made micro-batch through the trainer's own code (`LossLayerForwards._completion_hidden_states`
with the packing `prepare_packing` resolves, the chunked LM head `head_logprobs`), and `alone(model)` each row alone,
unpadded, through the model's own forward and LM head. The loss is `Σ w · log p` over the completion tokens with fixed
random weights `w`: every loss of the trainer is a function of these log-probs, so its gradient is `Σ (∂L/∂log p) ·
∇ log p`, and a weighted sum with arbitrary weights exercises every token's `∇ log p`.

The micro-batch: 5 rows, prompts of 3 and 2 tokens (left-padded, each shared by two rows), completions of 1 to 3
tokens (right-padded); row 4's completion is fully masked (a truncated completion under
`mask_truncated_completions`), so its prompt is forwarded by `off` but not by the packed layouts, except for the MoE
router loss, which counts it as TRL does.
"""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.utils import disable_dropout_in_model

from hf_rlloss.loss.chunked_logprobs import chunked_objective
from hf_rlloss.parallel import layouts
from hf_rlloss.parallel.layouts import (
    attention_dropout,
    model_layouts,
    switch_attention,
    zero_dropout,
)
from hf_rlloss.parallel.ulysses import register_ulysses_attention, ulysses_sequence_parallel, use_ulysses_attention
from hf_rlloss.trainer.common.forwards import LossLayerForwards
from hf_rlloss.trainer.common.lm_head import (
    causal_lm,
    check_model_supported,
    head_logprobs,
    load_balancing_loss_func,
    logit_scale,
)
from hf_rlloss.trainer.common.packing import prepare_packing
from hf_rlloss.trainer.common.sp_batch import SPMicroBatch

VOCAB = 64
PAD = 0
PROMPTS = torch.tensor([[5, 6, 7], [5, 6, 7], [PAD, 8, 9], [PAD, 8, 9], [PAD, 10, 11]])
COMPLETIONS = torch.tensor([[20, 21, PAD], [22, PAD, PAD], [23, 24, 25], [23, 26, PAD], [27, 28, PAD]])
COMPLETION_MASK = (COMPLETIONS != PAD).long()
COMPLETION_MASK[4] = 0  # truncated: fully masked, its prompt still counted by TRL's router loss

# Common shrinking: every family's config gets these (unknown keys are ignored by the families without them).
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
    # GPT-2 / BigCode / NeoX style names
    n_embd=32, n_layer=2, n_head=4, n_positions=128, n_inner=64,
)  # fmt: skip

# The families of the matrix: model_type -> overrides of `TINY` (and the row of the docs table).
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"decoder_sparse_step": 1, "mlp_only_layers": []},
    "mistral": {"sliding_window": 4},
    "mixtral": {"sliding_window": None},
    "qwen2_moe": {"decoder_sparse_step": 1, "mlp_only_layers": []},
    "olmoe": {},
    "gemma": {},
    "gemma2": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
    "olmo2": {},
    "granite": {},
    "cohere": {},
    "cohere2": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_oss": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "smollm3": {},
    "gpt2": {},  # attn_pdrop=0.1 by default: the matrix runs with disable_dropout (see `GPT2_DROPOUT` below)
    "gpt_bigcode": {},  # attn_pdrop=0.1, a float on the attention module that TRL's disable_dropout leaves
    "deepseek_v3": {
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
        "head_dim": 4,
        "num_key_value_heads": 4,
    },  # fmt: skip
    "glm4": {},
    "exaone4": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    "starcoder2": {"sliding_window": 4},
    "gpt_neox": {"rotary_pct": 0.5},
    "falcon": {"num_kv_heads": 1, "drop": ["head_dim"]},
    "falcon_alibi": {"model_type": "falcon", "alibi": True, "drop": ["head_dim"]},
    "qwen3_next": {
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    },  # fmt: skip
    "lfm2": {"layer_types": ["conv", "full_attention"], "block_ff_dim": 64, "block_auto_adjust_ff_dim": False},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
        "mamba_expand": 2,
        "shared_intermediate_size": 16,
    },  # fmt: skip
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 8, "attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "mamba_d_state": 8},
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_d_ssm": 64},
    "zamba2": {"mamba_headdim": 8, "mamba_d_state": 8, "n_mamba_heads": 8, "layers_block_type": ["mamba", "hybrid"]},
}


_MLA = {
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "head_dim": 4, "num_key_value_heads": 4,
}  # fmt: skip
_GATED_DELTANET = {
    "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8,
}  # fmt: skip
# The full matrix (HF_RLLOSS_FULL_MATRIX=1): the other decoder-only families of transformers' causal-LM mapping that
# `TINY` shrinks as they are, and these, which need overrides.
FULL_OVERRIDES: dict[str, dict] = {
    "deepseek_v2": _MLA, "deepseek_v32": _MLA, "glm_moe_dsa": _MLA, "glm4_moe_lite": _MLA, "minicpm3": _MLA,
    "sarvam_mla": _MLA,
    # longcat_flash: its layers counted by num_layers (num_hidden_layers is twice it; before 5.18 a field of its own)
    "longcat_flash": {**_MLA, "num_layers": 1},
    "gptj": {"rotary_dim": 4}, "codegen": {"rotary_dim": 4}, "qwen3_5_text": _GATED_DELTANET,
    "qwen3_5_moe_text": _GATED_DELTANET,
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 32},
    "mamba2": {"num_heads": 8, "head_dim": 8, "state_size": 8, "n_groups": 1, "expand": 2},
    "zamba": {"layers_block_type": ["mamba", "hybrid"], "mamba_d_state": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "flint": {"mlp_only_layers": []},  # its defaults make layers 0 and 1 dense: no router in a 2-layer model
    # DeepSeek-V4's compressed sparse attention, compressing every 2 keys (its default layers compress every 128,
    # more than the matrix's rows hold): a compressor that pools windows of absolute positions
    "deepseek_v4_compressed": {
        "model_type": "deepseek_v4", "layer_types": ["compressed_sparse_attention"] * 2,
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        "mlp_layer_types": ["moe", "moe"],
    },
}  # fmt: skip


def _hash_routes(model: torch.nn.Module) -> None:
    """Fill a hash router's token -> experts table (DeepSeek-V4's `tid2eid`, a checkpoint's buffer that
    transformers initializes to zeros) with distinct random experts per token: with the zeros every token would take
    expert 0 twice, its two weights s/(2s) = 1/2 whatever the gate, and the gate's exact gradient would be 0."""
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            experts = module.num_experts
            rows = [torch.randperm(experts, generator=generator)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 random model of `family` (a `FAMILIES` key or any model_type), in training mode."""
    overrides = dict(FAMILIES.get(family, FULL_OVERRIDES.get(family, {})))
    model_type = overrides.pop("model_type", family)
    settings = {**TINY, **overrides}
    for key in overrides.pop("drop", ()):  # settings the family's config computes itself (read-only properties)
        settings.pop(key)
    settings.pop("drop", None)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    _hash_routes(model)
    return model.train()


def batch(truncated: bool = True) -> dict[str, torch.Tensor]:
    """The matrix's micro-batch; with `truncated=False` row 4's completion is kept (see `SP_BATCHES`)."""
    return {
        "prompt_ids": PROMPTS, "prompt_mask": (PROMPTS != PAD).long(), "completion_ids": COMPLETIONS,
        "completion_mask": COMPLETION_MASK if truncated else (COMPLETIONS != PAD).long(),
    }  # fmt: skip


# The micro-batches of the sequence-parallel cells (`run_sp_cell`), name -> `truncated`. sp_size=2 splits a packed
# row in halves: the matrix's own batch packs into 18 (padding_free) and 14 (shared_prefix) positions whose halves
# end at a sequence boundary, so no sequence is split over the ranks; with row 4's completion kept they are 22 and
# 18, and a sequence straddles the two shards in both layouts (attention and positions across ranks).
SP_BATCHES = {"matrix": True, "straddling": False}


def weights() -> torch.Tensor:  # (B, C): the loss's fixed random weight of each completion token
    return torch.randn(COMPLETIONS.shape, generator=torch.Generator().manual_seed(0))


class _Forwards(LossLayerForwards):
    """The trainer's forwards (`LossLayerForwards`) on one process, without a trainer around them."""

    accelerator = SimpleNamespace(autocast=contextlib.nullcontext)
    rl_loss_config = SimpleNamespace(chunk_size=16, logit_softcapping=None, compile_epilogue=False)

    def __init__(self, packing: str, row_aligned: bool = False):
        self._packing = packing
        self._row_aligned = row_aligned


def row_aligned(model) -> bool:
    """Whether the trainer right-aligns the padded forward of `model` (`RLLossGRPOTrainer._setup_padded_forward`)."""
    return bool(model_layouts(causal_lm(model)).row_start)


def _head(model, hidden, labels, w=None):  # (n, H) -> (n,) log-probs, or the differentiable Σ w · log p
    """The trainer's chunked LM head on `hidden`: the log-probs (`head_logprobs`, no gradient) or, with weights `w`,
    the loss `Σ w · log p` through `chunked_objective` (the head the trainer's loss runs, gradients in the forward)."""
    lm = causal_lm(model)
    text_config = lm.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    temperature = 1.0 / logit_scale(text_config)
    weight = lm.get_output_embeddings().weight
    if w is None:
        cfg = SimpleNamespace(chunk_size=16, logit_softcapping=softcap, compile_epilogue=False)
        return head_logprobs(hidden.detach(), weight.detach(), labels, cfg, temperature, None)

    def objective(logps, chunk, entropy):
        return (logps * w[chunk]).sum(), {}

    value, _ = chunked_objective(
        hidden, weight, labels, objective, temperature=temperature, chunk_size=16, softcap=softcap,
        compile_epilogue=False,
    )  # fmt: skip
    return value


def run_cell(model, mode: str, router: bool = False, truncated: bool = True, aligned: bool | None = None) -> dict:
    """One forward and backward of the micro-batch laid out as `mode`, through the trainer's code. Returns the
    `(B, C)` log-probs (0 where masked) and the parameters' gradients of `Σ w · log p`; with `router`, of that plus
    the MoE router loss (the model's `load_balancing_loss_func`, as `_loss_forward_with_router_aux`), and its value.
    `aligned`: the padded forward right-aligned (default: as the trainer decides, `row_aligned`; `False`: TRL's)."""
    model.zero_grad(set_to_none=True)
    data = batch(truncated)
    aligned = row_aligned(model) if aligned is None else aligned
    out = _Forwards(mode, aligned)._completion_hidden_states(model, data, output_router_logits=router)
    hidden, router_logits, router_mask, _ = out
    mask = data["completion_mask"].bool()
    labels = data["completion_ids"][mask]
    logps = torch.zeros(mask.shape)
    logps[mask] = _head(model, hidden[mask], labels).float()
    loss = _head(model, hidden[mask], labels, weights()[mask])
    aux = None
    if router:
        lm = causal_lm(model)
        aux = torch.zeros(())  # no MoE layer recorded a router: as `_loss_forward_with_router_aux`
        if router_logits:
            aux = load_balancing_loss_func(lm)(router_logits, lm.num_experts, lm.num_experts_per_tok, router_mask)
        loss = loss + aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logps": logps, "grads": grads, "aux": None if aux is None else aux.item()}


def alone(model) -> dict:
    """Each row alone, unpadded, through the model's own forward (its own LM head and logits), with the same loss."""
    model.zero_grad(set_to_none=True)
    data = batch()
    mask = data["completion_mask"].bool()
    logps = torch.zeros(mask.shape)
    total = 0.0
    w = weights()
    for b in range(mask.shape[0]):
        if not mask[b].any():
            continue
        prompt = data["prompt_ids"][b][data["prompt_mask"][b].bool()]
        completion = data["completion_ids"][b][mask[b]]
        ids = torch.cat([prompt, completion]).unsqueeze(0)
        logits = model(input_ids=ids, use_cache=False).logits[0, prompt.numel() - 1 : -1].float()
        row = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        logps[b, mask[b]] = row.detach()
        total = total + (row * w[b, mask[b]]).sum()
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logps": logps, "grads": grads}


def trainer_model(family: str) -> torch.nn.Module:
    """The tiny model of `family` as `RLLossGRPOTrainer` prepares it with `disable_dropout=True`: TRL's
    `disable_dropout_in_model`, then every other dropout zeroed (`zero_dropout`, `_setup_padded_forward`)."""
    model = tiny_model(family)
    disable_dropout_in_model(model)
    zero_dropout(model)
    return model


def reference_cell(family: str, truncated: bool = True) -> dict:
    """`run_cell` of `off` on one process, the matrix's reference: the model as the trainer prepares it with
    `disable_dropout=True` (`trainer_model`: no dropout at all), as `matrix_row` computes it."""
    return run_cell(trainer_model(family), "off", truncated=truncated)


def stock_trl_cell(family: str) -> dict:
    """`off` as stock TRL runs it (`disable_dropout=True`: TRL's `disable_dropout_in_model` only, the padded batch
    left-padded), against each row alone on the same weights without dropout (`alone(trainer_model(...))`):
    `{"trl": (Δ log p, Δ grad), "trainer": (Δ log p, Δ grad)}`, the trainer's `off` beside it."""
    model = tiny_model(family)
    disable_dropout_in_model(model)
    exact = trainer_model(family)
    reference = alone(exact)
    torch.manual_seed(0)  # a dropout TRL leaves draws its mask from the global generator
    trl = differences(run_cell(model, "off", aligned=False), reference)
    return {"trl": trl, "trainer": differences(run_cell(exact, "off"), reference)}


def sp_model(family: str, sp_size: int, force: bool = False) -> torch.nn.Module:
    """The tiny model of `family` as `RLLossGRPOTrainer` prepares it for `sp_size > 1` with `disable_dropout=True`:
    `trainer_model` (TRL's `disable_dropout_in_model`, then `zero_dropout`), then `use_ulysses_attention` (which
    refuses what the rule refuses). `force` switches to the Ulysses attention without the rule's check, to measure a
    family the rule refuses."""
    model = trainer_model(family)
    lm = causal_lm(model)
    if force:
        switch_attention(lm, register_ulysses_attention(), f"sp_size={sp_size}: {family}, forced")
    else:
        use_ulysses_attention(lm, sp_size, "the policy", disable_dropout=True)
    return model


def run_sp_cell(model, mode: str, sp_mesh, truncated: bool = True) -> dict:
    """`run_cell` under sequence parallelism (collective over `sp_mesh`): the micro-batch packed as `mode` by the
    trainer's `_sp_layout`, each rank forwarding its shard (`SPMicroBatch`, `_sp_hidden_states`: the Ulysses
    attention) and projecting its share of the completion tokens (`term_hidden`), forward and backward inside
    `ulysses_sequence_parallel` as the trainer's `training_step`. The loss `Σ w · log p` is the sum of the ranks'
    shares, so its gradient is the sum of the ranks' gradients (the all-reduce DDP would do, without its averaging);
    the log-probs are gathered (`SPMicroBatch.gather`, as `_block_logps`). Returns the same `(B, C)` log-probs and
    gradients as `run_cell`, on every rank."""
    model.zero_grad(set_to_none=True)
    data = batch(truncated)
    forwards = _Forwards(mode)
    forwards.sp_mesh, forwards.args = sp_mesh, SimpleNamespace(packing=mode)
    mask = data["completion_mask"].bool()
    ignore = -100
    with ulysses_sequence_parallel(sp_mesh):
        micro_batch = SPMicroBatch.from_layout(forwards._sp_layout(data), sp_mesh, PAD)
        hidden = micro_batch.term_hidden(forwards._sp_hidden_states(model, micro_batch))[0]  # (M_local, H)
        labels = micro_batch.shard(data["completion_ids"].masked_fill(~mask, ignore), ignore)[0]  # (M_local,)
        w = micro_batch.shard(weights(), 0.0)[0]
        valid = labels != ignore
        local = torch.zeros(labels.shape[0], 1)
        local[valid, 0] = _head(model, hidden[valid], labels[valid]).float()
        logps = micro_batch.gather(local.unsqueeze(0), tuple(mask.shape))[..., 0]
        _head(model, hidden[valid], labels[valid], w[valid]).backward()
    grads = {}
    for name, p in model.named_parameters():  # every parameter, in one order on every rank (an expert may be idle)
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        torch.distributed.all_reduce(grad, group=sp_mesh.get_group())
        grads[name] = grad
    return {"logps": logps, "grads": grads}


def router_loss_model(model) -> bool:
    """Whether the model trains a router loss as TRL decides it: its config declares `output_router_logits` and a
    non-zero `router_aux_loss_coef` (TRL's `aux_loss_enabled`), and transformers ships its loss function."""
    text_config = model.config.get_text_config()
    if not hasattr(text_config, "output_router_logits") or not getattr(text_config, "router_aux_loss_coef", 0.0):
        return False
    try:
        load_balancing_loss_func(causal_lm(model))
    except ValueError:
        return False
    return True


def differences(cell: dict, reference: dict) -> tuple[float, float]:
    """`(max |Δ log p|, max over parameters of max |Δ grad| / scale)` between two cells, `scale` the parameter's
    largest gradient, or `GRAD_FLOOR` times the model's largest where that is larger (see `GRAD_FLOOR`)."""
    dlogp = (cell["logps"] - reference["logps"]).abs().max().item()
    largest = max((ref.abs().max().item() for ref in reference["grads"].values()), default=0.0)
    dgrad = 0.0
    for name, ref in reference["grads"].items():
        scale = max(ref.abs().max().item(), GRAD_FLOOR * largest)
        got = cell["grads"].get(name, torch.zeros_like(ref))
        if scale > 0:
            dgrad = max(dgrad, (got - ref).abs().max().item() / scale)
    return dlogp, dgrad


def matrix_row(family: str, modes=("padding_free", "shared_prefix")) -> dict:
    """One family: `off` against each row alone, and every packing against `off`, as the trainer resolves it with
    `disable_dropout=True` (TRL's `disable_dropout_in_model` first, then `prepare_packing`).

    Returns `{"alone": (Δ log p, Δ grad), mode: {"used", "reason", "zeroed", "logp", "grad", "error"}, "router":
    {"aux", "aux_off", "grad"}}`; `used` is the layout trained (a fallback gives `"off"` and its reason); `error` is
    what a packed forward raised. The router entry (MoE models whose router loss TRL trains) compares the
    padding-free router loss (what `shared_prefix` also falls back to) and the gradients of the loss plus it."""
    raw = tiny_model(family)
    softcap = getattr(raw.config.get_text_config(), "final_logit_softcapping", None)
    try:  # what the trainer refuses at construction (an LM head with a bias, ...), it never packs
        check_model_supported(raw, softcap)
    except ValueError as error:
        return {"refused": str(error)}
    disable_dropout_in_model(raw)  # TRL's disable_dropout=True: the nn.Dropout modules
    zeroed = attention_dropout(raw)  # what prepare_packing would zero (the docs table names it)
    zero_dropout(raw)  # the trainer's disable_dropout=True: every other dropout (`_setup_padded_forward`)
    base = copy.deepcopy(raw)
    off = run_cell(base, "off")
    row = {"alone": differences(off, alone(base))}
    for mode in modes:
        model = copy.deepcopy(raw)
        used, reason = prepare_packing(mode, causal_lm(model), disable_dropout=True)
        if used == "shared_prefix" and router_loss_model(model):  # as RLLossGRPOTrainer._setup_packing
            used, reason = "padding_free", "the MoE router loss counts every row's prompt tokens, as TRL's"
        entry = {"used": used, "reason": reason, "zeroed": zeroed if used != "off" else {}, "error": None}
        if used == "off":  # the kinds of layer the rule refuses `mode` for, and where they were found
            found = layouts.model_layouts(causal_lm(model)).mixers
            entry["kinds"] = {k: v for k, v in found.items() if mode not in layouts.MIXER_RULES[k].exact}
        try:
            cell = run_cell(model, used) if used != "off" else off
            entry["logp"], entry["grad"] = differences(cell, off)
        except ValueError as error:
            entry["error"], entry["logp"], entry["grad"] = str(error), math.inf, math.inf
        row[mode] = entry
    if router_loss_model(base) and row["padding_free"]["used"] == "padding_free":
        reference = run_cell(base, "off", router=True)
        model = copy.deepcopy(base)
        prepare_packing("padding_free", causal_lm(model), disable_dropout=True)
        cell = run_cell(model, "padding_free", router=True)
        row["router"] = {"aux": cell["aux"], "aux_off": reference["aux"], "grad": differences(cell, reference)[1]}
    return row


# Tolerances, float32 (ε = 2^-23 ≈ 1.2e-7). A packed layout changes the order of the float32 reductions (attention
# over segments instead of padded rows, matmuls over another number of rows, blocked differently), not the math.
# A log-prob here is a chain of 2 layers of reductions of at most 64 terms (hidden 32, MLP 64, ≤ 8 keys, 64 logits)
# on values of order 1: reordering a sum of n terms of order 1 changes it by at most n·ε, so each layer adds at most
# ~64 ε and the log-softmax another 64 ε times |log p| ≈ log 64 ≈ 4: a bound of about 2 · 64 ε + 4 · 64 ε ≈ 2^9 ε
# (6e-5 nats), and twice that, 2^10 ε ≈ 1.2e-4, as the tolerance. A wrong layout (a state carried across rows, a
# shifted position, an attention that sees a sibling) moves log-probs by 1e-2 to 1 (`test_a_broken_layout_is_caught`).
LOGP_ATOL = 2**10 * torch.finfo(torch.float32).eps
# A gradient adds one more reduction, over the ≤ 12 completion tokens, and is compared relative to each parameter's
# largest gradient (small entries of order ε·scale can flip sign): the same bound times 2^4 (12 tokens, rounded up).
GRAD_RTOL = 2**14 * torch.finfo(torch.float32).eps
# A parameter whose exact gradient is 0 holds only round-off: a key projection's bias (OPT, BioGPT, XGLM: adding a
# constant to every key of a query's row leaves its softmax unchanged), a router weight whose normalized weights are
# constant. Its entries are sums of terms of the order of the model's other gradients, so their round-off is of order
# ε times those; relative to the parameter's own largest (round-off) entry it is anything. Such a parameter is
# compared relative to 2^-20 of the model's largest gradient: an absolute tolerance of GRAD_RTOL · 2^-20 = 2^-29
# of that gradient, still about 2^10 ε of it.
GRAD_FLOOR = 2.0**-20
# The router loss: a sum over experts of (fraction routed) × (mean probability), means over ≤ 20 tokens of softmaxes
# over 4 experts; relative error ≤ (20 + 4) ε per mean, 2^6 ε for both with room.
AUX_RTOL = 2**6 * torch.finfo(torch.float32).eps


def format_float(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"
