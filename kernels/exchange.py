"""The JAX layer's padded exchange: received blocks into the worst-case layout the grouped GEMMs read.

The padded exchange moves every (source, destination) pair's rows as one block of the step's block size
(EPLayout.exchange_block_rows[index], a static size per lax.switch branch), and the layer's GEMMs read the
rows through a permutation of the worst-case layout (every block EPLayout.pair_rows rows), so each
arriving [EP, rows, H] buffer is placed into [EP, pair_rows, H]. Only the rows a source actually sent
(sizes[p] <= rows) carry data and only those are read: this kernel copies them and writes nothing else,
where a pad would stream the whole worst-case buffer (EP times the routed rows; half of it empty at EP = 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._plan import Buffer, Launch, Plan, cached, cdiv, next_pow2
from .permutation import _as_bits


@triton.jit
def _place_blocks_kernel(
    blocks_ptr,  # [P * rows, W] the arriving blocks, moved as raw bits
    sizes_ptr,  # [P] integer: rows of block p that carry data (clipped to [0, rows])
    rows,  # rows of an arriving block
    out_rows,  # rows of a placed block (>= rows)
    out_ptr,  # [P * out_rows, W]
    WIDTH: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
):
    """out[p * out_rows + j] = blocks[p * rows + j] for j < sizes[p]; nothing else written. Grid (P *
    cdiv(rows, TILE_ROWS), cdiv(W, TILE_COLS)): program (t, c) copies columns [c*TILE_COLS, +TILE_COLS) of
    tile t % cdiv(rows, TILE_ROWS) of block t // cdiv(rows, TILE_ROWS); a tile past the block's size exits."""
    tiles = tl.cdiv(rows, TILE_ROWS)
    block = tl.program_id(0) // tiles
    first = (tl.program_id(0) % tiles) * TILE_ROWS
    size = tl.minimum(tl.maximum(tl.load(sizes_ptr + block).to(tl.int32), 0), rows)
    if first >= size:
        return
    within = first + tl.arange(0, TILE_ROWS)
    cols = tl.program_id(1) * TILE_COLS + tl.arange(0, TILE_COLS)
    mask = (within < size)[:, None] & (cols < WIDTH)[None, :]
    source = (block.to(tl.int64) * rows + within)[:, None] * WIDTH + cols[None, :]
    target = (block.to(tl.int64) * out_rows + within)[:, None] * WIDTH + cols[None, :]
    values = tl.load(_as_bits(blocks_ptr) + source, mask=mask)
    tl.store(_as_bits(out_ptr) + target, values, mask=mask)


@cached
def place_blocks_plan(*, num_blocks: int, rows: int, out_rows: int, width: int, element_bytes: int) -> Plan:
    """Place P = num_blocks arriving blocks of `rows` rows into blocks of `out_rows` rows (module doc).

    Inputs: "blocks" [P * rows, W] of any dtype element_bytes wide, "sizes" [P] integer.
    Result: "out" [P * out_rows, W] in the dtype of blocks; row j of block p is written for j < sizes[p]
    only (sizes clipped to [0, rows]), every other row is unspecified.
    """
    if min(num_blocks, rows, width) < 0 or out_rows < rows:
        raise ValueError(
            f"place_blocks: expected sizes >= 0 and out_rows >= rows, got P={num_blocks}, rows={rows},"
            f" out_rows={out_rows}, W={width}"
        )
    buffers = {"out": Buffer((num_blocks * out_rows, width), "like:blocks")}
    if num_blocks * rows == 0 or width == 0:
        return Plan(buffers, (), ("out",))
    tile_rows = 4
    tile_cols = max(16, min(next_pow2(width), 16384 // element_bytes))  # a 16 KiB streaming copy per row
    launch = Launch(
        kernel=_place_blocks_kernel,
        grid=(num_blocks * cdiv(rows, tile_rows), cdiv(width, tile_cols)),
        args=("blocks", "sizes", rows, out_rows),
        outputs=("out",),
        constexprs=dict(WIDTH=width, TILE_ROWS=tile_rows, TILE_COLS=tile_cols),
        num_warps=4,
    )
    return Plan(buffers, (launch,), ("out",))
