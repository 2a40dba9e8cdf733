"""Grouped GEMM for the expert MLPs: rows [M, K] split into E contiguous groups, group g multiplied by its own
weight matrix [K, N] (`jax.lax.ragged_dot` semantics). This module holds the bf16 / fp16 / fp32 kernels,
`fp8` the FP8 ones.

`group_sizes` [E] lives on the device, so the number of row tiles of each group is only known to the
kernel: grids are sized for the worst case (cdiv(M, BLOCK_M) + E row tiles: every group may waste one
partial tile) and every program locates its tile from the group sizes, O(E) vector work next to a
[BLOCK_M, BLOCK_N] tile's K-deep product. Rows past sum(group_sizes) are written as zeros, as ragged_dot
defines them; group sizes are clipped to the rows present, so a bad size can never read or write out of
bounds. Both kernels accumulate in fp32 and store in the output dtype.

Row permutations. Either side of the product kernel may go through a row permutation [M] instead of the
rows in order: it reads row i of the product from lhs[lhs_rows[i]] and writes it to out[out_rows[i]]. The
expert-parallel layer multiplies the exchanged rows, which arrive grouped by source rank, in expert-major
order this way, with no chunk sort copying them before and after the GEMMs. Entries are clipped into
[0, M), so a bad permutation gives wrong rows, never an access out of bounds. The weight-gradient kernel
reads its rows in order: permuted row reads inside its row loop were slower (more address work per step
than the loads hide), so its plan gathers each permuted operand first, one copy by a
row-gather kernel (`_gather_rows_kernel`; XLA's gather of the same rows ran at about half the copy
bandwidth).
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from .._jit import _as_bits, _group_bounds, _pick, block_columns
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
from . import fp8


@triton.jit
def _permuted(rows_ptr, rows, mask, num_rows, PERMUTED: tl.constexpr):
    """rows_ptr[rows] clipped into [0, num_rows) where PERMUTED, else the rows themselves."""
    if PERMUTED:
        rows = tl.load(rows_ptr + rows, mask=mask, other=0)
        rows = tl.minimum(tl.maximum(rows, 0), num_rows - 1)
    return rows


@triton.jit
def _gather_rows_kernel(
    inp_ptr,  # [M, W] rows, moved as raw bits
    rows_ptr,  # [M] integer: row i of the output is inp[rows[i]], clipped into [0, M)
    group_sizes_ptr,  # [E] integer: only rows below sum(group_sizes) are copied
    num_rows,
    out_ptr,  # [M, W]
    WIDTH: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """out[i] = inp[clip(rows[i], 0, M - 1)] for i < sum(group_sizes) (clipped to M), the only rows the
    weight-gradient kernel reads; later rows are not written. Grid (cdiv(M, BLOCK_ROWS), cdiv(W,
    BLOCK_COLS)): program (b, c) copies columns [c*BLOCK_COLS, (c+1)*BLOCK_COLS) of output rows
    [b*BLOCK_ROWS, (b+1)*BLOCK_ROWS); a block wholly past the groups exits."""
    _, _, sizes = _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS, GROUPS_POW2)
    group_rows = tl.sum(sizes, axis=0)
    first = tl.program_id(0) * BLOCK_ROWS
    if first >= group_rows:
        return
    out_rows = first + tl.arange(0, BLOCK_ROWS)
    rmask = out_rows < group_rows
    src_rows = _permuted(rows_ptr, out_rows, rmask, num_rows, True).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = rmask[:, None] & (cols[None, :] < WIDTH)
    values = tl.load(_as_bits(inp_ptr) + src_rows[:, None] * WIDTH + cols[None, :], mask=mask)
    tl.store(_as_bits(out_ptr) + out_rows.to(tl.int64)[:, None] * WIDTH + cols[None, :], values, mask=mask)


@triton.jit
def _grouped_matmul_kernel(
    lhs_ptr,  # [M, K]
    rhs_ptr,  # [E, K, N] through (RHS_K_STRIDE, RHS_N_STRIDE): [E, N, K] transposed reads serve the dgrad
    group_sizes_ptr,  # [E] integer
    lhs_rows_ptr,  # [M] int32, read where GATHER_LHS
    out_rows_ptr,  # [M] int32, read where SCATTER_OUT
    num_rows,  # M
    out_ptr,  # [M, N]
    NUM_COLS: tl.constexpr,  # N
    DEPTH: tl.constexpr,  # K
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    RHS_K_STRIDE: tl.constexpr,
    RHS_N_STRIDE: tl.constexpr,
    GATHER_LHS: tl.constexpr,
    SCATTER_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIZZLE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    """out[rows of g] = lhs[rows of g] @ rhs[g], rows through lhs_rows / out_rows where GATHER_LHS /
    SCATTER_OUT. Grid ((cdiv(M, BLOCK_M) + E) * cdiv(N, BLOCK_N),).

    Program p owns row tile m and column tile n (SWIZZLE row tiles walk the column tiles together, so
    their weight tiles are read from L2). Row tiles are numbered group by group, each group starting a new
    tile; tile m of group g covers rows [start_g + i * BLOCK_M, min(.. + BLOCK_M, end_g)). Tiles past the
    groups' tiles zero the rows past sum(group_sizes) where ZERO_TAIL (else leave them unwritten); programs
    past those exit.
    """
    pid = tl.program_id(0)
    col_tiles: tl.constexpr = (NUM_COLS + BLOCK_N - 1) // BLOCK_N
    row_tiles = tl.cdiv(num_rows, BLOCK_M) + NUM_GROUPS
    band = pid // (SWIZZLE * col_tiles)
    band_rows = tl.minimum(row_tiles - band * SWIZZLE, SWIZZLE)
    row_tile = band * SWIZZLE + (pid % (SWIZZLE * col_tiles)) % band_rows
    col_tile = (pid % (SWIZZLE * col_tiles)) // band_rows

    groups, starts, sizes = _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS, GROUPS_POW2)
    tiles = tl.cdiv(sizes, BLOCK_M)
    tile_ends = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_ends <= row_tile).to(tl.int32), axis=0)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NUM_COLS
    if group >= NUM_GROUPS:
        first = tl.sum(sizes, axis=0) + (row_tile - tl.sum(tiles, axis=0)) * BLOCK_M
        # Two ifs: Triton cannot `and` a constexpr with a tensor.
        if ZERO_TAIL:  # noqa: SIM102
            if first < num_rows:
                rows = first + tl.arange(0, BLOCK_M)
                out_rows = _permuted(out_rows_ptr, rows, rows < num_rows, num_rows, SCATTER_OUT)
                zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
                mask = (rows < num_rows)[:, None] & col_mask[None, :]
                out = out_ptr + out_rows.to(tl.int64)[:, None] * NUM_COLS + cols[None, :]
                tl.store(out, zeros, mask=mask)
        return
    start = _pick(starts, groups, group)
    end = start + _pick(sizes, groups, group)
    first = start + (row_tile - _pick(tile_ends - tiles, groups, group)) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    lhs_rows = _permuted(lhs_rows_ptr, rows, row_mask, num_rows, GATHER_LHS)
    depth = tl.arange(0, BLOCK_K)
    lhs = lhs_ptr + lhs_rows.to(tl.int64)[:, None] * DEPTH + depth[None, :]
    rhs = (
        rhs_ptr
        + group.to(tl.int64) * DEPTH * NUM_COLS
        + depth[:, None] * RHS_K_STRIDE
        + cols[None, :].to(tl.int64) * RHS_N_STRIDE
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(DEPTH, BLOCK_K)):
        left = DEPTH - k * BLOCK_K
        a = tl.load(lhs, mask=row_mask[:, None] & (depth[None, :] < left), other=0.0)
        b = tl.load(rhs, mask=(depth[:, None] < left) & col_mask[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        lhs += BLOCK_K
        rhs += BLOCK_K * RHS_K_STRIDE
    mask = row_mask[:, None] & col_mask[None, :]
    out_rows = _permuted(out_rows_ptr, rows, row_mask, num_rows, SCATTER_OUT)
    out = out_ptr + out_rows.to(tl.int64)[:, None] * NUM_COLS + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_matmul_wgrad_kernel(
    lhs_ptr,  # [M, K]
    grad_ptr,  # [M, N]
    group_sizes_ptr,  # [E] integer
    num_rows,  # M
    out_ptr,  # [E, K, N]
    NUM_COLS: tl.constexpr,  # N
    DEPTH: tl.constexpr,  # K
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIZZLE: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """out[g] = lhs[rows of g]^T @ grad[rows of g], the weight gradient. Grid
    (E * cdiv(K, BLOCK_K) * cdiv(N, BLOCK_N),).

    Program p owns group g and the output tile (k, n) of out[g], swizzled as in the forward; it walks the
    group's rows BLOCK_M at a time. An empty group's tile is zeros.
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

    groups, starts, sizes = _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS, GROUPS_POW2)
    start = _pick(starts, groups, group)
    end = start + _pick(sizes, groups, group)
    depth = depth_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    depth_mask = depth < DEPTH
    col_mask = cols < NUM_COLS
    rows = start + tl.arange(0, BLOCK_M)
    lhs = lhs_ptr + rows.to(tl.int64)[:, None] * DEPTH + depth[None, :]
    grad = grad_ptr + rows.to(tl.int64)[:, None] * NUM_COLS + cols[None, :]
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for first in range(start, end, BLOCK_M):
        row_mask = (first + tl.arange(0, BLOCK_M)) < end
        a = tl.load(lhs, mask=row_mask[:, None] & depth_mask[None, :], other=0.0)
        b = tl.load(grad, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b, acc)
        lhs += BLOCK_M * DEPTH
        grad += BLOCK_M * NUM_COLS
    out = (
        out_ptr
        + group.to(tl.int64) * DEPTH * NUM_COLS
        + depth.to(tl.int64)[:, None] * NUM_COLS
        + cols[None, :]
    )
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=depth_mask[:, None] & col_mask[None, :])


def _matmul_space(kernel: str, block_m: tuple[int, ...], block_k: tuple[int, ...]) -> SearchSpace:
    """A GEMM kernel's tiles: its own row (block_m) and depth (block_k) tiles; the column tiles, warps and
    stages, which both kernels search alike."""
    params = {"block_m": block_m, "block_n": (64, 128, 256), "block_k": block_k}
    return SearchSpace(kernel, dict(params, num_warps=(4, 8), num_stages=(3, 4)))


GROUPED_MATMUL_SPACE = _matmul_space("grouped_matmul", block_m=(64, 128), block_k=(32, 64))
GROUPED_MATMUL_WGRAD_SPACE = _matmul_space("grouped_matmul_wgrad", block_m=(32, 64), block_k=(64, 128))
#: The family's search spaces, bf16 and FP8 (moetriton.kernels.SEARCH_SPACES gathers every family's).
SEARCH_SPACES = (GROUPED_MATMUL_SPACE, GROUPED_MATMUL_WGRAD_SPACE, *fp8.SEARCH_SPACES)
_SWIZZLE = 8


def _fp32_dot(element_bytes: int) -> bool:
    """Whether tiles are multiplied as IEEE fp32: for fp32 inputs (not TF32: ragged_dot's precision), and for
    every dtype under the interpreter, whose 16-bit tl.dot reads the operands' bits wrongly (Triton 3.9)."""
    return element_bytes == 4 or INTERPRETER


def _check(num_rows: int, depth: int, num_cols: int, num_groups: int, element_bytes: int) -> None:
    if min(num_rows, depth, num_cols) < 0 or num_groups < 1:
        raise ValueError(
            f"grouped_matmul: sizes must be >= 0 with at least one group, got M={num_rows}, K={depth}, "
            f"N={num_cols}, E={num_groups}"
        )
    if element_bytes not in (2, 4):
        raise ValueError(f"grouped_matmul: element size {element_bytes} bytes (bf16, fp16 or fp32 only)")


def _launch(kernel, num_programs: int, args: tuple, sizes: dict, cfg: dict, **constexprs) -> Launch:
    """A launch of either kernel: a 1-D grid, the sizes and tiles as constexprs (N and K known to the
    compiler, so their divisibility lets it vectorise), plus `constexprs` of one kernel."""
    return Launch(
        kernel=kernel,
        grid=(num_programs,),
        args=args,
        outputs=("out",),
        constexprs=dict(
            NUM_COLS=sizes["num_cols"],
            DEPTH=sizes["depth"],
            NUM_GROUPS=sizes["num_groups"],
            GROUPS_POW2=next_pow2(sizes["num_groups"]),
            BLOCK_M=cfg["block_m"],
            BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"],
            SWIZZLE=_SWIZZLE,
            FP32_DOT=_fp32_dot(sizes["element_bytes"]),
            **constexprs,
        ),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


@sized_by(
    Sizes(
        axes=dict(num_rows=("lhs", 0), depth=("lhs", 1), num_cols=("rhs", 2), num_groups=("rhs", 0)),
        present=dict(gather_lhs="lhs_rows", scatter_out="out_rows"),
        element_bytes="lhs",
    )
)
@cached
def grouped_matmul_plan(
    *,
    num_rows: int,
    depth: int,
    num_cols: int,
    num_groups: int,
    element_bytes: int,
    transpose_rhs: bool = False,
    gather_lhs: bool = False,
    scatter_out: bool = False,
    zero_tail: bool = True,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """out = ragged_dot(lhs, rhs, group_sizes): the forward GEMMs, and with `transpose_rhs` the input
    gradient (rhs [E, N, K] read as its transpose [E, K, N]). With `gather_lhs` row i of the product reads
    lhs[lhs_rows[i]]; with `scatter_out` it is written to out[out_rows[i]] (permutations of [0, M)).
    Rows of the product past sum(group_sizes) are zeros, or left unwritten (unspecified) without
    `zero_tail`: callers that never read them (the MoE layers' worst-case receive buffers, about half
    tail at EP = 2) skip those writes.

    Inputs: "lhs" [M, K], "rhs" [E, K, N] (or [E, N, K] with `transpose_rhs`), "group_sizes" [E] int32,
    "lhs_rows" / "out_rows" [M] int32 where asked for (None otherwise).
    Result: "out" [M, N] in the dtype of lhs (element_bytes wide; 4 = fp32, multiplied in IEEE fp32).
    """
    _check(num_rows, depth, num_cols, num_groups, element_bytes)
    features = dict(rows_per_group=cdiv(num_rows, num_groups), depth=depth, num_cols=num_cols)
    small = num_rows < 128 * num_groups  # small groups waste less of a 64-row tile
    # A sweep (benchmarks/grouped_gemm.py --sweep): 128 x 256 x 64 tiles lead at the layer shapes; the
    # transposed weight reads of the input gradient gain from a fourth stage.
    heuristic = dict(
        block_m=64 if small else 128,
        block_n=128 if small else 256,
        block_k=64,
        num_warps=4 if small else 8,
        num_stages=4 if transpose_rhs else 3,
    )
    cfg = autotune.resolve(GROUPED_MATMUL_SPACE, heuristic, config, features, device)
    if element_bytes == 4:  # fp32 tiles take twice the shared memory per stage
        cfg = dict(cfg, block_n=min(cfg["block_n"], 128), block_k=min(cfg["block_k"], 32))
    buffers = {"out": Buffer((num_rows, num_cols), "like:lhs")}
    if num_rows == 0 or num_cols == 0:
        return Plan(buffers, (), ("out",))
    row_tiles = cdiv(num_rows, cfg["block_m"]) + num_groups
    rhs_strides = (1, depth) if transpose_rhs else (num_cols, 1)
    launch = _launch(
        _grouped_matmul_kernel,
        row_tiles * cdiv(num_cols, cfg["block_n"]),
        ("lhs", "rhs", "group_sizes", "lhs_rows", "out_rows", num_rows),
        dict(num_cols=num_cols, depth=depth, num_groups=num_groups, element_bytes=element_bytes),
        cfg,
        RHS_K_STRIDE=rhs_strides[0],
        RHS_N_STRIDE=rhs_strides[1],
        GATHER_LHS=gather_lhs,
        SCATTER_OUT=scatter_out,
        ZERO_TAIL=zero_tail,
    )
    return Plan(buffers, (launch,), ("out",))


def _gather_launch(source: str, rows: str, gathered: str, sizes: dict, width: int):
    """The copy gathered[i] = source[rows[i]] of the groups' rows of [M, W]: 16 KiB of columns by 4 rows
    per program (a plain streaming copy; the chunk sort's tuned configs for these widths are in the same
    range)."""
    num_rows, num_groups, element_bytes = sizes["num_rows"], sizes["num_groups"], sizes["element_bytes"]
    block_cols = block_columns(width, 16384 // element_bytes)
    return Launch(
        kernel=_gather_rows_kernel,
        grid=(cdiv(num_rows, 4), cdiv(width, block_cols)),
        args=(source, rows, "group_sizes", num_rows),
        outputs=(gathered,),
        constexprs=dict(
            WIDTH=width,
            NUM_GROUPS=num_groups,
            GROUPS_POW2=next_pow2(num_groups),
            BLOCK_ROWS=4,
            BLOCK_COLS=block_cols,
        ),
        num_warps=4,
    )


@sized_by(
    Sizes(
        axes=dict(num_rows=("lhs", 0), depth=("lhs", 1), num_cols=("grad", 1), num_groups=("group_sizes", 0)),
        present=dict(gather_lhs="lhs_rows", gather_grad="out_rows"),
        element_bytes="lhs",
    )
)
@cached
def grouped_matmul_wgrad_plan(
    *,
    num_rows: int,
    depth: int,
    num_cols: int,
    num_groups: int,
    element_bytes: int,
    gather_lhs: bool = False,
    gather_grad: bool = False,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """The weight gradient of ragged_dot: out[g] = lhs[rows of g]^T @ grad[rows of g]. With `gather_lhs`
    (`gather_grad`) row i of the product reads lhs[lhs_rows[i]] (grad[out_rows[i]]): the gradient of
    grouped_matmul_plan's product with those permutations, each operand gathered by one copy first (the
    groups' rows only: the kernel reads nothing else).

    Inputs: "lhs" [M, K], "grad" [M, N], "group_sizes" [E] int32, "lhs_rows" / "out_rows" [M] int32 where
    asked for (None otherwise). Result: "out" [E, K, N] in the dtype of lhs (element_bytes wide); empty
    groups get zeros.
    """
    _check(num_rows, depth, num_cols, num_groups, element_bytes)
    sizes = dict(
        num_rows=num_rows, depth=depth, num_cols=num_cols, num_groups=num_groups, element_bytes=element_bytes
    )
    features = dict(rows_per_group=cdiv(num_rows, num_groups), depth=depth, num_cols=num_cols)
    heuristic = dict(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3)  # the sweep's best
    cfg = autotune.resolve(GROUPED_MATMUL_WGRAD_SPACE, heuristic, config, features, device)
    if element_bytes == 4:
        cfg = dict(cfg, block_m=32, block_n=min(cfg["block_n"], 128), block_k=64)
    buffers = {"out": Buffer((num_groups, depth, num_cols), "like:lhs")}
    if depth == 0 or num_cols == 0:
        return Plan(buffers, (), ("out",))
    gathers = []

    def operand(gather: bool, source: str, rows: str, width: int) -> str:
        """The buffer the weight-gradient kernel reads for `source`: itself, or its gathered copy."""
        if not (gather and num_rows):
            return source
        gathered = f"gathered_{source}"
        buffers[gathered] = Buffer((num_rows, width), f"like:{source}")
        gathers.append(_gather_launch(source, rows, gathered, sizes, width))
        return gathered

    lhs = operand(gather_lhs, "lhs", "lhs_rows", depth)
    grad = operand(gather_grad, "grad", "out_rows", num_cols)
    launch = _launch(
        _grouped_matmul_wgrad_kernel,
        num_groups * cdiv(depth, cfg["block_k"]) * cdiv(num_cols, cfg["block_n"]),
        (lhs, grad, "group_sizes", num_rows),
        sizes,
        cfg,
    )
    return Plan(buffers, (*gathers, launch), ("out",))
