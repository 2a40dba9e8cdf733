"""The PyTorch layer's expert activation op (moetriton.torch.activation.ACTIVATE: a kernel per direction over
every row) against a float64 autograd reference: every activation and dtype, strided and expanded inputs
(the cotangent of out.sum() has stride 0), empty dimensions, and the torch.library custom op's fake. On
CPU the kernels run under the Triton interpreter (the conftest sets it), on a GPU compiled."""

from __future__ import annotations

import pytest
import torch

from moetriton.torch.activation import ACTIVATE
from tests.torch._helpers import DEVICE, ROUNDED_TOLERANCE, assert_rounded

_FUNCTIONS = {
    "swiglu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
}


def _reference(hidden: torch.Tensor, grad: torch.Tensor, activation: str):
    hidden = hidden.detach().double().requires_grad_(True)
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        out = _FUNCTIONS[activation](gate) * up
    else:
        out = _FUNCTIONS[activation](hidden)
    (grad_hidden,) = torch.autograd.grad(out, hidden, grad.double())
    return out.detach(), grad_hidden


def _check(hidden: torch.Tensor, grad: torch.Tensor, activation: str) -> None:
    leaf = hidden.detach().requires_grad_(True)
    out = ACTIVATE(leaf, activation)
    out.backward(grad)
    expected_out, expected_grad = _reference(hidden, grad, activation)
    assert out.shape == expected_out.shape and out.dtype == hidden.dtype and leaf.grad.dtype == hidden.dtype
    assert_rounded(out, expected_out, "out")
    assert_rounded(leaf.grad, expected_grad, "grad")


@pytest.mark.parametrize("activation", sorted(_FUNCTIONS))
@pytest.mark.parametrize("dtype", list(ROUNDED_TOLERANCE), ids=str)
@pytest.mark.parametrize("rows", [1, 37])
def test_matches_the_reference(activation, dtype, rows):
    ffn = 24
    width = 2 * ffn if activation == "swiglu" else ffn
    generator = torch.Generator().manual_seed(rows)
    hidden = (2 * torch.randn(rows, width, generator=generator)).to(dtype).to(DEVICE)
    grad = torch.randn(rows, ffn, generator=generator).to(dtype).to(DEVICE)
    _check(hidden, grad, activation)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_strided_hidden_and_the_stride_zero_cotangent_of_a_sum(activation):
    """hidden a transposed view (column stride != 1); the cotangent of out.sum() an expanded scalar."""
    ffn = 16
    width = 2 * ffn if activation == "swiglu" else ffn
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(width, 9, generator=generator).to(torch.bfloat16).to(DEVICE).t()
    assert not hidden.is_contiguous()
    leaf = hidden.detach().requires_grad_(True)
    ACTIVATE(leaf, activation).sum().backward()
    expected_out, expected_grad = _reference(hidden, torch.ones(9, ffn, device=DEVICE), activation)
    assert_rounded(ACTIVATE(hidden, activation), expected_out, "out")
    assert_rounded(leaf.grad, expected_grad, "grad")
    assert leaf.grad.shape == hidden.shape


@pytest.mark.parametrize(("rows", "ffn"), [(0, 8), (5, 0)])
def test_empty_dimensions(rows, ffn):
    hidden = torch.randn(rows, 2 * ffn).to(DEVICE)
    _check(hidden, torch.randn(rows, ffn).to(DEVICE), "swiglu")


def test_custom_op_fake_shapes():
    """The torch.library op's fake (what torch.compile traces) gives the plan's shapes and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.empty(6, 10, dtype=torch.bfloat16)
        out = ACTIVATE(hidden, "swiglu")
        grad_hidden = torch.ops.moetriton.activate_backward(
            torch.empty(6, 5, dtype=torch.bfloat16), hidden, "swiglu"
        )
    assert out.shape == (6, 5) and out.dtype == torch.bfloat16
    assert grad_hidden.shape == (6, 10) and grad_hidden.dtype == torch.bfloat16
