"""The PyTorch layer's expert activation op (moetriton.torch.activation.ACTIVATE: a kernel per direction over
every row) against a float64 autograd reference: every activation and dtype, strided and expanded inputs
(the cotangent of out.sum() has stride 0), empty dimensions, and the torch.library custom op's fake. On
CPU the kernels run under the Triton interpreter (the conftest sets it), on a GPU compiled."""

from __future__ import annotations

import pytest
import torch

from moetriton.torch.activation import ACTIVATE
from tests.torch._helpers import DEVICE, ROUNDED_TOLERANCE, assert_rounded


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's activation as transformers writes it (GptOssExperts._apply_gate, alpha 1.702, limit 7)."""
    gate = gate.clamp(min=None, max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


#: A gated activation's function of (gate, up), a plain one's of hidden.
_FUNCTIONS = {
    "swiglu": lambda gate, up: torch.nn.functional.silu(gate) * up,
    "clamped_swiglu": _clamped_swiglu,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
}
_GATED = ("swiglu", "clamped_swiglu")


def _reference(hidden: torch.Tensor, grad: torch.Tensor, activation: str):
    hidden = hidden.detach().double().requires_grad_(True)
    function = _FUNCTIONS[activation]
    out = function(*hidden.chunk(2, dim=-1)) if activation in _GATED else function(hidden)
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
    width = 2 * ffn if activation in _GATED else ffn
    generator = torch.Generator().manual_seed(rows)
    # clamped_swiglu's clamps at +-7 matter: a quarter of 6 N(0, 1) lies past them.
    scale = 6 if activation == "clamped_swiglu" else 2
    hidden = (scale * torch.randn(rows, width, generator=generator)).to(dtype).to(DEVICE)
    grad = torch.randn(rows, ffn, generator=generator).to(dtype).to(DEVICE)
    _check(hidden, grad, activation)


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "gelu"])
def test_strided_hidden_and_the_stride_zero_cotangent_of_a_sum(activation):
    """hidden a transposed view (column stride != 1); the cotangent of out.sum() an expanded scalar."""
    ffn = 16
    width = 2 * ffn if activation in _GATED else ffn
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


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid(-170): 0
def test_clamped_swiglu_is_gpt_oss_experts_gate():
    """Against transformers' own GptOssExperts._apply_gate (with the module's alpha and limit) on its
    interleaved [gate0, up0, gate1, up1, ...] columns, de-interleaved to [gate | up] for ours: values past
    +-limit, at it and NaN; the gradients are autograd's of transformers' code."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the test extra) is not installed"
    )
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    # The module's own attributes: transformers 5.17 fixes them in GptOssExperts, later versions read them
    # from the config (swiglu_alpha, swiglu_limit).
    config = transformers.GptOssConfig(hidden_size=4, intermediate_size=4, num_local_experts=1)
    experts = GptOssExperts(config)
    generator = torch.Generator().manual_seed(5)
    interleaved = 8 * torch.randn(7, 2 * 20, generator=generator)
    interleaved[0, :8] = torch.tensor([7.0, -7.0, 100.0, -100.0, -7.0, 7.0, -100.0, 100.0])
    interleaved[1, :4] = torch.tensor([float("nan"), 1.0, 1.0, float("nan")])
    grad = torch.randn(7, 20, generator=generator)
    leaf = interleaved.clone().requires_grad_(True)
    expected = experts._apply_gate(leaf)
    expected.backward(grad)
    ours = torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], dim=1).to(DEVICE).requires_grad_(True)
    out = ACTIVATE(ours, "clamped_swiglu")
    out.backward(grad.to(DEVICE))
    grad_ours = torch.stack([ours.grad[:, :20], ours.grad[:, 20:]], dim=2).flatten(1)  # re-interleaved
    torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(grad_ours.cpu(), leaf.grad, rtol=1e-5, atol=1e-5, equal_nan=True)
    # (gate, up) = (100, -100) is (7, -7) with no gradient; NaN in the gate and in the up of one column each.
    assert out[0, 1] == out[0, 0] and (grad_ours[0, 2:4] == 0).all() and out[1].isnan().sum() == 2


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
