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
