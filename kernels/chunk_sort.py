"""Chunk sort: reorder contiguous row chunks (e.g. rank-major -> expert-major after an all-to-all).

The input's first sum(split_sizes) rows form S chunks, chunk c holding split_sizes[c] rows. Output chunk j
is input chunk sorted_indices[j]; rows past sum(split_sizes) stay where they are. `row_id_map` [N] int32
gives the destination row of every input row. The map is computed inside the data kernel (one launch per
direction), so the backward, a gather through the same map, needs nothing saved but the split arguments.

The sizes and the order must describe a partition of the first rows: every size in [0, N], their sum at
most N, the order a permutation of [0, S). Every program checks this on the values it reads (in their own
dtype, before narrowing; O(S) work beside its O(ROWS * S) lookup), and a description that is not one moves
nothing: every output row and permuted prob is zero and every row_id_map entry -1 (so is the gradient).
No address is ever computed from an unchecked size or order entry.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ._jit import TILE_ELEMENTS, _aligned, _as_bits, _chunk_of_rows, block_columns, column_programs
from .runtime import autotune
from .runtime.plan import (
    DEFAULT_DEVICE,
    Buffer,
    DeviceInfo,
    Launch,
    Plan,
    RowStride,
    SearchSpace,
    Sizes,
    alignment,
    cached,
    cdiv,
    next_pow2,
    sized_by,
)


@triton.jit
def _partition(
    split_sizes_ptr, sorted_indices_ptr, num_splits, num_rows, SPLITS_POW2: tl.constexpr, WORDS: tl.constexpr
):
    """(sizes [SPLITS_POW2] int32, order [SPLITS_POW2] int32, valid): the split sizes and sorted indices
    (entries past S zero), and whether they describe a partition of at most `num_rows` rows (module doc).
    Invalid: all sizes zero and the order the identity, so every row lies past the chunks."""
    splits = tl.arange(0, SPLITS_POW2)
    smask = splits < num_splits
    raw_sizes = tl.load(split_sizes_ptr + splits, mask=smask, other=0)
    raw_order = tl.load(sorted_indices_ptr + splits, mask=smask, other=0)
    sizes_ok = (raw_sizes >= 0) & (raw_sizes <= num_rows)
    sizes = tl.where(sizes_ok, raw_sizes, 0).to(tl.int64)
    order_ok = (raw_order >= 0) & (raw_order < num_splits)
    order = tl.where(order_ok, raw_order, 0).to(tl.int32)
    # A permutation: S entries in [0, S) whose bits (value v is bit v % 32 of word v // 32) fill every
    # word. A sum of n powers of two has at most n bits set, and S entries must set S bits, so equal word
    # sums mean distinct entries. O(S * S / 32) work, far less than a histogram of the entries.
    words = tl.arange(0, WORDS)
    bit = tl.where(smask, tl.full([SPLITS_POW2], 1, tl.int64) << (order % 32), 0)
    word_sums = tl.sum(tl.where((order // 32)[:, None] == words[None, :], bit[:, None], 0), axis=0)
    word_bits = tl.minimum(tl.maximum(num_splits - 32 * words, 0), 32).to(tl.int64)
    permutation = (
        tl.sum((word_sums != (tl.full([WORDS], 1, tl.int64) << word_bits) - 1).to(tl.int32), axis=0) == 0
    )
    bad = tl.sum((smask & ~(sizes_ok & order_ok)).to(tl.int32), axis=0)
    valid = (bad == 0) & (tl.sum(sizes, axis=0) <= num_rows) & permutation
    sizes = tl.where(valid, sizes, 0).to(tl.int32)
    order = tl.where(valid, order, splits)
    return sizes, order, valid


@triton.jit
def _sort_chunks_kernel(
    inp_ptr,  # [N, H]
    split_sizes_ptr,  # [S] integer
    sorted_indices_ptr,  # [S] integer, a permutation of [0, S)
    probs_ptr,  # [N] (HAS_PROBS)
    num_rows,
    hidden,
    inp_stride,  # row stride of inp
    num_splits,
    out_ptr,  # [N, H]
    row_map_ptr,  # [N] int32 (WRITE_MAP)
    out_probs_ptr,  # [N] (HAS_PROBS)
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    GATHER: tl.constexpr,
    WRITE_MAP: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    INP_STRIDE_ALIGN: tl.constexpr,
):
    """Grid (cdiv(N, ROWS), cdiv(H, BLOCK_H)). Program (b, c) computes the destination of rows
    [b*ROWS, (b+1)*ROWS) from the split sizes (O(ROWS * S) compares) and moves their columns
    [c*BLOCK_H, (c+1)*BLOCK_H): scattered to the destinations (forward), or gathered from them (GATHER,
    the backward). Program (b, 0) also moves the probs and writes the row map."""
    row_block = tl.program_id(0)
    chunk = tl.program_id(1)
    hidden = _aligned(hidden, HIDDEN_ALIGN)
    inp_stride = _aligned(inp_stride, INP_STRIDE_ALIGN)
    splits = tl.arange(0, SPLITS_POW2)
    smask = splits < num_splits
    words: tl.constexpr = (SPLITS_POW2 + 31) // 32
    sizes, order, valid = _partition(
        split_sizes_ptr, sorted_indices_ptr, num_splits, num_rows, SPLITS_POW2, words
    )
    total = tl.sum(sizes, axis=0)
    # `order` lies in [0, S) (the identity where invalid, and then every size reads as 0).
    sorted_sizes = tl.where(valid, tl.load(split_sizes_ptr + order, mask=smask, other=0), 0).to(tl.int32)
    dst_start_by_position = tl.cumsum(sorted_sizes, axis=0) - sorted_sizes

    rows = row_block * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    # The rows whose values move: all of them when the partition is valid, none otherwise. (A vector: the
    # interpreter rejects a vector mask & a scalar one.)
    moved = rmask & ((rows * 0 + valid.to(tl.int32)) != 0)
    chunk_of_row, src_first = _chunk_of_rows(rows, sizes, smask, SPLITS_POW2)
    dst_first = tl.sum(
        tl.where(
            (order[None, :] == chunk_of_row[:, None]) & smask[None, :], dst_start_by_position[None, :], 0
        ),
        axis=1,
    )
    dst = tl.where(rows < total, dst_first + rows - src_first, rows)

    if GATHER:
        read_rows = dst
        write_rows = rows
    else:
        read_rows = rows
        write_rows = dst
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = rmask[:, None] & (cols[None, :] < hidden)
    # Not a partition: nothing is read, and every row is written with zeros where it stands.
    values = tl.load(
        _as_bits(inp_ptr) + read_rows.to(tl.int64)[:, None] * inp_stride + cols[None, :],
        mask=moved[:, None] & (cols[None, :] < hidden),
        other=0,
    )
    tl.store(_as_bits(out_ptr) + write_rows.to(tl.int64)[:, None] * hidden + cols[None, :], values, mask=mask)
    if chunk == 0:
        if HAS_PROBS:
            probs = tl.load(_as_bits(probs_ptr) + read_rows, mask=moved, other=0)
            tl.store(_as_bits(out_probs_ptr) + write_rows, probs, mask=rmask)
        if WRITE_MAP:
            tl.store(row_map_ptr + rows, tl.where(valid, dst, -1), mask=rmask)


SORT_CHUNKS_SPACE = SearchSpace(
    "sort_chunks", {"rows": (1, 4, 16), "block_bytes": (4096, 8192, 16384), "num_warps": (4, 8)}
)
#: The family's search spaces (moetriton.kernels.SEARCH_SPACES gathers every family's).
SEARCH_SPACES = (SORT_CHUNKS_SPACE,)


@sized_by(
    Sizes(
        axes=dict(num_rows=("inp", 0), hidden=("inp", 1), num_splits=("split_sizes", 0)),
        present=dict(has_probs="probs"),
        element_bytes="inp",
    )
)
@cached
def sort_chunks_plan(
    *,
    num_rows: int,
    hidden: int,
    num_splits: int,
    element_bytes: int,
    has_probs: bool,
    backward: bool,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Inputs: "inp" [N, H], "split_sizes" [S], "sorted_indices" [S], "probs" [N] or None.
    Results: output [N, H], row_id_map [N] int32 (forward only; [0] in the backward), permuted_probs [N].
    `config["rows"]` is an upper bound: the [rows, S] compare tile stays within 4096 elements."""
    features = dict(num_rows=num_rows, hidden=hidden, num_splits=num_splits, element_bytes=element_bytes)
    cfg = autotune.resolve(
        SORT_CHUNKS_SPACE, dict(rows=4, block_bytes=8192, num_warps=8), config, features, device
    )
    buffers = {
        "output": Buffer((num_rows, hidden), "like:inp"),
        "row_id_map": Buffer.absent("int32") if backward else Buffer((num_rows,), "int32"),
        "permuted_probs": Buffer((num_rows,), "like:probs") if has_probs else Buffer.absent("float32"),
    }
    results = ("output", "row_id_map", "permuted_probs")
    if num_rows == 0:
        return Plan(buffers, (), results)
    splits_pow2 = next_pow2(num_splits)
    block_h = block_columns(hidden, cfg["block_bytes"] // element_bytes)
    rows = max(1, min(cfg["rows"], TILE_ELEMENTS // splits_pow2))
    rows = 1 << (rows.bit_length() - 1)
    launch = Launch(
        kernel=_sort_chunks_kernel,
        grid=(cdiv(num_rows, rows), column_programs(hidden, block_h)),
        args=(
            "inp",
            "split_sizes",
            "sorted_indices",
            "probs",
            num_rows,
            hidden,
            RowStride("inp", "INP_STRIDE_ALIGN"),
            num_splits,
        ),
        outputs=("output", "row_id_map", "permuted_probs"),
        constexprs=dict(
            ROWS=rows,
            BLOCK_H=block_h,
            SPLITS_POW2=splits_pow2,
            HAS_PROBS=has_probs,
            GATHER=backward,
            WRITE_MAP=not backward,
            HIDDEN_ALIGN=alignment(hidden),
        ),
        num_warps=cfg["num_warps"],
    )
    return Plan(buffers, (launch,), results)
