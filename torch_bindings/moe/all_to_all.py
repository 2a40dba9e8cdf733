"""The dropless row exchange through all_to_all_single: counts gathered and read on the host (the call's one
sync), rows exchanged source-major, chunk-sorted to expert-major for the experts and back; the layer's token
chunks pipelined, one chunk's exchange beside another's GEMMs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import EPLayout, dropless_exchange, ep_layout

from .._stages import stage
from ..permutation import sort_chunks_by_index
from .collectives import finish_exchange, start_exchange
from .experts import expert_mlp


@functools.lru_cache(maxsize=64)
def chunk_orders(ep_size: int, local_experts: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(to expert-major, back to source-major) sorted_indices on the device, built once: a host-to-device
    copy on every call would sync and could not be captured in a CUDA graph."""
    layout = ep_layout(num_tokens=0, num_experts=ep_size * local_experts, topk=1, ep_size=ep_size)
    return (
        torch.tensor(layout.expert_major_order(), device=device),
        torch.tensor(layout.source_major_order(), device=device),
    )


def dropless_experts(
    sends: Sequence[tuple[Tensor, Tensor]],
    gathered: Sequence[tuple[Tensor, Callable[[], np.ndarray]]] | None,
    layouts: Sequence[EPLayout],
    ep_rank: int,
    group,
    gate_up: Tensor,
    down: Tensor,
    activation: str,
    combine: Callable[[int, Tensor], Tensor],
) -> list[Tensor]:
    """The dropless experts of a pipeline's token chunks: chunk c's send buffer [S_c, H] and its rows per
    expert [E] (sends[c]) -> combine(c, its expert outputs in the send buffer's layout), for every c.

    With EP > 1, gathered[c] is `gather_counts`' pair for chunk c (every rank's counts [EP, E] and their
    host copy; the host waits once, for all chunks) and every exchange is started, not waited for
    (all_to_all_single on NCCL's stream): chunk c + 1's rows arrive while chunk c's GEMMs run, and chunk
    c's results return while chunk c + 1's run; the backward runs the same pipeline in reverse (see
    `finish_exchange`). One chunk is the unpipelined layer, its exchanges in order on the current stream."""
    if layouts[0].ep_size == 1:  # the send buffer is the receive buffer, already expert-major
        return [
            combine(chunk, expert_mlp(send, counts, gate_up, down, activation))
            for chunk, (send, counts) in enumerate(sends)
        ]
    ep_size, local = layouts[0].ep_size, layouts[0].local_experts
    with stage("chunk_sort"):
        # Before the host waits: the device work queued here runs while it does, and nothing of it is left
        # between the wait and the row exchanges.
        to_expert_major, to_source_major = chunk_orders(ep_size, local, sends[0][0].device)
        on_device = []  # per chunk (its exchange plan, the returning chunk sizes [L * EP] expert-major)
        for (counts, _), layout in zip(gathered, layouts, strict=True):
            plan = dropless_exchange(counts, ep_rank, layout)
            on_device.append((plan, plan["chunk_sizes"][to_expert_major]))
    with stage("exchange_sizes"):
        sizes = []  # per chunk (send_sizes, recv_sizes) on the host: the call's one host sync
        for (_, on_host), layout in zip(gathered, layouts, strict=True):
            host_plan = dropless_exchange(on_host(), ep_rank, layout)
            sizes.append((host_plan["send_sizes"].tolist(), host_plan["recv_sizes"].tolist()))
    # One chunk has nothing to run beside its exchanges: they run in order on the layer's stream.
    asynchronous = len(sends) > 1
    with stage("all_to_all"):
        arriving = [
            start_exchange(send, sent, got, sum(got), group, asynchronous)  # [R_c, H] source-major
            for (send, _), (sent, got) in zip(sends, sizes, strict=True)
        ]
    returning = []
    for (send, _), (sent, got), (plan, returning_sizes), started in zip(
        sends, sizes, on_device, arriving, strict=True
    ):
        with stage("all_to_all"):
            received = finish_exchange(started)
        with stage("chunk_sort"):
            # chunk sizes [EP * L] source-major
            expert_major, _ = sort_chunks_by_index(received, plan["chunk_sizes"], to_expert_major)
        out = expert_mlp(expert_major, plan["group_sizes"], gate_up, down, activation)
        with stage("chunk_sort"):
            source_major, _ = sort_chunks_by_index(out, returning_sizes, to_source_major)
        with stage("all_to_all"):
            returning.append(start_exchange(source_major, got, sent, send.shape[0], group, asynchronous))
    results = []
    for chunk, started in enumerate(returning):
        with stage("all_to_all"):
            rows = finish_exchange(started)
        results.append(combine(chunk, rows))
    return results
