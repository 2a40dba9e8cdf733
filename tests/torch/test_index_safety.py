"""The index rule (docs/design.md, "Index data is never trusted") on every kernel that reads an index from
data, through the PyTorch executor: hostile row maps, expert ids, split sizes and orders, group sizes and
peer tables (tests/strategies_hostile.py) give the documented result, computed by the references, and no
buffer is read or written outside its bounds (tests/torch/_guards.py). Then the public functions: what
they refuse on the host, the debug switch, and the rule under torch.compile.

On the GPU the same tests run compiled; the GPU check also runs this file under compute-sanitizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moetriton.torch as mt
from moetriton import kernels
from moetriton.kernels.rules import validation
from moetriton.torch import reference
from moetriton.torch.executor import Executable
from tests.strategies_hostile import (
    clamped_end,
    clip_group_sizes,
    group_sizes,
    ids_problems,
    is_partition,
    row_map_problems,
    row_owners,
    split_problems,
)
from tests.torch._guards import guarded, guarded_input, run_guarded
from tests.torch._helpers import DEVICE


def _tensor(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(DEVICE)


# Row maps ----------------------------------------------------------------------------------------------


def _row_map_sizes(problem) -> dict:
    """The sizes every row-map plan takes from a row-map problem, its fp32 rows included."""
    sizes = dict(num_tokens=problem.num_tokens, hidden=problem.hidden, num_slots=problem.num_slots)
    return dict(sizes, num_rows=problem.num_rows, element_bytes=4)


@given(problem=row_map_problems(), weighted=st.booleans(), gather=st.booleans())
def test_combine_follows_only_live_entries(problem, weighted, gather):
    """Forward combine (and dispatch's backward, which gathers the probs too): entries past the clamped
    count or with a row outside [0, N) add nothing, a slot outside [0, S) weighs 0; nothing else read."""
    gather = gather and not weighted
    row_map, rows = _tensor(problem.row_map), _tensor(problem.rows)
    weights = _tensor(problem.weights) if weighted else None
    probs = _tensor(problem.permuted_probs) if gather else None
    plan = kernels.combine_plan(**_row_map_sizes(problem), has_weights=weighted, gather_probs=gather)
    inputs = dict(inp=rows, row_id_map=row_map, weights=weights, permuted_probs=probs)
    out, gathered = run_guarded(plan, inputs, DEVICE)
    torch.testing.assert_close(out, reference.combine(rows, row_map, weights), rtol=1e-6, atol=1e-6)
    if gather:
        _, expected = reference.dispatch_backward(rows, probs, row_map)
        if problem.corruption != "duplicates":  # a slot listed twice: either entry's prob may win
            torch.testing.assert_close(gathered, expected, rtol=0, atol=0)


@given(problem=row_map_problems(), padded=st.booleans())
def test_scatter_writes_only_rows_inside_the_buffer(problem, padded):
    """Unweighted combine's backward: a row named by one live entry gets its token's gradient; rows no
    live entry names are zero where the rule says so (padded buffers, and past the clamped `end`)."""
    row_map, grad = _tensor(problem.row_map), _tensor(problem.grad)
    plan = kernels.scatter_plan(**_row_map_sizes(problem), padded=padded)
    (out,) = run_guarded(plan, dict(grad=grad, row_id_map=row_map), DEVICE)
    _check_named_rows(problem, out.cpu(), torch.from_numpy(problem.grad), padded)


def _check_named_rows(problem, out: torch.Tensor, per_token: torch.Tensor, padded: bool) -> None:
    owner, named = row_owners(problem)
    end = clamped_end(problem)
    for row in range(problem.num_rows):
        if named[row] == 1 and (padded or row < end):
            torch.testing.assert_close(out[row], per_token[owner[row]], rtol=1e-6, atol=1e-6)
        elif named[row] == 0 and (padded or row >= end):
            assert not out[row].any(), f"row {row}: no entry names it, expected zeros"


@given(problem=row_map_problems(), padded=st.booleans())
def test_combine_backward_writes_only_rows_inside_the_buffer(problem, padded):
    row_map, grad, rows, weights = map(
        _tensor, (problem.row_map, problem.grad, problem.rows, problem.weights)
    )
    plan = kernels.combine_backward_plan(**_row_map_sizes(problem), padded=padded)
    grad_rows, grad_weights = run_guarded(
        plan, dict(grad=grad, row_id_map=row_map, inp=rows, weights=weights), DEVICE
    )
    expected_rows, expected_weights = reference.combine_backward(
        grad, row_map, rows, weights, problem.num_rows
    )
    torch.testing.assert_close(grad_weights, expected_weights, rtol=1e-5, atol=1e-5)
    # Per row: the owner's gradient times its entry's weight (0 for a slot out of range), as the reference.
    _, named = row_owners(problem)
    end = clamped_end(problem)
    for row in range(problem.num_rows):
        if named[row] == 1 and (padded or row < end):
            torch.testing.assert_close(grad_rows[row], expected_rows[row], rtol=1e-6, atol=1e-6)
        elif named[row] == 0 and (padded or row >= end):
            assert not grad_rows[row].any()


# Expert ids ----------------------------------------------------------------------------------------------


@given(problem=ids_problems(), padded=st.booleans())
def test_dispatch_treats_every_id_outside_the_experts_as_no_expert(problem, padded):
    """Ids are compared in their own dtype before narrowing: 2**32 is no expert (not expert 0), and
    neither is any other id outside [0, E)."""
    ids, tokens, probs = _tensor(problem.ids), _tensor(problem.tokens), _tensor(problem.probs)
    num_out = problem.ids.size
    align = 2 if padded else None
    plan = kernels.dispatch_plan(
        num_tokens=problem.num_tokens,
        hidden=tokens.shape[1],
        num_slots=ids.shape[1],
        num_experts=problem.num_experts,
        is_mask=False,
        num_out_tokens=num_out,
        element_bytes=4,
        has_probs=True,
        scale_cols=None,
        align_size=align,
    )
    got = run_guarded(plan, dict(inp=tokens, routing=ids, probs=probs, scales=None), DEVICE)
    expected = reference.dispatch(tokens, ids, probs, None, problem.num_experts, False, num_out, align)
    names = ("output", "permuted_probs", "permuted_scales", "row_id_map", "pad_offsets", "tokens_per_expert")
    for name, value, want in zip(names, got, expected, strict=True):
        if name != "permuted_scales" and (padded or name != "pad_offsets"):
            assert torch.equal(value, want), name


# Chunk sort ----------------------------------------------------------------------------------------------


@given(problem=split_problems(), backward=st.booleans())
def test_sort_chunks_moves_nothing_for_a_description_that_is_not_a_partition(problem, backward):
    rows, probs = _tensor(problem.rows), _tensor(problem.probs)
    sizes, order = _tensor(problem.sizes), _tensor(problem.order)
    plan = kernels.sort_chunks_plan(
        num_rows=problem.num_rows,
        hidden=problem.hidden,
        num_splits=len(problem.sizes),
        element_bytes=4,
        has_probs=True,
        backward=backward,
    )
    out, row_map, permuted = run_guarded(
        plan, dict(inp=rows, split_sizes=sizes, sorted_indices=order, probs=probs), DEVICE
    )
    expected = reference.sort_chunks(rows, sizes, order, probs, backward)
    assert torch.equal(out, expected[0]) and torch.equal(permuted, expected[2])
    if not backward:
        assert torch.equal(row_map, expected[1])
    if not is_partition(problem.sizes, problem.order, problem.num_rows):
        assert not out.any() and not permuted.any()
        assert backward or bool((row_map == -1).all())


# Group sizes ---------------------------------------------------------------------------------------------


@given(data=st.data())
def test_grouped_matmul_clips_group_sizes_of_any_width(data):
    """Sizes are clipped in their own dtype (an int64 2**32 + 1 is M, not 1) and summed without wrapping."""
    num_rows, depth, num_cols, num_groups = 9, 16, 16, 3
    sizes = data.draw(group_sizes(num_rows, num_groups))
    generator = torch.Generator().manual_seed(3)
    lhs = torch.randn(num_rows, depth, generator=generator).to(DEVICE)
    rhs = torch.randn(num_groups, depth, num_cols, generator=generator).to(DEVICE)
    plan = kernels.grouped_matmul_plan(
        num_rows=num_rows, depth=depth, num_cols=num_cols, num_groups=num_groups, element_bytes=4
    )
    inputs = dict(lhs=lhs, rhs=rhs, group_sizes=_tensor(sizes), lhs_rows=None, out_rows=None)
    (out,) = run_guarded(plan, inputs, DEVICE)
    expected, start = torch.zeros(num_rows, num_cols), 0
    for group, size in enumerate(clip_group_sizes(sizes, num_rows)):
        expected[start : start + size] = lhs[start : start + size].cpu() @ rhs[group].cpu()
        start += size
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


@given(data=st.data())
def test_activation_counts_clipped_group_rows(data):
    num_rows, ffn = 7, 8
    sizes = data.draw(group_sizes(num_rows, 3))
    hidden = torch.randn(num_rows, 2 * ffn, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    plan = kernels.activation_plan(
        activation="swiglu", num_rows=num_rows, width=2 * ffn, num_groups=3, element_bytes=4
    )
    (out,) = run_guarded(plan, dict(hidden=hidden, group_sizes=_tensor(sizes)), DEVICE)
    live = sum(clip_group_sizes(sizes, num_rows))
    torch.testing.assert_close(out[:live], reference.activate(hidden[:live], "swiglu"), rtol=1e-6, atol=1e-6)


# Peer tables ---------------------------------------------------------------------------------------------


@given(data=st.data(), scale_dot=st.booleans())
def test_peer_copies_stay_inside_every_source_buffer(data, scale_dot):
    """Chunk sizes past R (and past int32), negative ones, and source offsets outside the sources' S rows:
    the pull writes every receiving row (zeros where nothing may be read), the push writes only rows
    inside the sources' buffers, and no buffer is touched outside its bounds."""
    ep, local, hidden, source_rows, num_rows = 2, 2, 8, 6, 7
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    sizes = rng.choice([-(2**40), -3, 0, 1, 2, 3, num_rows + 2, 2**32 + 1], ep * local)
    offsets = rng.choice([-(2**35), -1, 0, 2, source_rows - 1, source_rows, 2**31 - 1, 2**33], ep * local)
    chunks = dict(
        chunk_sizes=_tensor(sizes.astype(np.int64)), source_offsets=_tensor(offsets.astype(np.int64))
    )
    expected_source = _peer_rule(sizes, offsets, ep, source_rows, num_rows)
    sources = [guarded_input(torch.randn(source_rows, hidden).to(DEVICE)) for _ in range(ep)]
    table = torch.tensor([source.data_ptr() for source in sources], dtype=torch.int64, device=DEVICE)
    common = dict(
        num_rows=num_rows, num_chunks=ep * local, num_sources=ep, source_rows=source_rows, hidden=hidden
    )
    saved = torch.randn(num_rows, hidden).to(DEVICE)
    weights = torch.rand(num_rows).to(DEVICE)
    pull = kernels.pull_rows_plan(**common, dtype="float32", element_bytes=4, scale_dot=scale_dot)
    inputs = dict(peer_rows=table, peer_probs=None, saved=saved, weights=weights, **chunks)
    with guarded() as guards:
        out = Executable(pull, torch.device(DEVICE))(inputs)[0]
    guards.check()
    for row, where in enumerate(expected_source):
        want = torch.zeros(hidden) if where is None else sources[where[0]][where[1]].cpu()
        torch.testing.assert_close(out[row].cpu(), want * (weights[row].cpu() if scale_dot else 1))
    # Push: the sources' buffers sit inside NaN margins; only valid rows change.
    before = [source.clone() for source in sources]
    push = kernels.push_rows_plan(**common, element_bytes=4, has_probs=False)
    rows = torch.randn(num_rows, hidden).to(DEVICE)
    Executable(push, torch.device(DEVICE))(
        dict(rows=rows, probs=None, peer_rows=table, peer_probs=None, **chunks)
    )
    targets = [where for where in expected_source if where is not None]
    written = {where: i for i, where in enumerate(expected_source) if targets.count(where) == 1}
    for p, source in enumerate(sources):
        margin = source.storage_offset() - 4 * hidden
        storage = torch.as_strided(source, (source_rows + 8, hidden), (hidden, 1), margin)
        assert torch.isnan(storage[:4]).all() and torch.isnan(storage[-4:]).all(), "a margin was written"
        for r in range(source_rows):
            if (p, r) in written:
                assert torch.equal(source[r], rows[written[p, r]])
            elif (p, r) not in targets:
                assert torch.equal(source[r], before[p][r]), "a row no receiving row names was written"


def _peer_rule(sizes, offsets, ep: int, source_rows: int, num_rows: int) -> list:
    """(source, source row) of every receiving row, None where the rule reads nothing: sizes clipped into
    [0, R], a row inside the chunks and a source row inside [0, S)."""
    result, start = [], 0
    bounds = []
    for chunk, size in enumerate(sizes):
        size = min(max(int(size), 0), num_rows)
        bounds.append((start, start + size, chunk))
        start += size
    for row in range(num_rows):
        found = None
        for first, end, chunk in bounds:
            if first <= row < end:
                source_row = int(offsets[chunk]) + row - first
                if 0 <= source_row < source_rows:
                    found = (chunk % ep, source_row)
                break
        result.append(found)
    return result


# Public functions ----------------------------------------------------------------------------------------


def test_host_checks_name_the_argument_and_the_mistake():
    x = torch.randn(32, 4)
    ids = torch.randint(0, 4, (32, 2))
    _, _, row_map, _, _ = mt.token_dispatch(x, None, 64, indices=ids, num_experts=4)
    with pytest.raises(ValueError, match=r"row_id_map: expected listed rows in \[-1, 4\)"):
        mt.token_combine(torch.ones(4, 4), row_map)
    hand_made = row_map.clone()
    hand_made[0, 0] = 2**28
    with pytest.raises(ValueError, match="row_id_map"):
        mt.token_combine(torch.ones(64, 4), hand_made)
    with pytest.raises(ValueError, match=r"indices: expected expert ids in \[-1, 3\)"):
        mt.token_dispatch(
            torch.randn(2, 4), None, 4, indices=torch.tensor([[2**32, 0], [0, 1]]), num_experts=3
        )
    with pytest.raises(ValueError, match="split_sizes"):
        mt.sort_chunks_by_index(torch.randn(5, 2), torch.tensor([4, 5]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="sorted_indices"):
        mt.sort_chunks_by_index(torch.randn(5, 2), torch.tensor([2, 3]), torch.tensor([0, 0]))


def test_wrong_kinds_of_argument_are_type_errors():
    import numpy

    mask = torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"inp: expected a torch.Tensor, got numpy.ndarray"):
        mt.token_dispatch(numpy.ones((4, 8), numpy.float32), mask, 8)
    with pytest.raises(TypeError, match=r"routing_map: expected a torch.Tensor, got builtins.list"):
        mt.token_dispatch(torch.ones(4, 8), [[True, False]] * 4, 8)
    probs, counts = torch.rand(4, 2), torch.tensor([4, 4])
    with pytest.raises(TypeError, match="total_num_tokens: expected an int, got float"):
        mt.fused_moe_aux_loss(probs, counts, 4.0, 2, 1, 1.0)


def test_fp8_payloads_take_a_gradient_as_in_jax():
    """The cotangent of an fp8 dispatch is combined in fp32 and rounded once to fp8."""
    x = torch.randn(6, 8).to(torch.float8_e4m3fn).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    out, *_ = mt.token_dispatch(x.to(DEVICE), mask.to(DEVICE), num_out_tokens=18)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float8_e4m3fn
    expected = mask.sum(1, keepdim=True).float().expand(6, 8).to(torch.float8_e4m3fn)
    assert torch.equal(x.grad.float(), expected.float())


@pytest.mark.skipif(
    DEVICE.type != "cuda", reason="the debug switch's device reads: CUDA only (on CPU every call checks)"
)
def test_debug_switch_checks_device_values(monkeypatch):
    x = torch.randn(32, 4, device=DEVICE)
    ids = torch.randint(0, 4, (32, 2), device=DEVICE)
    _, _, row_map, _, _ = mt.token_dispatch(x, None, 64, indices=ids, num_experts=4)
    small = torch.ones(4, 4, device=DEVICE)
    # Off: the kernels ignore the rows past the buffer (no error, nothing read out of bounds).
    expected = reference.combine(small, row_map, None)
    assert torch.equal(mt.token_combine(small, row_map), expected)
    monkeypatch.setattr(validation, "CHECK_VALUES", True)
    with pytest.raises(ValueError, match="row_id_map"):
        mt.token_combine(small, row_map)
    with pytest.raises(ValueError, match="indices"):
        mt.token_dispatch(x, None, 64, indices=ids + 4, num_experts=4)


def test_compiled_dispatch_reads_int64_ids_before_narrowing():
    """torch.compile never reads values on the host: ids 2**32 and 2**32 + 2 with E = 3 are no expert (not
    experts 0 and 2), as the index rule says."""
    x = torch.randn(3, 8, device=DEVICE)
    ids = torch.tensor([[2**32, 1], [2**32 + 2, 0], [2, -1]], device=DEVICE)

    def dispatch(x, ids):
        return mt.token_dispatch(x, None, 6, indices=ids, num_experts=3)

    got = torch.compile(dispatch, fullgraph=True)(x, ids)
    expected = reference.token_dispatch(x, None, 6, indices=ids, num_experts=3)
    assert torch.equal(got[4], expected[4]) and got[4].tolist() == [1, 1, 1]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
