"""Where the host microseconds of one eager PyTorch call go.

    python -m benchmarks.profile_host [--shapes tiny,mixtral] [--calls 500] [--top 14]

For each op (dispatch with probs, combine forward + backward, chunk sort, router top-k), times `calls`
calls without the profiler in bursts of 10, each burst followed by a sync (host time per call: the best
burst, which a noisy host disturbs least, and the median), then runs them under cProfile and prints the
functions with the most own time, in microseconds per call (`--top 0`: timing only). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import moetriton.torch as mt
from moetriton.kernels.rules.shapes import NAMED_SHAPES


def _calls(shape) -> dict:
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    generator = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(T, E, device="cuda", generator=generator)
    ids = scores.topk(K, dim=1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=generator)
    row_map = mt.token_dispatch(x, mask, T * K)[2]
    rows = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = scores.clone().requires_grad_()
    grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    sizes = torch.full((E,), T * K // E, device="cuda", dtype=torch.int32)
    order = torch.arange(E, device="cuda", dtype=torch.int32).flip(0)
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_()
    grad_rows = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
    return {
        "dispatch": lambda: mt.token_dispatch(x, mask, T * K, scores),
        "dispatch_fwd_bwd": lambda: torch.autograd.grad(
            mt.token_dispatch(x_grad, mask, T * K, scores)[0], x_grad, grad_rows
        ),
        "combine_fwd_bwd": lambda: torch.autograd.grad(
            mt.token_combine(rows, row_map, weights), (rows, weights), grad
        ),
        "chunk_sort": lambda: mt.sort_chunks_by_index(rows.detach(), sizes, order),
        "router_topk": lambda: mt.fused_topk_with_score_function(logits, K),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="tiny,mixtral")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    for shape_name in args.shapes.split(","):
        for name, call in _calls(NAMED_SHAPES[shape_name]).items():
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            bursts = []
            for _ in range(args.calls // 10):  # bursts short enough that the launch queue never fills
                start = time.perf_counter()
                for _ in range(10):
                    call()
                bursts.append((time.perf_counter() - start) / 10 * 1e6)
                torch.cuda.synchronize()
            bursts.sort()
            host_us, median_us = bursts[0], bursts[len(bursts) // 2]
            print(f"\n== {shape_name} {name}: {host_us:.1f} us per call without the profiler", end="")
            print(f" (best burst of 10; median {median_us:.1f})")
            if args.top == 0:
                continue
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(profile).sort_stats("tottime")
            rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[: args.top]
            for (path, line, function), (_, calls, own, cumulative, _) in rows:
                where = f"{path.rsplit('/', 2)[-2:][-1]}:{line}" if "/" in path else path
                print(
                    f"  {own / args.calls * 1e6:7.2f} us own  {cumulative / args.calls * 1e6:7.2f} us cum  "
                    f"{calls / args.calls:5.1f}x  {function}  ({where})"
                )


if __name__ == "__main__":
    main()
