"""MoE routing replay in the asynchronous trainer (`RLLossAsyncGRPOConfig.routing_replay`).

The hooks, the gate weights and the metrics are the synchronous trainer's (`common/routing_replay.py`); what is
asynchronous is where the routes come from and the layout they are replayed in:

* `"rollout"` (R3): `HFGenerateRolloutWorker` records the routers during its HF `generate`
  (`RoutingReplay.recording`, `generation_routes`), and each `RolloutSample` carries its tokens' routes
  (`routed_experts` `(T, L, k)` int16, `-1` where no route was recorded: the last generated token) through the sample
  channel. TRL's collator folds a row's samples into a prefix trie (`TreeRow`), where a token shared by several
  samples (their common prompt, a common start of their completions) is one packed position: it replays the route of
  the first sample that recorded one (`tree_routes`), and the samples whose own route differs there are counted
  (`routing/shared_tokens_differing`). The trainer replays the packed row's routes in every forward of it: π_old,
  the reference and the loss.
* `"old_policy"` (R2): the π_old pass of each packed row (`get_batch_samples`, before the step's first backward)
  records its routes, and the loss forward of that row replays them; with `num_mini_batches > 1` the later
  mini-batches then train through the experts π_old chose.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..common.packing import tree_positions
from ..common.routing_replay import NO_ROUTE, RoutingReplay, routing_metrics

__all__ = [
    "AsyncRoutingReplay",
    "RoutedRolloutSample",
    "collate_routes",
    "sample_routes",
    "tree_routes",
]


@dataclasses.dataclass(slots=True)
class RoutedRolloutSample(RolloutSample):
    """TRL's `RolloutSample` (slotted) with its tokens' MoE routes: `routed_experts` `(T, L, k)` int16, aligned with
    `input_ids`, `-1` where no route was recorded."""

    routed_experts: np.ndarray | None = None


_SHARED_DIFFERING = "routing/shared_tokens_differing"


def sample_routes(sample: RolloutSample, prompt: torch.Tensor, completion: torch.Tensor) -> RoutedRolloutSample:
    """`sample` carrying the `(p + c, L, k)` int16 routes of its tokens to the trainer: its prompt's `(p, L, k)` and
    its completion's `(c, L, k)` (`generation_routes`)."""
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(RolloutSample)}
    return RoutedRolloutSample(**fields, routed_experts=torch.cat([prompt, completion]).to(torch.int16).numpy())


def tree_routes(row: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor | None, int, int]:
    """`(N, L, k)` int16 routes of a `TreeRow`'s packed positions (`input_ids` `(N,)`: its packed tokens, checked
    against the layout), `-1` where no sample recorded one, or `None` when its samples carry no routes; also the
    number of tokens of later samples at a position an earlier sample's route is replayed for, and how many of them
    recorded another route (another set of experts in at least one layer).

    A shared position replays the route of the first of its samples (in the row's order) that recorded one.
    """
    routes = [sample.get("routed_experts") for sample in row.samples]
    if all(r is None for r in routes):
        return None, 0, 0
    if any(r is None for r in routes):
        raise ValueError("routing_replay='rollout': some samples of a packed row carry routed experts, others none")
    positions = torch.tensor(tree_positions(row), dtype=torch.long)
    if not torch.equal(input_ids[positions], torch.tensor(row.tokens, dtype=input_ids.dtype)):
        raise RuntimeError("routing_replay: TRL's TreeRow.pack lays its trie out in another order than tree_positions")
    layers, k = routes[0].shape[1:]
    out = torch.full((len(row.tokens), layers, k), NO_ROUTE, dtype=torch.int16)
    owned = torch.zeros(len(row.tokens), dtype=torch.bool)
    shared = differing = 0
    for route, nodes in zip(routes, row.sample_nodes, strict=True):
        route, nodes = torch.as_tensor(route), torch.tensor(nodes, dtype=torch.long)
        if route.shape[0] != nodes.shape[0]:
            raise ValueError(f"a sample of {nodes.shape[0]} tokens carries routes of {route.shape[0]} tokens")
        has = route[:, 0, 0] >= 0
        new = has & ~owned[nodes]
        out[nodes[new]] = route[new]
        owned[nodes[new]] = True
        seen = has & ~new  # another sample's route is replayed here
        shared += int(seen.sum())
        mine, replayed = route[seen].sort(dim=-1).values, out[nodes[seen]].sort(dim=-1).values
        differing += int((mine != replayed).flatten(1).any(dim=1).sum())
    packed = torch.full((input_ids.shape[0], layers, k), NO_ROUTE, dtype=torch.int16)
    packed[positions] = out
    return packed, shared, differing


def collate_routes(rows: list[Any], packed_ids: list[torch.Tensor], width: int, metrics: dict[str, list]):
    """`(R, width, L, k)` routes of a micro-batch's rows (padded with `-1` like TRL pads the rows), or `None`; the
    shared tokens whose own route differs from the replayed one are appended to `metrics`
    (`routing/shared_tokens_differing`: their fraction of the shared tokens)."""
    per_row = [tree_routes(row, ids) for row, ids in zip(rows, packed_ids, strict=True)]
    if all(routes is None for routes, _, _ in per_row):
        return None
    layers, k = next(routes for routes, _, _ in per_row if routes is not None).shape[1:]
    out = torch.full((len(rows), width, layers, k), NO_ROUTE, dtype=torch.int16)
    for r, (routes, _, _) in enumerate(per_row):
        if routes is not None:
            out[r, : routes.shape[0]] = routes
    shared, differing = sum(s for _, s, _ in per_row), sum(d for _, _, d in per_row)
    metrics[_SHARED_DIFFERING].append((float(differing), float(shared)))
    return out


class AsyncRoutingReplay:
    """The asynchronous trainer's side of routing replay (mixed into `RLLossAsyncGRPOTrainer`): the hooks on the
    policy and the reference, and the routes each forward of a packed row replays or records."""

    _routing: RoutingReplay | None = None
    _routing_mode = "off"

    @staticmethod
    def _check_routes_source(mode: str, worker: Any) -> None:
        """`"rollout"` needs a rollout worker whose samples carry the routes it sampled with (`records_routes`)."""
        if mode == "rollout" and not getattr(worker, "records_routes", False):
            name = "TRL's vLLM rollout worker" if worker is None else type(worker).__name__
            raise ValueError(
                f"routing_replay='rollout' replays the experts the sampler chose, but {name} does not record them "
                "(records_routes): use HFGenerateRolloutWorker built with these arguments, or routing_replay="
                "'old_policy'"
            )

    def _setup_routing_replay(self, mode: str, policy: nn.Module, reference: nn.Module | None) -> None:
        """Attach the hooks to the policy's and the reference's routers (`mode` != `"off"`)."""
        self._routing_mode = mode
        if mode == "off":
            return
        self._routing = RoutingReplay().attach(policy)
        if reference is not None:
            self._routing.attach(reference)

    @contextlib.contextmanager
    def _routed_pass(self, row: Any, role: str, count: bool = False) -> Iterator[None]:
        """Route one forward of the packed `row` (`role`: `"old"`, the π_old pass; `"reference"`; `"loss"`): replay
        its `routed_experts`, or, in the π_old pass under `"old_policy"`, record them into `row.routed_experts`."""
        routing = self._routing
        if routing is None or (role == "reference" and self._routing_mode != "rollout"):
            yield
            return
        if role == "old" and self._routing_mode == "old_policy":
            with routing.recording() as records:
                yield
            row.routed_experts = torch.stack([torch.cat(calls) for calls in records], dim=1)  # (N, L, k)
            return
        if row.routed_experts is None:
            raise RuntimeError(
                f"routing_replay={self._routing_mode!r}: this packed row carries no routed experts to replay"
            )
        with routing.replay(row.routed_experts.to(torch.long), count=count):
            yield

    def _routing_loss_metrics(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The disagreement accumulators of the loss forward just run (`routing/*`), or none when replay is off."""
        if self._routing is None:
            return {}
        return routing_metrics(self._routing.take_counts(), device)
