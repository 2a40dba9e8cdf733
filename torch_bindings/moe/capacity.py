"""The capacity policy's exchange: fixed [L, C] slabs through all_to_all_single (no size depends on data), and
the check that every rank of the EP group holds the same T, which those slabs need."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import EPLayout

from .._stages import stage
from ..chunk_sort import sort_chunks_by_index
from .all_to_all import chunk_orders
from .collectives import all_to_all_rows, gather_counts
from .exchange import Exchange, Send
from .experts import Experts


class CapacityExchange(Exchange):
    """Capacity with EP > 1 through all_to_all_single (moetriton.torch.moe.exchange's contract): the send
    buffer [E * C, H] = [EP, L, C] slabs goes out as it is, arrives source-major [EP, L, C], is chunk-sorted
    to the experts' [L, EP * C] for one batched GEMM per projection, and returns the same way. One chunk;
    nothing is counted or synced (eager calls check every rank's T first: `gather_tokens`)."""

    def __init__(
        self, layout: EPLayout, group, rank: int, same_tokens: Callable[[], np.ndarray] | None
    ) -> None:
        super().__init__(layout, group, rank)
        self.same_tokens = same_tokens

    def __call__(self, sends: Iterable[Send], experts: Experts) -> Iterator[tuple[Send, Tensor]]:
        layout, group = self.layout, self.group
        (send,) = sends
        if self.same_tokens is not None:  # before any row is exchanged
            check_same_tokens(self.same_tokens())
        rows = send.rows.shape[0]
        with stage("all_to_all"):
            received = all_to_all_rows(send.rows, None, None, rows, group)  # [EP, L, C] source-major
        with stage("chunk_sort"):
            to_expert_major, to_source_major = chunk_orders(
                layout.ep_size, layout.local_experts, received.device
            )
            chunk_sizes = torch.full_like(to_expert_major, layout.capacity)
            expert_major, _ = sort_chunks_by_index(received, chunk_sizes, to_expert_major)  # [L, EP, C]
        out = experts(expert_major)
        with stage("chunk_sort"):
            source_major, _ = sort_chunks_by_index(out, chunk_sizes, to_source_major)
        with stage("all_to_all"):
            returned = all_to_all_rows(source_major, None, None, rows, group)
        yield send, returned


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
