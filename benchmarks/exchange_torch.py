"""Time the PyTorch MoE layer's dropless row exchange alone, beside a plain all_to_all_single.

    torchrun --nproc-per-node 2 -m benchmarks.exchange_torch [--shapes mixtral,dsv3] [--steps 10]

Per shape (MOE_LAYER_SHAPES, tokens per GPU as there): T * K routed rows of H bf16 per rank, routed
uniformly at random; the forward exchange then the reverse one through moetriton.torch.moe.all_to_all_rows
(host split sizes, as the layer uses them), against two plain all_to_all_single calls of the same rows in
equal splits. Every timed call starts together on all ranks (barrier) and ends synchronised, so no rank's
lateness counts as exchange time (in a layer step it does: the benchmark's all_to_all stage). GB/s = bytes
this rank sends in both exchanges over the median wall time. One JSON line per measurement, from rank 0;
all of them in <out>/<n>x_<gpu>/exchange_torch.csv (benchmarks.common). The landing and overlap variants
are studies: benchmarks.studies.exchange_landing, benchmarks.studies.exchange_overlap.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.common import exchange_parser, layer_shape, write_results
from benchmarks.moe_torch import _median_ms
from moetriton.torch.moe import all_to_all_rows


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


def run(measure_shape: Callable[[str, int, int, torch.device], None], name: str, args) -> int:
    """`measure_shape(shape, steps, tokens, device)` for every shape of `args` (exchange_parser's) in one
    process group (NCCL on CUDA GPUs, else gloo), then rank 0's ROWS to <args.out>/<n>x_<gpu>/<name>.csv.
    The exchange studies (benchmarks.studies.exchange_landing, exchange_overlap) run the same way."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    for shape in args.shapes.split(","):
        measure_shape(shape, args.steps, args.tokens, device)
    if dist.get_rank() == 0:
        device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
        print(f"wrote {write_results(name, ROWS, device_name, dist.get_world_size(), args.out)}")
    dist.destroy_process_group()
    return 0


def run_study(doc: str, measure_shape: Callable, name: str, needs_gpus: bool = False) -> int:
    """An exchange study's command line (benchmarks.studies): exchange_parser's options, results under
    benchmarks/studies/results, then `run`. needs_gpus: refused without CUDA GPUs, before any process
    group starts."""
    from benchmarks.studies import RESULTS_ROOT

    parser = exchange_parser(doc)
    parser.set_defaults(out=RESULTS_ROOT)
    args = parser.parse_args()
    if needs_gpus and not torch.cuda.is_available():
        parser.error("needs CUDA GPUs of one host (streams, symmetric memory)")
    return run(measure_shape, name, args)


def main() -> int:
    return run(measure, "exchange_torch", exchange_parser(__doc__).parse_args())


if __name__ == "__main__":
    sys.exit(main())
