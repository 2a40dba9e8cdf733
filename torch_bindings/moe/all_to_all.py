"""The dropless row exchange through all_to_all_single: counts gathered and read on the host (the call's one
sync), rows exchanged source-major, chunk-sorted to expert-major for the experts and back."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import dropless_exchange, ep_layout

from .._stages import stage
from ..permutation import sort_chunks_by_index
from .collectives import all_to_all_rows
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
    send, send_counts, gathered, layout, ep_rank, group, gate_up, down, activation
) -> Tensor:
    """Dropless: send buffer [S, H] with send_counts [E] rows per expert -> expert outputs, same layout.
    gathered: with EP > 1, `gather_counts`' pair (every rank's counts [EP, E], their host copy)."""
    if layout.ep_size == 1:
        return expert_mlp(send, send_counts, gate_up, down, activation)
    counts_all, counts_on_host = gathered
    with stage("chunk_sort"):
        # Before the host waits: the device work queued here runs while it does, and nothing of it is left
        # between the wait and the row exchange.
        on_device = dropless_exchange(counts_all, ep_rank, layout)
        to_expert_major, to_source_major = chunk_orders(layout.ep_size, layout.local_experts, send.device)
        chunk_sizes = on_device["chunk_sizes"]  # [EP * L] source-major
        returning_sizes = chunk_sizes[to_expert_major]  # [L * EP] expert-major
    with stage("exchange_sizes"):
        on_host = dropless_exchange(counts_on_host(), ep_rank, layout)  # the call's one host sync
        send_sizes, recv_sizes = on_host["send_sizes"].tolist(), on_host["recv_sizes"].tolist()
    with stage("all_to_all"):
        received = all_to_all_rows(
            send, send_sizes, recv_sizes, sum(recv_sizes), group
        )  # [R, H] source-major
    with stage("chunk_sort"):
        expert_major, _ = sort_chunks_by_index(received, chunk_sizes, to_expert_major)
    out = expert_mlp(expert_major, on_device["group_sizes"], gate_up, down, activation)
    with stage("chunk_sort"):
        source_major, _ = sort_chunks_by_index(out, returning_sizes, to_source_major)
    with stage("all_to_all"):
        return all_to_all_rows(source_major, recv_sizes, send_sizes, send.shape[0], group)
