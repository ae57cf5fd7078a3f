"""MoE routing replay: the training forwards route each token through the experts recorded for it.

In a mixture-of-experts model a tiny numerical difference (another precision, another kernel, a KV cache instead of
a full forward, a step of training) flips a router's top-k choice, and the token's log-prob is then computed through
other experts than the ones that produced it. `RLLossGRPOConfig.routing_replay` replays recorded expert ids:

* `"rollout"` (R3, Rollout Routing Replay): the ids chosen during HF `generate`, recorded by a forward hook on every
  router (`RoutingReplay.recording`), replayed in every training forward (π_old, the reference, the loss);
* `"old_policy"` (R2): the ids chosen in the π_old pass, replayed in the loss forward (`num_iterations > 1`, or
  `steps_per_generation > gradient_accumulation_steps`).

transformers gives every MoE family a router module returning `(router_logits, top_k_weights, top_k_index)`. A
forward hook on it returns replacement outputs: the recorded ids, and gate weights recomputed from the *live* router
logits at those ids exactly as the family computes them (`ROUTER_FAMILIES`: softmax over all experts or over the
chosen logits, sigmoid; top-k renormalization; routed scaling factor; a correction bias only moves the choice, so it
is not applied to the weights). The router therefore keeps its gradient (through the gathered weights, as in R3),
and `router_logits` (the router loss, TRL's `aux_loss`) are the model's own.

Layout. Routes are kept per token like the batch: `(B, P + C, L, k)` int16, aligned with
`prompt_and_completion(batch)` (left-padded prompt, right-padded completion; in the batch as two keys, `ROUTE_KEYS`,
padded like the prompt and the completion), `-1` where no route was recorded: the
padding, the last generated token (never forwarded during generation; its hidden state predicts nothing), the tokens
of tool results and of later turns. A token without a route is routed live (the model's own top-k). Each training
forward gives its router rows the routes in its own layout (`layout_routes`): the padded batch (`B × (P + C)` rows)
or a packed row (`padding_free`: the kept tokens in order). Under `packing: shared_prefix` a shared prompt position
would be one router row standing for G rows that generation routed separately (with batch-dependent kernels they
can differ), so the trainer packs `padding_free` instead, and every row replays its own routes.

Activation checkpointing recomputes each layer in the backward, calling the routers again: the targets stay
installed after a forward for the calls made inside a backward (`RoutingReplay.replay`), so the recomputation
replays the same ids, and the disagreement is counted once (`counting` only inside the forward); any other router
call after the forward (generation, a pass without routes) routes live.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from torch import nn
from transformers.utils import logging

from ...loss.metrics import Reduction, register_finalizer, register_metric
from ...parallel.sequence import sp_gather, sp_rank, sp_split
from .transformers_compat import transformers_at_least

__all__ = [
    "ROUTE_KEYS",
    "ROUTER_FAMILIES",
    "ROUTING_REPLAY_MODES",
    "RoutingReplay",
    "RoutingReplayTrainer",
    "batch_routes",
    "find_routers",
    "generation_routes",
    "get_batch_routes",
    "layout_routes",
    "routed_forward",
    "routes_from_layout",
    "routing_metrics",
    "set_batch_routes",
]

logger = logging.get_logger(__name__)

ROUTING_REPLAY_MODES = ("off", "rollout", "old_policy")
NO_ROUTE = -1
# The batch keys of the routes: the prompt's (left-padded, like `prompt_ids`) and the completion's (right-padded), so
# that whatever pads, pools, gathers or concatenates a TRL batch's rows by key (`sp_batch.pad_rows_to_length`, with
# `-1`) keeps them aligned with their tokens.
ROUTE_KEYS = ("prompt_routed_experts", "completion_routed_experts")


# ---------------------------------------------------------------------------------------------------------------
# How each family computes its gate weights at given ids, from the live router logits (`(N, E)`) and ids (`(N, k)`)


def _softmax_then_gather(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, renorm: bool) -> torch.Tensor:
    """Qwen2/3-MoE, OLMoE, Mixtral: softmax over all experts in float32, the chosen ones, renormalized if asked."""
    weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _qwen_like(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # Qwen2MoeTopKRouter, Qwen3MoeTopKRouter, OlmoeTopKRouter: renormalized when norm_topk_prob, cast to the logits'
    return _softmax_then_gather(router, logits, ids, bool(router.norm_topk_prob)).to(logits.dtype)


def _mixtral(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # MixtralTopKRouter: always renormalized, kept in float32
    return _softmax_then_gather(router, logits, ids, True)


def _softmax_of_chosen(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor):
    # GptOssTopKRouter: softmax over the k chosen logits, in the logits' dtype
    return torch.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype)


def _granite(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # GraniteMoeTopKRouter: float32 logits, softmax over the k chosen, cast to the hidden states' dtype
    return torch.softmax(logits.float().gather(1, ids), dim=-1).type_as(hidden)


def _sigmoid_scaled(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor):
    # DeepseekV3TopkRouter, Glm4MoeTopkRouter: sigmoid scores (the e_score_correction_bias only moves the choice),
    # renormalized when norm_topk_prob (with the model's 1e-20), times routed_scaling_factor
    weights = logits.float().sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


@dataclasses.dataclass(frozen=True)
class RouterFamily:
    """A transformers router class (`module`, `name`) and its gate weights at given ids (`gate(router, logits, ids,
    hidden) -> (N, k)`); `since`: the first transformers release whose router returns `(logits, weights, ids)`, as the
    replay hook reads it (`None`: every supported release)."""

    module: str
    name: str
    gate: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    since: str | None = None

    def supported(self) -> bool:
        return self.since is None or transformers_at_least(self.since)


ROUTER_FAMILIES = (
    RouterFamily("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", _qwen_like),
    RouterFamily("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter", _qwen_like),
    RouterFamily("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter", _qwen_like),
    RouterFamily("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter", _mixtral),
    RouterFamily("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", _softmax_of_chosen),
    # before 5.21 its router returned (ids, weights, logits)
    RouterFamily("transformers.models.granitemoe.modeling_granitemoe", "GraniteMoeTopKRouter", _granite, "5.21"),
    RouterFamily("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", _sigmoid_scaled),
    RouterFamily("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter", _sigmoid_scaled),
)


def _router_classes() -> dict[type, RouterFamily]:
    classes = {}
    for family in ROUTER_FAMILIES:
        if not family.supported():
            continue
        try:
            classes[getattr(importlib.import_module(family.module), family.name)] = family
        except (ImportError, AttributeError):  # a transformers version without this family
            continue
    return classes


def find_routers(model: nn.Module) -> list[tuple[nn.Module, RouterFamily]]:
    """The model's routers in module order (one per MoE layer) with their family; an error when the model routes
    tokens through a router this table does not know (e.g. a `...Router`/`...Gate` module of another family), or has
    no router at all."""
    classes = _router_classes()
    routers = [(m, classes[type(m)]) for m in model.modules() if type(m) in classes]
    if routers:
        return routers
    unknown = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("Router", "Gate"))})
    for family in ROUTER_FAMILIES:
        if family.name in unknown and not family.supported():
            raise ValueError(
                f"routing_replay replays {family.name} from transformers {family.since} on "
                f"({transformers.__version__} is installed, whose router returns its outputs in another order): "
                "upgrade transformers, or set "
                "routing_replay='off'"
            )
    known = ", ".join(f.name for f in ROUTER_FAMILIES)
    raise ValueError(
        f"routing_replay needs an MoE model whose routers it can replay ({known}); "
        + (f"{type(model).__name__} has {', '.join(unknown)}" if unknown else f"{type(model).__name__} has no router")
        + ": set routing_replay='off'"
    )


# ---------------------------------------------------------------------------------------------------------------
# Layouts: `(B, S, L, k)` routes aligned with prompt + completion <-> the router rows of one forward


def layout_routes(routes: torch.Tensor, layout: Any = None) -> torch.Tensor:  # (B, S, L, k) -> (N, L, k)
    """The routes of a forward's router rows: the padded batch's `B × S` rows (`layout=None`), or the positions of a
    packed row (a `packing.PackedLayout`, through its `grid_position`). A position standing for several tokens (a
    prompt shared by its G completions under `"shared_prefix"`) replays the route of its first row's token that has
    one; `-1` where none has."""
    if layout is None:
        return routes.reshape(-1, *routes.shape[2:])
    grid = layout.grid_position.to(routes.device).reshape(-1)  # (B × S,)
    flat = routes.reshape(-1, *routes.shape[2:])
    candidate = torch.where((grid >= 0) & (flat[:, 0, 0] >= 0), grid, -1)  # the tokens with a route
    index = torch.arange(grid.numel(), device=grid.device)
    first = torch.full((layout.forwarded_tokens,), grid.numel(), dtype=torch.long, device=grid.device)
    first = first.scatter_reduce(0, candidate.clamp(min=0), torch.where(candidate >= 0, index, grid.numel()), "amin")
    padded = torch.cat([flat, flat.new_full((1, *flat.shape[1:]), NO_ROUTE)])  # row B × S: no route
    return padded[first]


def shared_route_counts(routes: torch.Tensor, layout: Any) -> tuple[int, int]:
    """Of the tokens of a packed layout whose position also stands for an earlier row's token (a shared prompt),
    how many have a route, and how many of those differ from the one their position replays (`layout_routes`) in
    the set of experts of at least one layer: `(shared, differing)`; `(0, 0)` for the padded batch."""
    if layout is None or layout.mode != "shared_prefix":
        return 0, 0
    grid = layout.grid_position.to(routes.device).reshape(-1)
    flat = routes.reshape(-1, *routes.shape[2:])
    replayed = layout_routes(routes, layout)
    mine = (grid >= 0) & (flat[:, 0, 0] >= 0)
    index = torch.arange(grid.numel(), device=grid.device)
    first = torch.full((layout.forwarded_tokens,), grid.numel(), dtype=torch.long, device=grid.device)
    first = first.scatter_reduce(0, grid.clamp(min=0)[mine], index[mine], "amin")
    shared = mine & (first[grid.clamp(min=0)] != index)
    ours, theirs = flat[shared].sort(-1).values, replayed[grid[shared]].sort(-1).values
    return int(shared.sum()), int((ours != theirs).flatten(1).any(dim=1).sum())


def routes_from_layout(rows: torch.Tensor, layout: Any, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of `layout_routes`: `(B, S, L, k)` from a forward's `(N, L, k)` router rows, each token given its
    position's route (a shared position's to every token it stands for), `-1` at the tokens not forwarded."""
    if layout is None:
        return rows.reshape(*shape, *rows.shape[1:])
    grid = layout.grid_position.to(rows.device)
    out = torch.full((*shape, *rows.shape[1:]), NO_ROUTE, dtype=rows.dtype, device=rows.device)
    out[grid >= 0] = rows[grid[grid >= 0]]
    return out


def set_batch_routes(batch: dict[str, Any], routes: torch.Tensor) -> dict[str, Any]:
    """Store `(B, P + C, L, k)` routes in `batch` under `ROUTE_KEYS`, split at its prompt's width `P`, as int32 (the
    narrowest integer type gloo and NCCL gather: the batch is pooled over an SP group, gathered over the ranks)."""
    prompt_length = batch["prompt_ids"].size(1)
    routes = routes.to(torch.int32)
    batch[ROUTE_KEYS[0]], batch[ROUTE_KEYS[1]] = routes[:, :prompt_length], routes[:, prompt_length:]
    return batch


def get_batch_routes(batch: dict[str, Any]) -> torch.Tensor | None:
    """The `(B, P + C, L, k)` routes of `batch` (`set_batch_routes`), or `None`."""
    if batch.get(ROUTE_KEYS[0]) is None:
        return None
    return torch.cat([batch[ROUTE_KEYS[0]], batch[ROUTE_KEYS[1]]], dim=1)


def batch_routes(
    prompt_routes: list[torch.Tensor],
    completion_routes: list[torch.Tensor],
    prompt_length: int,
    completion_length: int,
) -> torch.Tensor:
    """`(B, P + C, L, k)` int16 routes of a padded batch from each sample's routes: its prompt's real tokens
    (`(p_i, L, k)`, right-aligned in the left-padded prompt) and its completion's first tokens (`(c_i, L, k)`), `-1`
    elsewhere."""
    layers, k = prompt_routes[0].shape[1:]
    out = torch.full((len(prompt_routes), prompt_length + completion_length, layers, k), NO_ROUTE, dtype=torch.int16)
    for i, (prompt, completion) in enumerate(zip(prompt_routes, completion_routes, strict=True)):
        p = min(prompt.shape[0], prompt_length)
        out[i, prompt_length - p : prompt_length] = prompt[prompt.shape[0] - p :]
        c = min(completion.shape[0], completion_length)
        out[i, prompt_length : prompt_length + c] = completion[:c]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Metrics: the loss forward's router decisions whose replayed expert differs from the router's own choice

_DECISIONS = "routing_acc/decisions"
_DIFFERING = "routing_acc/differing"
_TOKENS = "routing_acc/tokens"
_TOKENS_DIFFERING = "routing_acc/tokens_differing"
_SHARED = "routing_acc/shared_tokens"
_SHARED_DIFFERING = "routing_acc/shared_tokens_differing"
for _name, _help in (
    (_DECISIONS, "replayed router decisions (token × MoE layer × k) of the loss forwards"),
    (_DIFFERING, "replayed decisions whose expert is not among the router's own top-k"),
    (_TOKENS, "tokens with a replayed route in the loss forwards"),
    (_TOKENS_DIFFERING, "tokens whose replayed route differs from the router's own in at least one layer"),
    (_SHARED, "tokens of a shared prompt position replaying an earlier row's route (packing='shared_prefix')"),
    (_SHARED_DIFFERING, "of those, the tokens whose own recorded route differs in at least one layer"),
):
    register_metric(_name, Reduction.SUM, _help)


@register_finalizer
def _log_routing_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """`routing/disagreement` (fraction of replayed router decisions that the trainer's own routing would have made
    otherwise), `routing/tokens_differing` (fraction of tokens differing in at least one layer), `routing/replayed`
    (tokens with a replayed route)."""
    if _DECISIONS not in reduced:
        return {}
    decisions, tokens, shared = reduced[_DECISIONS], reduced[_TOKENS], reduced.get(_SHARED, 0.0)
    out = {
        "routing/disagreement": reduced[_DIFFERING] / decisions if decisions > 0 else 0.0,
        "routing/tokens_differing": reduced[_TOKENS_DIFFERING] / tokens if tokens > 0 else 0.0,
        "routing/replayed_tokens": tokens,
    }
    if shared > 0:
        out["routing/shared_tokens_differing"] = reduced[_SHARED_DIFFERING] / shared
    return out


def routing_metrics(counts: dict[str, float], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The 0-dim accumulators of one loss forward (`RoutingReplay.take_counts`), to merge into the loss metrics."""
    names = (_DECISIONS, _DIFFERING, _TOKENS, _TOKENS_DIFFERING, _SHARED, _SHARED_DIFFERING)
    return {name: torch.tensor(float(counts.get(name, 0.0)), device=device) for name in names}


def disagreement(recorded: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per router row, how many recorded experts are not among the live top-k `(N,)`, given `(N, k)` ids of each."""
    return (~(recorded[:, :, None] == live[:, None, :]).any(dim=-1)).sum(dim=-1), recorded.shape[1]


# ---------------------------------------------------------------------------------------------------------------
# The hooks


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (activation checkpointing recomputes the
    forward there). torch has no public query for it; without the private one, recomputation is assumed."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return True if current is None else current() != -1


class RoutingReplay:
    """Forward hooks on the routers of one or more models (the policy, the reference) that record the experts each
    router chooses, or replay given ones.

    States: `"live"` (hooks pass the outputs through), `"record"` (each router call's `(N, k)` ids are appended to
    `records[layer]`), `"replay"` (each router replaces its ids by `targets[layer]` where they are `>= 0` and
    recomputes the gate weights from its live logits). Layers are numbered in module order, the same in every model
    attached (the reference is the policy's architecture).
    """

    def __init__(self):
        self.state = "live"
        self.records: list[list[torch.Tensor]] = []
        self.targets: torch.Tensor | None = None  # (N, L, k) for the current forward's router rows
        self.captured: list[torch.Tensor] | None = None  # a list while an "old_policy" π_old pass is captured
        self.counting = False
        self.counted: torch.Tensor | None = None  # (N,) the router rows counted (real tokens); None: every row
        self.counts: dict[str, float] = {}
        self._row_differs: torch.Tensor | None = None
        self._layers: dict[int, tuple[int, RouterFamily]] = {}
        self.num_layers = 0
        self.top_k = 0
        self._handles: list[Any] = []

    def attach(self, model: nn.Module) -> RoutingReplay:
        """Register the hooks on `model`'s routers (`find_routers`); an error when it has none this table knows."""
        routers = find_routers(model)
        if self.num_layers and len(routers) != self.num_layers:
            raise ValueError(f"{type(model).__name__} has {len(routers)} routers; the policy has {self.num_layers}")
        self.num_layers = len(routers)
        self.top_k = int(routers[0][0].top_k)
        for layer, (router, family) in enumerate(routers):
            if id(router) in self._layers:
                continue
            self._layers[id(router)] = (layer, family)
            self._handles.append(router.register_forward_hook(self._hook))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._layers = [], {}

    def _hook(self, router: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]):
        layer, family = self._layers[id(router)]
        logits, _, ids = output
        if self.state == "record":
            self.records[layer].append(ids.detach().to(torch.int16))
            return None
        if self.state == "recompute" and not _in_backward():
            self.live()  # a forward outside `replay` (e.g. generation) after a replayed one: route live
        if self.state not in ("replay", "recompute") or self.targets is None:
            return None
        target = self.targets[:, layer].to(device=ids.device, dtype=ids.dtype)  # (N, k)
        if target.shape != ids.shape:
            raise RuntimeError(
                f"routing_replay: the router of MoE layer {layer} routes {tuple(ids.shape)} (tokens, k) but "
                f"{tuple(target.shape)} routes were given: the replayed layout does not match the forward's"
            )
        has_route = target[:, 0] >= 0  # (N,)
        chosen = torch.where(has_route[:, None], target, ids)
        if self.counting:
            counted = has_route if self.counted is None else has_route & self.counted.to(has_route.device)
            self._count(layer, chosen[counted], ids[counted])
        hidden = args[0].reshape(-1, args[0].shape[-1]) if args else logits
        return logits, family.gate(router, logits, chosen, hidden), chosen

    def _count(self, layer: int, replayed: torch.Tensor, live: torch.Tensor) -> None:
        differing, k = disagreement(replayed, live)
        counts = self.counts
        counts[_DECISIONS] = counts.get(_DECISIONS, 0.0) + float(differing.numel() * k)
        counts[_DIFFERING] = counts.get(_DIFFERING, 0.0) + float(differing.sum())
        if layer == 0 or self._row_differs is None or self._row_differs.shape[0] != differing.shape[0]:
            if self._row_differs is not None:
                self._flush_tokens()
            self._row_differs = differing > 0
        else:
            self._row_differs = self._row_differs | (differing > 0)

    def _flush_tokens(self) -> None:
        if self._row_differs is not None:
            self.counts[_TOKENS] = self.counts.get(_TOKENS, 0.0) + float(self._row_differs.numel())
            self.counts[_TOKENS_DIFFERING] = self.counts.get(_TOKENS_DIFFERING, 0.0) + float(self._row_differs.sum())
        self._row_differs = None

    def take_counts(self) -> dict[str, float]:
        """The disagreement counts since the last call (see `routing_metrics`), reset."""
        self._flush_tokens()
        counts, self.counts = self.counts, {}
        return counts

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[list[torch.Tensor]]]:
        """Record every router call inside the block: yields `records`, one list of `(N, k)` int16 ids per layer."""
        self.state, self.targets = "record", None
        self.records = [[] for _ in range(self.num_layers)]
        try:
            yield self.records
        finally:
            self.state = "live"

    @contextlib.contextmanager
    def replay(
        self, targets: torch.Tensor | None, count: bool = False, real: torch.Tensor | None = None
    ) -> Iterator[None]:
        """Replay `targets` `(N, L, k)` (the forward's router rows, `-1`: live) inside the block; `None`: live routing.

        After the block the targets serve activation checkpointing's recomputation of the forward in the backward
        (state `"recompute"`), and only that: a router called outside a backward routes live from then on. With
        `count`, the disagreement is counted over the rows with a route that are real tokens (`real` `(N,)` bool,
        e.g. a padded batch's attention mask; `None`: every row is one).
        """
        self.state, self.targets, self.counting = ("replay" if targets is not None else "live"), targets, count
        self.counted = real
        try:
            yield
        finally:
            self.counting, self.counted = False, None
            if self.state == "replay":
                self.state = "recompute"
            if count:
                self._flush_tokens()

    def live(self) -> None:
        """Route live from now on (generation, forwards without routes)."""
        self.state, self.targets = "live", None


def generation_routes(
    records: list[list[torch.Tensor]], prompt_mask: torch.Tensor, completion_lengths: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sample's `(p_i, L, k)` prompt routes and `(c_i, L, k)` completion routes from the router calls of one
    HF `generate` (with a KV cache): per layer, the prefill's `B × P` rows, then one `(B, k)` block per decode step.

    Decode step `j ≥ 1` forwards completion token `j − 1`; the last generated token is never forwarded, so its route
    is `-1` (routed live in training, where its hidden state predicts nothing).

    Args:
        records (`list[list[torch.Tensor]]`): per MoE layer, the `(N, k)` ids of each router call, in call order.
        prompt_mask (`torch.Tensor`): `(B, P)` the left-padded attention mask given to `generate`.
        completion_lengths (`list[int]`): each completion's length (cut at its EOS).
    """
    batch, prompt_length = prompt_mask.shape
    calls = len(records[0])
    if calls == 0 or records[0][0].shape[0] != batch * prompt_length:
        rows = records[0][0].shape[0] if calls else 0
        raise RuntimeError(
            f"routing_replay='rollout': the first router call of generate routed {rows} tokens, not the prefill's "
            f"{batch} × {prompt_length}: only HF generate with a KV cache and an unchunked prefill can be replayed"
        )
    if any(call.shape[0] != batch for call in records[0][1:]):
        raise RuntimeError("routing_replay='rollout': a decode step of generate did not route one token per row")
    # (L, calls) -> per call (rows, L, k)
    prefill = torch.stack([layer[0] for layer in records], dim=1).reshape(batch, prompt_length, len(records), -1)
    steps = [torch.stack([layer[j] for layer in records], dim=1) for j in range(1, calls)]  # (B, L, k) each
    decoded = torch.stack(steps, dim=1) if steps else prefill.new_empty(batch, 0, *prefill.shape[2:])
    last = torch.full((batch, 1, *prefill.shape[2:]), NO_ROUTE, dtype=prefill.dtype)
    decoded = torch.cat([decoded.cpu(), last], dim=1)  # (B, calls, L, k): completion position c <- step c + 1
    keep = prompt_mask.bool().cpu()
    prompts = [prefill[i].cpu()[keep[i]] for i in range(batch)]
    completions = [decoded[i, :length] for i, length in enumerate(completion_lengths)]
    return prompts, completions


@contextlib.contextmanager
def routed_forward(
    routing: RoutingReplay | None, batch: dict[str, Any], layout: Any = None, count: bool = False, sp_mesh: Any = None
) -> Iterator[None]:
    """Route one training forward of `batch` (its prompt and completion, and when recorded its routes
    `(B, S, L, k)`, `get_batch_routes`) laid out padded (`layout=None`) or as a packed row (`packing.PackedLayout`),
    of which, under sequence parallelism (`sp_mesh`), this rank forwards its contiguous shard (`sp_split`): replay
    its routes, or, while `routing.captured` is a list (an `"old_policy"` π_old pass), record the forward's routes
    into it `(B, S, L, k)`. With `count`, the disagreement (and a shared prompt's) is counted."""
    if routing is None:
        yield
        return
    shape = (batch["prompt_ids"].size(0), batch["prompt_ids"].size(1) + batch["completion_ids"].size(1))
    if routing.captured is not None:
        with routing.recording() as records:
            yield
        rows = torch.stack([torch.cat(calls) for calls in records], dim=1)  # (N_local, L, k)
        if sp_mesh is not None:  # every rank's shard, in rank order, without the SP padding
            rows = sp_gather(rows.to(torch.int32).unsqueeze(0), sp_mesh, dim=1)[0, : layout.forwarded_tokens]
        routing.captured.append(routes_from_layout(rows, layout, shape))
        return
    routes = get_batch_routes(batch)
    targets = None if routes is None else layout_routes(routes, layout)
    if targets is not None and sp_mesh is not None:  # this rank's shard of the row, padded as `sp_shard_inputs`
        targets = sp_split(targets.unsqueeze(0), sp_mesh, 1, NO_ROUTE)[0]
    if count and routes is not None:
        shared, differing = shared_route_counts(routes, layout)
        if shared and (sp_mesh is None or sp_rank(sp_mesh) == 0):  # the SP group's row: counted on its first rank
            routing.counts[_SHARED] = routing.counts.get(_SHARED, 0.0) + shared
            routing.counts[_SHARED_DIFFERING] = routing.counts.get(_SHARED_DIFFERING, 0.0) + differing
    with routing.replay(targets, count=count, real=None if layout is not None else _padded_real_tokens(batch)):
        yield


def _padded_real_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """`(B × (P + C),)` bool: which rows of a padded forward of `batch` are real tokens (its attention mask). The
    forward routes the padding too, and a π_old pass under `"old_policy"` records a route there: replayed, but not
    counted in the `routing/*` metrics (a packed row forwards real tokens only)."""
    return torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).reshape(-1).bool()


class RoutingReplayTrainer:
    """The trainer's side of routing replay (mixed into `RLLossGRPOTrainer`): the hooks on the policy and the
    reference, the routes recorded during HF `generate` (`"rollout"`) or captured in the π_old pass
    (`"old_policy"`), and the batch's routes (`ROUTE_KEYS`) the training forwards replay (`routed_forward`)."""

    _routing: RoutingReplay | None = None
    _routing_mode = "off"

    def _setup_routing_replay(self, unwrapped: nn.Module) -> None:
        """Attach the hooks (`args.routing_replay` != `"off"`); a model or backend that cannot replay is refused."""
        self._routing_mode = getattr(self.args, "routing_replay", "off")
        self._routing_generated: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._routing_captured: torch.Tensor | None = None
        if self._routing_mode == "off":
            return
        if getattr(self, "_row_aligned", False):
            raise ValueError(
                f"routing_replay={self._routing_mode!r}: {type(self._causal_lm(unwrapped)).__name__}'s layers read "
                "each row from its first position, so its padded forwards are right-aligned, and the routes are "
                "recorded left-padded: use routing_replay='off'"
            )
        if self._routing_mode == "rollout" and self.rollout_func is not None:
            raise ValueError(
                "routing_replay='rollout' records the experts chosen during HF generate; a rollout_func returns no "
                "routed experts: use routing_replay='old_policy' or 'off'"
            )
        if self._routing_mode == "rollout" and getattr(self, "tools", None):
            raise ValueError(
                "routing_replay='rollout' with tools/environment_factory: a conversation's later turns are separate "
                "generate calls whose routes are not stitched into its sample; use routing_replay='old_policy'"
            )
        if self._routing_mode == "rollout" and self._shares_prompts():
            logger.warning(
                "shared_prompt_generation is set aside: routing_replay='rollout' records the routers during HF "
                "generate row by row, and a prompt prefilled once would give its G completions one row of routes"
            )
        self._routing = RoutingReplay()
        self._routing.attach(self._causal_lm(unwrapped))
        if self.ref_model is not None:
            self._routing.attach(self.accelerator.unwrap_model(self.ref_model))

    def _shares_prompts(self) -> bool:
        """Whether HF generate would share each prompt's prefill (`shared_prompt_generation`) but for the replay."""
        args = self.args
        hf_generate = not self.use_vllm and not getattr(args, "use_transformers_continuous_batching", False)
        return hf_generate and bool(getattr(args, "shared_prompt_generation", False))

    def _routing_recorded_generate(self, generate: Callable[[], Any], prompt_ids: list[list[int]]) -> Any:
        """`generate()` (TRL's HF-generate turn) with the routers recorded under `"rollout"`; each sample's routes are
        kept for `_routing_add_rollout_routes`."""
        if self._routing_mode != "rollout":
            return generate()
        with self._routing.recording() as records:
            completion_ids, logprobs = generate()
        rows = records[0][0].shape[0] if records and records[0] else 0
        batch = len(prompt_ids)
        width = rows // batch if batch else 0
        prompt_mask = torch.zeros(batch, width, dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            prompt_mask[i, width - min(len(ids), width) :] = 1
        lengths = [len(ids) for ids in completion_ids]
        self._routing_generated.append(generation_routes(records, prompt_mask, lengths))
        return completion_ids, logprobs

    def _routing_rollout_routes(self, rows: int, prompt_length: int, completion_length: int) -> torch.Tensor | None:
        """`(B, P + C, L, k)` routes of the generation batch from its first generate call (the only one: tool calls,
        which would make more, are refused with this mode), or `None` when no call covered every row."""
        if self._routing_mode != "rollout":
            return None
        prompts = self._routing_generated[0][0] if self._routing_generated else []
        if len(prompts) != rows:
            logger.warning_once(
                f"routing_replay='rollout': the first HF generate call of a batch recorded the routes of "
                f"{len(prompts)} rows, not of the batch's {rows}: that batch is routed live (not replayed)"
            )
            return None
        completions = self._routing_generated[0][1]
        routes = batch_routes(prompts, completions, prompt_length, completion_length)
        return routes.to(self.accelerator.device)

    @contextlib.contextmanager
    def _routing_old_pass(self, rows: int, prompt_length: int, completion_length: int) -> Iterator[Any]:
        """Around a π_old pass: yields the routes it replays (`"rollout"`) or `None`; under `"old_policy"` the pass's
        own routes are captured (`_routing_captured`, added to the batch by `_routing_add_captured`)."""
        if self._routing_mode != "old_policy":
            yield self._routing_rollout_routes(rows, prompt_length, completion_length)
            return
        self._routing.captured = []
        try:
            yield None
            self._routing_captured = torch.cat(self._routing.captured) if self._routing.captured else None
        finally:
            self._routing.captured = None

    def _routing_add_rollout_routes(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch's routes (`ROUTE_KEYS`) from generation (`"rollout"`)."""
        shape = (batch["prompt_ids"].size(0), batch["prompt_ids"].size(1), batch["completion_ids"].size(1))
        routes = self._routing_rollout_routes(*shape)
        self._routing_generated = []
        return batch if routes is None else set_batch_routes(batch, routes)

    def _routing_add_captured(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch's routes (`ROUTE_KEYS`) from the π_old pass (`"old_policy"`); none when every micro-batch is
        on-policy (the loss forward is then the π_old pass itself)."""
        captured, self._routing_captured = self._routing_captured, None
        return batch if captured is None else set_batch_routes(batch, captured)

    def _routing_loss_metrics(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The disagreement accumulators of the loss forward just run (`routing/*`), or none when replay is off."""
        if self._routing is None:
            return {}
        return routing_metrics(self._routing.take_counts(), device)
