"""Launch configurations of the peer exchange's copies (moetriton.kernels.peer_exchange) on the GPUs of one
host, every rank copying at once as in the layer (so NVLink carries both directions):

    torchrun --nproc-per-node 2 -m benchmarks.peer_exchange_sweep [--shapes dsv3,mixtral]

Per MOE_LAYER_SHAPES shape, balanced counts (T K / E rows per expert and rank), the staging buffers of the
layer (moetriton.torch.moe.peer) filled with random rows: for every config of the grid (rows per
program, bytes per step, warps) the pull, the pull with scale and dot products (the combine backward's) and
the push, each timed alone (CUDA events around the copy, after a barrier; median of the iterations, slowest
rank), as ms and GB/s of the bytes a rank receives (R x H x 2). The defaults (DEFAULT_CONFIG) are marked.
Writes <out>/<n>x_<gpu>/peer_exchange_sweep.csv (benchmarks.common).
"""

from __future__ import annotations

import itertools
import statistics

import torch
import torch.distributed as dist

from benchmarks.common import shape_layout, shapes_parser, write_results
from moetriton import kernels
from moetriton.kernels.peer_exchange import DEFAULT_CONFIG
from moetriton.kernels.rules.expert_parallel import peer_chunks
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES
from moetriton.torch.executor import Executable
from moetriton.torch.moe.peer import _staging

GRID = dict(rows=(2, 4, 8), block_bytes=(2048, 4096, 8192), num_warps=(4, 8))


def _timed(executable, inputs: dict, staging, iterations: int, group) -> float:
    """Median ms of `executable(inputs)` over the iterations, slowest rank."""
    times = []
    for _ in range(iterations):
        staging.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        executable(inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest)


def main() -> None:
    parser = shapes_parser(__doc__, "dsv3,mixtral")
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    rows = []
    dist.init_process_group("nccl")
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device, group = torch.device("cuda", rank), dist.group.WORLD
    for name in args.shapes.split(","):
        shape = MOE_LAYER_SHAPES[name]
        layout = shape_layout(shape, ep)
        slots = shape.num_tokens * shape.topk
        counts = torch.full((ep, shape.num_experts), slots // shape.num_experts, dtype=torch.int64)
        counts[:, : slots % shape.num_experts] += 1
        chunks = {key: value.to(device) for key, value in peer_chunks(counts, rank, layout).items()}
        num_rows = int(chunks["chunk_sizes"].sum())
        staging = _staging(group, device, layout.send_rows, shape.hidden * 2)
        staging.rows_view(layout.send_rows, shape.hidden, torch.bfloat16).normal_()
        rows = torch.randn(num_rows, shape.hidden, device=device, dtype=torch.bfloat16)
        weights = torch.rand(num_rows, device=device)
        sizes = dict(num_rows=num_rows, num_chunks=chunks["chunk_sizes"].shape[0], num_sources=ep)
        sizes.update(hidden=shape.hidden, element_bytes=2)
        common = dict(chunk_sizes=chunks["chunk_sizes"], source_offsets=chunks["source_offsets"])
        common.update(peer_rows=staging.rows_table)
        received = num_rows * shape.hidden * 2
        if rank == 0:
            print(f"{name}: R = {num_rows} rows of H = {shape.hidden} per rank, {received / 1e9:.3f} GB")
        for values in itertools.product(*GRID.values()):
            config = dict(zip(GRID, values, strict=True))
            pull_dot = kernels.pull_rows_plan(**sizes, dtype="bfloat16", scale_dot=True, config=config)
            runs = {
                "pull": (kernels.pull_rows_plan(**sizes, dtype="bfloat16", config=config), common),
                "pull_scale_dot": (pull_dot, {**common, "saved": rows, "weights": weights}),
                "push": (
                    kernels.push_rows_plan(**sizes, has_probs=False, config=config),
                    {**common, "rows": rows},
                ),
            }
            line = []
            for kind, (plan, inputs) in runs.items():
                executable = Executable(plan, device)
                _timed(executable, inputs, staging, 2, group)  # compile and warm up
                ms = _timed(executable, inputs, staging, args.iterations, group)
                line.append(f"{kind} {ms:.3f} ms {received / ms / 1e6:6.1f} GB/s")
                rows.append(
                    dict(shape=name, ep=ep, **config, default=config == DEFAULT_CONFIG, copy=kind)
                    | dict(rows_received=num_rows, ms=round(ms, 4), gbps=round(received / ms / 1e6, 1))
                )
            if rank == 0:
                mark = " (default)" if config == DEFAULT_CONFIG else ""
                print(f"  {config}{mark}: " + " | ".join(line), flush=True)
    if rank == 0:
        path = write_results("peer_exchange_sweep", rows, torch.cuda.get_device_name(device), ep, args.out)
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
