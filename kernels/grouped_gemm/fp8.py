"""FP8 grouped GEMMs for the expert MLPs on Hopper: the forward, data-gradient and weight-gradient products
of the two FP8 recipes (kernels/rules/fp8.py) from the copies kernels/quantize.py writes, and their plans.

"tensorwise": one scale per operand tensor (per expert of a weight), applied to the finished tile; the
products accumulate in the tensor cores, or with `split_accumulator` are added into fp32 registers every
block_k (Hopper's FP8 wgmma otherwise sums inside a step with reduced precision). "blockwise": a scale per
1 x 128 tile of activations and gradients and per 128 x 128 block of weights, so each 128-deep product is
scaled and added in fp32 (`acc += dot(a, b) * scale_a * scale_b`). Both operands of every product are
K-major (the quantization module's doc says why); `b` enters tl.dot as tl.trans(b), a view of its
shared-memory tile.

Group sizes come from the device and are clipped as the bf16 kernels clip them: rows past
sum(group_sizes) are never read; the forward writes zeros there (or nothing without `zero_tail`).

Under the Triton interpreter, whose fp8 tl.dot misreads the e4m3 NaN code (as 480) and e5m2 subnormals,
the kernels decode fp8 in integer arithmetic (`_fp8_value`) and multiply in IEEE fp32, exact per product
like the tensor cores.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from .._jit import _group_bounds, _group_tile, _pick
from ..rules.fp8 import BLOCK, check_plan_dtypes, check_plan_sizes, recipe_of
from ..runtime import autotune
from ..runtime.interpreter import INTERPRETER
from ..runtime.plan import (
    DEFAULT_DEVICE,
    Buffer,
    DeviceInfo,
    Launch,
    Plan,
    SearchSpace,
    Sizes,
    cached,
    cdiv,
    next_pow2,
    sized_by,
)


@triton.jit
def _fp8_value(q):
    """fp32 values of the fp8 tile q, decoded in integer arithmetic (NaN, and e5m2's infinities, kept):
    the interpreter's own fp8 conversions, and its fp8 tl.dot, misread the e4m3 NaN code (as 480) and
    e5m2 subnormals (as 0 or the wrong multiple of 2**-16)."""
    E5M2: tl.constexpr = q.dtype == tl.float8e5
    MANTISSA: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    # 2**(1 - BIAS - MANTISSA): the subnormal step.
    STEP: tl.constexpr = 1.52587890625e-05 if E5M2 else 0.001953125
    code = q.to(tl.uint8, bitcast=True).to(tl.int32)
    negative = (code & 0x80) != 0
    exponent = (code >> MANTISSA) & ((1 << (7 - MANTISSA)) - 1)
    mantissa = code & ((1 << MANTISSA) - 1)
    normal = (((exponent + 127 - BIAS) << 23) | (mantissa << (23 - MANTISSA))).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * STEP, normal)
    if E5M2:
        value = tl.where(exponent == 31, tl.where(mantissa == 0, float("inf"), float("nan")), value)
    else:
        value = tl.where((code & 0x7F) == 0x7F, float("nan"), value)
    return tl.where(negative, -value, value)


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr, IMPRECISE: tl.constexpr):
    """acc + a @ b^T for fp8 tiles a [R, D] and b [C, D], D contiguous in both (K-major for wgmma; b's
    transpose is a view of its shared-memory tile). IMPRECISE: max_num_imprecise_acc (None: all of it).
    FP32_DOT (the interpreter): decoded to fp32 and multiplied in IEEE fp32, which is exact per product
    like the tensor cores' FP8 products."""
    if FP32_DOT:
        return tl.dot(_fp8_value(a), tl.trans(_fp8_value(b)), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE)


@triton.jit
def _fp8_grouped_matmul_kernel(
    lhs_ptr,  # [M, D] fp8, D (the contraction) contiguous
    rhs_ptr,  # [E, C, D] fp8, D contiguous
    lhs_scale_ptr,  # fp32 [M, cdiv(D, 128)] where BLOCKWISE, else [1]
    rhs_scale_ptr,  # fp32 [E, 128 x 128 blocks] through RHS_SCALE_*_STRIDE where BLOCKWISE, else [E]
    group_sizes_ptr,  # [E] integer
    num_rows,  # M
    out_ptr,  # [M, C] bf16 or fp32
    NUM_COLS: tl.constexpr,  # C
    DEPTH: tl.constexpr,  # D
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    RHS_SCALE_DEPTH_STRIDE: tl.constexpr,
    RHS_SCALE_COL_STRIDE: tl.constexpr,
    SPLIT_ACCUMULATOR: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIZZLE: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    """out[rows of g] = dequant(lhs[rows of g]) @ dequant(rhs[g])^T: the forward (lhs X, rhs the weight's
    transposed copy [E, N, K]) and the data gradient (lhs dY, rhs the weight [E, K, N]). Grid
    ((cdiv(M, BLOCK_M) + E) * cdiv(C, BLOCK_N),).

    Program p owns row tile m and column tile n (SWIZZLE row tiles walk the column tiles together, so
    their weight tiles are read from L2), tiles numbered as in the bf16 product kernel. BLOCKWISE (then
    BLOCK_K = 128): each 128-deep product is scaled by its rows' and columns' block scales before it is
    added, in fp32; else the tile is scaled once at the end, its products accumulated in the tensor cores
    (SPLIT_ACCUMULATOR: added into an fp32 register accumulator every BLOCK_K, which Hopper's FP8 wgmma
    otherwise sums with reduced precision). Tiles past the groups' tiles zero the rows past
    sum(group_sizes) where ZERO_TAIL; programs past those exit.
    """
    pid = tl.program_id(0)
    col_tiles: tl.constexpr = (NUM_COLS + BLOCK_N - 1) // BLOCK_N
    row_tiles = tl.cdiv(num_rows, BLOCK_M) + NUM_GROUPS
    band = pid // (SWIZZLE * col_tiles)
    band_rows = tl.minimum(row_tiles - band * SWIZZLE, SWIZZLE)
    row_tile = band * SWIZZLE + (pid % (SWIZZLE * col_tiles)) % band_rows
    col_tile = (pid % (SWIZZLE * col_tiles)) // band_rows

    group, first, end, group_rows, group_tiles = _group_tile(
        group_sizes_ptr, num_rows, row_tile, NUM_GROUPS, GROUPS_POW2, BLOCK_M
    )
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NUM_COLS
    if group >= NUM_GROUPS:
        first = group_rows + (row_tile - group_tiles) * BLOCK_M
        # Two ifs: Triton cannot `and` a constexpr with a tensor.
        if ZERO_TAIL:  # noqa: SIM102
            if first < num_rows:
                rows = first + tl.arange(0, BLOCK_M)
                zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
                mask = (rows < num_rows)[:, None] & col_mask[None, :]
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * NUM_COLS + cols[None, :], zeros, mask=mask)
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    depth = tl.arange(0, BLOCK_K)
    lhs = lhs_ptr + rows.to(tl.int64)[:, None] * DEPTH + depth[None, :]
    rhs = (
        rhs_ptr + group.to(tl.int64) * NUM_COLS * DEPTH + cols.to(tl.int64)[:, None] * DEPTH + depth[None, :]
    )
    depth_blocks: tl.constexpr = (DEPTH + 127) // 128
    col_blocks: tl.constexpr = (NUM_COLS + 127) // 128
    lhs_scale = lhs_scale_ptr + rows.to(tl.int64) * depth_blocks
    rhs_scale = rhs_scale_ptr + group.to(tl.int64) * depth_blocks * col_blocks
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(DEPTH, BLOCK_K)):
        left = DEPTH - k * BLOCK_K
        a = tl.load(lhs, mask=row_mask[:, None] & (depth[None, :] < left), other=0.0)
        b = tl.load(rhs, mask=col_mask[:, None] & (depth[None, :] < left), other=0.0)
        if BLOCKWISE:
            a_scale = tl.load(lhs_scale + k, mask=row_mask, other=0.0)
            if BLOCK_N <= 128:
                # The tile lies inside one 128-column block: one weight scale, folded into the row scales.
                b_scale = tl.load(
                    rhs_scale + k * RHS_SCALE_DEPTH_STRIDE + col_tile * BLOCK_N // 128 * RHS_SCALE_COL_STRIDE
                )
                acc += _dot(a, b, None, FP32_DOT, None) * (a_scale * b_scale)[:, None]
            else:
                b_scale = tl.load(
                    rhs_scale + k * RHS_SCALE_DEPTH_STRIDE + cols // 128 * RHS_SCALE_COL_STRIDE,
                    mask=col_mask,
                    other=0.0,
                )
                acc += _dot(a, b, None, FP32_DOT, None) * (a_scale[:, None] * b_scale[None, :])
        else:
            acc = _dot(a, b, acc, FP32_DOT, BLOCK_K if SPLIT_ACCUMULATOR else None)
        lhs += BLOCK_K
        rhs += BLOCK_K
    if not BLOCKWISE:
        acc *= tl.load(lhs_scale_ptr) * tl.load(rhs_scale_ptr + group)
    out = out_ptr + rows.to(tl.int64)[:, None] * NUM_COLS + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_grouped_matmul_wgrad_kernel(
    lhs_ptr,  # [K, P] fp8: the columnwise copy of the rows [M, K]
    grad_ptr,  # [N, P] fp8: the columnwise copy of the output gradient [M, N]
    lhs_scale_ptr,  # fp32 [P / 128, K] where BLOCKWISE, else [1]
    grad_scale_ptr,  # fp32 [P / 128, N] where BLOCKWISE, else [1]
    group_sizes_ptr,  # [E] integer
    num_rows,  # M
    out_ptr,  # [E, K, N] fp32 or bf16
    NUM_COLS: tl.constexpr,  # N
    DEPTH: tl.constexpr,  # K
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    SPLIT_ACCUMULATOR: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIZZLE: tl.constexpr,
):
    """out[g] = dequant(rows of g)^T @ dequant(grad rows of g), the weight gradient, from the
    columnwise copies (each group's rows a run of whole 128-column blocks, zeros past its last row).
    Grid (E * cdiv(K, BLOCK_K) * cdiv(N, BLOCK_N),).

    Program p owns group g and the output tile (k, n) of out[g], swizzled as in the bf16 weight-gradient
    kernel; it walks the group's blocks BLOCK_M columns at a time (BLOCKWISE: BLOCK_M = 128, one scale
    per column of each operand and block, applied to each product before it is added). An empty group's
    tile is zeros.
    """
    pid = tl.program_id(0)
    col_tiles: tl.constexpr = (NUM_COLS + BLOCK_N - 1) // BLOCK_N
    depth_tiles: tl.constexpr = (DEPTH + BLOCK_K - 1) // BLOCK_K
    group = pid // (col_tiles * depth_tiles)
    local = pid % (col_tiles * depth_tiles)
    band = local // (SWIZZLE * col_tiles)
    band_rows = tl.minimum(depth_tiles - band * SWIZZLE, SWIZZLE)
    depth_tile = band * SWIZZLE + (local % (SWIZZLE * col_tiles)) % band_rows
    col_tile = (local % (SWIZZLE * col_tiles)) // band_rows

    groups, _, sizes = _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS, GROUPS_POW2)
    blocks = tl.cdiv(sizes, 128)
    first_block = _pick(tl.cumsum(blocks, axis=0) - blocks, groups, group)
    steps = _pick(blocks, groups, group) * (128 // BLOCK_M)
    # rules.fp8.padded_rows(M, E), computed here rather than passed: the compiler then knows the
    # row stride is a multiple of 128 (16-byte copies), which jax-triton does not tell it.
    padded = 128 * (tl.cdiv(num_rows, 128) + NUM_GROUPS - 1)
    depth = depth_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    depth_mask = depth < DEPTH
    col_mask = cols < NUM_COLS
    positions = first_block.to(tl.int64) * 128 + tl.arange(0, BLOCK_M)
    lhs = lhs_ptr + depth.to(tl.int64)[:, None] * padded + positions[None, :]
    grad = grad_ptr + cols.to(tl.int64)[:, None] * padded + positions[None, :]
    lhs_scale = lhs_scale_ptr + first_block.to(tl.int64) * DEPTH + depth
    grad_scale = grad_scale_ptr + first_block.to(tl.int64) * NUM_COLS + cols
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for step in range(0, steps):
        a = tl.load(lhs, mask=depth_mask[:, None], other=0.0)
        b = tl.load(grad, mask=col_mask[:, None], other=0.0)
        if BLOCKWISE:
            a_scale = tl.load(lhs_scale + step * DEPTH, mask=depth_mask, other=0.0)
            b_scale = tl.load(grad_scale + step * NUM_COLS, mask=col_mask, other=0.0)
            acc += _dot(a, b, None, FP32_DOT, None) * (a_scale[:, None] * b_scale[None, :])
        else:
            acc = _dot(a, b, acc, FP32_DOT, BLOCK_M if SPLIT_ACCUMULATOR else None)
        lhs += BLOCK_M
        grad += BLOCK_M
    if not BLOCKWISE:
        acc *= tl.load(lhs_scale_ptr) * tl.load(grad_scale_ptr)
    out = (
        out_ptr
        + group.to(tl.int64) * DEPTH * NUM_COLS
        + depth.to(tl.int64)[:, None] * NUM_COLS
        + cols[None, :]
    )
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=depth_mask[:, None] & col_mask[None, :])


def _matmul_space(kernel: str, **params: tuple[int, ...]) -> SearchSpace:
    return SearchSpace(kernel, dict(params, num_warps=(4, 8), num_stages=(3, 4)))


# Blockwise tiles stop at 128 columns: a 128 x 256 tile keeps the scaled product beside the accumulator
# (256 fp32 registers a thread at 8 warps) and spills; 128-deep steps are the recipe's.
FP8_GROUPED_MATMUL_SPACES = {
    "tensorwise": _matmul_space(
        "fp8_grouped_matmul_tensorwise", block_m=(64, 128), block_n=(64, 128, 256), block_k=(64, 128)
    ),
    "blockwise": _matmul_space(
        "fp8_grouped_matmul_blockwise", block_m=(64, 128), block_n=(64, 128), block_k=(128,)
    ),
}
# block_m is the step along the rows (the contraction); block_k x block_n the output tile of [K, N].
FP8_GROUPED_MATMUL_WGRAD_SPACES = {
    "tensorwise": _matmul_space(
        "fp8_grouped_matmul_wgrad_tensorwise", block_m=(64, 128), block_n=(64, 128, 256), block_k=(64, 128)
    ),
    "blockwise": _matmul_space(
        "fp8_grouped_matmul_wgrad_blockwise", block_m=(128,), block_n=(64, 128), block_k=(64, 128)
    ),
}
_SWIZZLE = 8


def _gemm_constexprs(cfg: Mapping[str, int], num_groups: int, **constexprs) -> dict:
    return dict(
        constexprs,
        NUM_GROUPS=num_groups,
        GROUPS_POW2=next_pow2(num_groups),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        SWIZZLE=_SWIZZLE,
        FP32_DOT=INTERPRETER,
    )


@sized_by(Sizes(axes=dict(num_rows=("lhs", 0), depth=("lhs", 1), num_cols=("rhs", 1), num_groups=("rhs", 0))))
@cached
def fp8_grouped_matmul_plan(
    *,
    recipe: str,
    num_rows: int,
    depth: int,
    num_cols: int,
    num_groups: int,
    data_gradient: bool = False,
    out_dtype: str = "bfloat16",
    split_accumulator: bool | None = None,
    zero_tail: bool = True,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """out[rows of g] = lhs[rows of g] @ rhs[g]^T in FP8, both operands K-major: the forward (lhs the
    rowwise copy of X [M, K], rhs the weight's "cols" copy [E, N, K]) and, with `data_gradient`, the
    input gradient (lhs the rowwise copy of dY [M, N], rhs the weight's "rows" copy [E, K, N]). The
    weight's scale is the one quantize_weights_plan wrote; `data_gradient` reads its blocks transposed.

    `split_accumulator` (tensorwise only; blockwise always adds every 128-deep product in fp32): add the
    tensor cores' partial sums into fp32 registers every block_k, as TransformerEngine does for the
    gradients (its default: off in the forward, on for the data gradient).

    Inputs: "lhs" [M, D] fp8, "rhs" [E, C, D] fp8, "lhs_scale" (blockwise [M, cdiv(D, 128)], tensorwise
    [1]), "rhs_scale" (the weight's scale), "group_sizes" [E] integer.
    Result: "out" [M, C] in `out_dtype`; rows past sum(group_sizes) zeros, or unwritten without
    `zero_tail`.
    """
    spec = recipe_of("fp8_grouped_matmul", recipe)
    check_plan_sizes("fp8_grouped_matmul", num_groups, M=num_rows, D=depth, C=num_cols)
    check_plan_dtypes("fp8_grouped_matmul", None, out_dtype=out_dtype)
    split = (data_gradient if split_accumulator is None else split_accumulator) and not spec.blockwise
    small = num_rows < 128 * num_groups  # small groups waste less of a 64-row tile
    heuristic = dict(
        block_m=64 if small else 128,
        block_n=128 if small or spec.blockwise or split else 256,
        block_k=128,
        num_warps=4 if small else 8,
        num_stages=4 if spec.blockwise or split or small else 3,
    )
    features = dict(rows_per_group=cdiv(num_rows, num_groups), depth=depth, num_cols=num_cols)
    space = FP8_GROUPED_MATMUL_SPACES[recipe]
    cfg = autotune.resolve(space, heuristic, config, features, device)
    buffers = {"out": Buffer((num_rows, num_cols), out_dtype)}
    if num_rows == 0 or num_cols == 0:
        return Plan(buffers, (), ("out",))
    # The weight's block scales [E, cdiv(K, 128), cdiv(N, 128)]: K is the depth of the forward and the
    # columns of the data gradient.
    depth_blocks, col_blocks = cdiv(depth, BLOCK), cdiv(num_cols, BLOCK)
    scale_strides = (1, depth_blocks) if data_gradient else (col_blocks, 1)
    row_tiles = cdiv(num_rows, cfg["block_m"]) + num_groups
    launch = Launch(
        kernel=_fp8_grouped_matmul_kernel,
        grid=(row_tiles * cdiv(num_cols, cfg["block_n"]),),
        args=("lhs", "rhs", "lhs_scale", "rhs_scale", "group_sizes", num_rows),
        outputs=("out",),
        constexprs=_gemm_constexprs(
            cfg,
            num_groups,
            NUM_COLS=num_cols,
            DEPTH=depth,
            BLOCKWISE=spec.blockwise,
            RHS_SCALE_DEPTH_STRIDE=scale_strides[0],
            RHS_SCALE_COL_STRIDE=scale_strides[1],
            SPLIT_ACCUMULATOR=split,
            ZERO_TAIL=zero_tail,
        ),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return Plan(buffers, (launch,), ("out",))


@sized_by(Sizes(axes=dict(depth=("lhs", 0), num_cols=("grad", 0), num_groups=("group_sizes", 0))))
@cached
def fp8_grouped_matmul_wgrad_plan(
    *,
    recipe: str,
    num_rows: int,
    depth: int,
    num_cols: int,
    num_groups: int,
    out_dtype: str = "bfloat16",
    split_accumulator: bool = True,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """The weight gradient out[g] = X[rows of g]^T @ dY[rows of g] in FP8, from the columnwise copies of X
    [M, K] and dY [M, N] (quantize_plan with `columnwise`). `num_rows` is M of those rows (the copies are
    padded_rows(M, E) wide; a binding passes it, it is not in their shapes). `split_accumulator` as in
    fp8_grouped_matmul_plan (tensorwise only), on by default as in TransformerEngine.

    Inputs: "lhs" [K, P] fp8, "grad" [N, P] fp8, "lhs_scale" / "grad_scale" (blockwise [P / 128, K] /
    [P / 128, N], tensorwise [1]), "group_sizes" [E] integer.
    Result: "out" [E, K, N] in `out_dtype` (bf16 by default, as the bf16 weight gradient: at small groups
    this GEMM is bound by its output's bytes, twice as many in fp32); empty groups get zeros.
    """
    spec = recipe_of("fp8_grouped_matmul_wgrad", recipe)
    check_plan_sizes("fp8_grouped_matmul_wgrad", num_groups, M=num_rows, K=depth, N=num_cols)
    check_plan_dtypes("fp8_grouped_matmul_wgrad", None, out_dtype=out_dtype)
    heuristic = dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
    features = dict(rows_per_group=cdiv(num_rows, num_groups), depth=depth, num_cols=num_cols)
    space = FP8_GROUPED_MATMUL_WGRAD_SPACES[recipe]
    cfg = autotune.resolve(space, heuristic, config, features, device)
    buffers = {"out": Buffer((num_groups, depth, num_cols), out_dtype)}
    if depth == 0 or num_cols == 0:
        return Plan(buffers, (), ("out",))
    launch = Launch(
        kernel=_fp8_grouped_matmul_wgrad_kernel,
        grid=(num_groups * cdiv(depth, cfg["block_k"]) * cdiv(num_cols, cfg["block_n"]),),
        args=("lhs", "grad", "lhs_scale", "grad_scale", "group_sizes", num_rows),
        outputs=("out",),
        constexprs=_gemm_constexprs(
            cfg,
            num_groups,
            NUM_COLS=num_cols,
            DEPTH=depth,
            BLOCKWISE=spec.blockwise,
            SPLIT_ACCUMULATOR=split_accumulator and not spec.blockwise,
        ),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return Plan(buffers, (launch,), ("out",))


#: The FP8 products' search spaces, one per kernel and recipe (gathered by the family's SEARCH_SPACES).
SEARCH_SPACES = (*FP8_GROUPED_MATMUL_SPACES.values(), *FP8_GROUPED_MATMUL_WGRAD_SPACES.values())
