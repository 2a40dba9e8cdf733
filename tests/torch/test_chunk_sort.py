"""Property tests of sort_chunks_by_index (PyTorch) against the reference.

Rows, the row map and the probs must match bit for bit, and the gradient is the inverse permutation. Every
test draws the memory layout of its inputs (and of the cotangents it feeds back), while the reference gets
contiguous copies.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import moetriton.torch as mt
from moetriton.torch import reference
from tests.strategies import chunk_problems, layouts
from tests.torch._helpers import DEVICE, assert_same, bits, cotangent, relayout, tokens


@given(chunk_problems(), st.booleans(), layouts(), layouts(cotangent=True))
def test_chunk_sort_matches_reference_and_inverts_in_backward(problem, with_probs, layout, grad_layout):
    x = tokens(problem)
    sizes = torch.from_numpy(problem.split_sizes).to(DEVICE)
    order = torch.from_numpy(problem.sorted_indices).to(DEVICE)
    p = torch.from_numpy(problem.probs).to(DEVICE) if with_probs else None
    got = mt.sort_chunks_by_index(
        relayout(x, layout), relayout(sizes, layout), relayout(order, layout), relayout(p, layout)
    )
    expected = reference.sort_chunks_by_index(x, sizes, order, p)
    assert len(got) == len(expected) == (3 if with_probs else 2)
    for name, g, e in zip(("output", "row_id_map", "permuted_probs"), got, expected, strict=False):
        assert_same(g, e, name)
    if not x.dtype.is_floating_point or x.element_size() == 1:
        return
    xg = x.clone().requires_grad_()
    pg = p.clone().requires_grad_() if with_probs else None
    result = mt.sort_chunks_by_index(relayout(xg, layout), sizes, order, relayout(pg, layout))
    g = cotangent(result[0], grad_layout)
    outputs, cotangents = [result[0]], [g]
    if with_probs:
        gp = cotangent(result[2], grad_layout, seed=1)
        outputs.append(result[2])
        cotangents.append(gp)
    found = torch.autograd.grad(outputs, [xg] + ([pg] if with_probs else []), cotangents)
    dst = got[1].long()
    # The gradient of a permutation is the inverse permutation (a gather through the map).
    assert torch.equal(bits(found[0]), bits(g[dst]))
    if with_probs:
        assert torch.equal(bits(found[1]), bits(gp[dst]))
