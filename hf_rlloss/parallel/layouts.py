"""What a model's forward can be rearranged into: the layouts that are exact for the layers it is made of.

The trainer lays a micro-batch out in one of several ways (`RLLossGRPOConfig.packing`, sequence parallelism): the
padded batch (`"off"`), one row of sequences without padding (`"padding_free"`), one row with every shared prefix
forwarded once (`"shared_prefix"`), or such a row split over the ranks of an SP group (`"sequence_parallel"`,
Ulysses). A packed row is exact when every layer of the model reads a token's own sequence only, given the
positions and the `tree_*` attention layout: true of attention computed through transformers' `AttentionInterface`
(the trainer swaps in the tree attention, `hf_rlloss.parallel.packed_attention`, which takes sliding windows,
softcapping and sinks), not of a layer that carries a state along the row (a state-space scan, a linear
attention's recurrence, a causal convolution): such a layer would carry one sequence's state into the next. Those
layers could be exact padding-free if they took the row's sequence boundaries, but transformers' own (torch)
implementations take none: `torch_chunk_gated_delta_rule` swallows `cu_seqlens` in `**kwargs`, the convolutions and
Mamba scans read no `seq_idx`; so they keep `"off"`, and sequence parallelism (each rank would scan its shard only)
is refused before the first step. This module sits with the attentions it rules on (`packed_attention`, `ulysses`),
which consult it; the trainers consult it through them and directly (`resolve_packing`).

`MIXER_RULES` is the table, one entry per kind of layer; `model_layouts(model)` reads a model (its config's
`layer_types`, its modules' classes, flags that change what attention means) and returns the layouts exact for it
with the reason for the others; `resolve_packing` picks the layout a requested packing falls back to.
`attention_dropout` and `zero_attention_dropout` handle the one runtime setting that makes a packed row inexact:
attention dropout, under any of the names transformers' models give it. `dropout_settings` and `zero_dropout` find
and zero every other dropout a model applies in training (functional `F.dropout` with a float probability,
`layerdrop`), which TRL's `disable_dropout` (it sets `nn.Dropout.p`) leaves on.

The padded batch (`"off"`) left-pads each prompt. A layer that reads the row from its first position (a state
carried along the row, a convolution, windows of absolute positions) sees that padding unless it masks it, and
some do not (RWKV, RecurrentGemma, Inkling's short convolutions, DeepSeek-V4's compressor); `ModelLayouts.row_start`
says that the padded forward must start each sequence at position 0 (the trainer right-aligns its rows).
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

__all__ = [
    "LAYOUTS",
    "MIXER_RULES",
    "MixerRule",
    "ModelLayouts",
    "attention_dropout",
    "check_sequence_parallel",
    "dropout_settings",
    "switch_attention",
    "model_layouts",
    "resolve_packing",
    "zero_attention_dropout",
    "zero_dropout",
]

# Every layout, from the most rearranged to the least; "sequence_parallel" is a packed row split over ranks.
LAYOUTS = ("sequence_parallel", "shared_prefix", "padding_free", "off")
_PACKED = frozenset(LAYOUTS)
_OFF = frozenset({"off"})


@dataclasses.dataclass(frozen=True)
class MixerRule:
    """The layouts exact for one kind of token mixer, and why the others are not; `row_start`: the mixer reads the
    row from its first position (a state, a convolution, windows of absolute positions), so a left-padded row is not
    exact unless each sequence starts at position 0."""

    exact: frozenset[str]
    why: str = ""
    row_start: bool = False


_STATE = (
    "carries a state along the row, and transformers' implementation takes no sequence boundaries (no "
    "cu_seqlens/seq_idx), so a packed row would carry one sequence's state into the next"
)
MIXER_RULES: dict[str, MixerRule] = {
    "attention": MixerRule(_PACKED),
    # the tree attention takes `sliding_window`; the Ulysses attention has not been proven with it
    "sliding_attention": MixerRule(
        _PACKED - {"sequence_parallel"}, "sliding windows, which the Ulysses attention does not take"
    ),
    "chunked_attention": MixerRule(
        _OFF, "attends within fixed chunks of absolute positions (no tree attention)", row_start=True
    ),
    "compressed_attention": MixerRule(
        _OFF,
        "compresses the keys over windows of absolute positions (a packed row would pool two sequences)",
        row_start=True,
    ),
    "bidirectional_attention": MixerRule(_OFF, "attends to later tokens (not causal)"),
    "alibi_attention": MixerRule(_OFF, "adds ALiBi biases the tree attention does not compute"),
    "opaque_attention": MixerRule(
        _OFF, "its attention does not go through transformers' AttentionInterface (it cannot be switched)"
    ),
    "layout_not_passed": MixerRule(
        _OFF, "its layers do not pass the packed row's layout (the attention's keyword arguments) on to the attention"
    ),
    "attention_bias": MixerRule(
        _OFF,
        "it adds a learned bias to the attention scores through the attention mask, which the tree attention does "
        "not take",
    ),
    "linear_attention": MixerRule(_OFF, "linear attention " + _STATE, row_start=True),
    "state_space": MixerRule(_OFF, "a state-space (Mamba) layer " + _STATE, row_start=True),
    "convolution": MixerRule(_OFF, "a causal convolution " + _STATE, row_start=True),
    "recurrent": MixerRule(_OFF, "a recurrent layer " + _STATE, row_start=True),
    "unknown": MixerRule(_OFF, "a layer type this table does not know", row_start=True),
}

# `config.layer_types` values -> kind of mixer (anything else is "unknown": padded, never guessed).
_LAYER_TYPES = {
    "full_attention": "attention",
    "attention": "attention",
    "global_attention": "attention",
    "sliding_attention": "sliding_attention",
    "chunked_attention": "chunked_attention",
    "linear_attention": "linear_attention",
    "mamba": "state_space",
    "conv": "convolution",
    "recurrent": "recurrent",
    "compressed_sparse_attention": "compressed_attention",
    "heavily_compressed_attention": "compressed_attention",
}
# Families whose modeling code defeats a packed row in a way neither the config nor the module classes show, found
# by the architecture matrix (tests/test_architectures.py); model_type -> (kind, what it does).
_FAMILY_MIXERS = {
    "falcon": ("layout_not_passed", "FalconModel calls its decoder layers without **kwargs"),
    "nemotron": ("layout_not_passed", "NemotronDecoderLayer calls its attention without **kwargs"),
    "stablelm": ("layout_not_passed", "StableLmDecoderLayer calls its attention without **kwargs"),
    "doge": ("attention_bias", "DogeAttention.prepare_dynamic_mask: exp(A · softplus(dt_proj(v))) per key"),
}
# Module classes (by name) that carry a state along the sequence -> kind; `nn.Conv1d` in the backbone is a convolution.
_STATEFUL_CLASSES = (
    (re.compile(r"DeltaNet|LinearAttention|LightningAttention|Retention"), "linear_attention"),
    (re.compile(r"Mamba|SSM|Mixer$|Hyena"), "state_space"),
    (re.compile(r"ShortConv"), "convolution"),
    (re.compile(r"RWKV|Rwkv|LSTM|Recurrent|RGLRU"), "recurrent"),
)


def _config_mixers(text_config) -> dict[str, str]:
    """Mixer kinds the text config declares: its `layer_types` and the flags that change what attention means."""
    found = {}
    for layer_type in getattr(text_config, "layer_types", None) or ():
        kind = _LAYER_TYPES.get(layer_type, "unknown")
        found.setdefault(kind, f"layer_types has {layer_type!r}")
    # a window of 0 or one switched off (`use_sliding_window=False`, Qwen2-MoE keeps `sliding_window=0`) is none
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True) is not False:
        found.setdefault("sliding_attention", f"sliding_window={text_config.sliding_window}")
    if getattr(text_config, "attention_chunk_size", None):
        found.setdefault("chunked_attention", f"attention_chunk_size={text_config.attention_chunk_size}")
    if getattr(text_config, "use_bidirectional_attention", False):
        found.setdefault("bidirectional_attention", "use_bidirectional_attention=True")
    if getattr(text_config, "alibi", False) or getattr(text_config, "position_embedding_type", None) == "alibi":
        found.setdefault("alibi_attention", "alibi")
    return found


def _module_mixers(backbone: nn.Module) -> dict[str, str]:
    """Mixer kinds found among the backbone's modules (by class), for models that declare no `layer_types`."""
    found = {}
    for module in backbone.modules():
        name = type(module).__name__
        if isinstance(module, nn.Conv1d):
            found.setdefault("convolution", name)
            continue
        for pattern, kind in _STATEFUL_CLASSES:
            if pattern.search(name):
                found.setdefault(kind, name)
                break
    return found


@dataclasses.dataclass(frozen=True)
class ModelLayouts:
    """The layouts exact for a model.

    Args:
        model_type (`str`): the text config's `model_type`.
        mixers (`dict[str, str]`): each kind of mixer found (a `MIXER_RULES` key) -> where it was found.
        exact (`tuple[str, ...]`): the exact layouts, in `LAYOUTS` order.
        reason (`str`, *optional*): why the other layouts are not exact (`None` when every layout is).
    """

    model_type: str
    mixers: dict[str, str]
    exact: tuple[str, ...]
    reason: str | None

    def allows(self, layout: str) -> bool:
        return layout in self.exact

    @property
    def row_start(self) -> dict[str, str]:
        """The mixers that read the row from its first position (`MixerRule.row_start`) -> where they were found:
        the padded forward is exact for such a model only with each sequence starting at position 0."""
        return {kind: where for kind, where in self.mixers.items() if MIXER_RULES[kind].row_start}


def model_layouts(model: nn.Module) -> ModelLayouts:
    """The layouts exact for a transformers causal LM (its text backbone), from `MIXER_RULES`.

    Reads the text config's `layer_types` (and `attention_chunk_size`, `use_bidirectional_attention`, ALiBi), the
    backbone's module classes (state-space, linear-attention, convolution and recurrent mixers), and whether the
    model's attention can be switched (`_can_set_attn_implementation`: attention through `AttentionInterface`).
    A model with none of these is made of causal attention layers: every layout.
    """
    text_config = model.config.get_text_config()
    backbone = getattr(model, "base_model", model)
    mixers = {**_module_mixers(backbone), **_config_mixers(text_config)}
    model_type = getattr(text_config, "model_type", type(model).__name__)
    if model_type in _FAMILY_MIXERS:
        kind, where = _FAMILY_MIXERS[model_type]
        mixers[kind] = where
    can_switch = getattr(model, "_can_set_attn_implementation", None)
    if can_switch is not None and not can_switch():
        mixers["opaque_attention"] = f"{type(model).__name__}._can_set_attn_implementation() is False"
    mixers.setdefault("attention", "default")
    exact = [layout for layout in LAYOUTS if all(layout in MIXER_RULES[kind].exact for kind in mixers)]
    reasons = [f"{MIXER_RULES[kind].why} ({where})" for kind, where in mixers.items() if MIXER_RULES[kind].why]
    return ModelLayouts(model_type, mixers, tuple(exact), "; ".join(reasons) or None)


def resolve_packing(requested: str, layouts: ModelLayouts) -> tuple[str, str | None]:
    """The packing to train with: `requested` when exact for the model, else the next exact one towards `"off"`
    (`shared_prefix` -> `padding_free` -> `off`), with the reason; `(requested, None)` when no fallback."""
    order = LAYOUTS[1:]
    for mode in order[order.index(requested) :]:
        if layouts.allows(mode):
            return mode, (None if mode == requested else f"{layouts.model_type}: {layouts.reason}")
    return "off", None  # "off" is exact for every model


def check_sequence_parallel(model: nn.Module, what: str = "the policy") -> None:
    """Refuse sequence parallelism, before the first step, for a model whose layers would see only their shard."""
    layouts = model_layouts(model)
    if not layouts.allows("sequence_parallel"):
        raise ValueError(
            f"sp_size > 1 splits each packed row over the ranks, which is not exact for {what} "
            f"({layouts.model_type}): {layouts.reason}. Train it with sp_size=1."
        )


def switch_attention(model: nn.Module, name: str, what: str) -> None:
    """`model.set_attn_implementation(name)`, checked: transformers only warns when a model cannot switch (Falcon:
    "does not support setting its attention implementation dynamically") and keeps its own attention, which would
    read a packed row as one sequence. Raises `ValueError` (naming `what`) when the switch did not take effect."""
    model.set_attn_implementation(name)
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    kept = sorted({str(getattr(c, "_attn_implementation", None)) for c in configs} - {name})
    if kept:
        raise ValueError(
            f"{what}: {type(model).__name__} kept attn_implementation={', '.join(kept)} when asked for {name!r} "
            "(its attention does not go through transformers' AttentionInterface)"
        )


# Where transformers' attention layers keep their attention dropout: a float or an `nn.Dropout` on the attention
# module (GPTBigCode: `attn_dropout`, a float; GPT-2: `attn_dropout`, an `nn.Dropout` whose `p` it passes on), or a
# config field the attention reads (`dropout=config.attention_dropout`). Output dropouts (`resid_dropout`) are not
# attention dropout: the tree attention never sees them.
_MODULE_DROPOUTS = ("attention_dropout", "attn_dropout", "attn_drop", "dropout", "dropout_p", "dropout_prob")
_CONFIG_DROPOUTS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def _is_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return "Attention" in name and not isinstance(module, nn.Dropout)


def attention_dropout(model: nn.Module) -> dict[str, float]:
    """Every non-zero attention dropout of a model: `{where: p}` (`"config.attn_pdrop"`,
    `"transformer.h.0.attn.attn_dropout"`, ...); empty when its attention has none."""
    found = {}
    text_config = model.config.get_text_config()
    for field in _CONFIG_DROPOUTS:
        value = getattr(text_config, field, None)
        if isinstance(value, (int, float)) and value > 0:
            found[f"config.{field}"] = float(value)
    for path, module in model.named_modules():
        if not _is_attention(module):
            continue
        for attr in _MODULE_DROPOUTS:
            value = getattr(module, attr, None)
            p = value.p if isinstance(value, nn.Dropout) else value
            if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                found[f"{path}.{attr}"] = float(p)
    return found


def zero_attention_dropout(model: nn.Module) -> dict[str, float]:
    """Set every attention dropout of `model` to 0 (what TRL's `disable_dropout` does for `nn.Dropout` modules, also
    for the floats and config fields it leaves); returns what was zeroed, as `attention_dropout` found it."""
    found = attention_dropout(model)
    _set_to_zero(model, found)
    return found


def _set_to_zero(model: nn.Module, wheres) -> None:
    """Zero each dropout named `config.<field>` or `<module path>.<attribute>` (an `nn.Dropout`'s `p`, or a float)."""
    text_config = model.config.get_text_config()
    modules = dict(model.named_modules())
    for where in wheres:
        path, _, attr = where.rpartition(".")
        if path == "config":
            setattr(text_config, attr, 0.0)
            if model.config is not text_config and hasattr(model.config, attr):
                setattr(model.config, attr, 0.0)
            continue
        owner = modules[path]
        value = getattr(owner, attr)
        if isinstance(value, nn.Dropout):
            value.p = 0.0
        else:
            setattr(owner, attr, 0.0)


# Every other dropout a model applies in training, under the names transformers' models give it: a float on a module
# passed to `F.dropout(..., training=self.training)` (OPT's `dropout`, `activation_dropout`; Seed-OSS's
# `residual_dropout`), a layer-skipping probability (`layerdrop`), or a config field read in the forward.
_DROPOUT_NAME = re.compile(r"drop")


def _dropout_value(value) -> float | None:
    """The probability a dropout attribute holds (a float, or an `nn.Dropout`'s `p`), `None` when not one."""
    p = value.p if isinstance(value, nn.Dropout) else value
    if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1:
        return float(p)
    return None


def dropout_settings(model: nn.Module) -> dict[str, float]:
    """Every non-zero dropout probability of a model: `{where: p}` over its text config's fields and its modules'
    attributes whose name holds `drop` (`"config.layerdrop"`, `"model.decoder.layers.0.activation_dropout"`,
    `"model.decoder.layers.0.self_attn.dropout"`, ...); `nn.Dropout` modules themselves are TRL's `disable_dropout`'s
    and not listed."""
    found = {}
    text_config = model.config.get_text_config()
    for field, value in vars(text_config).items():
        p = _dropout_value(value) if _DROPOUT_NAME.search(field) else None
        if p is not None:
            found[f"config.{field}"] = p
    for path, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            continue
        for attr, value in vars(module).items():
            p = _dropout_value(value) if _DROPOUT_NAME.search(attr) and not attr.startswith("_") else None
            if p is not None:
                found[f"{path}.{attr}" if path else attr] = p
        for attr, value in module._modules.items():  # an nn.Dropout child: its p
            if isinstance(value, nn.Dropout) and value.p > 0:
                found[f"{path}.{attr}" if path else attr] = float(value.p)
    return found


def zero_dropout(model: nn.Module) -> dict[str, float]:
    """Set every dropout probability of `model` to 0 (`dropout_settings`: the floats and config fields TRL's
    `disable_dropout` leaves, the `nn.Dropout` modules it zeroes, and the attention dropouts of
    `zero_attention_dropout`); returns what was zeroed."""
    found = {**zero_attention_dropout(model), **dropout_settings(model)}
    _set_to_zero(model, found)
    return found
