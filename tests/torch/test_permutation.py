"""Property tests of token_dispatch / token_combine (PyTorch) against the reference.

Data movement must match bit for bit; combine matches the sequential-fp32 reference bit for bit too (the
kernel turns fused multiply-add off); gradients are compared against autograd of the reference. Every test
draws the memory layout of its inputs (and of the cotangents it feeds back), while the reference gets
contiguous copies.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moetriton.torch as mt
from moetriton.torch import reference
from tests.strategies import FLOAT_DTYPES, layouts, routing_problems
from tests.torch._helpers import (
    DEVICE,
    assert_reduced,
    assert_same,
    bits,
    cotangent,
    probs,
    relayout,
    routing_args,
    tokens,
)


def _dispatch_both(problem, with_probs=True, with_scales=False, layout="contiguous"):
    """(moetriton's results on inputs in `layout`, the reference's on contiguous ones)."""
    routing_map, kwargs = routing_args(problem)
    x = tokens(problem)
    p = probs(problem) if with_probs else None
    if with_scales:
        kwargs["scales"] = torch.arange(problem.num_tokens * 3, dtype=torch.float32, device=DEVICE).view(
            -1, 3
        )
    args = (x, routing_map, problem.num_out_tokens, p, problem.align_size)
    strided_args = tuple(relayout(a, layout) if isinstance(a, torch.Tensor) else a for a in args)
    strided_kwargs = {k: relayout(v, layout) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return mt.token_dispatch(*strided_args, **strided_kwargs), reference.token_dispatch(*args, **kwargs)


@given(routing_problems(), st.booleans(), st.booleans(), layouts())
def test_dispatch_matches_reference_bitwise(problem, with_probs, with_scales, layout):
    got, expected = _dispatch_both(problem, with_probs, with_scales, layout)
    names = ("output", "permuted_probs", "row_id_map", "pad_offsets", "tokens_per_expert", "permuted_scales")
    assert len(got) == len(expected)
    for name, g, e in zip(names, got, expected, strict=False):
        assert_same(g, e, name)


def _contract_rows(problem, capacity: int | None = None) -> np.ndarray:
    """Destination row of every slot, straight from docs/design.md's formula (a second, loop-based oracle);
    with a capacity, expert e owns rows [e * capacity, (e + 1) * capacity) and keeps its first `capacity`
    slots."""
    if problem.kind == "mask":
        experts = np.where(problem.routing, np.arange(problem.num_experts)[None, :], -1)
    else:
        experts = problem.routing
    counts = np.array([(experts == e).sum() for e in range(problem.num_experts)], dtype=np.int64)
    align = problem.align_size or 1
    aligned = -(-counts // align) * align if capacity is None else np.full_like(counts, capacity)
    start = np.concatenate([[0], np.cumsum(aligned)[:-1]])
    rows_in_buffer = (
        problem.num_experts * capacity
        if capacity is not None
        else problem.num_out_tokens
        if problem.align_size is None
        else ((problem.num_out_tokens + problem.num_experts * (align - 1)) // align * align)
    )
    rows = np.full(experts.shape, -1, dtype=np.int64)
    seen = np.zeros(problem.num_experts, dtype=np.int64)
    for t in range(experts.shape[0]):
        for s in range(experts.shape[1]):
            e = experts[t, s]
            if e >= 0:
                row = start[e] + seen[e]
                kept = row < rows_in_buffer and (capacity is None or seen[e] < capacity)
                seen[e] += 1
                rows[t, s] = row if kept else -1
    return rows


def _contract_map(problem, capacity: int | None = None) -> np.ndarray:
    """The row map but its `end` column, built with loops from `_contract_rows`: the rows of each token's
    slots that have a row and those slots (both in ascending slot order, then -1), and their count."""
    rows = _contract_rows(problem, capacity)
    listed_rows = np.full(rows.shape, -1, dtype=np.int64)
    listed = np.full(rows.shape, -1, dtype=np.int64)
    counts = np.zeros((rows.shape[0], 1), dtype=np.int64)
    for t in range(rows.shape[0]):
        for s in range(rows.shape[1]):
            if rows[t, s] >= 0:
                listed_rows[t, counts[t, 0]] = rows[t, s]
                listed[t, counts[t, 0]] = s
                counts[t, 0] += 1
    return np.concatenate([listed_rows, listed, counts], axis=1)


@given(routing_problems(dtypes=("float32",)))
def test_row_map_follows_the_design_formula(problem):
    (_, _, row_id_map, pad_offsets, tokens_per_expert), _ = _dispatch_both(problem, with_probs=False)
    np.testing.assert_array_equal(row_id_map[:, :-1].cpu().numpy(), _contract_map(problem))
    assert tokens_per_expert.dtype == torch.int32 and row_id_map.dtype == torch.int32
    assert (pad_offsets is None) == (problem.align_size is None)


@given(routing_problems(padding=(False,)), st.integers(1, 6), layouts(), layouts(cotangent=True))
def test_capacity_dispatch_keeps_the_first_slots_of_each_expert(problem, capacity, layout, grad_layout):
    routing_map, kwargs = routing_args(problem)
    x, p = tokens(problem), probs(problem)
    strided = {k: relayout(v, layout) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = mt.token_dispatch(
        relayout(x, layout),
        relayout(routing_map, layout),
        None,
        relayout(p, layout),
        capacity=capacity,
        **strided,
    )
    expected = reference.token_dispatch(x, routing_map, None, p, capacity=capacity, **kwargs)
    for name, g, e in zip(
        ("output", "permuted_probs", "row_id_map", "pad_offsets", "counts"), got, expected, strict=True
    ):
        assert_same(g, e, name)
    np.testing.assert_array_equal(got[2][:, :-1].cpu().numpy(), _contract_map(problem, capacity))
    assert got[0].shape[0] == problem.num_experts * capacity
    assert bool((got[4] == capacity).all())
    if not x.dtype.is_floating_point or x.element_size() == 1:
        return
    # Combine over the capacity layout and its gradients, pad rows included, against the reference.
    grads = []
    for api in (mt, reference):
        leaves = [t.clone().requires_grad_() for t in (x, p)]
        out, permuted_probs, row_id_map, pad_offsets, _ = api.token_dispatch(
            leaves[0], routing_map, None, leaves[1], capacity=capacity, **kwargs
        )
        y = api.token_combine(
            out * permuted_probs[:, None].to(out.dtype), row_id_map, leaves[1] * 0.5, pad_offsets
        )
        if not y.requires_grad:  # the reference builds no graph when no slot is kept
            return
        grads.append(torch.autograd.grad(y, leaves, cotangent(y, grad_layout), allow_unused=True))
    tolerance = dict(rtol=1e-5, atol=1e-5) if x.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got_grad, expected_grad in zip(*grads, strict=True):
        if expected_grad is not None:
            torch.testing.assert_close(got_grad, expected_grad, **tolerance)


@given(routing_problems(padding=(True,)))
def test_rows_without_a_token_are_zero(problem):
    (output, permuted_probs, row_id_map, _, counts), _ = _dispatch_both(problem)
    used = torch.zeros(output.shape[0], dtype=torch.bool, device=DEVICE)
    rows = row_id_map[:, : problem.num_slots]
    used[rows[rows >= 0].long()] = True
    assert not bits(output)[~used].any()
    assert not bits(permuted_probs)[~used].any()
    assert int(counts.sum()) <= output.shape[0]
    if problem.align_size:
        assert bool((counts % problem.align_size == 0).all())


@given(routing_problems(dtypes=FLOAT_DTYPES), st.booleans(), layouts())
def test_combine_matches_reference_bitwise(problem, weighted, layout):
    (output, _, row_id_map, pad_offsets, _), _ = _dispatch_both(problem, with_probs=False)
    expert_out = output * 3 - 1  # any values; the dispatch output only supplies the layout
    weights = probs(problem) if weighted else None
    got = mt.token_combine(
        relayout(expert_out, layout), relayout(row_id_map, layout), relayout(weights, layout), pad_offsets
    )
    assert_reduced(got, reference.token_combine(expert_out, row_id_map, weights), "combine")


def _long_rows(kind: str, num_experts: int, topk: int | None, generator: torch.Generator) -> torch.Tensor:
    """Long routing rows: a token with no slot, one with every slot (of the first 96: the interpreter walks
    each), one on power-of-two edges (slots 0, 31, 32, 63, 64, 127, 128, 1023, 1024 and the last: the
    kernel walks 64-slot windows), one with a run of 40,
    and random ones. [T, E] bool for a mask, else [T, K] int32 ids."""
    num_slots = num_experts if kind == "mask" else topk
    valid = torch.zeros(7, num_slots, dtype=torch.bool)
    valid[1, :96] = True
    valid[2, [s for s in (0, 31, 32, 63, 64, 127, 128, 1023, 1024, num_slots - 1) if s < num_slots]] = True
    valid[3, 30 : 30 + 40] = True
    valid[4:] = torch.rand(3, num_slots, generator=generator) < min(0.3, 30 / num_slots)
    if kind == "mask":
        return valid
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:topk] for _ in range(7)]).int()
    return torch.where(valid, ids, -1)


@pytest.mark.parametrize(
    ("kind", "num_experts", "topk"), [("mask", 70, None), ("indices", 80, 40), ("mask", 1100, None)]
)
def test_combine_walks_long_rows(kind, num_experts, topk):
    """Rows far longer than the routing problems above draw (which stay under 10 slots): the combine kernels'
    slot walk over up to 1100 slots, S not a power of two, every slot valid. Forward against the
    sequential reference, gradients against autograd of the reference."""
    generator = torch.Generator().manual_seed(5)
    routing = _long_rows(kind, num_experts, topk, generator).to(DEVICE)
    routing_map, kwargs = (
        (routing, {}) if kind == "mask" else (None, dict(indices=routing, num_experts=num_experts))
    )
    routed = int(routing.sum()) if kind == "mask" else int((routing >= 0).sum())
    x = torch.randn(routing.shape[0], 5, generator=generator).to(DEVICE)
    out, _, row_id_map, pad_offsets, _ = mt.token_dispatch(x, routing_map, routed, **kwargs)
    expert_out = torch.randn(out.shape, generator=generator).to(DEVICE)
    weights = torch.rand(routing.shape, generator=generator).to(DEVICE)
    for w in (None, weights):
        got = mt.token_combine(expert_out, row_id_map, w, pad_offsets)
        assert_reduced(got, reference.token_combine(expert_out, row_id_map, w), "combine")
    cotangent_ = torch.randn(x.shape, generator=generator).to(DEVICE)
    grads = []
    for api in (mt, reference):
        xg, eg, wg = (t.clone().requires_grad_() for t in (x, expert_out, weights))
        permuted = api.token_dispatch(xg, routing_map, routed, **kwargs)[0]
        y = api.token_combine(permuted, row_id_map, None, pad_offsets) + api.token_combine(
            eg, row_id_map, wg, pad_offsets
        )
        grads.append(torch.autograd.grad(y, (xg, eg, wg), cotangent_))
    for name, got, expected in zip(("inp", "expert_out", "merging_probs"), *grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=name)


@given(routing_problems(dtypes=("float32",)))
def test_round_trip_with_normalised_weights_is_identity(problem):
    routing_map, kwargs = routing_args(problem)
    x = tokens(problem)
    routed = problem.routing if problem.kind == "mask" else problem.routing >= 0
    count = np.maximum(routed.sum(1, keepdims=True), 1)
    weights = torch.from_numpy(routed / count).to(DEVICE, x.dtype)
    out, _, row_id_map, pad_offsets, _ = mt.token_dispatch(
        x, routing_map, int(routed.sum()), None, problem.align_size, **kwargs
    )
    back = mt.token_combine(out, row_id_map, weights, pad_offsets)
    expected = torch.where(torch.from_numpy(routed.any(1)).to(DEVICE)[:, None], x, torch.zeros_like(x))
    torch.testing.assert_close(back, expected, rtol=1e-6, atol=1e-6)


def _pipeline(api, x, p, w, routing_map, kwargs, problem):
    out, permuted_probs, row_id_map, pad_offsets, _ = api.token_dispatch(
        x, routing_map, problem.num_out_tokens, p, problem.align_size, **kwargs
    )
    expert_out = out * 2 + permuted_probs[:, None] * out.square()
    return api.token_combine(expert_out, row_id_map, w, pad_offsets)


@given(routing_problems(dtypes=("float32", "bfloat16")), layouts(), layouts(cotangent=True))
def test_gradients_match_autograd_of_reference(problem, layout, grad_layout):
    routing_map, kwargs = routing_args(problem)
    dtype = tokens(problem).dtype
    grads = []
    for api in (mt, reference):
        x = tokens(problem).requires_grad_()
        p = probs(problem).requires_grad_()
        w = probs(problem).flip(0).contiguous().requires_grad_()
        strided = api is mt and layout != "contiguous"
        inputs = tuple(relayout(t, layout) for t in (x, p, w)) if strided else (x, p, w)
        y = _pipeline(api, *inputs, routing_map, kwargs, problem)
        g = cotangent(y, grad_layout, seed=1)
        if not y.requires_grad:  # the reference builds no graph when nothing is routed
            grads.append(tuple(torch.zeros_like(t) for t in (x, p, w)))
            continue
        found = torch.autograd.grad(y, (x, p, w), g, allow_unused=True)
        grads.append(
            tuple(torch.zeros_like(t) if d is None else d for t, d in zip((x, p, w), found, strict=True))
        )
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, got, expected in zip(("inp", "probs", "merging_probs"), *grads, strict=True):
        torch.testing.assert_close(got, expected, **tolerance, msg=name)


@pytest.mark.parametrize("kind", ["mask", "indices"])
@pytest.mark.parametrize("align_size", [None, 4])
def test_gradcheck_fp64(kind, align_size):
    generator = torch.Generator().manual_seed(3)
    num_tokens, hidden, num_experts, topk = 4, 3, 3, 2
    ids = torch.rand(num_tokens, num_experts, generator=generator).topk(topk, dim=1).indices.to(DEVICE)
    if kind == "mask":
        routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=DEVICE).scatter_(
            1, ids, True
        )
        kwargs, slots = {}, num_experts
    else:
        routing_map, kwargs, slots = None, dict(indices=ids.int(), num_experts=num_experts), topk
    x = torch.rand(num_tokens, hidden, dtype=torch.float64, generator=generator).to(DEVICE).requires_grad_()
    p = torch.rand(num_tokens, slots, dtype=torch.float64, generator=generator).to(DEVICE).requires_grad_()
    w = torch.rand(num_tokens, slots, dtype=torch.float64, generator=generator).to(DEVICE).requires_grad_()

    def f(x, p, w):
        out, pp, row_id_map, pad_offsets, _ = mt.token_dispatch(
            x, routing_map, num_tokens * topk, p, align_size, **kwargs
        )
        return mt.token_combine(out * pp[:, None] + out.sin(), row_id_map, w, pad_offsets)

    # fast_mode checks random projections of the Jacobian: each full column would rerun the interpreter.
    assert torch.autograd.gradcheck(f, (x, p, w), fast_mode=True)


def test_fp8_payload_moves_bit_for_bit_with_scales():
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (9, 32), dtype=torch.uint8, generator=generator).to(DEVICE)
    x = raw.view(torch.float8_e4m3fn)  # includes NaN encodings: still moved untouched
    scales = torch.rand(9, 2, generator=generator).to(DEVICE)
    ids = torch.randint(-1, 5, (9, 2), generator=generator).int().to(DEVICE)
    out, _, row_id_map, _, _, permuted_scales = mt.token_dispatch(
        x, None, 18, indices=ids, num_experts=5, scales=scales, align_size=16
    )
    expected = reference.token_dispatch(x, None, 18, indices=ids, num_experts=5, scales=scales, align_size=16)
    assert torch.equal(bits(out), bits(expected[0]))
    assert torch.equal(permuted_scales, expected[5])
    assert torch.equal(row_id_map, expected[2])
