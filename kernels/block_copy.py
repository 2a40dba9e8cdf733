"""Block copies of the JAX layer's padded exchange: received blocks placed into the worst-case layout the
grouped GEMMs read, and taken back out of it.

The padded exchange moves every (source, destination) pair's rows as one block of the step's block size
(EPLayout.exchange_block_rows[index], a static size per lax.switch branch), while the buffers around it
have the static worst-case layout (every block EPLayout.pair_rows rows). Placing an arriving [EP, rows, H]
buffer into that layout, and taking departing blocks out of it, moves only the rows a source actually sent
(sizes[p] <= rows): these kernels copy those and write nothing else, where a pad would stream the whole
worst-case buffer (EP times the routed rows; half of it empty at EP = 2). With `permuted` the layout rows
are themselves permuted (the layer's expert-major order: the rows land where the grouped GEMMs read them in
order, so neither GEMM reads through a permutation and the weight gradients gather nothing). With `offsets`
the layout is any buffer of rows and block p starts at its row offsets[p] (a send buffer whose rank-major
blocks start where the dispatch put them): taking the departing blocks out of it and placing the arriving
ones back copies only each block's rows, where XLA's gather and select stream every row of the blocks and
zero the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import _as_bits, block_columns
from .runtime.plan import Buffer, Launch, Plan, cached, cdiv


@triton.jit
def _block_tile(sizes_ptr, rows, WIDTH: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr):
    """This program's block p, rows `within` [TILE_ROWS] of it, columns [TILE_COLS], the mask of the rows
    below sizes[p] (clipped to [0, rows]), that mask with the columns below W, and whether any row is."""
    tiles = tl.cdiv(rows, TILE_ROWS)
    block = tl.program_id(0) // tiles
    first = (tl.program_id(0) % tiles) * TILE_ROWS
    # Clipped in its own dtype, then narrowed: a size of 2**32 + 5 is `rows`, not 5.
    size = tl.minimum(tl.maximum(tl.load(sizes_ptr + block), 0), rows).to(tl.int32)
    within = first + tl.arange(0, TILE_ROWS)
    cols = tl.program_id(1) * TILE_COLS + tl.arange(0, TILE_COLS)
    row_mask = within < size
    mask = row_mask[:, None] & (cols < WIDTH)[None, :]
    return block.to(tl.int64), within, cols, row_mask, mask, first < size


@triton.jit
def _layout_rows(
    dest_rows_ptr,
    offsets_ptr,
    block,
    within,
    row_mask,
    mask,
    out_rows,
    num_blocks,
    PERMUTED: tl.constexpr,
    OFFSETS: tl.constexpr,
):
    """(rows of the layout of block rows `within`, the copy mask [TILE_ROWS, TILE_COLS]): p * out_rows + j,
    or dest_rows[that] clipped into [0, P * out_rows) where PERMUTED, under `mask` as it is; where OFFSETS
    offsets[p] + j, with `mask` narrowed to the rows in [0, out_rows) (a row a bad offset puts outside is
    neither read nor written)."""
    if OFFSETS:
        rows = tl.load(offsets_ptr + block).to(tl.int64) + within
        return rows, mask & ((rows >= 0) & (rows < out_rows))[:, None]
    rows = block * out_rows + within
    if PERMUTED:
        rows = tl.load(dest_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        rows = tl.minimum(tl.maximum(rows, 0), num_blocks * out_rows - 1)
    return rows, mask


@triton.jit
def _copy_rows(source_ptr, source_rows, target_ptr, target_rows, cols, mask, WIDTH: tl.constexpr):
    """target[target_rows, cols] = source[source_rows, cols] under `mask` [TILE_ROWS, TILE_COLS], as raw bits
    (both kernels move rows between the blocks and the layout; only the direction differs)."""
    values = tl.load(_as_bits(source_ptr) + source_rows[:, None] * WIDTH + cols[None, :], mask=mask)
    tl.store(_as_bits(target_ptr) + target_rows[:, None] * WIDTH + cols[None, :], values, mask=mask)


@triton.jit
def _place_blocks_kernel(
    blocks_ptr,  # [P * rows, W] the arriving blocks, moved as raw bits
    sizes_ptr,  # [P] integer: rows of block p that carry data (clipped to [0, rows])
    dest_rows_ptr,  # [P * out_rows] integer, read where PERMUTED: where layout row p * out_rows + j goes
    offsets_ptr,  # [P] integer, read where OFFSETS: the layout row where block p starts
    rows,  # rows of an arriving block
    out_rows,  # rows of a block in the layout (>= rows); where OFFSETS, rows of the whole layout
    num_blocks,  # P
    out_ptr,  # [P * out_rows, W] ([out_rows, W] where OFFSETS)
    WIDTH: tl.constexpr,
    PERMUTED: tl.constexpr,
    OFFSETS: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
):
    """out[p * out_rows + j] (out[dest_rows[p * out_rows + j]] where PERMUTED, out[offsets[p] + j] where
    OFFSETS) = blocks[p * rows + j] for j < sizes[p]; nothing else written. Grid (P * cdiv(rows, TILE_ROWS),
    cdiv(W, TILE_COLS)): program (t, c) copies columns [c*TILE_COLS, +TILE_COLS) of tile
    t % cdiv(rows, TILE_ROWS) of block t // cdiv(rows, TILE_ROWS); a tile past the block's size exits."""
    block, within, cols, row_mask, mask, live = _block_tile(sizes_ptr, rows, WIDTH, TILE_ROWS, TILE_COLS)
    if not live:
        return
    target, mask = _layout_rows(
        dest_rows_ptr, offsets_ptr, block, within, row_mask, mask, out_rows, num_blocks, PERMUTED, OFFSETS
    )
    _copy_rows(blocks_ptr, block * rows + within, out_ptr, target, cols, mask, WIDTH)


@triton.jit
def _take_blocks_kernel(
    layout_ptr,  # [P * out_rows, W] rows in the placed layout, moved as raw bits
    sizes_ptr,  # [P] integer
    dest_rows_ptr,  # [P * out_rows] integer, read where PERMUTED
    offsets_ptr,  # [P] integer, read where OFFSETS
    rows,
    out_rows,
    num_blocks,
    blocks_ptr,  # [P * rows, W] the departing blocks
    WIDTH: tl.constexpr,
    PERMUTED: tl.constexpr,
    OFFSETS: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
):
    """The inverse of `_place_blocks_kernel`: blocks[p * rows + j] = layout[p * out_rows + j] (or
    layout[dest_rows[p * out_rows + j]], or layout[offsets[p] + j]) for j < sizes[p] and a layout row
    inside the layout; nothing else written. Grid and programs as `_place_blocks_kernel`'s."""
    block, within, cols, row_mask, mask, live = _block_tile(sizes_ptr, rows, WIDTH, TILE_ROWS, TILE_COLS)
    if not live:
        return
    source, mask = _layout_rows(
        dest_rows_ptr, offsets_ptr, block, within, row_mask, mask, out_rows, num_blocks, PERMUTED, OFFSETS
    )
    _copy_rows(layout_ptr, source, blocks_ptr, block * rows + within, cols, mask, WIDTH)


def _blocks_plan(
    take: bool,
    num_blocks: int,
    rows: int,
    out_rows: int,
    width: int,
    element_bytes: int,
    permuted: bool,
    offsets: bool,
) -> Plan:
    """The plan of `_take_blocks_kernel` (take) or `_place_blocks_kernel`: their builders' docs."""
    name = "take_blocks" if take else "place_blocks"
    if min(num_blocks, rows, width, out_rows) < 0 or (out_rows < rows and not offsets):
        raise ValueError(
            f"{name}: expected sizes >= 0 and out_rows >= rows (rows of a block in the layout), got"
            f" P={num_blocks}, rows={rows}, out_rows={out_rows}, W={width}"
        )
    if permuted and offsets:
        raise ValueError(f"{name}: permuted and offsets are exclusive")
    source, result = ("layout", "blocks") if take else ("blocks", "out")
    layout_rows = out_rows if offsets else num_blocks * out_rows
    shape = (num_blocks * rows, width) if take else (layout_rows, width)
    buffers = {result: Buffer(shape, f"like:{source}")}
    if num_blocks * rows == 0 or width == 0:
        return Plan(buffers, (), (result,))
    tile_rows = 4
    tile_cols = block_columns(width, 16384 // element_bytes)  # a 16 KiB streaming copy per row
    launch = Launch(
        kernel=_take_blocks_kernel if take else _place_blocks_kernel,
        grid=(num_blocks * cdiv(rows, tile_rows), cdiv(width, tile_cols)),
        args=(source, "sizes", "dest_rows", "offsets", rows, out_rows, num_blocks),
        outputs=(result,),
        constexprs=dict(
            WIDTH=width, PERMUTED=permuted, OFFSETS=offsets, TILE_ROWS=tile_rows, TILE_COLS=tile_cols
        ),
        num_warps=4,
    )
    return Plan(buffers, (launch,), (result,))


@cached
def place_blocks_plan(
    *,
    num_blocks: int,
    rows: int,
    out_rows: int,
    width: int,
    element_bytes: int,
    permuted: bool = False,
    offsets: bool = False,
) -> Plan:
    """Place P = num_blocks arriving blocks of `rows` rows into the layout of blocks of `out_rows` rows
    (module doc), or with `permuted` at dest_rows of those layout rows (the layer's expert-major order), or
    with `offsets` into a layout of out_rows rows in all, block p from its row offsets[p].

    Inputs: "blocks" [P * rows, W] of any dtype element_bytes wide, "sizes" [P] integer, "dest_rows"
    [P * out_rows] integer with `permuted` (None otherwise; a permutation, entries clipped into range),
    "offsets" [P] integer with `offsets` (None otherwise; rows they put outside the layout are skipped).
    Result: "out" [P * out_rows, W] ([out_rows, W] with `offsets`) in the dtype of blocks; row j of block p
    lands for j < sizes[p] only (sizes clipped to [0, rows]), every other row is unspecified.
    """
    return _blocks_plan(False, num_blocks, rows, out_rows, width, element_bytes, permuted, offsets)


@cached
def take_blocks_plan(
    *,
    num_blocks: int,
    rows: int,
    out_rows: int,
    width: int,
    element_bytes: int,
    permuted: bool = False,
    offsets: bool = False,
) -> Plan:
    """The inverse of `place_blocks_plan`: departing blocks of `rows` rows out of the layout.

    Inputs: "layout" [P * out_rows, W] ([out_rows, W] with `offsets`), "sizes" [P] integer, "dest_rows"
    [P * out_rows] with `permuted`, "offsets" [P] with `offsets`. Result: "blocks" [P * rows, W] in the
    dtype of layout; row j of block p is written for j < sizes[p] (and a layout row inside the layout)
    only, every other row is unspecified.
    """
    return _blocks_plan(True, num_blocks, rows, out_rows, width, element_bytes, permuted, offsets)
