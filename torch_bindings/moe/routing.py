"""The MoE layer's routing stage: the router (logits, fused top-k, merging weights), the token mask, the drop
policy under a capacity, and the token chunks of the dropless pipeline."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import EPLayout, pipeline_chunk_bounds

from ..router import fused_topk_with_score_function


@dataclass
class Routing:
    """Where a rank's tokens go: logits [T, E] (x.dtype), routing_map [T, E] bool, indices [T, K] int32
    (-1: no expert), merging weights [T, K] (the router's probs at indices) and routed [E] int64 (the routing
    map's column sums, this rank's slots per expert). Padding tokens have no routing-map row, index -1 and
    weight 0."""

    logits: Tensor
    routing_map: Tensor
    indices: Tensor
    merging: Tensor
    routed: Tensor


def route(
    tokens: Tensor,
    gate_weight: Tensor,
    gate_bias: Tensor | None,
    valid: Tensor | None,
    expert_bias: Tensor | None,
    routing_indices: Tensor | None = None,
    **router,
) -> Routing:
    """The router on tokens [T, H] with gate_weight [E, H] and gate_bias [E] or None (logits in tokens.dtype,
    fp32 accumulation) and
    the router's options (moetriton.kernels.rules.moe.ROUTER_OPTIONS, by name). valid [T] bool or None:
    False marks padding, which takes no slot (index -1 is no expert to the dispatch), no weight and no
    count. routing_indices [T, K] or None: the router's replay (a slot it refuses has index -1)."""
    logits = F.linear(tokens, gate_weight, gate_bias)  # [T, E]
    probs, routing_map, indices = fused_topk_with_score_function(
        logits, expert_bias=expert_bias, return_indices=True, routing_indices=routing_indices, **router
    )
    # [T, K]; a slot without expert (-1, from a replay) has weight 0
    merging = torch.where(indices >= 0, probs.gather(1, indices.clamp_min(0).long()), 0.0)
    if valid is not None:
        routing_map = routing_map & valid[:, None]
        indices = torch.where(valid[:, None], indices, -1)
        merging = torch.where(valid[:, None], merging, 0.0)
    return Routing(logits, routing_map, indices, merging, routing_map.sum(0))


def apply_drop_policy(routing: Routing, layout: EPLayout, drop_policy: str) -> Routing:
    """The routing the dispatch runs: under a capacity with drop_policy "probs", every slot its expert drops
    set to -1 (`most_probable_slots`), so that the dispatch's position capacity keeps all the rest; the
    routing itself otherwise ("position": the dispatch keeps each expert's first C slots in token order;
    dropless: every slot)."""
    if layout.dropless or drop_policy != "probs":
        return routing
    return replace(routing, indices=most_probable_slots(routing.indices, routing.merging, layout))


def most_probable_slots(indices: Tensor, merging: Tensor, layout: EPLayout) -> Tensor:
    """drop_policy "probs": indices [T, K] with every slot an expert drops set to -1 (no expert), so that
    the dispatch's position capacity keeps all the rest. Each expert keeps its C = layout.capacity slots of
    highest merging weight (merging [T, K]), NaN below every number and ties (-0.0 and +0.0, NaN and NaN)
    to the earlier slot in (token, slot) order (moetriton.kernels.rules.moe.NON_FINITE); slots already -1
    (masked tokens) stay -1. Sorts on the device: static shapes, no host sync, deterministic."""
    num_experts = layout.num_experts
    experts = indices.reshape(-1).long()
    experts = torch.where(experts >= 0, experts, num_experts)  # [T * K]; no expert sorts last
    weights = merging.reshape(-1).float()
    missing = weights.isnan()
    # Canonical keys: NaN as -inf (set apart by the second sort), -0.0 as +0.0 (a radix sort on the GPU
    # would order their bits).
    weights = torch.where(missing, -torch.inf, torch.where(weights == 0, 0.0, weights))
    # Stable sorts: by weight (descending; ties keep slot order), then by expert with NaN weights after
    # every number of the same expert.
    by_weight = torch.sort(weights, descending=True, stable=True).indices
    group = 2 * experts + missing  # [T * K]
    order = by_weight[torch.sort(group[by_weight], stable=True).indices]  # [T * K] expert-major
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=indices.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))  # scatter_add: bincount would sync
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=indices.device) - starts[experts[order]]
    return torch.where((rank < layout.capacity).reshape(indices.shape), indices, -1)


@dataclass
class Chunk:
    """One token chunk of the routed path: its tokens [T_c, H], indices and merging weights [T_c, K], routing
    map [T_c, E], its layout (T = T_c), its place among the call's chunks, and its routed slots per expert
    [E] where already counted (the whole call's, for one chunk)."""

    index: int
    tokens: Tensor
    indices: Tensor
    merging: Tensor
    routing_map: Tensor
    layout: EPLayout
    counted: Tensor | None = None

    @property
    def routed(self) -> Tensor:
        """[E] int64: the chunk's routed slots per expert."""
        return self.counted if self.counted is not None else self.routing_map.sum(0)


def token_chunks(tokens: Tensor, routing: Routing, layout: EPLayout, pipeline_chunks: int) -> list[Chunk]:
    """The routed path's chunks: consecutive token ranges of sizes differing by one at most
    (moetriton.kernels.rules.expert_parallel.pipeline_chunk_bounds; empty ones where T < n, so that every
    rank runs the same number), or the whole call as one chunk (pipeline_chunks 1, and under a capacity,
    which the layer's checks hold to 1)."""
    if pipeline_chunks == 1:
        return [
            Chunk(0, tokens, routing.indices, routing.merging, routing.routing_map, layout, routing.routed)
        ]
    sizes = [end - start for start, end in pipeline_chunk_bounds(layout.num_tokens, pipeline_chunks)]
    # split, not slices: one concatenation of the chunks' gradients in the backward
    parts = (value.split(sizes) for value in (tokens, routing.indices, routing.merging, routing.routing_map))
    return [
        Chunk(index, *values, replace(layout, num_tokens=size))
        for index, (size, *values) in enumerate(zip(sizes, *parts, strict=True))
    ]
