"""Quick CUDA check of the permutation kernels against the reference on corner and mid-size cases."""

import itertools

import torch

import moetriton.torch as mt
from moetriton.torch import reference


def check(num_tokens, hidden, num_experts, topk, kind, align, dtype):
    generator = torch.Generator(device="cuda").manual_seed(num_tokens * 31 + hidden)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=generator).to(dtype)
    ids = torch.rand(num_tokens, num_experts, device="cuda", generator=generator).topk(topk, dim=1).indices
    if kind == "mask":
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
        kwargs, probs = {}, torch.rand(num_tokens, num_experts, device="cuda", generator=generator)
        args = (x, routing, num_tokens * topk)
    else:
        kwargs = dict(indices=ids.int(), num_experts=num_experts)
        probs = torch.rand(num_tokens, topk, device="cuda", generator=generator)
        args = (x, None, num_tokens * topk)
    got = mt.token_dispatch(*args, probs, align, **kwargs)
    exp = reference.token_dispatch(*args, probs, align, **kwargs)
    for name, g, e in zip(("output", "probs", "map", "pad", "counts"), got, exp, strict=True):
        if g is None:
            continue
        assert torch.equal(
            g.view(torch.uint8) if g.dtype.itemsize == 1 else g,
            e.view(torch.uint8) if e.dtype.itemsize == 1 else e,
        ), (name, kind, align, dtype)
    if dtype.itemsize == 1:
        return
    weights = torch.rand(probs.shape, device="cuda", generator=generator)
    y = mt.token_combine(got[0], got[2], weights, got[3])
    y_ref = reference.token_combine(got[0], got[2], weights)
    assert torch.equal(y, y_ref), ("combine", (y.float() - y_ref.float()).abs().max())
    grad = torch.randn_like(y)
    g_inp, g_w = torch.ops.moetriton.combine_backward(grad, got[2], got[0], weights, align is not None)
    r_inp, r_w = reference.combine_backward(grad, got[2], got[0], weights, got[0].shape[0])
    assert torch.equal(g_inp, r_inp), "combine_bwd act"
    torch.testing.assert_close(g_w, r_w, rtol=1e-4, atol=1e-4)


cases = list(
    itertools.product(
        [1, 7, 1000],
        [1, 33, 512],
        [(1, 1), (8, 2), (64, 4), (256, 8)],
        ["mask", "indices"],
        [None, 16],
        [torch.bfloat16, torch.float8_e4m3fn],
    )
)
for case in cases:
    T, H, (E, K), kind, align, dtype = case
    check(T, H, E, K, kind, align, dtype)
print(f"smoke: {len(cases)} dispatch/combine cases match the reference")
x = torch.randn(1000, 64, device="cuda")
sizes = torch.tensor([100, 0, 300, 250, 150], device="cuda")
order = torch.tensor([3, 1, 0, 4, 2], device="cuda")
got = mt.sort_chunks_by_index(x, sizes, order)
exp = reference.sort_chunks_by_index(x, sizes, order)
assert all(torch.equal(a, b) for a, b in zip(got, exp, strict=True))
print("smoke: chunk sort matches")
