"""Does landing rows expert-major by NCCL point-to-point beat all-to-all + chunk sort? No (history.md 47).

    torchrun --nproc-per-node 2 -m benchmarks.studies.exchange_landing [--shapes mixtral,dsv3] [--steps 10]

The forward exchange as the layer lands it in expert-major order, two ways: "sorted"
(all_to_all_rows, then the chunk sort to expert-major: the layer's path) and "landing" (one NCCL send /
receive per (peer, local expert) chunk through batch_isend_irecv, straight into expert-major order; the
rows a rank keeps are copied in place by index). host_ms: the host time to issue one call, unsynchronised.
Writes <out>/<n>x_<gpu>/exchange_landing.csv (benchmarks.studies).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import layer_shape, shape_layout
from benchmarks.exchange_torch import ROWS, _routed_indices, run_study
from benchmarks.moe_torch import _median_ms
from moetriton.kernels.rules.expert_parallel import dropless_exchange
from moetriton.torch import sort_chunks_by_index
from moetriton.torch.moe import all_to_all_rows
from moetriton.torch.moe.all_to_all import chunk_orders


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


def main() -> int:
    return run_study(__doc__, measure_landing, "exchange_landing")


if __name__ == "__main__":
    sys.exit(main())
