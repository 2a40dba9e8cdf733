"""PyTorch benchmarks of the permutation ops on a named shape: moetriton beside the pure-torch reference.

Routing: every token picks K distinct experts uniformly at random (dropless, num_out_tokens = T * K),
bf16 tokens, fp32 probs, a [T, E] bool mask (TE's format). Chunk sort reorders T * K rows split into
E chunks from rank-major to expert-major as after an all-to-all over min(8, E) ranks. "dispatch_bitmap" is
the same dispatch from the mask bit-packed as the router writes it (uint8 [T, ceil(E / 8)]).
"""

from __future__ import annotations

import torch

from moetriton import kernels
from moetriton.kernels.rules.shapes import MoEShape
from moetriton.torch.executor import device_info, run_plan

from .common import Result, shape_dispatch_plan, token_bytes
from .timing import input_sets, time_eager, time_graph

DTYPE = torch.bfloat16


def _routing(shape: MoEShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(shape.num_tokens, shape.num_experts, device="cuda", generator=generator)
    ids = scores.topk(shape.topk, dim=1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
    return mask, torch.rand(shape.num_tokens, shape.num_experts, device="cuda", generator=generator)


def _sets(shape: MoEShape, bytes_per_call: int, build):
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [build(generator) for _ in range(input_sets(bytes_per_call))]


def results(shape: MoEShape, quick: bool = False) -> list[Result]:
    import moetriton.torch as mt
    from moetriton.torch import reference

    if not torch.cuda.is_available():
        return []
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K
    eb = torch.finfo(DTYPE).bits // 8
    map_bytes = T * (E + 1) * 4
    out: list[Result] = []

    def add(op, impl, ms, nbytes, note=""):
        out.append(Result(op, "torch", impl, shape.name, ms, nbytes, note))

    # dispatch: mask + probs -> permuted tokens + probs (map building included)
    dispatch_bytes = (
        token_bytes(T, H, eb) + T * E + T * E * 4 + token_bytes(N, H, eb) + N * 4 + map_bytes + E * 4
    )

    def make_dispatch(generator):
        x = torch.randn(T, H, device="cuda", dtype=DTYPE, generator=generator)
        mask, probs = _routing(shape, generator)
        return x, mask, probs

    sets = _sets(shape, dispatch_bytes, make_dispatch)
    add(
        "dispatch",
        "moetriton",
        time_graph([lambda s=s: mt.token_dispatch(s[0], s[1], N, s[2]) for s in sets]),
        dispatch_bytes,
        "map + permute + probs, CUDA graph",
    )
    packed = [(s[0], reference.pack_bitmap(s[1]), s[2]) for s in sets]
    add(
        "dispatch_bitmap",
        "moetriton",
        time_graph(
            [
                lambda s=s: mt.token_dispatch(s[0], s[1], N, s[2], num_experts=E, routing_map_format="bitmap")
                for s in packed
            ]
        ),
        dispatch_bytes - T * E + T * ((E + 7) // 8),
        "map from a bitmap + permute + probs, CUDA graph",
    )

    # The two halves of dispatch, to compare with TE's separate row-map and permute kernels. Ours split
    # differently: the counts (histogram + scan) come first, and the permute kernel assigns the rows itself.
    device = torch.device("cuda")
    plan = shape_dispatch_plan(shape, is_mask=True, device=device_info(device))
    counted = tuple(name for launch in plan.launches[:-1] for name in launch.outputs)
    written = plan.launches[-1].outputs
    counts_plan = kernels.Plan(plan.buffers, plan.launches[:-1], counted)
    permute_plan = kernels.Plan({k: plan.buffers[k] for k in written}, plan.launches[-1:], written[:2])
    inputs = [dict(inp=s[0], routing=s[1], probs=s[2], scales=None) for s in sets]
    for entry in inputs:
        entry.update(zip(counted, run_plan(counts_plan, entry, device), strict=True))
    add(
        "row_map",
        "moetriton",
        time_graph([lambda i=i: run_plan(counts_plan, i, device) for i in inputs]),
        T * E + 3 * E * 4,
        "expert counts: histogram + scan (2 launches; rows are assigned by the permute kernel), CUDA graph",
    )
    add(
        "permute",
        "moetriton",
        time_graph([lambda i=i: run_plan(permute_plan, i, device) for i in inputs]),
        token_bytes(T, H, eb) + T * E + map_bytes + N * 4 + token_bytes(N, H, eb) + N * 4 + 3 * E * 4,
        "rows (writes the row map) + permute + probs, from the counts, CUDA graph",
    )
    if not quick:
        add(
            "dispatch",
            "torch-ref",
            time_eager([lambda s=s: reference.token_dispatch(s[0], s[1], N, s[2]) for s in sets[:2]]),
            dispatch_bytes,
            "eager",
        )

    # combine with merging probs, and its backward
    combine_bytes = token_bytes(N, H, eb) + map_bytes + T * E * 4 + token_bytes(T, H, eb)
    combine_bwd_bytes = token_bytes(T, H, eb) + 2 * token_bytes(N, H, eb) + map_bytes + 2 * T * E * 4

    def make_combine(generator):
        x, mask, probs = make_dispatch(generator)
        _, _, row_map, _, _ = mt.token_dispatch(x[:, :1].contiguous(), mask, N)
        expert_out = torch.randn(N, H, device="cuda", dtype=DTYPE, generator=generator)
        grad = torch.randn(T, H, device="cuda", dtype=DTYPE, generator=generator)
        return expert_out, row_map, probs, grad

    sets = _sets(shape, combine_bwd_bytes, make_combine)
    add(
        "combine",
        "moetriton",
        time_graph([lambda s=s: mt.token_combine(s[0], s[1], s[2]) for s in sets]),
        combine_bytes,
        "merging probs, CUDA graph",
    )
    add(
        "combine_bwd",
        "moetriton",
        time_graph(
            [lambda s=s: torch.ops.moetriton.combine_backward(s[3], s[1], s[0], s[2], False) for s in sets]
        ),
        combine_bwd_bytes,
        "act grad + probs grad, CUDA graph",
    )
    add(
        "dispatch_bwd",
        "moetriton",
        time_graph([lambda s=s: torch.ops.moetriton.dispatch_backward(s[0], None, s[1]) for s in sets]),
        token_bytes(N, H, eb) + map_bytes + token_bytes(T, H, eb),
        "combine of the cotangent, CUDA graph",
    )
    if not quick:
        add(
            "combine",
            "torch-ref",
            time_eager([lambda s=s: reference.token_combine(s[0], s[1], s[2]) for s in sets[:2]]),
            combine_bytes,
            "eager",
        )

    # chunk sort: rank-major -> expert-major
    ranks = min(8, E)
    sort_bytes = 2 * token_bytes(N, H, eb) + N * 4

    def make_sort(generator):
        x = torch.randn(N, H, device="cuda", dtype=DTYPE, generator=generator)
        cuts = torch.sort(torch.randint(0, N + 1, (E - 1,), device="cuda", generator=generator)).values
        edges = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), N)])
        sizes = (edges[1:] - edges[:-1]).long()
        order = torch.arange(E, device="cuda").view(ranks, E // ranks).t().reshape(-1)
        return x, sizes, order

    sets = _sets(shape, sort_bytes, make_sort)
    add(
        "chunk_sort",
        "moetriton",
        time_graph([lambda s=s: mt.sort_chunks_by_index(*s) for s in sets]),
        sort_bytes,
        f"{E} chunks, CUDA graph",
    )
    if not quick:
        add(
            "chunk_sort",
            "torch-ref",
            time_eager([lambda s=s: reference.sort_chunks_by_index(*s) for s in sets[:2]]),
            sort_bytes,
            "eager",
        )
    return out
