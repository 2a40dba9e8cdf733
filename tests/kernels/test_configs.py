"""Every config in every kernel's search space computes the reference result, so nothing the heuristics
or the autotuner can pick is untested. Runs the plans through the PyTorch executor.

Under the interpreter num_warps has no effect, so on CPU configs that differ only in num_warps run once.
"""

import pytest
import torch

from moetriton import kernels
from moetriton.torch import reference
from moetriton.torch.executor import run_plan
from tests import _plans
from tests._plans import HIDDEN, NUM_EXPERTS, NUM_TOKENS, TOPK
from tests.torch._helpers import DEVICE, assert_plan_results, assert_reduced


def _configs(name: str) -> list[dict]:
    return _plans.distinct_configs(name, interpreted=DEVICE.type == "cpu")


def _problem(kind: str):
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=generator).to(DEVICE, torch.bfloat16)
    ids = torch.rand(NUM_TOKENS, NUM_EXPERTS, generator=generator).topk(TOPK, dim=1).indices.to(DEVICE)
    ids[3, 1] = -1
    if kind == "mask":  # token 3 keeps its first expert and gains expert 0 where its -1 was
        routing = torch.zeros(NUM_TOKENS, NUM_EXPERTS, dtype=torch.bool, device=DEVICE)
        routing.scatter_(1, ids.clamp(min=0), True)
    else:
        routing = ids.int()
    probs = torch.rand(routing.shape, generator=generator).to(DEVICE)
    return x, routing, probs


@pytest.mark.parametrize("kind", ["mask", "indices"])
@pytest.mark.parametrize("align_size", [None, 4])
@pytest.mark.parametrize("config", _configs("row_map") + _configs("dispatch"), ids=str)
def test_every_dispatch_config(kind, align_size, config):
    x, routing, probs = _problem(kind)
    plan = _plans.sweep_dispatch_plan(kind, align_size=align_size, config=config)
    got = run_plan(plan, dict(inp=x, routing=routing, probs=probs, scales=None), DEVICE)
    expected = reference.dispatch(
        x, routing, probs, None, NUM_EXPERTS, kind == "mask", NUM_TOKENS * TOPK, align_size
    )
    assert_plan_results(plan, got, expected)


def _layout(align_size):
    x, routing, _ = _problem("indices")
    _, _, _, row_map, _, _ = reference.dispatch(
        x, routing, None, None, NUM_EXPERTS, False, NUM_TOKENS * TOPK, align_size
    )
    num_rows = kernels.buffer_rows(NUM_TOKENS * TOPK, NUM_EXPERTS, align_size)
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(num_rows, HIDDEN, generator=generator).to(DEVICE, torch.bfloat16)
    grad = torch.randn(NUM_TOKENS, HIDDEN, generator=generator).to(DEVICE, torch.bfloat16)
    weights = torch.rand(NUM_TOKENS, TOPK, generator=generator).to(DEVICE)
    return row_map, rows, grad, weights


@pytest.mark.parametrize("weighted", [True, False], ids=["combine", "dispatch_backward"])
@pytest.mark.parametrize("config", _configs("combine"), ids=str)
def test_every_combine_config(config, weighted):
    """Weighted combine, and dispatch's backward: an unweighted combine that also gathers the probs."""
    row_map, rows, _, weights = _layout(None)
    plan = _plans.sweep_combine_plan(rows.shape[0], weighted=weighted, config=config)
    permuted_probs = torch.rand(rows.shape[0], generator=torch.Generator().manual_seed(6)).to(DEVICE)
    inputs = dict(
        inp=rows,
        row_id_map=row_map,
        weights=weights if weighted else None,
        permuted_probs=None if weighted else permuted_probs,
    )
    got = run_plan(plan, inputs, DEVICE)
    if weighted:
        assert_reduced(got[0], reference.combine(rows, row_map, weights), "combine")
    else:
        expected = reference.dispatch_backward(rows, permuted_probs, row_map)
        assert_reduced(got[0], expected[0], "combine")
        assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("kind", ["mask", "indices"])
@pytest.mark.parametrize("lookahead", [1, 2])
def test_dispatch_backward_gathers_the_probs_once_over_column_chunks(kind, lookahead):
    """Rows wider than a block: every column chunk of a token sums its rows, and only the first writes the
    token's probs gradient (slots without a row get 0)."""
    hidden = 1100  # three chunks of 512 columns
    x, routing, probs = _problem(kind)
    _, _, _, row_map, _, _ = reference.dispatch(
        x, routing, probs, None, NUM_EXPERTS, kind == "mask", NUM_TOKENS * TOPK, None
    )
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(NUM_TOKENS * TOPK, hidden, generator=generator).to(DEVICE, torch.bfloat16)
    grad_probs = torch.rand(NUM_TOKENS * TOPK, generator=generator).to(DEVICE)
    plan = kernels.combine_plan(
        num_tokens=NUM_TOKENS,
        hidden=hidden,
        num_slots=routing.shape[1],
        num_rows=rows.shape[0],
        element_bytes=2,
        has_weights=False,
        gather_probs=True,
        config=dict(block_h=512, num_warps=4, lookahead=lookahead, streaming=0),
    )
    inputs = dict(inp=rows, row_id_map=row_map, weights=None, permuted_probs=grad_probs)
    got = run_plan(plan, inputs, DEVICE)
    expected = reference.dispatch_backward(rows, grad_probs, row_map)
    assert_reduced(got[0], expected[0], "dispatch backward")
    assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("align_size", [None, 4])
@pytest.mark.parametrize("config", _configs("combine_backward"), ids=str)
def test_every_combine_backward_config(align_size, config):
    row_map, rows, grad, weights = _layout(align_size)
    plan = _plans.sweep_combine_backward_plan(rows.shape[0], padded=align_size is not None, config=config)
    grad_input, grad_weights = run_plan(
        plan, dict(grad=grad, row_id_map=row_map, inp=rows, weights=weights), DEVICE
    )
    expected_input, expected_weights = reference.combine_backward(grad, row_map, rows, weights, rows.shape[0])
    assert_reduced(grad_input, expected_input, "grad_input")
    torch.testing.assert_close(grad_weights, expected_weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("config", _configs("sort_chunks"), ids=str)
def test_every_sort_chunks_config(backward, config):
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(_plans.SORT_ROWS, HIDDEN, generator=generator).to(DEVICE, torch.bfloat16)
    probs = torch.rand(_plans.SORT_ROWS, generator=generator).to(DEVICE)
    sizes = torch.tensor(_plans.SORT_SPLIT_SIZES, device=DEVICE)
    order = torch.tensor(_plans.SORT_ORDER, device=DEVICE)
    plan = _plans.sweep_sort_chunks_plan(backward=backward, config=config)
    got = run_plan(plan, dict(inp=rows, split_sizes=sizes, sorted_indices=order, probs=probs), DEVICE)
    expected = reference.sort_chunks(rows, sizes, order, probs, backward)
    assert_plan_results(plan, got, expected)
