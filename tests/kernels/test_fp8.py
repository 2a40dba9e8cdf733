"""The FP8 quantization kernels and grouped GEMMs against the PyTorch reference (_fp8_reference).

Quantization is compared bit for bit (codes and scales); the GEMMs against the float64 product of the
dequantized operands, within the error bound of fp32 accumulation: |got - exact| <= u (D + 2 D/128 + 8)
(|A| @ |B|) with u = 2**-24, plus half an ulp of a bf16 output. Every output lies inside guard zones
(sentinel-filled margins, checked untouched), inputs inside margins of poison (huge values, NaN codes)
that would show in the results if read; rows past the groups hold poison too.

On CPU the kernels run under the Triton interpreter; on a GPU the same tests run them compiled (and then
check the hardware fp8 conversion and the FP8 tensor-core products, which the interpreter replaces by
integer rounding and an fp32 product of the decoded operands: its own fp8 conversions and fp8 dot
misread NaN codes and e5m2 subnormals).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from moetriton.kernels import quantize as fq
from moetriton.kernels.grouped_gemm import fp8 as fg
from moetriton.kernels.rules import fp8 as rules
from moetriton.kernels.runtime.interpreter import INTERPRETER

from . import _fp8_reference as ref
from ._fp8_launch import Guarded, run_plan

DEVICE = torch.device("cpu" if INTERPRETER else "cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAMES = {E4M3: "float8_e4m3fn", E5M2: "float8_e5m2"}
GUARD = 300  # elements of margin before and after every output
POISON_CODE = 0x7F  # a NaN code: read by a GEMM it shows (as NaN, or as 480 under the interpreter)
POISON = 1.0e30  # read by an amax it would change every scale


def _poisoned(x: torch.Tensor, rows_past: int = 0) -> torch.Tensor:
    """`x` on the device inside margins of poison; with rows_past, its last rows poisoned too."""
    holder = Guarded(tuple(x.shape), x.dtype, DEVICE, GUARD)
    if x.dtype.itemsize == 1:
        holder.full.view(torch.uint8).fill_(POISON_CODE)
    else:
        holder.full.fill_(min(POISON, torch.finfo(x.dtype).max) if x.dtype.is_floating_point else 10**9)
    holder.view.copy_(x.to(DEVICE))
    if rows_past:
        if x.dtype.itemsize == 1:
            holder.view[x.shape[0] - rows_past :].view(torch.uint8).fill_(POISON_CODE)
        else:
            holder.view[x.shape[0] - rows_past :] = min(POISON, torch.finfo(x.dtype).max)
    return holder.view


def _sizes(sizes: list[int], dtype=torch.int32) -> torch.Tensor:
    return _poisoned(torch.tensor(sizes, dtype=dtype))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.uint8)


def _assert_guards(holders: dict) -> None:
    for name, holder in holders.items():
        assert holder.margins_intact(), f"{name}: written outside its buffer"


def _unwritten(x: torch.Tensor) -> bool:
    """Whether x still holds the sentinel its guarded allocation started with."""
    if x.dtype.itemsize == 1:
        return bool((_bits(x) == 0x5A).all())
    return bool((x.cpu() == -777.0).all())


# ----------------------------------------------------------------------------------------------------
# The rounding itself


@triton.jit
def _codes_kernel(x_ptr, out_ptr, count, FP8: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """Grid (cdiv(count, 1024),): out = fp8 codes of x at scale 1, through the kernels' quantizer."""
    offsets = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    x, finite, _ = fq._prepared(tl.load(x_ptr + offsets, mask=offsets < count, other=0.0))
    tl.store(out_ptr + offsets, fq._quantized(x, finite, 1.0, FP8, SOFTWARE_CAST), mask=offsets < count)


def _every_bfloat16() -> torch.Tensor:
    """All 65536 bf16 bit patterns as fp32 (every exponent, ties at 3 and 2 kept bits, NaN and inf),
    then fp32 values with full mantissas just around e4m3 and e5m2 ties and the subnormal boundaries."""
    everything = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    generator = torch.Generator().manual_seed(3)
    near = torch.tensor([2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 2.0**-14, 2.0**-16, 2.0**-17, 1.0625, 1.9375])
    near = torch.cat([near * (1 + d) for d in (-(2.0**-23), 0.0, 2.0**-23)])
    noise = torch.randn(4096, generator=generator) * 10.0 ** torch.randint(
        -8, 6, (4096,), generator=generator
    )
    return torch.cat([everything, near, -near, noise, torch.tensor([448.0, 464.0, 57344.0, 61440.0])])


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "software", [True] if INTERPRETER else [True, False], ids=lambda s: "software" if s else "hw"
)
def test_rounding_matches_pytorch_bit_for_bit(dtype, software):
    """Saturate, round to nearest even, NaN for non-finite: the codes of
    every bf16 value and of fp32 values around every rounding boundary, against PyTorch's conversion."""
    x = _every_bfloat16()
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _codes_kernel[(triton.cdiv(x.numel(), 1024),)](
        x.to(DEVICE), out, x.numel(), FP8=_tl(dtype), SOFTWARE_CAST=software
    )
    expected = _bits(ref.codes(x, torch.tensor(1.0), dtype))
    wrong = (out.cpu() != expected).nonzero().flatten()
    assert wrong.numel() == 0, [(x[i].item(), out[i].item(), expected[i].item()) for i in wrong[:8]]


def _tl(dtype: torch.dtype):
    return tl.float8e4nv if dtype == E4M3 else tl.float8e5


# ----------------------------------------------------------------------------------------------------
# Quantization of activations and gradients


def _rows(num_rows: int, width: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows of mixed magnitudes (a different spread per row), with a zero row and a zero column."""
    generator = torch.Generator().manual_seed(seed)
    spread = 10.0 ** torch.randint(-3, 4, (num_rows, 1), generator=generator).float()
    x = torch.randn(num_rows, width, generator=generator) * spread
    if num_rows > 2:
        x[2] = 0.0
    if width > 5:
        x[:, 5] = 0.0
    return x.to(dtype)


def _quantize(recipe, x, sizes, fp8, rowwise=True, columnwise=True, rows_past=0):
    plan = fq.quantize_plan(
        recipe=recipe,
        num_rows=x.shape[0],
        width=x.shape[1],
        num_groups=sizes.numel(),
        element_bytes=x.element_size(),
        fp8_dtype=NAMES[fp8],
        rowwise=rowwise,
        columnwise=columnwise,
    )
    inputs = dict(inp=_poisoned(x, rows_past), group_sizes=sizes)
    buffers, holders = run_plan(plan, inputs, DEVICE, guard=GUARD)
    _assert_guards(holders)
    return buffers


def _check_quantized(recipe, x, sizes, fp8, buffers, rowwise=True, columnwise=True):
    """Every written code and scale against the reference; what the plan leaves unwritten untouched."""
    blockwise = recipe == "blockwise"
    sizes = sizes.cpu()
    covered = ref.group_bounds(sizes, x.shape[0])[-1][1]
    if rowwise:
        q, scales = ref.rowwise(x, sizes, blockwise, fp8)
        assert torch.equal(_bits(buffers["rows"][:covered]), _bits(q)), "rowwise codes"
        assert torch.equal(
            buffers["rows_scale"][: scales.shape[0]].cpu(), scales.reshape(-1, *scales.shape[1:])
        )
        assert _unwritten(buffers["rows"][covered:]), "rows past the groups were written"
        if blockwise:
            assert _unwritten(buffers["rows_scale"][covered:])
    if columnwise:
        cols, scales, written = ref.columnwise(x, sizes, blockwise, fp8)
        assert buffers["cols"].shape == cols.shape
        got = _bits(buffers["cols"]).view(cols.shape[0], -1, rules.BLOCK)
        assert torch.equal(got[:, written], _bits(cols).view(cols.shape[0], -1, rules.BLOCK)[:, written])
        assert _unwritten(buffers["cols"].view(cols.shape[0], -1, rules.BLOCK)[:, ~written])
        if blockwise:
            assert torch.equal(buffers["cols_scale"][written].cpu(), scales[written])
            assert _unwritten(buffers["cols_scale"][~written])
        else:
            assert torch.equal(buffers["cols_scale"].cpu(), scales)


GROUPINGS = [
    (300, 256, [130, 0, 150]),  # an empty group, rows past the groups, a group over two blocks
    (260, 200, [1, 1, 0, 129, 3]),  # groups of 1 row, 129 rows; W not a multiple of 128
    (40, 40, [17, 23]),  # W < 128, groups smaller than a block
    (0, 64, [0, 0]),  # M = 0
    (10, 128, [0]),  # no rows in the only group
]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize(("num_rows", "width", "sizes"), GROUPINGS)
def test_quantize_activations(recipe, num_rows, width, sizes):
    x = _rows(num_rows, width, seed=num_rows + width)
    group_sizes = _sizes(sizes)
    rows_past = num_rows - min(sum(sizes), num_rows)
    buffers = _quantize(recipe, x, group_sizes, E4M3, rows_past=rows_past)
    _check_quantized(recipe, x, group_sizes, E4M3, buffers)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("copies", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
def test_quantize_dtypes_and_single_copies(recipe, fp8, source, copies):
    x = _rows(150, 136, seed=4, dtype=source)
    sizes = _sizes([100, 50])
    buffers = _quantize(recipe, x, sizes, fp8, *copies)
    _check_quantized(recipe, x, sizes, fp8, buffers, *copies)
    for name, wanted in (("rows", copies[0]), ("cols", copies[1])):
        assert wanted or buffers[name].numel() == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize(
    "sizes",
    [
        [-5, 2**31 - 1, 7],  # negative: empty; huge: clipped to the rows left
        [200, 200, 200],  # sum > M
        [2**40, 3],  # int64 past 2**32: clipped before narrowing
    ],
)
def test_hostile_group_sizes(recipe, sizes):
    x = _rows(150, 128, seed=9)
    group_sizes = _sizes(sizes, torch.int64 if max(sizes) >= 2**31 else torch.int32)
    buffers = _quantize(recipe, x, group_sizes, E4M3)
    _check_quantized(recipe, x, group_sizes, E4M3, buffers)


def _special_rows() -> torch.Tensor:
    """fp32 rows of every special case: all zeros, past the e4m3 and e5m2 ranges, up to fp32's max,
    subnormals, and non-finite values beside finite ones (the block scales must ignore them)."""
    x = _rows(260, 256, seed=5, dtype=torch.float32)
    x[0] = 0.0  # an all-zero row: scale 1
    x[1] = torch.linspace(-1.0e6, 1.0e6, 256)  # past e4m3 and e5m2
    x[3, :128] = 3.0e38  # near fp32's max: one block at its limit
    x[4] = torch.linspace(-1e-39, 1e-39, 256)  # fp32 subnormals only: the scale's floor 2**-126
    x[5, 7], x[5, 9], x[5, 130] = float("nan"), float("inf"), float("-inf")
    x[6, :128] = float("nan")  # a block of NaN only: scale 1, every code NaN
    x[7, 3] = 1e-39  # one subnormal in a normal block
    x[140:150, 10] = float("inf")  # a column with infinities inside one group's block
    x[200:260, :] = 0.0  # a whole 128-row block of the second group half zero
    return x


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_special_values(recipe, fp8):
    x = _special_rows()
    sizes = _sizes([130, 130])
    buffers = _quantize(recipe, x, sizes, fp8)
    _check_quantized(recipe, x, sizes, fp8, buffers)
    codes = _bits(buffers["rows"])
    assert (codes[5, [7, 9, 130]] == 0x7F).all() and (codes[6, :128] == 0x7F).all()
    assert (
        torch.isfinite(buffers["rows_scale"].cpu()).all()
        and torch.isfinite(buffers["cols_scale"].cpu()).all()
    )
    if recipe == "blockwise":
        assert (buffers["rows_scale"][[0, 6], 0].cpu() == 1.0).all()  # the zero and the NaN blocks
        assert buffers["rows_scale"][4, 0].item() == 2.0**-126 and codes[4, :128].any()


def test_tensorwise_scale_ignores_rows_past_the_groups():
    """The amax covers the groups' rows only: poison (1e30) in the rows past them changes nothing."""
    x = _rows(200, 128, seed=8)
    buffers = _quantize("tensorwise", x, _sizes([60, 70]), E4M3, rows_past=70)
    scale = ref.scale_of(ref.amax(x[:130]), E4M3)
    assert buffers["rows_scale"].item() == scale.item() and buffers["cols_scale"].item() == scale.item()


# ----------------------------------------------------------------------------------------------------
# Quantization of weights


def _weights(num_groups: int, depth: int, num_cols: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    spread = 10.0 ** torch.randint(-2, 3, (num_groups, 1, 1), generator=generator).float()
    w = torch.randn(num_groups, depth, num_cols, generator=generator) * spread / depth**0.5
    return w.to(dtype)


def _quantize_weights(recipe, w, fp8, rowwise=True, columnwise=True):
    plan = fq.quantize_weights_plan(
        recipe=recipe,
        num_groups=w.shape[0],
        depth=w.shape[1],
        num_cols=w.shape[2],
        element_bytes=w.element_size(),
        fp8_dtype=NAMES[fp8],
        rowwise=rowwise,
        columnwise=columnwise,
    )
    buffers, holders = run_plan(plan, dict(weight=_poisoned(w)), DEVICE, guard=GUARD)
    _assert_guards(holders)
    return buffers


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("num_groups", "depth", "num_cols"), [(3, 200, 136), (1, 128, 256), (2, 40, 24)])
def test_quantize_weights(recipe, fp8, num_groups, depth, num_cols):
    w = _weights(num_groups, depth, num_cols, seed=depth)
    if depth >= 128:
        w[0, :128, :128] = 0.0  # an all-zero block
        w[-1, 3, 5] = float("nan")
        w[-1, 4, 6] = 1.0e4  # past e4m3's range
    buffers = _quantize_weights(recipe, w, fp8)
    rows, cols, scales = ref.weights(w, recipe == "blockwise", fp8)
    assert torch.equal(_bits(buffers["rows"]), _bits(rows))
    assert torch.equal(_bits(buffers["cols"]), _bits(cols))
    assert torch.equal(buffers["scale"].cpu(), scales)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_quantize_weights_one_copy_and_empty(recipe):
    w = _weights(2, 136, 72, seed=1, dtype=torch.float32)
    rows, cols, scales = ref.weights(w, recipe == "blockwise", E4M3)
    only_cols = _quantize_weights(recipe, w, E4M3, rowwise=False)
    assert only_cols["rows"].numel() == 0 and torch.equal(_bits(only_cols["cols"]), _bits(cols))
    only_rows = _quantize_weights(recipe, w, E4M3, columnwise=False)
    assert only_rows["cols"].numel() == 0 and torch.equal(_bits(only_rows["rows"]), _bits(rows))
    assert torch.equal(only_rows["scale"].cpu(), scales)
    empty = _quantize_weights(recipe, torch.zeros(2, 0, 72), E4M3)
    assert empty["rows"].numel() == 0 and empty["scale"].shape[0] == 2


# ----------------------------------------------------------------------------------------------------
# GEMMs


def _recipe(recipe: str):
    spec = rules.RECIPES[recipe]
    dtypes = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}
    return spec.blockwise, dtypes[spec.forward_dtype], dtypes[spec.gradient_dtype]


def _run_gemm(plan, inputs: dict) -> tuple[torch.Tensor, dict]:
    buffers, holders = run_plan(plan, inputs, DEVICE, guard=GUARD)
    _assert_guards(holders)
    return buffers["out"], buffers


def _forward(
    recipe, x, w, sizes, out_dtype="bfloat16", data_gradient=False, config=None, zero_tail=True, split=None
):
    """The kernels' forward (or data gradient: x is dY [M, N], w the weight [E, K, N]) from the kernels'
    quantization, every operand poisoned around."""
    blockwise, forward_dtype, gradient_dtype = _recipe(recipe)
    lhs_dtype = gradient_dtype if data_gradient else forward_dtype
    quantized = _quantize(recipe, x, sizes, lhs_dtype, columnwise=False)
    weights = _quantize_weights(recipe, w, forward_dtype)
    rhs = weights["rows"] if data_gradient else weights["cols"]
    num_cols = w.shape[1] if data_gradient else w.shape[2]
    plan = fg.fp8_grouped_matmul_plan(
        recipe=recipe,
        num_rows=x.shape[0],
        depth=x.shape[1],
        num_cols=num_cols,
        num_groups=w.shape[0],
        data_gradient=data_gradient,
        out_dtype=out_dtype,
        zero_tail=zero_tail,
        split_accumulator=split,
        config=config,
    )
    inputs = dict(
        lhs=_poisoned(quantized["rows"]),
        rhs=_poisoned(rhs),
        lhs_scale=_poisoned(quantized["rows_scale"]),
        rhs_scale=_poisoned(weights["scale"]),
        group_sizes=sizes,
    )
    out, _ = _run_gemm(plan, inputs)
    split = data_gradient if split is None else split
    return out, not blockwise and not split


def _expected_forward(recipe, x, w, sizes, data_gradient=False):
    blockwise, forward_dtype, gradient_dtype = _recipe(recipe)
    if data_gradient:
        return ref.data_gradient(x, w, sizes.cpu(), blockwise, gradient_dtype, forward_dtype)
    return ref.forward(x, w, sizes.cpu(), blockwise, forward_dtype, forward_dtype)


PROBLEMS = [
    # (M, K, N, group sizes)
    (300, 256, 192, [130, 0, 150]),  # an empty group, 20 rows past the groups
    (140, 200, 72, [1, 1, 0, 129]),  # groups of one row; K and N not multiples of 128
    (64, 128, 64, [0, 0]),  # no rows in any group: all zeros
    (0, 128, 64, [0, 0]),  # M = 0
]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("data_gradient", [False, True], ids=["forward", "dgrad"])
@pytest.mark.parametrize(("num_rows", "depth", "num_cols", "sizes"), PROBLEMS)
def test_forward_and_data_gradient(recipe, data_gradient, num_rows, depth, num_cols, sizes):
    x = _rows(num_rows, depth if not data_gradient else num_cols, seed=num_rows)
    w = _weights(len(sizes), depth, num_cols, seed=7)
    group_sizes = _sizes(sizes)
    out, fast = _forward(recipe, x, w, group_sizes, data_gradient=data_gradient)
    expected, bound = _expected_forward(recipe, x, w, group_sizes, data_gradient)
    ref.assert_product(out, expected, bound, x.shape[1], fast)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("sizes", [[-3, 2**31 - 1, 5], [200, 200]], ids=["negative-huge", "sum-past-M"])
def test_forward_hostile_sizes_and_fp32_out(recipe, sizes):
    x, w = _rows(150, 128, seed=2), _weights(len(sizes), 128, 96, seed=3)
    group_sizes = _sizes(sizes)
    out, fast = _forward(recipe, x, w, group_sizes, out_dtype="float32")
    expected, bound = _expected_forward(recipe, x, w, group_sizes)
    ref.assert_product(out, expected, bound, 128, fast)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_forward_without_zero_tail_leaves_the_tail(recipe):
    x, w = _rows(200, 128, seed=6), _weights(2, 128, 64, seed=6)
    out, fast = _forward(recipe, x, w, _sizes([50, 60]), zero_tail=False)
    expected, bound = _expected_forward(recipe, x, w, _sizes([50, 60]))
    ref.assert_product(out[:110], expected[:110], bound[:110], 128, fast)
    assert _unwritten(out[110:])


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_forward_from_reference_operands(recipe):
    """The GEMM alone: operands quantized by the reference, not by the kernels."""
    blockwise, fp8, _ = _recipe(recipe)
    x, w, sizes = _rows(200, 256, seed=12), _weights(3, 256, 128, seed=12), torch.tensor([90, 10, 100])
    rows, rows_scale = ref.rowwise(x, sizes, blockwise, fp8)
    _, cols, w_scale = ref.weights(w, blockwise, fp8)
    plan = fg.fp8_grouped_matmul_plan(recipe=recipe, num_rows=200, depth=256, num_cols=128, num_groups=3)
    inputs = dict(lhs=rows, rhs=cols, lhs_scale=rows_scale, rhs_scale=w_scale, group_sizes=sizes)
    out, _ = _run_gemm(plan, {k: _poisoned(v) for k, v in inputs.items()})
    ref.assert_product(out, *ref.forward(x, w, sizes, blockwise, fp8, fp8), 256, not blockwise)


def _wgrad(recipe, x, dy, sizes, out_dtype="float32", config=None, split=True):
    blockwise, forward_dtype, gradient_dtype = _recipe(recipe)
    lhs = _quantize(recipe, x, sizes, forward_dtype, rowwise=False)
    grad = _quantize(recipe, dy, sizes, gradient_dtype, rowwise=False)
    plan = fg.fp8_grouped_matmul_wgrad_plan(
        recipe=recipe,
        num_rows=x.shape[0],
        depth=x.shape[1],
        num_cols=dy.shape[1],
        num_groups=sizes.numel(),
        out_dtype=out_dtype,
        split_accumulator=split,
        config=config,
    )
    inputs = dict(
        lhs=_poisoned(lhs["cols"]),
        grad=_poisoned(grad["cols"]),
        lhs_scale=_poisoned(lhs["cols_scale"]),
        grad_scale=_poisoned(grad["cols_scale"]),
        group_sizes=sizes,
    )
    out, _ = _run_gemm(plan, inputs)
    expected, bound = ref.weight_gradient(x, dy, sizes.cpu(), blockwise, forward_dtype, gradient_dtype)
    return out, expected, bound, not blockwise and not split


WGRAD_PROBLEMS = [
    (300, 256, 192, [130, 0, 150]),  # an empty group (zeros), rows past the groups
    (140, 72, 200, [1, 1, 0, 129]),  # groups of one row; K and N not multiples of 128
    (50, 64, 64, [0, 0]),  # no rows: zeros
    (0, 64, 64, [0]),  # M = 0: zeros
    (150, 128, 128, [-4, 2**31 - 1]),  # hostile sizes
]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize(("num_rows", "depth", "num_cols", "sizes"), WGRAD_PROBLEMS)
def test_weight_gradient(recipe, num_rows, depth, num_cols, sizes):
    x, dy = _rows(num_rows, depth, seed=1), _rows(num_rows, num_cols, seed=2)
    out, expected, bound, fast = _wgrad(recipe, x, dy, _sizes(sizes))
    ref.assert_product(out, expected, bound, max(num_rows, 1), fast)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_weight_gradient_bf16_out_and_unsplit(recipe):
    x, dy = _rows(200, 128, seed=3), _rows(200, 64, seed=4)
    out, expected, bound, fast = _wgrad(recipe, x, dy, _sizes([70, 130]), out_dtype="bfloat16", split=False)
    ref.assert_product(out, expected, bound, 200, fast)


def test_non_finite_values_propagate_through_e5m2_gemms():
    """A NaN or inf in the gradient (e5m2 under tensorwise) makes exactly the products it feeds NaN, in
    the data gradient and the weight gradient; the other rows keep their values (their scale is not
    poisoned)."""
    dy, w, x = _rows(200, 128, seed=5), _weights(2, 64, 128, seed=5), _rows(200, 64, seed=6)
    dy[10, 3], dy[150, 100] = float("nan"), float("inf")
    sizes = _sizes([120, 80])
    out, fast = _forward("tensorwise", dy, w, sizes, data_gradient=True)
    expected, bound = _expected_forward("tensorwise", dy, w, sizes, data_gradient=True)
    assert torch.isnan(expected[10]).all() and torch.isnan(expected[150]).all()
    ref.assert_product(out, expected, bound, 128, fast)
    out, expected, bound, fast = _wgrad("tensorwise", x, dy, sizes)
    assert torch.isnan(expected[0, :, 3]).all() and torch.isnan(expected[1, :, 100]).all()
    ref.assert_product(out, expected, bound, 200, fast)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_non_finite_values_propagate_through_e4m3_gemms(recipe):
    x, w = _rows(200, 128, seed=7), _weights(2, 128, 64, seed=7)
    x[10, 3] = float("nan")
    w[1, 5, 7] = float("inf")
    sizes = _sizes([120, 80])
    out, fast = _forward(recipe, x, w, sizes)
    expected, bound = _expected_forward(recipe, x, w, sizes)
    assert torch.isnan(expected[10]).all() and torch.isnan(expected[120:, 7]).all()
    ref.assert_product(out, expected, bound, 128, fast)


def _some(space, count: int = 5) -> list[dict]:
    """`count` configs spread over a search space (the first, the last, and evenly between), distinct
    in their tiles where the interpreter ignores warps and stages."""
    configs = space.configs()
    if INTERPRETER:
        tiles = {tuple(v for k, v in c.items() if k not in ("num_warps", "num_stages")): c for c in configs}
        configs = list(tiles.values())
    picks = sorted({round(i * (len(configs) - 1) / (count - 1)) for i in range(count)})
    return [configs[i] for i in picks]


@pytest.mark.parametrize(
    ("recipe", "config"),
    [(r, c) for r, space in fg.FP8_GROUPED_MATMUL_SPACES.items() for c in _some(space)],
    ids=str,
)
@pytest.mark.parametrize("data_gradient", [False, True], ids=["forward", "dgrad"])
def test_gemm_configs(recipe, config, data_gradient):
    x = _rows(300, 256, seed=21)
    w = _weights(3, 256, 256, seed=21)
    sizes = _sizes([65, 0, 200])
    out, fast = _forward(recipe, x, w, sizes, data_gradient=data_gradient, config=config)
    expected, bound = _expected_forward(recipe, x, w, sizes, data_gradient)
    ref.assert_product(out, expected, bound, 256, fast)


@pytest.mark.parametrize(
    ("recipe", "config"),
    [(r, c) for r, space in fg.FP8_GROUPED_MATMUL_WGRAD_SPACES.items() for c in _some(space)],
    ids=str,
)
def test_wgrad_configs(recipe, config):
    x, dy = _rows(300, 256, seed=22), _rows(300, 256, seed=23)
    out, expected, bound, fast = _wgrad(recipe, x, dy, _sizes([65, 0, 200]), config=config)
    ref.assert_product(out, expected, bound, 300, fast)


# ----------------------------------------------------------------------------------------------------
# Plans


@pytest.mark.parametrize(
    ("builder", "kwargs", "match"),
    [
        (fq.quantize_plan, dict(recipe="mx", num_rows=4, width=4, num_groups=1, element_bytes=2), "recipe"),
        (
            fq.quantize_plan,
            dict(recipe="blockwise", num_rows=4, width=4, num_groups=0, element_bytes=2),
            "group",
        ),
        (
            fq.quantize_plan,
            dict(recipe="blockwise", num_rows=-1, width=4, num_groups=1, element_bytes=2),
            ">= 0",
        ),
        (
            fq.quantize_plan,
            dict(recipe="blockwise", num_rows=4, width=4, num_groups=1, element_bytes=1),
            "bytes",
        ),
        (
            fq.quantize_plan,
            dict(recipe="blockwise", num_rows=4, width=4, num_groups=1, element_bytes=2, fp8_dtype="int8"),
            "fp8_dtype",
        ),
        (
            fq.quantize_plan,
            dict(recipe="blockwise", num_rows=4, width=4, num_groups=1, element_bytes=2, rowwise=False),
            "copy",
        ),
        (
            fg.fp8_grouped_matmul_plan,
            dict(recipe="blockwise", num_rows=4, depth=4, num_cols=4, num_groups=1, out_dtype="float16"),
            "out_dtype",
        ),
        (
            fg.fp8_grouped_matmul_wgrad_plan,
            dict(recipe="tensorwise", num_rows=4, depth=4, num_cols=-4, num_groups=1),
            ">= 0",
        ),
    ],
)
def test_bad_plans_raise(builder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(**kwargs)


def test_heuristics_lie_in_the_search_spaces():
    """Every plan's default config is a member of its search space (SearchSpace.default checks), at the
    benchmark shapes and small ones, for both recipes and every GEMM."""
    for recipe, rows, (depth, cols), groups in itertools.product(
        rules.RECIPES, (64, 32768), ((4096, 28672), (768, 2048)), (8, 128)
    ):
        for data_gradient in (False, True):
            fg.fp8_grouped_matmul_plan(
                recipe=recipe,
                num_rows=rows,
                depth=depth,
                num_cols=cols,
                num_groups=groups,
                data_gradient=data_gradient,
            )
        fg.fp8_grouped_matmul_wgrad_plan(
            recipe=recipe, num_rows=rows, depth=depth, num_cols=cols, num_groups=groups
        )


def test_padded_rows_bounds_the_groups_blocks():
    """padded_rows(M, E) holds the 128-row blocks of any clipped group sizes (a brute force over small
    cases, the reference's own block count)."""
    for num_rows, num_groups in itertools.product((0, 1, 127, 128, 129, 300), (1, 2, 3, 5)):
        for sizes in itertools.product((0, 1, 127, 128, 129, 300), repeat=min(num_groups, 3)):
            sizes = list(sizes) + [num_rows] * (num_groups - len(sizes))
            bounds = ref.group_bounds(torch.tensor(sizes), num_rows)
            blocks = sum(-(-(end - start) // 128) for start, end in bounds)
            assert (
                128 * blocks
                <= rules.padded_rows(num_rows, num_groups)
                == ref.padded_rows(num_rows, num_groups)
            )
