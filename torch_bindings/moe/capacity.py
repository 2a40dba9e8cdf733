"""The capacity policy's exchange: fixed [L, C] slabs through all_to_all_single (no size depends on data),
and the check that every rank of the EP group holds the same T, which those slabs need."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import EPLayout

from .._stages import stage
from ..permutation import sort_chunks_by_index
from .all_to_all import chunk_orders
from .collectives import all_to_all_rows, gather_counts
from .experts import batched_mlp


def capacity_experts(send, layout, group, gate_up, down, activation) -> Tensor:
    """Capacity: send buffer [E * C, H] = [EP, L, C] slabs -> expert outputs, same layout."""
    if layout.ep_size == 1:
        return batched_mlp(send, gate_up, down, activation)
    with stage("all_to_all"):
        received = all_to_all_rows(send, None, None, send.shape[0], group)  # [EP, L, C] source-major
    with stage("chunk_sort"):
        to_expert_major, to_source_major = chunk_orders(layout.ep_size, layout.local_experts, send.device)
        chunk_sizes = torch.full_like(to_expert_major, layout.capacity)
        expert_major, _ = sort_chunks_by_index(received, chunk_sizes, to_expert_major)  # [L, EP, C]
    out = batched_mlp(expert_major, gate_up, down, activation)
    with stage("chunk_sort"):
        source_major, _ = sort_chunks_by_index(out, chunk_sizes, to_source_major)
    with stage("all_to_all"):
        return all_to_all_rows(source_major, None, None, send.shape[0], group)


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


def gather_tokens(layout: EPLayout, group, device: torch.device) -> Callable[[], np.ndarray] | None:
    """Capacity with EP > 1 moves [L, C] slabs whose C follows from T, so every rank must hold the same T.
    Eager calls gather every rank's T first (queued before the router, awaited before the rows move: the
    host waits for the start of the call only); returns the function that waits for them, or None where
    nothing is gathered: dropless, EP = 1, and while torch.compile traces or a CUDA graph is captured (no
    host read there: equal T is then the caller's promise)."""
    if layout.dropless or layout.ep_size == 1 or torch.compiler.is_compiling():
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    mine = torch.full((1,), layout.num_tokens, dtype=torch.int64, device=device)
    return gather_counts(mine, layout.ep_size, group)[1]


def check_same_tokens(tokens_per_rank: np.ndarray) -> None:
    """The same error on every rank (each sees every rank's T) before any row is exchanged."""
    counts = tokens_per_rank.reshape(-1).tolist()
    if len(set(counts)) > 1:
        raise ValueError(
            f"x: capacity_factor needs the same number of tokens on every rank of ep_group, got {counts}"
            " (rank order); pass capacity_factor=None (dropless) for batches that differ"
        )
