"""Do the ops tied with TE's lead, interleaved? All but three, which trail by 0.4% or 0.2 µs (performance.md).

    python -m benchmarks.studies.interleave_te [--shapes qwen3] [--rounds 7] [--out ROOT]

Our permutation kernels against TE's Triton kernels, interleaved in one process on one GPU. The eager
benchmark times ours and TE's one after the other, and two such runs differ by 1-2% per op, so an op within
that of TE reads as ahead in one run and behind in the next. Here every round times each op of both
implementations once (CUDA-graph replays over rotating input sets, as `benchmarks.timing.time_graph`),
alternating which goes first, and the table gives each side's median and best over the rounds and the ratio
of the medians (docs/performance.md, "Results: H200"). Ops: dispatch backward (an unweighted combine:
`unpermute_with_mask_map` without probs), weighted combine and weighted combine backward, mask routing.
Needs TE's `transformer_engine.pytorch.triton.permutation` importable (scripts/gpu_check.sh adds TE_PATH to
the import path). Writes <out>/<gpu>/interleave_te.csv (benchmarks.studies).
"""

from __future__ import annotations

import statistics

import torch

import moetriton.torch as mt
from benchmarks.common import shapes_parser, write_results
from benchmarks.eager_cases import mask_routing, te_permutation
from benchmarks.studies import RESULTS_ROOT
from benchmarks.timing import input_sets, time_graph
from moetriton.kernels.rules.shapes import NAMED_SHAPES
from moetriton.torch import permutation


def _cases(shape, te, generator):
    """{op: (ours, TE's)}, each a list of no-argument calls, one per input set."""
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K

    def make():
        mask, probs = mask_routing(shape, generator)
        row_map = mt.token_dispatch(torch.empty(T, 0, device="cuda", dtype=torch.bfloat16), mask, N)[2]
        rows = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=generator)
        grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=generator)
        rows_grad = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=generator)
        return rows, row_map, probs, grad, rows_grad, te.make_row_id_map(mask, T, E)

    # Bytes one set holds: two [N, H] row buffers, the [T, H] gradient, both row maps and the probs.
    set_bytes = 2 * N * H * 2 + T * H * 2 + T * (2 * E + 2) * 4 + T * (2 * E + 1) * 4 + T * E * 4
    sets = [make() for _ in range(input_sets(set_bytes))]
    te_combine_backward = te.unpermute_with_mask_map_bwd_with_merging_probs
    return {
        "dispatch_bwd": (
            [lambda s=s: permutation.DISPATCH_BACKWARD(s[4], None, s[1]) for s in sets],
            [lambda s=s: te.unpermute_with_mask_map(s[4], s[5], None, None, None, T, E, H) for s in sets],
        ),
        "combine": (
            [lambda s=s: mt.token_combine(s[0], s[1], s[2]) for s in sets],
            [lambda s=s: te.unpermute_with_mask_map(s[0], s[5], s[2], None, None, T, E, H) for s in sets],
        ),
        "combine_bwd": (
            [lambda s=s: permutation.COMBINE_BACKWARD(s[3], s[1], s[0], s[2], False) for s in sets],
            [lambda s=s: te_combine_backward(s[3], s[5], s[0], s[2], None, T, E, N, H) for s in sets],
        ),
    }


def main() -> None:
    parser = shapes_parser(__doc__, "qwen3")
    parser.set_defaults(out=RESULTS_ROOT)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = []
    te = te_permutation()
    if te is None:
        raise SystemExit("TE's Triton permutation wrappers are not importable")
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, {args.rounds} rounds, graph µs per call")
    print("op,shape,ours_median,ours_best,te_median,te_best,median_ratio")
    for name in args.shapes.split(","):
        for op, (ours, theirs) in _cases(NAMED_SHAPES[name], te, generator).items():
            times: dict[str, list[float]] = {"ours": [], "te": []}
            for round_index in range(args.rounds):
                order = [("ours", ours), ("te", theirs)]
                for side, calls in order if round_index % 2 == 0 else order[::-1]:
                    times[side].append(time_graph(calls) * 1e3)
            ours_ms, te_ms = statistics.median(times["ours"]), statistics.median(times["te"])
            row = dict(op=op, shape=name, rounds=args.rounds, ours_median=round(ours_ms, 1))
            row |= dict(ours_best=round(min(times["ours"]), 1), te_median=round(te_ms, 1))
            row |= dict(te_best=round(min(times["te"]), 1), median_ratio=round(ours_ms / te_ms, 3))
            rows.append(row)
            print(",".join(str(value) for key, value in row.items() if key != "rounds"), flush=True)
    print(f"wrote {write_results('interleave_te', rows, torch.cuda.get_device_name(), 1, args.out)}")


if __name__ == "__main__":
    main()
