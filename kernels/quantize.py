"""FP8 quantization for the expert MLPs: the kernels writing the FP8 copies (codes and scales) that the FP8
grouped GEMMs (kernels/grouped_gemm/fp8.py) read, and their launch plans.

Recipes, formats, the scale rule and the non-finite rule are kernels/rules/fp8.py's. Divisions are IEEE
(div_rn: div.rn.f32, no flushing of denormals), so codes and scales are functions of the inputs alone and
agree bit for bit with any correct implementation of the rule.

Layouts. Hopper's FP8 wgmma reads both operands K-major (the contraction contiguous): Triton feeds an
MN-major FP8 operand through registers (a synchronous load and a byte-permuting store into a transposed
shared-memory tile every step, no asynchronous copies, no wgmma left in flight), so every operand is
written K-major here, as a rowwise and a columnwise copy:
  forward        X rows [M, K]  x  W^T copy [E, N, K]      (quantize_plan rowwise, quantize_weights_plan cols)
  data gradient  dY rows [M, N] x  W itself [E, K, N]      (quantize_plan rowwise, quantize_weights_plan rows)
  weight grad    X^T [K, P]     x  dY^T [N, P]             (quantize_plan columnwise of X and of dY)
The columnwise copies are transposed and padded per group: group g's rows become columns
[128 b_g, 128 (b_g + cdiv(size_g, 128))) with b_g = sum_{g' < g} cdiv(size_g', 128), zeros past the group's
last row, P = padded_rows(M, E). Every group starts a new 128-row block: blockwise scales never mix two
groups, every group starts 16-byte aligned, and the weight-gradient kernel needs no row mask.
Scales: rowwise blockwise [M, cdiv(W, 128)] (row-major, the layout dispatch permutes with the rows),
columnwise blockwise [P / 128, W], weights [E, cdiv(K, 128), cdiv(N, 128)] (one array for both copies: a
128 x 128 block transposed is the same block), tensorwise [1] per activation copy and [E] per weight.

Group sizes come from the device and are clipped as every grouped kernel clips them (`_group_bounds`): a
bad size never makes a kernel read or write out of bounds. Rows past sum(group_sizes) are neither read nor
written.

Under the Triton interpreter fp32 -> fp8 conversion does not round to nearest even (it rounds half up,
drops the carry into the exponent and overflows into NaN), so there the kernels round in integer arithmetic
(`_fp8_code`); compiled, they use the hardware conversion (cvt.rn.satfinite).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import _as_bits, _group_bounds, _group_tile
from .rules.fp8 import BLOCK, SCALE_FLOOR, check_plan_dtypes, check_plan_sizes, padded_rows, recipe_of
from .runtime.interpreter import INTERPRETER
from .runtime.plan import (
    DEFAULT_DEVICE,
    Buffer,
    DeviceInfo,
    Launch,
    Plan,
    Sizes,
    cached,
    cdiv,
    next_pow2,
    sized_by,
)

#: The scale floor (kernels/rules/fp8.py) as a constant of the kernels.
_TINY = tl.constexpr(SCALE_FLOOR)


@triton.jit
def _prepared(x):
    """(x in fp32, where x is finite, |x| for the amax: 0 where x is not finite)."""
    x = x.to(tl.float32)
    magnitude = tl.abs(x)
    finite = magnitude < float("inf")
    return x, finite, tl.where(finite, magnitude, 0.0)


@triton.jit
def _scale(amax, FP8_MAX: tl.constexpr):
    """The dequantization scale of blocks of `amax`: max(amax / FP8_MAX, 2**-126), 1 where amax is 0."""
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), _TINY)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def _fp8_code(y, E5M2: tl.constexpr):
    """The fp8 codes (int32) of fp32 `y`, |y| <= the format's max, rounded to nearest even in integer
    arithmetic: what the hardware conversion gives, for the interpreter, whose own conversion does not
    round to nearest even. NaN is handled by the caller."""
    MANTISSA: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    DROP: tl.constexpr = 23 - MANTISSA
    # 2**(BIAS - 1 + MANTISSA): |y| in units of the format's subnormal step.
    SUBNORMAL_STEPS: tl.constexpr = 65536.0 if E5M2 else 512.0
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal results: rebias the exponent, then drop DROP mantissa bits rounding to nearest even (a carry
    # moves into the exponent, as it should).
    rebased = magnitude - ((127 - BIAS) << 23)
    normal = (rebased + ((1 << (DROP - 1)) - 1) + ((rebased >> DROP) & 1)) >> DROP
    # Below the smallest normal 2**(1 - BIAS): a whole number of subnormal steps, rounded to nearest even
    # by the fp32 addition of 2**23 (whose ulp is 1); the code of 2**(1 - BIAS) itself comes out right.
    subnormal = (tl.abs(y) * SUBNORMAL_STEPS + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(magnitude >= ((128 - BIAS) << 23), normal, subnormal) | sign


@triton.jit
def _quantized(x, finite, scale, FP8: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """uint8 codes of saturate(x / scale) in the fp8 format FP8 (NaN, code 0x7f, where x is not finite)."""
    E5M2: tl.constexpr = FP8 == tl.float8e5  # noqa: SIM300 (a dtype, not a constant)
    FP8_MAX: tl.constexpr = 57344.0 if E5M2 else 448.0
    y = tl.math.div_rn(x, scale)
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    # Constexpr conditions: only the chosen conversion is compiled.
    code = _fp8_code(y, E5M2) if SOFTWARE_CAST else y.to(FP8).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where(finite, code, 0x7F).to(tl.uint8)


@triton.jit
def _amax_kernel(
    inp_ptr,  # [S, L]: S segments of L elements
    group_sizes_ptr,  # [E] integer: with NUM_GROUPS > 0 only the first sum(group_sizes) rows count
    segment_length,  # L
    num_rows,  # M, rows of ROW_WIDTH elements (with NUM_GROUPS > 0)
    amax_ptr,  # [S] fp32, zero-initialised
    ROW_WIDTH: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STEPS: tl.constexpr,
):
    """amax[s] = max(amax[s], |x|) over the finite x of segment s (the _prepared rule). With
    NUM_GROUPS > 0 (an activation: S = 1, L = M * ROW_WIDTH) only the groups' rows count, sizes clipped
    as in _group_bounds; with NUM_GROUPS = 0 (the experts of a weight [E, K, N]: S = E, L = K * N) all of
    it. Grid (cdiv(L, BLOCK_SIZE * STEPS), S): program (c, s) reduces elements [c * BLOCK_SIZE * STEPS,
    +BLOCK_SIZE * STEPS) of segment s and folds its maximum in by one atomic max on the float's bits
    (amaxes are >= 0, where the bits order as the values do: the result does not depend on the order)."""
    segment = tl.program_id(1)
    if NUM_GROUPS > 0:
        _, _, sizes = _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS, GROUPS_POW2)
        valid = tl.sum(sizes, axis=0).to(tl.int64) * ROW_WIDTH
    else:
        valid = segment_length
    first = tl.program_id(0).to(tl.int64) * (BLOCK_SIZE * STEPS)
    if first >= valid:
        return
    base = inp_ptr + segment.to(tl.int64) * segment_length
    largest = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for step in tl.static_range(STEPS):
        offsets = first + step * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        x = tl.load(base + offsets, mask=offsets < valid, other=0.0)
        _, _, magnitude = _prepared(x)
        largest = tl.maximum(largest, magnitude)
    block_max = tl.max(largest, axis=0)
    if block_max > 0.0:
        bits_ptr = amax_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + segment
        tl.atomic_max(bits_ptr, block_max.to(tl.int32, bitcast=True))


@triton.jit
def _quantize_kernel(
    inp_ptr,  # [M, W] bf16, fp16 or fp32
    group_sizes_ptr,  # [E] integer
    amax_ptr,  # [1] fp32: the amax of the groups' rows (tensorwise; unread where BLOCKWISE)
    num_rows,  # M
    rows_ptr,  # [M, W] fp8 (ROWWISE)
    rows_scale_ptr,  # fp32 [M, cdiv(W, 128)] where BLOCKWISE, else [1] (ROWWISE)
    cols_ptr,  # [W, P] fp8 (COLUMNWISE), P = padded_rows(M, E)
    cols_scale_ptr,  # fp32 [P / 128, W] where BLOCKWISE, else [1] (COLUMNWISE)
    WIDTH: tl.constexpr,  # W
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
):
    """The rowwise copy (the rows, scaled per 1 x 128 tile along W, or by the tensor's scale) and the
    columnwise copy (transposed, padded per group, scaled per 128 x 1 tile along the rows of one group,
    or by the tensor's scale) of the groups' rows of [M, W]. Grid (max(1, cdiv(M, 128) + E - 1),
    max(1, cdiv(W, 128))).

    Program (b, c) owns row tile b (128-row tiles numbered group by group, each group starting a new
    tile, as the forward GEMM numbers its row tiles) and columns [128 c, 128 c + 128): it writes those
    rows of the rowwise copy with their row scales, and block b of the columnwise copy (columns
    [128 b, 128 b + 128) of rows [128 c, +128)), zeros past the group's last row, with its column scales.
    Tiles past the groups' tiles exit; program (0, 0) writes the tensorwise scales first, so they exist
    when no group has a row.
    """
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    FP8: tl.constexpr = rows_ptr.dtype.element_ty if ROWWISE else cols_ptr.dtype.element_ty
    FP8_MAX: tl.constexpr = 57344.0 if FP8 == tl.float8e5 else 448.0  # noqa: SIM300
    if not BLOCKWISE:
        scale = _scale(tl.load(amax_ptr), FP8_MAX)
        if (tile == 0) & (col_block == 0):
            if ROWWISE:
                tl.store(rows_scale_ptr, scale)
            if COLUMNWISE:
                tl.store(cols_scale_ptr, scale)
    group, first, end, _, _ = _group_tile(group_sizes_ptr, num_rows, tile, NUM_GROUPS, GROUPS_POW2, 128)
    if group >= NUM_GROUPS:
        return
    rows = first + tl.arange(0, 128)
    row_mask = rows < end
    cols = col_block * 128 + tl.arange(0, 128)
    col_mask = cols < WIDTH
    offsets = rows.to(tl.int64)[:, None] * WIDTH + cols[None, :]
    x = tl.load(inp_ptr + offsets, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    x, finite, magnitude = _prepared(x)
    if ROWWISE:
        if BLOCKWISE:
            row_scale = _scale(tl.max(magnitude, axis=1), FP8_MAX)
            scale_blocks: tl.constexpr = (WIDTH + 127) // 128
            tl.store(rows_scale_ptr + rows.to(tl.int64) * scale_blocks + col_block, row_scale, mask=row_mask)
            codes = _quantized(x, finite, row_scale[:, None], FP8, SOFTWARE_CAST)
        else:
            codes = _quantized(x, finite, scale, FP8, SOFTWARE_CAST)
        tl.store(_as_bits(rows_ptr) + offsets, codes, mask=row_mask[:, None] & col_mask[None, :])
    if COLUMNWISE:
        if BLOCKWISE:
            col_scale = _scale(tl.max(magnitude, axis=0), FP8_MAX)
            tl.store(cols_scale_ptr + tile.to(tl.int64) * WIDTH + cols, col_scale, mask=col_mask)
            codes = _quantized(x, finite, col_scale[None, :], FP8, SOFTWARE_CAST)
        else:
            codes = _quantized(x, finite, scale, FP8, SOFTWARE_CAST)
        # rules.fp8.padded_rows(M, E), computed here rather than passed: the compiler then knows the
        # row stride is a multiple of 128 (16-byte copies), which jax-triton does not tell it.
        padded = 128 * (tl.cdiv(num_rows, 128) + NUM_GROUPS - 1)
        # Element (r, c) of the tile goes to column 128 b + r of row c; rows past the group's end are
        # x = 0, so the padding is written as zeros.
        positions = tile * 128 + tl.arange(0, 128)
        out = cols.to(tl.int64)[None, :] * padded + positions[:, None]
        tl.store(_as_bits(cols_ptr) + out, codes, mask=col_mask[None, :])


@triton.jit
def _quantize_weights_kernel(
    weight_ptr,  # [E, K, N] bf16, fp16 or fp32
    amax_ptr,  # [E] fp32: each expert's amax (tensorwise; unread where BLOCKWISE)
    rows_ptr,  # [E, K, N] fp8 (ROWWISE): the data gradient's operand
    cols_ptr,  # [E, N, K] fp8 (COLUMNWISE): the forward's operand
    scale_ptr,  # fp32 [E, cdiv(K, 128), cdiv(N, 128)] where BLOCKWISE, else [E]
    DEPTH: tl.constexpr,  # K
    NUM_COLS: tl.constexpr,  # N
    BLOCKWISE: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
):
    """Both K-major copies of each expert's weight, from one read: scaled per 128 x 128 block (one scale
    serves the block and its transpose) or by the expert's scale. Grid (cdiv(K, 128), cdiv(N, 128), E):
    program (i, j, e) quantizes block (i, j) of expert e, stores it as it is and transposed, and its
    scale (tensorwise: program (0, 0, e) stores expert e's)."""
    depth_block = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    FP8: tl.constexpr = rows_ptr.dtype.element_ty if ROWWISE else cols_ptr.dtype.element_ty
    FP8_MAX: tl.constexpr = 57344.0 if FP8 == tl.float8e5 else 448.0  # noqa: SIM300
    depth = depth_block * 128 + tl.arange(0, 128)
    cols = col_block * 128 + tl.arange(0, 128)
    mask = (depth < DEPTH)[:, None] & (cols < NUM_COLS)[None, :]
    base = expert * DEPTH * NUM_COLS
    rows_at = base + depth.to(tl.int64)[:, None] * NUM_COLS + cols[None, :]
    cols_at = base + cols.to(tl.int64)[None, :] * DEPTH + depth[:, None]
    x = tl.load(weight_ptr + rows_at, mask=mask, other=0.0)
    x, finite, magnitude = _prepared(x)
    if BLOCKWISE:
        scale = _scale(tl.max(tl.max(magnitude, axis=1), axis=0), FP8_MAX)
        col_blocks: tl.constexpr = (NUM_COLS + 127) // 128
        depth_blocks: tl.constexpr = (DEPTH + 127) // 128
        tl.store(scale_ptr + (expert * depth_blocks + depth_block) * col_blocks + col_block, scale)
    else:
        scale = _scale(tl.load(amax_ptr + expert), FP8_MAX)
        if (depth_block == 0) & (col_block == 0):
            tl.store(scale_ptr + expert, scale)
    codes = _quantized(x, finite, scale, FP8, SOFTWARE_CAST)
    if ROWWISE:
        tl.store(_as_bits(rows_ptr) + rows_at, codes, mask=mask)
    if COLUMNWISE:
        tl.store(_as_bits(cols_ptr) + cols_at, codes, mask=mask)


#: The amax reduction reads 8 steps of 4096 elements a program: few atomics on the one address, and
#: enough bytes in flight per program.
_AMAX_BLOCK, _AMAX_STEPS = 4096, 8


def _amax_launch(
    source: str, group_sizes: str, segments: int, segment_length: int, num_rows: int, **constexprs
) -> Launch:
    """The amax reduction of `source` as `segments` segments of `segment_length` elements (constexprs:
    ROW_WIDTH, NUM_GROUPS, GROUPS_POW2 of `_amax_kernel`) into the zeroed buffer "amax"."""
    return Launch(
        kernel=_amax_kernel,
        grid=(max(1, cdiv(segment_length, _AMAX_BLOCK * _AMAX_STEPS)), segments),
        args=(source, group_sizes, segment_length, num_rows),
        outputs=("amax",),
        constexprs=dict(constexprs, BLOCK_SIZE=_AMAX_BLOCK, STEPS=_AMAX_STEPS),
        num_warps=8,
    )


@sized_by(
    Sizes(
        axes=dict(num_rows=("inp", 0), width=("inp", 1), num_groups=("group_sizes", 0)),
        element_bytes="inp",
    )
)
@cached
def quantize_plan(
    *,
    recipe: str,
    num_rows: int,
    width: int,
    num_groups: int,
    element_bytes: int,
    fp8_dtype: str = "float8_e4m3fn",
    rowwise: bool = True,
    columnwise: bool = False,
    device: DeviceInfo = DEFAULT_DEVICE,
) -> Plan:
    """The FP8 copies of the groups' rows of an activation or gradient [M, W] that the GEMMs read: the
    rowwise copy (the forward's or the data gradient's lhs) and the columnwise copy (the weight
    gradient's operand: transposed, each group padded to whole 128-row blocks; module doc).

    Inputs: "inp" [M, W] bf16, fp16 or fp32; "group_sizes" [E] integer.
    Results: "rows" [M, W] fp8 and "rows_scale" (blockwise [M, cdiv(W, 128)], tensorwise [1]) where
    `rowwise`; "cols" [W, padded_rows(M, E)] fp8 and "cols_scale" (blockwise [padded_rows / 128, W],
    tensorwise [1]) where `columnwise`; placeholders otherwise. Rows past sum(group_sizes) are not
    written; neither are columnwise blocks past the groups' blocks. Tensorwise plans reduce the amax
    into a zeroed [1] buffer "amax" first, on the device.
    """
    spec = recipe_of("quantize", recipe)
    check_plan_sizes("quantize", num_groups, M=num_rows, W=width)
    check_plan_dtypes("quantize", element_bytes, fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("quantize: ask for the rowwise copy, the columnwise copy or both")
    padded = padded_rows(num_rows, num_groups)
    scale_blocks = cdiv(width, BLOCK)

    def made(wanted: bool, shape: tuple[int, ...], dtype: str) -> Buffer:
        return Buffer(shape, dtype) if wanted else Buffer.absent(dtype)

    buffers = {
        "rows": made(rowwise, (num_rows, width), fp8_dtype),
        "rows_scale": made(rowwise, (num_rows, scale_blocks) if spec.blockwise else (1,), "float32"),
        "cols": made(columnwise, (width, padded), fp8_dtype),
        "cols_scale": made(columnwise, (padded // BLOCK, width) if spec.blockwise else (1,), "float32"),
    }
    results = ("rows", "rows_scale", "cols", "cols_scale")
    launches = []
    groups = dict(NUM_GROUPS=num_groups, GROUPS_POW2=next_pow2(num_groups))
    if not spec.blockwise:
        buffers["amax"] = Buffer((1,), "float32", zero=True)
        if num_rows and width:
            launches.append(
                _amax_launch("inp", "group_sizes", 1, num_rows * width, num_rows, ROW_WIDTH=width, **groups)
            )
    elif num_rows == 0 or width == 0:
        return Plan(buffers, (), results)
    launches.append(
        Launch(
            kernel=_quantize_kernel,
            grid=(max(1, cdiv(num_rows, BLOCK) + num_groups - 1), max(1, scale_blocks)),
            args=("inp", "group_sizes", "amax" if not spec.blockwise else "group_sizes", num_rows),
            outputs=results,
            constexprs=dict(
                WIDTH=width,
                BLOCKWISE=spec.blockwise,
                ROWWISE=rowwise,
                COLUMNWISE=columnwise,
                SOFTWARE_CAST=INTERPRETER,
                **groups,
            ),
            num_warps=8,
        )
    )
    return Plan(buffers, tuple(launches), results)


@sized_by(
    Sizes(
        axes=dict(num_groups=("weight", 0), depth=("weight", 1), num_cols=("weight", 2)),
        element_bytes="weight",
    )
)
@cached
def quantize_weights_plan(
    *,
    recipe: str,
    num_groups: int,
    depth: int,
    num_cols: int,
    element_bytes: int,
    fp8_dtype: str = "float8_e4m3fn",
    rowwise: bool = True,
    columnwise: bool = True,
    device: DeviceInfo = DEFAULT_DEVICE,
) -> Plan:
    """The FP8 copies of expert weights [E, K, N]: "rows" [E, K, N] (the data gradient's rhs) and "cols"
    [E, N, K] (the transposed copy, the forward's rhs), both K-major for their GEMM, and "scale": blockwise
    [E, cdiv(K, 128), cdiv(N, 128)], one per 128 x 128 block, shared by both copies; tensorwise [E], from
    each expert's amax (reduced on the device into a zeroed [E] buffer "amax" first). A copy not asked
    for is a placeholder.

    Inputs: "weight" [E, K, N] bf16, fp16 or fp32.
    """
    spec = recipe_of("quantize_weights", recipe)
    check_plan_sizes("quantize_weights", num_groups, K=depth, N=num_cols)
    check_plan_dtypes("quantize_weights", element_bytes, fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("quantize_weights: ask for the rowwise copy, the columnwise copy or both")
    depth_blocks, col_blocks = cdiv(depth, BLOCK), cdiv(num_cols, BLOCK)
    shape = (num_groups, depth, num_cols)
    buffers = {
        "rows": Buffer(shape, fp8_dtype) if rowwise else Buffer.absent(fp8_dtype),
        "cols": Buffer((num_groups, num_cols, depth), fp8_dtype) if columnwise else Buffer.absent(fp8_dtype),
        "scale": Buffer(
            (num_groups, depth_blocks, col_blocks) if spec.blockwise else (num_groups,), "float32"
        ),
    }
    results = ("rows", "cols", "scale")
    launches = []
    if not spec.blockwise:
        buffers["amax"] = Buffer((num_groups,), "float32", zero=True)
        if depth and num_cols:
            # No group sizes: every element of each expert counts (the weight stands in for the pointer).
            segment = depth * num_cols
            launch = _amax_launch(
                "weight", "weight", num_groups, segment, 0, ROW_WIDTH=num_cols, NUM_GROUPS=0, GROUPS_POW2=1
            )
            launches.append(launch)
    elif depth == 0 or num_cols == 0:
        return Plan(buffers, (), results)
    launches.append(
        Launch(
            kernel=_quantize_weights_kernel,
            grid=(max(1, depth_blocks), max(1, col_blocks), num_groups),
            args=("weight", "amax" if not spec.blockwise else "weight"),
            outputs=results,
            constexprs=dict(
                DEPTH=depth,
                NUM_COLS=num_cols,
                BLOCKWISE=spec.blockwise,
                ROWWISE=rowwise,
                COLUMNWISE=columnwise,
                SOFTWARE_CAST=INTERPRETER,
            ),
            num_warps=8,
        )
    )
    return Plan(buffers, tuple(launches), results)
