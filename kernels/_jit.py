"""@triton.jit helpers shared by several kernel families, and the column arithmetic of their launches.

A kernel family's own helpers stay in its file; these are the ones two or more families call, so that no
family imports another's private names.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .runtime.plan import cdiv, next_pow2

#: Largest number of elements one program holds in a tile of index arithmetic (the permutation's and the
#: chunk sort's per-slot and per-split compares); keeps register use bounded for any E, K and H.
TILE_ELEMENTS = 4096


@triton.jit
def _as_bits(ptr):
    """Reinterprets a pointer as a pointer to unsigned integers of the same width (pure data movement).
    Booleans are stored as bytes, so an int1 pointer becomes a uint8 one (byte loads vectorise; int1 loads
    did not, and made reading routing masks several times slower)."""
    bits: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth
    if bits <= 8:
        return ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    elif bits == 16:
        return ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    elif bits == 32:
        return ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    else:
        return ptr.to(tl.pointer_type(tl.uint64), bitcast=True)


@triton.jit
def _bitmap_flags(bitmap_ptr, rows, columns, row_bytes, mask):
    """[R, C] flags of `rows` [R] x `columns` [C] in a uint8 bitmap of `row_bytes` bytes per row: bit c % 8
    of byte c // 8 (LSB first), False where `mask` [R, C] is (nothing is read there). Callers mask every
    column at or past the bitmap's E, so the unused high bits of a row's last byte are never followed."""
    packed = tl.load(
        bitmap_ptr + rows.to(tl.int64)[:, None] * row_bytes + (columns // 8)[None, :], mask=mask, other=0
    )
    return mask & (((packed.to(tl.int32) >> (columns % 8)[None, :]) & 1) != 0)


@triton.jit
def _aligned(value, ALIGN: tl.constexpr):
    """`value` rebuilt as a multiple of ALIGN, so that the compiler knows its divisibility (the plan sets
    ALIGN to a power of two dividing `value`). PyTorch's launcher tells Triton which integer arguments are
    multiples of 16; jax-triton does not, and without the hint the row addresses `row * hidden + cols` and the
    masks `cols < hidden` do not vectorise (the JAX combine ran far slower than the same kernel from
    PyTorch)."""
    return value // ALIGN * ALIGN


@triton.jit
def _chunk_of_rows(rows, sizes, in_table, CHUNKS_POW2: tl.constexpr):
    """For rows [ROWS] of chunks laid end to end, `sizes` [CHUNKS_POW2] (entries outside `in_table` zero):
    (the chunk of each row, the first row of that chunk). The chunk of a row is the number of chunks that
    end at or before it (empty chunks included); a row past the last chunk gets the table's length."""
    ends = tl.cumsum(sizes, axis=0)
    chunk = tl.sum(((ends[None, :] <= rows[:, None]) & in_table[None, :]).to(tl.int32), axis=1)
    chunks = tl.arange(0, CHUNKS_POW2)
    first = tl.sum(tl.where(chunks[None, :] == chunk[:, None], (ends - sizes)[None, :], 0), axis=1)
    return chunk, first


@triton.jit
def _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr):
    """[GROUPS_POW2] vectors of the groups, their first rows and their row counts, sizes clipped to
    [0, num_rows - first row] so that every group lies inside the rows present. Sizes are clipped in their
    own dtype before narrowing and summed in int64, so no size (2**32 + 5, or many large ones) wraps."""
    groups = tl.arange(0, GROUPS_POW2)
    sizes = tl.load(group_sizes_ptr + groups, mask=groups < NUM_GROUPS, other=0)
    sizes = tl.minimum(tl.maximum(sizes, 0), num_rows).to(tl.int64)
    running = tl.cumsum(sizes, axis=0)
    ends = tl.minimum(running, num_rows).to(tl.int32)
    starts = tl.minimum(running - sizes, num_rows).to(tl.int32)
    return groups, starts, ends - starts


@triton.jit
def _pick(values, groups, group):
    """values[group] of a [GROUPS_POW2] vector, as a scalar."""
    return tl.sum(tl.where(groups == group, values, 0), axis=0)


@triton.jit
def _group_tile(
    group_sizes_ptr,
    num_rows,
    tile,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Row tile `tile` when every group's rows are cut into BLOCK_M-row tiles numbered group by group
    (each group starting a new tile): (its group, first row, the group's end row, the rows of all groups,
    the tiles of all groups). The group is NUM_GROUPS for tiles past the groups' tiles."""
    groups, starts, sizes = _group_bounds(group_sizes_ptr, num_rows, NUM_GROUPS, GROUPS_POW2)
    tiles = tl.cdiv(sizes, BLOCK_M)
    tile_ends = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
    start = _pick(starts, groups, group)
    end = start + _pick(sizes, groups, group)
    first = start + (tile - _pick(tile_ends - tiles, groups, group)) * BLOCK_M
    return group, first, end, tl.sum(sizes, axis=0), tl.sum(tiles, axis=0)


def column_programs(hidden: int, block_h: int) -> int:
    """Programs per token row: one per BLOCK_H columns, and one even for H = 0, since a token's first
    program also moves its per-slot data (row map, probs)."""
    return max(1, cdiv(hidden, block_h))


def block_columns(hidden: int, block: int) -> int:
    """Columns per program: the configured block, no wider than the row (power of two, at least 16)."""
    return max(16, min(next_pow2(hidden), block))
