"""What limits the combine kernels beside TE's unpermute? DRAM, for both (performance.md, "Results: H200").

A hardware-counter profile of the combine kernel (which is also dispatch's backward) beside TE's unpermute
kernel, on the named shapes: run it under Nsight Compute, e.g. (scripts/gpu_check.sh, stage `ncu`)

    ncu --clock-control none --kernel-name regex:'_combine_kernel|_unpermute_kernel' \
        --section SpeedOfLight --section WarpStateStats ... \
        python -m benchmarks.studies.profile_kernels --shapes qwen3

Per shape, in this order and each called twice (ncu profiles every call; the first call of ours also
compiles): dispatch backward (unweighted combine of the cotangent) ours then TE's, then the weighted combine
ours then TE's. bf16 rows, a [T, E] mask with K random experts per token, as in the eager benchmark.
"""

from __future__ import annotations

import argparse
import sys

import torch

import moetriton.torch as mt
from benchmarks.eager_cases import te_permutation
from moetriton.kernels.rules.shapes import NAMED_SHAPES
from moetriton.torch import permutation

CALLS = 2


def profile(shape_name: str, te) -> None:
    shape = NAMED_SHAPES[shape_name]
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K
    generator = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(T, E, device="cuda", generator=generator).topk(K, dim=1).indices
    mask = torch.zeros(T, E, device="cuda", dtype=torch.bool).scatter_(1, ids, True)
    weights = torch.rand(T, E, device="cuda", generator=generator)
    rows = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=generator)
    row_map = mt.token_dispatch(torch.empty(T, 0, device="cuda", dtype=torch.bfloat16), mask, N)[2]
    te_map = te.make_row_id_map(mask, T, E)
    cases = (
        ("dispatch_bwd ours", lambda: permutation.DISPATCH_BACKWARD(rows, None, row_map)),
        ("dispatch_bwd te", lambda: te.unpermute_with_mask_map(rows, te_map, None, None, None, T, E, H)),
        ("combine ours", lambda: mt.token_combine(rows, row_map, weights)),
        ("combine te", lambda: te.unpermute_with_mask_map(rows, te_map, weights, None, None, T, E, H)),
    )
    for name, call in cases:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
        print(f"{shape_name}: {name} x{CALLS}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="qwen3,dsv3,mixtral")
    args = parser.parse_args()
    te = te_permutation()
    if te is None:
        sys.exit("TE's Triton permutation wrappers are not importable (carry .te)")
    for shape_name in args.shapes.split(","):
        profile(shape_name, te)


if __name__ == "__main__":
    main()
