"""The dropless row exchange through all_to_all_single: counts gathered and read on the host (the call's one
sync), rows exchanged source-major, chunk-sorted to expert-major for the experts and back; the layer's token
chunks pipelined, one chunk's exchange beside another's GEMMs."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import dropless_exchange, ep_layout

from .._stages import stage
from ..chunk_sort import sort_chunks_by_index
from .collectives import finish_exchange, start_exchange
from .exchange import Exchange, Send, gather_chunk_counts
from .experts import Experts
from .routing import Chunk


@functools.lru_cache(maxsize=64)
def chunk_orders(ep_size: int, local_experts: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(to expert-major, back to source-major) sorted_indices on the device, built once: a host-to-device
    copy on every call would sync and could not be captured in a CUDA graph."""
    layout = ep_layout(num_tokens=0, num_experts=ep_size * local_experts, topk=1, ep_size=ep_size)
    return (
        torch.tensor(layout.expert_major_order(), device=device),
        torch.tensor(layout.source_major_order(), device=device),
    )


class AllToAllExchange(Exchange):
    """The dropless exchange of an EP group through all_to_all_single (moetriton.torch.moe.exchange's
    contract). Every chunk is dispatched before the first row moves; with more than one chunk every exchange
    is started, not waited for (all_to_all_single on NCCL's stream): chunk c + 1's rows arrive while chunk
    c's GEMMs run, and chunk c's results return while chunk c + 1's run; the backward runs the same pipeline
    in reverse (see moetriton.torch.moe.collectives.finish_exchange). One chunk is the unpipelined layer, its
    exchanges in order on the current stream."""

    def start(self, chunks: Sequence[Chunk]) -> None:
        self.gathered = gather_chunk_counts(chunks, self.group)

    def __call__(self, sends: Iterable[Send], experts: Experts) -> Iterator[tuple[Send, Tensor]]:
        sends = list(sends)
        ep_size, local = self.layout.ep_size, self.layout.local_experts
        with stage("chunk_sort"):
            # Before the host waits: the device work queued here runs while it does, and nothing of it is left
            # between the wait and the row exchanges.
            to_expert_major, to_source_major = chunk_orders(ep_size, local, sends[0].rows.device)
            on_device = []  # per chunk (its exchange plan, the returning chunk sizes [L * EP] expert-major)
            for counts, send in zip(self.gathered, sends, strict=True):
                plan = dropless_exchange(counts.on_device, self.rank, send.chunk.layout)
                on_device.append((plan, plan["chunk_sizes"][to_expert_major]))
        with stage("exchange_sizes"):
            sizes = []  # per chunk (send_sizes, recv_sizes) on the host: the call's one host sync
            for counts, send in zip(self.gathered, sends, strict=True):
                host_plan = dropless_exchange(counts.on_host(), self.rank, send.chunk.layout)
                sizes.append((host_plan["send_sizes"].tolist(), host_plan["recv_sizes"].tolist()))
        # One chunk has nothing to run beside its exchanges: they run in order on the layer's stream.
        asynchronous = len(sends) > 1
        with stage("all_to_all"):
            arriving = [
                start_exchange(
                    send.rows, sent, got, sum(got), self.group, asynchronous
                )  # [R_c, H] source-major
                for send, (sent, got) in zip(sends, sizes, strict=True)
            ]
        returning = []
        for send, (sent, got), (plan, returning_sizes), started in zip(
            sends, sizes, on_device, arriving, strict=True
        ):
            with stage("all_to_all"):
                received = finish_exchange(started)
            with stage("chunk_sort"):
                # chunk sizes [EP * L] source-major
                expert_major, _ = sort_chunks_by_index(received, plan["chunk_sizes"], to_expert_major)
            out = experts(expert_major, plan["group_sizes"])
            with stage("chunk_sort"):
                source_major, _ = sort_chunks_by_index(out, returning_sizes, to_source_major)
            with stage("all_to_all"):
                returning.append(
                    start_exchange(source_major, got, sent, send.rows.shape[0], self.group, asynchronous)
                )
        for send, started in zip(sends, returning, strict=True):
            with stage("all_to_all"):
                rows = finish_exchange(started)
            yield send, rows
