"""The PyTorch FP8 ops (moetriton.torch: quantize, quantize_weights, grouped_matmul_fp8,
grouped_matmul_fp8_wgrad, fp8_grouped_linear) against the independent reference of the quantized math
(tests/kernels/_fp8_reference.py): codes and scales bit for bit, products within the fp32 accumulation
bound of the float64 product of the dequantized operands, and fp8_grouped_linear's gradients against the
float64 gradients of the same quantized operands. Also the custom op's path (what torch.compile traces)
against the eager one, and the argument errors. On CPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import moetriton.torch as mt
from moetriton.torch.fp8 import LINEAR
from tests.kernels import _fp8_reference as ref
from tests.torch._helpers import DEVICE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FORMATS = {"tensorwise": (E4M3, E5M2), "blockwise": (E4M3, E4M3)}  # (forward, gradient)
RECIPES = list(_FORMATS)


def _rows(num_rows: int, width: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    spread = 10.0 ** torch.randint(-2, 3, (num_rows, 1), generator=generator).float()
    return (torch.randn(num_rows, width, generator=generator) * spread).to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.uint8)


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_matches_the_reference_bit_for_bit(recipe):
    blockwise = recipe == "blockwise"
    x = _rows(150, 200, seed=1)
    sizes = torch.tensor([20, 0, 110])  # 20 rows past the groups
    rows, rows_scale, cols, cols_scale = mt.quantize(x.to(DEVICE), sizes.to(DEVICE), recipe, columnwise=True)
    q, scale = ref.rowwise(x, sizes, blockwise, E4M3)
    assert rows.dtype == E4M3 and torch.equal(_bits(rows[:130]), _bits(q))
    assert torch.equal(rows_scale[: scale.shape[0]].cpu(), scale)
    expected_cols, expected_scale, written = ref.columnwise(x, sizes, blockwise, E4M3)
    got = _bits(cols).view(cols.shape[0], -1, 128)[:, written]
    assert torch.equal(got, _bits(expected_cols).view(cols.shape[0], -1, 128)[:, written])
    if blockwise:
        assert torch.equal(cols_scale[written].cpu(), expected_scale[written])
    else:
        assert torch.equal(cols_scale.cpu(), expected_scale)
    none = mt.quantize(x.to(DEVICE), sizes.to(DEVICE), recipe, fp8_dtype=E5M2)
    assert none[0].dtype == E5M2 and none[2] is None and none[3] is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_weights_matches_the_reference_bit_for_bit(recipe):
    w = _rows(2 * 136, 72, seed=2, dtype=torch.float32).view(2, 136, 72)
    rows, cols, scale = mt.quantize_weights(w.to(DEVICE), recipe)
    expected_rows, expected_cols, expected_scale = ref.weights(w, recipe == "blockwise", E4M3)
    assert torch.equal(_bits(rows), _bits(expected_rows)) and torch.equal(_bits(cols), _bits(expected_cols))
    assert torch.equal(scale.cpu(), expected_scale)
    only_cols = mt.quantize_weights(w.to(DEVICE), recipe, rowwise=False)
    assert only_cols[0] is None and torch.equal(_bits(only_cols[1]), _bits(expected_cols))


@pytest.mark.parametrize("recipe", RECIPES)
def test_products_within_the_accumulation_bound(recipe):
    """The forward, data-gradient and weight-gradient products from the public ops' copies."""
    blockwise = recipe == "blockwise"
    fwd, grad_format = _FORMATS[recipe]
    x, dy, w = _rows(140, 200, seed=3), _rows(140, 72, seed=4), _rows(3 * 200, 72, seed=5).view(3, 200, 72)
    sizes = torch.tensor([1, 0, 129]).to(DEVICE)
    x_rows, x_scale, x_cols, x_cols_scale = mt.quantize(x.to(DEVICE), sizes, recipe, columnwise=True)
    dy_rows, dy_scale, dy_cols, dy_cols_scale = mt.quantize(
        dy.to(DEVICE), sizes, recipe, fp8_dtype=grad_format, columnwise=True
    )
    w_rows, w_cols, w_scale = mt.quantize_weights(w.to(DEVICE), recipe)
    out = mt.grouped_matmul_fp8(x_rows, w_cols, x_scale, w_scale, sizes, recipe)
    assert out.shape == (140, 72) and out.dtype == torch.bfloat16
    ref.assert_product(out, *ref.forward(x, w, sizes.cpu(), blockwise, fwd, fwd), 200, not blockwise)
    grad_x = mt.grouped_matmul_fp8(
        dy_rows, w_rows, dy_scale, w_scale, sizes, recipe, data_gradient=True, out_dtype=torch.float32
    )
    assert grad_x.dtype == torch.float32
    ref.assert_product(grad_x, *ref.data_gradient(dy, w, sizes.cpu(), blockwise, grad_format, fwd), 72)
    grad_w = mt.grouped_matmul_fp8_wgrad(x_cols, dy_cols, x_cols_scale, dy_cols_scale, sizes, 140, recipe)
    assert grad_w.shape == (3, 200, 72) and grad_w.dtype == torch.bfloat16
    ref.assert_product(grad_w, *ref.weight_gradient(x, dy, sizes.cpu(), blockwise, fwd, grad_format), 140)


def _expected_linear(x, sizes, w, dy, recipe):
    """(out, d rows, d weight) and their bounds in float64, from the operands quantized as the op
    quantizes them."""
    blockwise = recipe == "blockwise"
    fwd, grad_format = _FORMATS[recipe]
    out = ref.forward(x, w, sizes, blockwise, fwd, fwd)
    grad_x = ref.data_gradient(dy, w, sizes, blockwise, grad_format, fwd)
    grad_w = ref.weight_gradient(x, dy, sizes, blockwise, fwd, grad_format)
    return out, grad_x, grad_w


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_grouped_linear_and_its_gradients(recipe, dtype):
    num_rows, depth, num_cols = 150, 136, 96
    x, w = _rows(num_rows, depth, seed=6, dtype=dtype), _rows(2 * depth, num_cols, seed=7, dtype=dtype)
    w = w.view(2, depth, num_cols)
    dy = _rows(num_rows, num_cols, seed=8, dtype=dtype)
    sizes = torch.tensor([60, 70])  # 20 rows past the groups: zero output, zero gradient
    leaf_x, leaf_w = x.to(DEVICE).requires_grad_(True), w.to(DEVICE).requires_grad_(True)
    out = mt.fp8_grouped_linear(leaf_x, sizes.to(DEVICE), leaf_w, recipe)
    out.backward(dy.to(DEVICE))
    assert out.dtype == dtype and leaf_x.grad.dtype == dtype and leaf_w.grad.dtype == dtype
    (out_ref, out_bound), (gx_ref, gx_bound), (gw_ref, gw_bound) = _expected_linear(x, sizes, w, dy, recipe)
    fast = recipe == "tensorwise"  # the forward's tensorwise product is not split
    ref.assert_product(out.detach(), out_ref, out_bound, depth, fast)
    ref.assert_product(leaf_x.grad, gx_ref, gx_bound, num_cols)
    ref.assert_product(leaf_w.grad, gw_ref, gw_bound, num_rows)
    assert not out[130:].any() and not leaf_x.grad[130:].any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_linear_custom_op_matches_the_eager_path(recipe):
    """The torch.library op (what torch.compile and tensor subclasses reach) runs the same kernels, with
    the same gradients, as the direct eager call; its fake gives the same shapes and dtypes."""
    x = _rows(40, 128, seed=9).to(DEVICE).requires_grad_(True)
    w = _rows(2 * 128, 64, seed=10).view(2, 128, 64).to(DEVICE).requires_grad_(True)
    sizes = torch.tensor([15, 25]).to(DEVICE)
    eager = LINEAR(x, sizes, w, recipe, True)
    custom = LINEAR.custom(x, sizes, w, recipe, True)
    fake = LINEAR.custom(x.to("meta"), sizes.to("meta"), w.to("meta"), recipe, True)
    for a, b, f in zip(eager, custom, fake, strict=True):
        assert a.shape == b.shape == f.shape and a.dtype == b.dtype == f.dtype
        assert torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
    grads = [torch.autograd.grad(out[0].float().sum(), (x, w)) for out in (eager, custom)]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_fp8_grouped_linear_without_grad_saves_nothing():
    x, w = _rows(8, 128, seed=11).to(DEVICE), _rows(128, 16, seed=12).view(1, 128, 16).to(DEVICE)
    _, *saved = LINEAR(x, torch.tensor([8]).to(DEVICE), w, "blockwise", False)
    assert all(tensor.numel() == 0 for tensor in saved)
    with torch.no_grad():
        out = mt.fp8_grouped_linear(x.requires_grad_(True), torch.tensor([8]).to(DEVICE), w, "blockwise")
    assert out.shape == (8, 16) and not out.requires_grad


def _mixed_recipes(x, sizes, w):
    """The forward with blockwise rows and a tensorwise weight (its scale has the wrong layout)."""
    rows, rows_scale, _, _ = mt.quantize(x, sizes, "blockwise")
    _, cols, scale = mt.quantize_weights(w, "tensorwise")
    return mt.grouped_matmul_fp8(rows, cols, rows_scale, scale, sizes, "blockwise")


def _wrong_row_count(x, sizes):
    """The weight gradient told another row count than its copies were quantized from."""
    _, _, cols, scale = mt.quantize(x, sizes, "tensorwise", rowwise=False, columnwise=True)
    return mt.grouped_matmul_fp8_wgrad(cols, cols, scale, scale, sizes, 200, "tensorwise")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x, s, w: mt.fp8_grouped_linear(x, s, w, "mx"), ValueError, "recipe"),
        (lambda x, s, w: mt.fp8_grouped_linear(x, s, w[:, :64], "blockwise"), ValueError, "weight"),
        (lambda x, s, w: mt.fp8_grouped_linear(x, s.float(), w, "blockwise"), TypeError, "integers"),
        (lambda x, s, w: mt.fp8_grouped_linear(x.half(), s, w, "blockwise"), TypeError, "share"),
        (lambda x, s, w: mt.fp8_grouped_linear(x.int(), s, w.int(), "blockwise"), TypeError, "rows"),
        (lambda x, s, w: mt.quantize(x, s, "blockwise", rowwise=False), ValueError, "copy"),
        (lambda x, s, w: mt.quantize(x, s, "blockwise", fp8_dtype=torch.int8), ValueError, "fp8_dtype"),
        (lambda x, s, w: mt.quantize_weights(w[0], "blockwise"), ValueError, "dimensions"),
        (lambda x, s, w: _mixed_recipes(x, s, w), ValueError, "rhs_scale"),
        (lambda x, s, w: _wrong_row_count(x, s), ValueError, "wide"),
    ],
)  # fmt: skip
def test_bad_arguments_raise(call, error, match):
    x, w = _rows(8, 128, seed=13).to(DEVICE), _rows(256, 16, seed=14).view(2, 128, 16).to(DEVICE)
    with pytest.raises(error, match=match):
        call(x, torch.tensor([3, 5]).to(DEVICE), w)


@pytest.mark.parametrize("recipe", RECIPES)
def test_strided_rows_and_an_expanded_gradient(recipe):
    """A column slice of wider rows and a transposed weight give what their contiguous copies give; the
    gradient of out.sum() (a stride-0 expanded tensor) is taken as the dense ones it equals."""
    wide = _rows(40, 256, seed=15).to(DEVICE)
    weight_t = _rows(2 * 64, 128, seed=16).view(2, 64, 128).to(DEVICE)
    sizes = torch.tensor([15, 25]).to(DEVICE)
    rows, weight = wide[:, 64:192], weight_t.transpose(1, 2)
    assert not rows.is_contiguous() and not weight.is_contiguous()
    for got, expected in zip(
        mt.quantize(rows, sizes, recipe, columnwise=True),
        mt.quantize(rows.contiguous(), sizes, recipe, columnwise=True),
        strict=True,
    ):
        assert torch.equal(_bits(got), _bits(expected))  # the groups cover every row and block
    results = []
    for x, w in ((rows, weight), (rows.contiguous(), weight.contiguous())):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        out = mt.fp8_grouped_linear(x, sizes, w, recipe)
        out.sum().backward()  # the cotangent: ones expanded from a scalar
        results.append((out.detach(), x.grad, w.grad))
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)


def test_fp8_grouped_linear_under_torch_compile_fullgraph():
    x = _rows(40, 128, seed=17).to(DEVICE)
    w = _rows(2 * 128, 64, seed=18).view(2, 128, 64).to(DEVICE)
    sizes = torch.tensor([15, 25]).to(DEVICE)
    results = []
    for function in (mt.fp8_grouped_linear, torch.compile(mt.fp8_grouped_linear, fullgraph=True)):
        leaf_x, leaf_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = function(leaf_x, sizes, leaf_w, "blockwise")
        out.float().square().sum().backward()
        results.append((out.detach(), leaf_x.grad, leaf_w.grad))
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)


def test_without_kernels_the_ops_refuse():
    """On CPU without the interpreter there is no framework fallback: the ops say what they need (checked
    in a fresh process, since TRITON_INTERPRET is read when moetriton is imported)."""
    code = (
        "import torch, moetriton.torch as mt\n"
        "try:\n"
        "    mt.quantize(torch.ones(4, 128, dtype=torch.bfloat16), torch.tensor([4]), 'blockwise')\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "TRITON_INTERPRET=1" in child.stdout, child.stdout + child.stderr


@pytest.mark.parametrize("frozen", ["rows", "weight"])
def test_fp8_grouped_linear_with_one_input_frozen(frozen):
    """The backward computes (and quantizes the output gradient for) only the gradient asked for, the same
    one as when both are asked for."""
    x = _rows(40, 128, seed=19).to(DEVICE)
    w = _rows(2 * 128, 64, seed=20).view(2, 128, 64).to(DEVICE)
    sizes, dy = torch.tensor([15, 25]).to(DEVICE), _rows(40, 64, seed=21).to(DEVICE)
    both = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    mt.fp8_grouped_linear(both[0], sizes, both[1], "tensorwise").backward(dy)
    one = [x.clone().requires_grad_(frozen != "rows"), w.clone().requires_grad_(frozen != "weight")]
    mt.fp8_grouped_linear(one[0], sizes, one[1], "tensorwise").backward(dy)
    for got, expected in zip(one, both, strict=True):
        if got.requires_grad:
            assert torch.equal(got.grad, expected.grad)
        else:
            assert got.grad is None
