"""Time the PyTorch MoE layer's dropless row exchange alone, beside a plain all_to_all_single.

    torchrun --nproc-per-node 2 -m benchmarks.exchange_torch [--shapes mixtral,dsv3] [--steps 10]
    torchrun --nproc-per-node 2 -m benchmarks.exchange_torch --overlap   # beside the experts' GEMMs

Per shape (MOE_LAYER_SHAPES, tokens per GPU as there): T * K routed rows of H bf16 per rank, routed
uniformly at random; the forward exchange then the reverse one through moetriton.torch.moe.all_to_all_rows
(host split sizes, as the layer uses them), against two plain all_to_all_single calls of the same rows in
equal splits. Every timed call starts together on all ranks (barrier) and ends synchronised, so no rank's
lateness counts as exchange time (in a layer step it does: the benchmark's all_to_all stage). GB/s = bytes
this rank sends in both exchanges over the median wall time. One JSON line per measurement, from rank 0;
all of them in <out>/<n>x_<gpu>/exchange_torch.csv (benchmarks.common; exchange_torch_landing.csv with
--landing).

With --landing, the forward exchange as the layer lands it in expert-major order, two ways: "sorted"
(all_to_all_rows, then the chunk sort to expert-major: the layer's path) and "landing" (one NCCL send /
receive per (peer, local expert) chunk through batch_isend_irecv, straight into expert-major order; the
rows a rank keeps are copied in place by index). host_ms: the host time to issue one call, unsynchronised.

With --overlap (CUDA GPUs of one host), how much of an exchange the GPU runs beside the experts' GEMMs, the
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
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.common import exchange_parser, layer_shape, shape_layout, write_results
from benchmarks.moe_torch import _median_ms
from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import dropless_exchange
from moetriton.torch import sort_chunks_by_index
from moetriton.torch.executor import bound
from moetriton.torch.moe import all_to_all_rows
from moetriton.torch.moe.all_to_all import chunk_orders


def _routed_indices(shape, rank: int, device: torch.device) -> torch.Tensor:
    """[T, K] distinct experts per token, uniformly at random (seeded by the rank)."""
    generator = torch.Generator(device).manual_seed(rank)
    scores = torch.rand(shape.num_tokens, shape.num_experts, generator=generator, device=device)
    return scores.argsort(1)[:, : shape.topk]


ROWS: list[dict] = []  # rank 0's measurements, for the results file


def measure(name: str, steps: int, num_tokens: int, device: torch.device) -> None:
    shape = layer_shape(name, num_tokens)
    ep, rank = dist.get_world_size(), dist.get_rank()
    rows, hidden = shape.num_tokens * shape.topk, shape.hidden
    indices = _routed_indices(shape, rank, device)
    per_rank = torch.bincount(indices.flatten() // (shape.num_experts // ep), minlength=ep)  # [EP]
    send_sizes = per_rank.tolist()
    recv = torch.empty_like(per_rank)
    dist.all_to_all_single(recv, per_rank)
    recv_sizes = recv.tolist()
    send = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)

    def both() -> None:
        received = all_to_all_rows(send, send_sizes, recv_sizes, sum(recv_sizes), None)
        all_to_all_rows(received, recv_sizes, send_sizes, rows, None)

    plain_out = torch.empty_like(send)

    def plain() -> None:
        dist.all_to_all_single(plain_out, send)
        dist.all_to_all_single(send, plain_out)

    gigabytes = 2 * rows * hidden * 2 / 1e9
    for exchange, step in (("layer", both), ("plain", plain)):
        step()
        ms = _median_ms(step, steps, device, dist.group.WORLD)
        if rank == 0:
            row = dict(shape=name, ep=ep, exchange=exchange, ms=round(ms, 4))
            ROWS.append(dict(row, gbps=round(gigabytes / (ms * 1e-3), 1)))
            print(json.dumps(ROWS[-1]), flush=True)


def measure_landing(name: str, steps: int, num_tokens: int, device: torch.device) -> None:
    shape = layer_shape(name, num_tokens)
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = shape.num_experts // ep
    indices = _routed_indices(shape, rank, device)
    counts = torch.bincount(indices.flatten(), minlength=shape.num_experts)  # [E]
    counts_all = torch.empty(ep * shape.num_experts, dtype=counts.dtype, device=device)
    dist.all_gather_into_tensor(counts_all, counts)
    counts_all = counts_all.view(ep, shape.num_experts)
    host_counts = counts_all.cpu()
    layout = shape_layout(shape, ep)
    sizes = dropless_exchange(host_counts, rank, layout)
    send_sizes, recv_sizes = sizes["send_sizes"].tolist(), sizes["recv_sizes"].tolist()
    rows = int(counts.sum())
    send = torch.randn(rows, shape.hidden, device=device, dtype=torch.bfloat16)
    on_device = dropless_exchange(counts_all, rank, layout)
    to_expert_major, _ = chunk_orders(ep, local, device)

    def sorted_exchange() -> torch.Tensor:
        received = all_to_all_rows(send, send_sizes, recv_sizes, sum(recv_sizes), None)
        return sort_chunks_by_index(received, on_device["chunk_sizes"], to_expert_major)[0]

    # Send chunks (peer, local expert) in the send buffer's order; landing chunks (local expert, source).
    send_starts = [0, *torch.cumsum(host_counts[rank], 0).tolist()]
    mine = host_counts.reshape(ep, ep, local)[:, rank]  # [source, local expert]
    land_sizes = mine.t().reshape(-1)  # [L * EP] expert-major
    land_starts = [0, *torch.cumsum(land_sizes, 0).tolist()]
    landed = send.new_empty(int(land_sizes.sum()), shape.hidden)
    ops, keep_src, keep_dst = [], [], []
    for peer in range(ep):
        for expert in range(local):
            chunk = peer * local + expert
            out_chunk = expert * ep + peer
            start, size = send_starts[chunk], int(host_counts[rank, chunk])
            land_start, land_size = land_starts[out_chunk], int(mine[peer, expert])
            if peer == rank:
                keep_src.append(torch.arange(start, start + size))
                keep_dst.append(torch.arange(land_start, land_start + land_size))
                continue
            if size:
                ops.append(dist.P2POp(dist.isend, send[start : start + size], peer))
            if land_size:
                ops.append(dist.P2POp(dist.irecv, landed[land_start : land_start + land_size], peer))
    keep_src = torch.cat(keep_src).to(device)
    keep_dst = torch.cat(keep_dst).to(device)
    host_times = []

    def landing_exchange() -> None:
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops)
        landed[keep_dst] = send[keep_src]
        for work in works:
            work.wait()
        host_times.append((time.perf_counter() - start) * 1e3)

    expected = sorted_exchange()
    landing_exchange()
    same = bool(torch.equal(expected[: landed.shape[0]], landed))
    gigabytes = rows * shape.hidden * 2 / 1e9
    for exchange, step in (("sorted", sorted_exchange), ("landing", landing_exchange)):
        host_times.clear()
        ms = _median_ms(step, steps, device, dist.group.WORLD)
        if rank == 0:
            row = dict(
                shape=name, ep=ep, exchange=exchange, ms=round(ms, 4), gbps=round(gigabytes / (ms * 1e-3), 1)
            )
            if host_times:
                row.update(
                    host_ms=round(sorted(host_times)[len(host_times) // 2], 3), p2p_ops=len(ops), same=same
                )
            ROWS.append(row)
            print(json.dumps(row), flush=True)


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
    parser = exchange_parser(__doc__)
    parser.add_argument("--landing", action="store_true", help="time the expert-major landing variants")
    parser.add_argument("--overlap", action="store_true", help="each transport beside the experts' GEMMs")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if args.landing and args.overlap:
        parser.error("--landing and --overlap are separate runs")
    if args.overlap and not on_gpu:
        parser.error("--overlap needs CUDA GPUs of one host (streams, symmetric memory)")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mode = "_landing" if args.landing else "_overlap" if args.overlap else ""
    run = {"_landing": measure_landing, "_overlap": measure_overlap, "": measure}[mode]
    for name in args.shapes.split(","):
        run(name, args.steps, args.tokens, device)
    if dist.get_rank() == 0:
        device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
        name = "exchange_torch" + mode
        print(f"wrote {write_results(name, ROWS, device_name, dist.get_world_size(), args.out)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
