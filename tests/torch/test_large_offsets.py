"""64-bit offsets: buffers past 2^31 elements (T = 600,000 tokens of H = 4096 bf16 values, 4.9 GB each)
through dispatch, combine (forward and backward) and chunk sort, compared with an independent torch
computation on a sample of rows that includes the highest ones (their element offsets pass 2^31). GPU only:
the interpreter would take hours, and int32 overflow is a property of compiled code.
"""

import pytest
import torch

import moetriton.torch as mt
from moetriton.torch import reference
from tests.torch._helpers import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU with about 20 GB free")

T, H, E = 600_000, 4096, 8


def _sample(num_rows: int, generator: torch.Generator) -> torch.Tensor:
    """Row indices to check: random ones, the first and the last 64 (the largest offsets)."""
    random = torch.randint(0, num_rows, (256,), generator=generator, device=DEVICE)
    ends = torch.cat([torch.arange(64, device=DEVICE), torch.arange(num_rows - 64, num_rows, device=DEVICE)])
    return torch.cat([random, ends])


def test_dispatch_and_combine_past_two_to_the_31_elements():
    assert T * H > 2**31
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, E, (T, 1), generator=generator, device=DEVICE, dtype=torch.int32)
    weights = torch.rand(T, 1, generator=generator, device=DEVICE)
    tokens = _sample(T, generator)

    x = torch.randn(T, H, generator=generator, device=DEVICE, dtype=torch.bfloat16)
    out, _, row_id_map, _, _ = mt.token_dispatch(x, None, T, indices=ids, num_experts=E)
    expected_map, _, _ = reference.row_map(ids, E, False, T, 1)
    assert torch.equal(row_id_map, expected_map)
    rows = row_id_map[tokens, 0].long()
    assert int(rows.max()) * H > 2**31
    assert torch.equal(out[rows], x[tokens])
    del x

    # Combine forward: y[t] = w[t] * out[row(t)] in fp32, rounded once.
    expert_out = out.mul_(0.5)
    y = mt.token_combine(expert_out, row_id_map, weights)
    expected = (expert_out[rows].float() * weights[tokens]).to(torch.bfloat16)
    assert torch.equal(y[tokens], expected)
    del y

    # Combine backward: grad_in[row(t)] = g[t] * w[t]; grad_w[t] = <out[row(t)], g[t]> (fp32).
    leaf = expert_out.requires_grad_()
    w = weights.clone().requires_grad_()
    grad = torch.randn(T, H, generator=generator, device=DEVICE, dtype=torch.bfloat16)
    grad_in, grad_w = torch.autograd.grad(mt.token_combine(leaf, row_id_map, w), (leaf, w), grad)
    assert torch.equal(grad_in[rows], (grad[tokens].float() * weights[tokens]).to(torch.bfloat16))
    dots = (expert_out[rows].float() * grad[tokens].float()).sum(1, keepdim=True)
    torch.testing.assert_close(grad_w[tokens], dots, rtol=1e-4, atol=1e-3)
    del grad_in, leaf, expert_out

    # Dispatch backward: the token gradient is the combine of the rows' cotangent.
    x = torch.zeros(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out, _, _, _, _ = mt.token_dispatch(x, None, T, indices=ids, num_experts=E)
    (grad_x,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(grad_x[tokens], grad[rows])


def test_chunk_sort_past_two_to_the_31_elements():
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    sizes = torch.tensor([T // 4, T // 8, T // 2, T - T // 4 - T // 8 - T // 2], device=DEVICE)
    order = torch.tensor([3, 1, 0, 2], device=DEVICE)
    rows_in = torch.randn(T, H, generator=generator, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out, row_id_map = mt.sort_chunks_by_index(rows_in, sizes, order)
    dst = reference.chunk_sort_map(sizes, order, T)
    assert torch.equal(row_id_map, dst)
    sample = _sample(T, generator)
    assert torch.equal(out[dst[sample].long()], rows_in[sample])
    grad = torch.randn(T, H, generator=generator, device=DEVICE, dtype=torch.bfloat16)
    (grad_in,) = torch.autograd.grad(out, rows_in, grad)
    assert torch.equal(grad_in[sample], grad[dst[sample].long()])
