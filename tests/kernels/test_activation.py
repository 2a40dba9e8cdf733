"""The grouped activation kernels (moetriton.kernels.activation) and the grouped GEMM's unwritten tails,
launched straight from their plans on torch buffers pre-filled with NaN: the groups' rows match a float64
torch reference (autograd for the backward), and no kernel writes a row at or past sum(group_sizes) where
the plan says so (the point of these options: those rows cost no memory traffic)."""

from __future__ import annotations

import json

import pytest
import torch

from moetriton import kernels
from moetriton.kernels.activation import activation_backward_plan, activation_plan
from moetriton.kernels.rules.activation import GATED_ACTIVATIONS
from tests.torch._helpers import DEVICE, assert_rounded

from ._compile import in_child

_DTYPES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's activation as transformers writes it (GptOssExperts._apply_gate, alpha 1.702, limit 7)."""
    gate = gate.clamp(min=None, max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


#: A gated activation's function of (gate, up), a plain one's of hidden.
_REFERENCE = {
    "swiglu": lambda gate, up: torch.nn.functional.silu(gate) * up,
    "geglu": lambda gate, up: torch.nn.functional.gelu(gate) * up,
    "clamped_swiglu": _clamped_swiglu,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
}


def _inputs(num_rows: int, width: int, activation: str, generator: torch.Generator) -> torch.Tensor:
    """[M, W] fp32: 2 N(0, 1); for clamped_swiglu 6 N(0, 1) (a quarter past +-7) with every 7th value
    exactly +-7, where the clamps' gradient rule decides."""
    if activation != "clamped_swiglu":
        return 2 * torch.randn(num_rows, width, generator=generator)
    hidden = 6 * torch.randn(num_rows, width, generator=generator)
    hidden.view(-1)[::7] = 7.0 * torch.sign(hidden.view(-1)[::7])
    return hidden


def _run(plan: kernels.Plan, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every buffer of `plan` after its launches, each allocated full of NaN (integers: -1)."""
    env = dict(inputs)
    for name, spec in plan.buffers.items():
        dtype = inputs[spec.dtype.removeprefix("like:")].dtype if spec.dtype.startswith("like:") else None
        dtype = dtype or getattr(torch, spec.dtype)
        fill = float("nan") if dtype.is_floating_point else -1
        env[name] = torch.full(spec.shape, fill, dtype=dtype, device=DEVICE)
    for launch in plan.launches:
        args = [env[arg] if isinstance(arg, str) else arg for arg in launch.args]
        outputs = [env[name] for name in launch.outputs]
        launch.kernel[launch.grid](
            *args, *outputs, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages
        )
    return env


def _reference(hidden: torch.Tensor, grad: torch.Tensor, activation: str):
    """(out, grad_hidden) in float64 from the rounded inputs."""
    hidden = hidden.detach().double().requires_grad_(True)
    function = _REFERENCE[activation]
    out = function(*hidden.chunk(2, dim=1)) if GATED_ACTIVATIONS[activation] else function(hidden)
    (grad_hidden,) = torch.autograd.grad(out, hidden, grad.double())
    return out.detach(), grad_hidden


@pytest.mark.parametrize("activation", sorted(_REFERENCE))
@pytest.mark.parametrize("dtype", list(_DTYPES), ids=str)
@pytest.mark.parametrize(
    ("num_rows", "sizes"),
    [(13, [4, 0, 5]), (9, [5, 7]), (6, [-3, 2]), (7, [0, 0]), (0, [3])],
    ids=["tail", "clipped", "negative", "empty-groups", "no-rows"],
)
def test_groups_rows_match_the_reference_and_the_tail_is_untouched(activation, dtype, num_rows, sizes):
    ffn = 24  # not a power of two: masked columns
    width = 2 * ffn if GATED_ACTIVATIONS[activation] else ffn
    generator = torch.Generator().manual_seed(num_rows + width)
    hidden = _inputs(num_rows, width, activation, generator).to(dtype).to(DEVICE)
    grad = torch.randn(num_rows, ffn, generator=generator).to(dtype).to(DEVICE)
    group_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    valid = min(sum(max(size, 0) for size in sizes), num_rows)
    dims = dict(
        activation=activation,
        num_rows=num_rows,
        width=width,
        num_groups=len(sizes),
        element_bytes=_DTYPES[dtype],
    )
    out = _run(activation_plan(**dims), dict(hidden=hidden, group_sizes=group_sizes))["out"]
    inputs = dict(hidden=hidden, grad=grad, group_sizes=group_sizes)
    grad_hidden = _run(activation_backward_plan(**dims), inputs)["grad_hidden"]
    assert out.shape == (num_rows, ffn) and out.dtype == dtype
    assert grad_hidden.shape == (num_rows, width) and grad_hidden.dtype == dtype
    expected_out, expected_grad = _reference(hidden[:valid], grad[:valid], activation)
    assert_rounded(out[:valid], expected_out, "out")
    assert_rounded(grad_hidden[:valid], expected_grad, "grad_hidden")
    assert out[valid:].isnan().all() and grad_hidden[valid:].isnan().all(), (
        "a row past the groups was written"
    )


def test_clamped_swiglu_nan_inputs_go_through_as_in_torch():
    """A NaN gate or up gives a NaN output; its own gradient is 0 (torch.clamp stops it at NaN), the other
    half's NaN, unless that half is clamped (gate > 7, |up| > 7): then 0 as well, as torch's autograd."""
    nan = float("nan")
    gate = [nan, nan, nan, 1.0, 9.0, -9.0, 7.0, nan]
    up = [1.0, 8.0, -7.0, nan, nan, nan, -7.0, nan]
    hidden = torch.tensor([gate + up], device=DEVICE)
    grad = torch.tensor([[1.0, 2.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0]], device=DEVICE)
    dims = dict(activation="clamped_swiglu", num_rows=1, width=16, num_groups=1, element_bytes=4)
    group_sizes = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    out = _run(activation_plan(**dims), dict(hidden=hidden, group_sizes=group_sizes))["out"]
    inputs = dict(hidden=hidden, grad=grad, group_sizes=group_sizes)
    grad_hidden = _run(activation_backward_plan(**dims), inputs)["grad_hidden"]
    expected_out, expected_grad = _reference(hidden, grad, "clamped_swiglu")
    assert out[0].isnan().tolist() == [True] * 6 + [False, True]
    # The gate's gradient is NaN where up or the cotangent is and the gate passes (<= 7), up's likewise.
    assert grad_hidden[0, :8].isnan().tolist() == [False] * 3 + [True, False, True, True, False]
    assert grad_hidden[0, 8:].isnan().tolist() == [True, False, True, False, False, False, True, False]
    for got, want in ((out, expected_out), (grad_hidden, expected_grad)):
        torch.testing.assert_close(got.cpu().double(), want.cpu(), rtol=1e-6, atol=1e-6, equal_nan=True)


def test_activation_plan_rejects_bad_problems():
    dims = dict(num_rows=4, num_groups=1, element_bytes=2)
    with pytest.raises(ValueError, match="activation must be one of"):
        activation_plan(activation="tanh", width=8, **dims)
    with pytest.raises(ValueError, match="even for 'swiglu'"):
        activation_plan(activation="swiglu", width=7, **dims)
    with pytest.raises(ValueError, match="element size 1"):
        activation_backward_plan(activation="relu", width=8, num_rows=4, num_groups=1, element_bytes=1)


@pytest.mark.parametrize("scatter_out", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_grouped_matmul_tail_is_zeros_or_unwritten(zero_tail, scatter_out):
    """Rows of the product past sum(group_sizes) are zeros with zero_tail, untouched without; the groups'
    rows are the same either way."""
    num_rows, depth, num_cols, sizes = 150, 40, 72, [30, 0, 45]
    generator = torch.Generator().manual_seed(3)
    lhs = torch.randn(num_rows, depth, generator=generator).to(DEVICE)
    rhs = torch.randn(len(sizes), depth, num_cols, generator=generator).to(DEVICE)
    order = torch.randperm(num_rows, generator=generator).int().to(DEVICE)
    dims = dict(num_rows=num_rows, depth=depth, num_cols=num_cols, num_groups=len(sizes), element_bytes=4)
    plan = kernels.grouped_matmul_plan(scatter_out=scatter_out, zero_tail=zero_tail, **dims)
    inputs = dict(lhs=lhs, rhs=rhs, group_sizes=torch.tensor(sizes, dtype=torch.int32, device=DEVICE))
    inputs.update(lhs_rows=order, out_rows=order)  # lhs_rows unused: the plan does not gather
    out = _run(plan, inputs)["out"]
    product = torch.cat([lhs[0:30] @ rhs[0], lhs[30:75] @ rhs[2]]).cpu().double()
    rows = order[:75].long().cpu() if scatter_out else torch.arange(75)
    tail = torch.ones(num_rows, dtype=torch.bool)
    tail[rows] = False
    torch.testing.assert_close(out.cpu().double()[rows], product, rtol=1e-5, atol=1e-4)
    if zero_tail:
        assert (out.cpu()[tail] == 0).all()
    else:
        assert out.cpu()[tail].isnan().all(), "a row past the groups was written"


def test_weight_gradient_gathers_only_the_groups_rows():
    """The weight-gradient plan's row gathers copy rows below sum(group_sizes) only (the kernel reads no
    other), and the gradient is the same as from fully gathered operands."""
    num_rows, depth, num_cols, sizes = 50, 24, 16, [15, 0, 20]
    generator = torch.Generator().manual_seed(4)
    lhs = torch.randn(num_rows, depth, generator=generator).to(DEVICE)
    grad = torch.randn(num_rows, num_cols, generator=generator).to(DEVICE)
    lhs_rows = torch.randperm(num_rows, generator=generator).int().to(DEVICE)
    out_rows = torch.randperm(num_rows, generator=generator).int().to(DEVICE)
    dims = dict(num_rows=num_rows, depth=depth, num_cols=num_cols, num_groups=len(sizes), element_bytes=4)
    plan = kernels.grouped_matmul_wgrad_plan(gather_lhs=True, gather_grad=True, **dims)
    inputs = dict(lhs=lhs, grad=grad, group_sizes=torch.tensor(sizes, dtype=torch.int32, device=DEVICE))
    inputs.update(lhs_rows=lhs_rows, out_rows=out_rows)
    env = _run(plan, inputs)
    gathered_lhs, gathered_grad = env["gathered_lhs"].cpu(), env["gathered_grad"].cpu()
    torch.testing.assert_close(gathered_lhs[:35], lhs.cpu()[lhs_rows[:35].long().cpu()])
    torch.testing.assert_close(gathered_grad[:35], grad.cpu()[out_rows[:35].long().cpu()])
    assert gathered_lhs[35:].isnan().all() and gathered_grad[35:].isnan().all()
    left, right = gathered_lhs.double(), gathered_grad.double()
    expected = torch.stack(
        [left[0:15].T @ right[0:15], torch.zeros(depth, num_cols).double(), left[15:35].T @ right[15:35]]
    )
    torch.testing.assert_close(env["out"].cpu().double(), expected, rtol=1e-5, atol=1e-4)


def _compile_all() -> None:
    """Child process: compile every variant of the kernels above for sm_90, print their names as JSON."""
    from moetriton.kernels import activation, grouped_gemm

    from ._compile import compile_sm90

    compiled = []
    for dtype in ("bf16", "fp32"):
        pointers = dict(hidden_ptr=f"*{dtype}", grad_ptr=f"*{dtype}", out_ptr=f"*{dtype}")
        pointers.update(grad_hidden_ptr=f"*{dtype}", group_sizes_ptr="*i32")
        for name in sorted(_REFERENCE):
            plan = activation_plan(activation=name, num_rows=4096, width=4096, num_groups=8, element_bytes=2)
            for kernel in (activation._activate_kernel, activation._activate_backward_kernel):
                compile_sm90(kernel, plan.launches[0].constexprs, pointers)
                compiled.append(f"{kernel.__name__}-{name}-{dtype}")
    plan = kernels.grouped_matmul_plan(
        num_rows=4096,
        depth=4096,
        num_cols=4096,
        num_groups=8,
        element_bytes=2,
        scatter_out=True,
        zero_tail=False,
    )
    pointers = dict(lhs_ptr="*bf16", rhs_ptr="*bf16", out_ptr="*bf16", group_sizes_ptr="*i32")
    pointers.update(lhs_rows_ptr="*i32", out_rows_ptr="*i32")
    compile_sm90(grouped_gemm._grouped_matmul_kernel, plan.launches[0].constexprs, pointers, num_warps=8)
    compiled.append("_grouped_matmul_kernel-no-zero-tail")
    plan = kernels.grouped_matmul_wgrad_plan(
        num_rows=4096, depth=4096, num_cols=4096, num_groups=8, element_bytes=2, gather_lhs=True
    )
    pointers = dict(inp_ptr="*bf16", rows_ptr="*i32", group_sizes_ptr="*i32", out_ptr="*bf16")
    compile_sm90(grouped_gemm._gather_rows_kernel, plan.launches[0].constexprs, pointers)
    compiled.append("_gather_rows_kernel")
    print(json.dumps(compiled))


def test_kernels_compile_for_sm90():
    """Every activation kernel variant, the product kernel without zero tail and the row gather compile
    for an H100 (the interpreter runs code that the compiler may reject)."""
    compiled = in_child("tests.kernels.test_activation:_compile_all")
    assert len(compiled) == 2 * 2 * len(_REFERENCE) + 2
