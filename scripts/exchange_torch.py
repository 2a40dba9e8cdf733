"""Time the PyTorch MoE layer's dropless row exchange alone, beside a plain all_to_all_single.

    torchrun --nproc-per-node 2 scripts/exchange_torch.py [--shapes mixtral,dsv3] [--steps 10]

Per shape (MOE_LAYER_SHAPES, tokens per GPU as there): T * K routed rows of H bf16 per rank, routed
uniformly at random; the forward exchange then the reverse one through moetriton.torch.moe.all_to_all_rows
(host split sizes, as the layer uses them), against two plain all_to_all_single calls of the same rows in
equal splits. Every timed call starts together on all ranks (barrier) and ends synchronised, so no rank's
lateness counts as exchange time (in a layer step it does: the benchmark's all_to_all stage). GB/s = bytes
this rank sends in both exchanges over the median wall time. One JSON line per measurement, from rank 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks`

import torch
import torch.distributed as dist

from benchmarks.common import exchange_parser, layer_shape
from benchmarks.moe_torch import _median_ms
from moetriton.torch.moe import all_to_all_rows


def measure(name: str, steps: int, num_tokens: int, device: torch.device) -> None:
    shape = layer_shape(name, num_tokens)
    ep, rank = dist.get_world_size(), dist.get_rank()
    rows, hidden = shape.num_tokens * shape.topk, shape.hidden
    generator = torch.Generator(device).manual_seed(rank)
    scores = torch.rand(shape.num_tokens, shape.num_experts, generator=generator, device=device)
    indices = scores.argsort(1)[:, : shape.topk]  # [T, K] distinct experts
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
            print(json.dumps(dict(row, gbps=round(gigabytes / (ms * 1e-3), 1))), flush=True)


def main() -> int:
    args = exchange_parser(__doc__).parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    for name in args.shapes.split(","):
        measure(name, args.steps, args.tokens, device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
