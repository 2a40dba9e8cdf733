"""Which transport runs beside the experts' GEMMs? Only the copy engines hide much (history.md 58).

    torchrun --nproc-per-node 2 -m benchmarks.studies.exchange_overlap [--shapes mixtral,dsv3] [--steps 10]

On CUDA GPUs of one host, how much of an exchange the GPU runs beside the experts' GEMMs, the
question behind overlapping the layer's exchange with compute (in chunks, or beside the shared experts). Per
transport, T * K rows of H bf16 per rank in EP equal blocks (the own block copied too): "nccl"
(all_to_all_single: NCCL's kernels, on a few SMs), "copy_engine" (each block written into its peer's
symmetric-memory buffer by cudaMemcpyAsync: the copy engines, no SMs; then a device barrier), "sm_copy"
(the same writes by an elementwise kernel over every SM) and "pull" (the layer's peer copy,
moetriton.kernels.pull_rows_plan: every rank gathers its rows from all sources' buffers expert-major, between
device barriers). The compute: moetriton.torch.moe.experts.expert_mlp forward on the same rows, L = E / EP
local experts with equal groups. gemm_ms, exchange_ms and both_ms (the exchange on a second stream, launched
with the GEMMs) are medians of calls started together on every rank; hidden_ms = gemm_ms + exchange_ms -
both_ms is the exchange time the GEMMs absorbed, hidden_pct of exchange_ms (100: fully hidden; 0: the two took
turns).
Writes <out>/<n>x_<gpu>/exchange_overlap.csv (benchmarks.studies).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.common import layer_shape
from benchmarks.exchange_torch import ROWS, run_study
from benchmarks.moe_torch import _median_ms
from moetriton import kernels
from moetriton.torch.executor import bound


def measure_overlap(name: str, steps: int, num_tokens: int, device: torch.device) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    from moetriton.torch.moe.experts import expert_mlp

    shape = layer_shape(name, num_tokens)
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = shape.num_experts // ep
    block = shape.num_tokens * shape.topk // ep  # rows for each destination rank
    rows, hidden, ffn = block * ep, shape.hidden, shape.ffn
    generator = torch.Generator(device).manual_seed(rank)
    send = torch.randn(rows, hidden, generator=generator, device=device, dtype=torch.bfloat16)
    received = torch.empty_like(send)
    gate_up = torch.randn(local, hidden, 2 * ffn, generator=generator, device=device).div(hidden**0.5)
    down = torch.randn(local, ffn, hidden, generator=generator, device=device).div(ffn**0.5)
    gate_up, down = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    group_sizes = torch.full((local,), rows // local, dtype=torch.int64, device=device)  # tail: last group

    def gemms() -> None:
        expert_mlp(send, group_sizes, gate_up, down, "swiglu")

    # Rank r's block for rank p lands at rows [r * block, (r + 1) * block) of p's buffer.
    buffer = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buffer, dist.group.WORLD)
    peers = [handle.get_buffer(peer, (rows, hidden), torch.bfloat16) for peer in range(ep)]

    def writes(copy) -> Callable[[], None]:
        def exchange() -> None:
            for peer in range(ep):
                copy(peers[peer][rank * block : (rank + 1) * block], send[peer * block : (peer + 1) * block])
            handle.barrier(channel=0)  # every peer's writes into this rank's buffer have landed

        return exchange

    # Chunk (j, p) of the expert-major receiving layout: local expert j's share of source p's block for
    # this rank, at rows [rank * block + j * chunk, +chunk) of p's buffer.
    chunk = block // local
    chunk_sizes = torch.full((ep * local,), chunk, dtype=torch.int64, device=device)
    source_offsets = rank * block + chunk * torch.arange(local, device=device).repeat_interleave(ep)
    pull_inputs = dict(
        peer_rows=torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
        chunk_sizes=chunk_sizes,
        source_offsets=source_offsets,
    )

    pull_rows = bound(
        kernels.pull_rows_plan,
        device,
        num_rows=chunk * ep * local,
        num_chunks=ep * local,
        num_sources=ep,
        source_rows=rows,
        hidden=hidden,
        dtype="bfloat16",
        element_bytes=2,
    )

    def pull() -> None:
        handle.barrier(channel=0)  # the sources' rows are in place
        pull_rows(pull_inputs)
        handle.barrier(channel=0)  # no source reuses its buffer while a peer still reads

    transports = {
        "nccl": lambda: dist.all_to_all_single(received, send),
        "copy_engine": writes(lambda target, source: target.copy_(source)),
        "sm_copy": writes(lambda target, source: torch.mul(source, 1, out=target)),
        "pull": pull,
    }
    side = torch.cuda.Stream(device)

    def together(exchange: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                exchange()
            gemms()
            torch.cuda.current_stream().wait_stream(side)

        return run

    def timed(step: Callable[[], None]) -> float:
        step()  # warm-up
        return _median_ms(step, steps, device, dist.group.WORLD)

    gemm_ms = timed(gemms)
    flops = 2 * rows * hidden * 2 * ffn + 2 * rows * ffn * hidden
    for transport, exchange in transports.items():
        exchange_ms, both_ms = timed(exchange), timed(together(exchange))
        hidden_ms = gemm_ms + exchange_ms - both_ms
        if rank == 0:
            row = dict(shape=name, ep=ep, transport=transport, gemm_ms=round(gemm_ms, 4))
            row.update(exchange_ms=round(exchange_ms, 4), both_ms=round(both_ms, 4))
            row.update(hidden_ms=round(hidden_ms, 4), hidden_pct=round(100 * hidden_ms / exchange_ms, 1))
            row.update(
                exchange_gbps=round(rows * hidden * 2 / 1e9 / (exchange_ms * 1e-3), 1),
                gemm_tflops=round(flops / (gemm_ms * 1e-3) / 1e12, 1),
            )
            ROWS.append(row)
            print(json.dumps(row), flush=True)


def main() -> int:
    return run_study(__doc__, measure_overlap, "exchange_overlap", needs_gpus=True)


if __name__ == "__main__":
    sys.exit(main())
