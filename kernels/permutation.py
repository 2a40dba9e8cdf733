"""Token permutation kernels (dispatch / combine) and their launch plans.

Symbols: T tokens, H hidden, E experts, S slots per token, N rows of the permuted buffer, A alignment.

Slots. A routing input gives every token S slots: a mask [T, E] has one slot per expert (slot e -> expert e);
an index map [T, K] has one slot per top-k position (slot k -> expert indices[t, k], -1 = none). Per-slot
tensors (probs, merging probs, their gradients) have the routing input's layout: [T, E] or [T, K].

Row map. `row_id_map` is int32 [T, 2S + 2] (`row_map_columns`), two lists and two counts per token.
Columns 0 .. S - 1 list the destination rows (padding applied) of the token's slots that have a row, in
ascending slot order, then -1; columns S .. 2S - 1 list those slots, in the same order, then -1. A slot has
no row when it is not routed or falls past the end of the buffer. Column 2S holds the number of listed
slots; column 2S + 1 holds `end`, the number of leading buffer rows that carry tokens or padding (the same
value on every token row, so each token shard can read it locally). The combine kernels walk the lists: a
step reads one row entry (and, independently, its slot where weights or probs need it), never a search over
S slots and never a chain of two dependent loads (TE's map is compact the same way). Rows are expert-major
and stable in (token, slot) order:
    row(t, s) = start[e] + #{(t', s') < (t, s) : expert(t', s') == e},    e = expert(t, s)
where start[e] is the exclusive prefix sum of the per-expert counts, each rounded up to A when padding.

Capacity. With a capacity C instead of padding, every expert owns exactly C rows (start[e] = e * C,
N = E * C): a slot keeps its row only when it is among the first C slots of its expert in (token, slot)
order, and the expert's unused rows are padding. The layout is static, e.g. for fixed-size all-to-all
exchanges.

Buffer rows that receive no token (padding and the tail past `end`) are written with zeros by extra "fill"
programs appended to the grid of the kernels that produce permuted buffers; nothing is pre-zeroed.

Token inputs ([T, H] and [N, H]) are read through a row stride (`RowStride` in the plans), so row-sliced views
reach the kernels without a copy; their columns are unit stride. Outputs are dense.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ._jit import _aligned, _as_bits, _bitmap_flags, block_columns, column_programs
from .rules.layout import buffer_rows, row_map_columns, row_map_slots
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

# Largest number of elements one program holds in a tile; keeps register use bounded for any E, K and H.
_TILE_ELEMENTS = 4096


@triton.jit
def _map_row(row_map_ptr, token, num_slots):
    """Pointer to token `token`'s row of a [T, 2S + 2] row map."""
    return row_map_ptr + token.to(tl.int64) * (2 * num_slots + 2)


@triton.jit
def _token_chunks(
    hidden, inp_stride, HIDDEN_ALIGN: tl.constexpr, INP_STRIDE_ALIGN: tl.constexpr, BLOCK_H: tl.constexpr
):
    """(H, the token input's row stride, both rebuilt with their alignment hints (`_aligned`), and the
    programs per token row: one per BLOCK_H columns, and one even when H = 0, since a token's first program
    also moves its per-slot data)."""
    hidden = _aligned(hidden, HIDDEN_ALIGN)
    inp_stride = _aligned(inp_stride, INP_STRIDE_ALIGN)
    return hidden, inp_stride, tl.maximum(tl.cdiv(hidden, BLOCK_H), 1)


@triton.jit
def _write_lists(map_row, rows, valid, slots, num_slots):
    """Columns 0 .. 2S of one token's row map (all but `end`): the rows of the `valid` slots and those
    slots, ascending, each list padded with -1, and their count. Every lane writes distinct addresses (a
    listed entry at its rank among the valid slots, a -1 at a position past the count), so no store races
    another."""
    flags = valid.to(tl.int32)
    count = tl.sum(flags, axis=0)
    rank = tl.cumsum(flags, axis=0) - flags
    tl.store(map_row + rank, rows, mask=valid)
    tl.store(map_row + num_slots + rank, slots, mask=valid)
    padding = (slots >= count) & (slots < num_slots)
    tl.store(map_row + slots, -1, mask=padding)
    tl.store(map_row + num_slots + slots, -1, mask=padding)
    tl.store(map_row + 2 * num_slots, count)


@triton.jit
def _listed_count(map_row, num_slots):
    """The token's count of listed slots (column 2S), clamped into [0, S]: a walk bounded by it never
    reads past the lists, whatever the map holds."""
    return tl.minimum(tl.maximum(tl.load(map_row + 2 * num_slots), 0), num_slots)


@triton.jit
def _listed_row(map_row, position, limit, num_rows):
    """(row, live) of the token's `position`-th listed slot; (-1, False) past the list, and nothing is read
    at or past `limit`. A listed row outside [0, num_rows) (the rows of the buffer it addresses) is not
    live: the entry is ignored, as an unlisted one (docs/design.md, "Index data is never trusted"). With
    limit = S the end is found from the list's -1 padding, so the first entries load while the count is
    still in flight (at large S the count and the lists lie in different cache lines): the combine walk
    does this. The combine backward, which was slower that way (same-GPU A/B, docs/history.md item 27),
    bounds its loads by the count."""
    row = tl.load(map_row + position, mask=position < limit, other=-1)
    return row.to(tl.int64), (row >= 0) & (row < num_rows)


@triton.jit
def _listed_slot(map_row, num_slots, position, limit, NEEDED: tl.constexpr = True):
    """The slot of the token's `position`-th listed entry; -1 past the list, and nothing is read at or past
    `limit` or when the caller does not NEED it. Bounded like the row and never masked by it, so its load
    (and the weight load behind it) does not wait for the row's. The value is not checked here: a slot
    outside [0, S) weighs 0 (`_slot_weight`) and matches no lane that is stored."""
    if NEEDED:
        slot = tl.load(map_row + num_slots + position, mask=position < limit, other=-1)
    else:
        slot = tl.full([], -1, tl.int32)
    return slot


@triton.jit
def _count_experts_kernel(
    routing_ptr,  # [T, S] mask (S == E), uint8 [T, ceil(E / 8)] bitmap of one (BITMAP) or expert ids (S == K)
    num_tokens,
    num_slots,
    num_experts,
    counts_ptr,  # [B, E] int32: routed slots per (token block, expert)
    ranks_ptr,  # [T, S] uint8 (masks) or int32 (ids): 1 + rank of the slot in its block and expert, 0: none
    IS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILE_T: tl.constexpr,
    TILE_S: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    GDC: tl.constexpr,
    BITMAP: tl.constexpr,
):
    """Per-block expert histograms and in-block ranks. Grid (B,): program b takes tokens
    [b*BLOCK_T, (b+1)*BLOCK_T), counts their slots per expert and ranks every routed slot among the
    block's earlier slots of its expert, in (token, slot) order.

    (Scalar arguments may arrive as constexprs: Triton specialises integers equal to 1. Kernels therefore
    widen the tensor side of an offset, never call methods on a scalar argument.)

    Masks: a running cumulative sum down each column of [TILE_T, TILE_S] tiles (ranks < BLOCK_T fit in a
    byte); with BITMAP the mask tile is read from the bitmap's bits in place (slot s: bit s % 8 of byte
    s // 8; bits at or past S = E are never read). Expert ids: CHUNK slots at a time, a slot's rank is the
    row sum of a [CHUNK, CHUNK] "same expert, earlier" matrix plus the chunk-start histogram `counts`, which
    one extra bin extends to absorb -1 (no expert) and every other id outside [0, E): such a slot has no
    expert (the index rule, docs/design.md).
    With GDC (programmatic dependent launch), the scan may be launched at once: it waits for this kernel.
    """
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    block = tl.program_id(0)
    first = block * BLOCK_T
    last = tl.minimum(first + BLOCK_T, num_tokens)
    if IS_MASK:
        for s0 in range(0, num_slots, TILE_S):
            slots = s0 + tl.arange(0, TILE_S)
            counts = tl.zeros([TILE_S], dtype=tl.int32)
            for t0 in range(first, last, TILE_T):
                tokens = t0 + tl.arange(0, TILE_T)
                ok = (tokens[:, None] < last) & (slots[None, :] < num_slots)
                offsets = tokens.to(tl.int64)[:, None] * num_slots + slots[None, :]
                if BITMAP:
                    routed = _bitmap_flags(routing_ptr, tokens, slots, (num_slots + 7) // 8, ok).to(tl.int32)
                else:
                    routed = (tl.load(_as_bits(routing_ptr) + offsets, mask=ok, other=0) != 0).to(tl.int32)
                ranks = tl.where(routed != 0, counts[None, :] + tl.cumsum(routed, axis=0), 0)
                tl.store(ranks_ptr + offsets, ranks.to(ranks_ptr.dtype.element_ty), mask=ok)
                counts += tl.sum(routed, axis=0)
            tl.store(counts_ptr + block * num_experts + slots, counts, mask=slots < num_slots)
    else:
        counts = tl.zeros([BINS], dtype=tl.int32)
        positions = tl.arange(0, CHUNK)
        earlier = positions[None, :] < positions[:, None]
        end = last.to(tl.int64) * num_slots
        for flat0 in range(first.to(tl.int64) * num_slots, end, CHUNK):
            flat = flat0 + positions
            ok = flat < end
            ids = tl.load(routing_ptr + flat, mask=ok, other=-1)
            # Compared in the ids' own dtype, narrowed after: an int64 id of 2**32 is out of range, not
            # expert 0. -1 and every id outside [0, E) land in bin num_experts, which is never stored.
            binned = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
            rank = tl.sum(((binned[:, None] == binned[None, :]) & earlier).to(tl.int32), axis=1)
            rank += tl.gather(counts, binned, 0)
            tl.store(ranks_ptr + flat, tl.where(binned < num_experts, rank + 1, 0), mask=ok)
            counts += tl.histogram(binned, BINS)
        bins = tl.arange(0, BINS)
        tl.store(counts_ptr + block * num_experts + bins, counts, mask=bins < num_experts)


@triton.jit
def _scan_counts_kernel(
    counts_ptr,  # [B, E] int32 from _count_experts_kernel
    num_blocks,
    num_experts,
    offsets_ptr,  # [B, E] int32: slots of expert e in blocks before b
    totals_ptr,  # [E] int32: slots of expert e in all blocks
    TILE_B: tl.constexpr,
    TILE_E: tl.constexpr,
    GDC: tl.constexpr,
):
    """Column scan of the block counts. Grid (cdiv(E, TILE_E),): program c walks down the B blocks for experts
    [c*TILE_E, (c+1)*TILE_E), writing exclusive prefix sums and column totals. O(B * E) work in all.
    With GDC it waits for the count kernel, then lets dispatch launch (dispatch waits for it in turn)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    experts = tl.program_id(0) * TILE_E + tl.arange(0, TILE_E)
    emask = experts < num_experts
    running = tl.zeros([TILE_E], dtype=tl.int32)
    for b0 in range(0, num_blocks, TILE_B):
        blocks = b0 + tl.arange(0, TILE_B)
        ok = (blocks[:, None] < num_blocks) & emask[None, :]
        offsets = blocks.to(tl.int64)[:, None] * num_experts + experts[None, :]
        counts = tl.load(counts_ptr + offsets, mask=ok, other=0)
        tl.store(offsets_ptr + offsets, tl.cumsum(counts, axis=0) - counts + running[None, :], mask=ok)
        running += tl.sum(counts, axis=0)
    tl.store(totals_ptr + experts, running, mask=emask)


@triton.jit
def _expert_layout(
    totals_ptr,
    num_experts,
    num_rows,
    align,
    capacity,
    EXPERTS_POW2: tl.constexpr,
    HAS_CAPACITY: tl.constexpr,
):
    """Where every expert's rows lie, from the slot totals: [EXPERTS_POW2] vectors of the experts, their slot
    counts, their padded counts, their first rows and the rows kept in the buffer, plus `end` (the rows
    holding tokens or padding). O(E) per call: cheap next to a token row, so each program derives it.
    With HAS_CAPACITY every expert's block is `capacity` rows, whatever its count."""
    experts = tl.arange(0, EXPERTS_POW2)
    total = tl.load(totals_ptr + experts, mask=experts < num_experts, other=0)
    if HAS_CAPACITY:
        padded = tl.where(experts < num_experts, tl.full([EXPERTS_POW2], capacity, tl.int32), 0)
    else:
        padded = tl.cdiv(total, align) * align
    start = tl.cumsum(padded, axis=0) - padded
    kept = tl.minimum(tl.maximum(num_rows - start, 0), padded)
    end = tl.minimum(tl.sum(padded, axis=0), num_rows)
    return experts, total, start, kept, end


@triton.jit
def _token_rows(
    routing_ptr,
    ranks_ptr,
    offsets_ptr,
    start,
    token,
    block,
    num_slots,
    num_experts,
    num_rows,
    capacity,
    slots,
    IS_MASK: tl.constexpr,
    HAS_CAPACITY: tl.constexpr,
):
    """Rows of one token's slots (-1: none): start[e] + the slot's rank in expert e, which is the block's
    offset for e (slots of e in earlier blocks, from the scan) + the slot's rank among the block's slots of e
    (from the count kernel). With HAS_CAPACITY, slots ranked `capacity` or later in their expert get none."""
    smask = slots < num_slots
    ranks = tl.load(ranks_ptr + token.to(tl.int64) * num_slots + slots, mask=smask, other=0).to(tl.int32)
    own = ranks != 0
    if IS_MASK:
        experts = slots
    else:
        ids = tl.load(routing_ptr + token.to(tl.int64) * num_slots + slots, mask=own, other=0)
        # Ranked slots had ids in range when counted; checked again (own dtype, then narrowed) so that no
        # address below is ever computed from an id outside [0, E).
        own = own & (ids >= 0) & (ids < num_experts)
        experts = tl.where(own, ids, 0).to(tl.int32)
        start = tl.gather(start, experts, 0)
    before = tl.load(offsets_ptr + block.to(tl.int64) * num_experts + experts, mask=own, other=0)
    rank = before + ranks - 1
    rows = start + rank
    keep = own & (rows < num_rows)
    if HAS_CAPACITY:
        keep = keep & (rank < capacity)
    return tl.where(keep, rows, -1)


@triton.jit
def _zero_rows(
    out_ptr,
    out_probs_ptr,
    out_scales_ptr,
    first,
    last,
    step,
    hidden,
    scale_cols,
    HAS_PROBS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCALES_POW2: tl.constexpr,
):
    """Zeroes rows first + i*step + [0, FILL_ROWS) (i = 0, 1, ...) below `last` of every permuted output."""
    for r0 in range(first, last, step):
        rows = r0 + tl.arange(0, FILL_ROWS)
        rmask = rows < last
        offsets = rows.to(tl.int64)[:, None] * hidden
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            tl.store(
                out_ptr + offsets + cols[None, :],
                tl.zeros([FILL_ROWS, BLOCK_H], out_ptr.dtype.element_ty),
                mask=rmask[:, None] & (cols[None, :] < hidden),
            )
        if HAS_PROBS:
            tl.store(out_probs_ptr + rows, tl.zeros([FILL_ROWS], out_probs_ptr.dtype.element_ty), mask=rmask)
        if HAS_SCALES:
            cols = tl.arange(0, SCALES_POW2)
            tl.store(
                out_scales_ptr + rows.to(tl.int64)[:, None] * scale_cols + cols[None, :],
                tl.zeros([FILL_ROWS, SCALES_POW2], out_scales_ptr.dtype.element_ty),
                mask=rmask[:, None] & (cols[None, :] < scale_cols),
            )


@triton.jit
def _zero_tail(
    out_ptr,
    row_map_ptr,
    fill,
    num_slots,
    num_rows,
    hidden,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Fill program `fill` of NUM_FILL zeroes its share of the rows [end, N) of `out_ptr` [N, H], with
    `end` read from the row map's last column (token 0) and clamped into [0, N]."""
    end = tl.minimum(tl.maximum(tl.load(row_map_ptr + 2 * num_slots + 1), 0), num_rows)
    _zero_rows(
        out_ptr,
        out_ptr,
        out_ptr,
        end + fill * FILL_ROWS,
        num_rows,
        NUM_FILL * FILL_ROWS,
        hidden,
        0,
        False,
        False,
        FILL_ROWS,
        BLOCK_H,
        1,
    )


@triton.jit
def _store_to_rows(out, values, rows, valid, hidden, cols, cmask, STREAMING: tl.constexpr):
    """Stores one token's column chunk `values` to each of its rows (`valid` entries of `rows`), in
    ascending row order; returns nothing. Rows of one token are distinct, so each is stored once."""
    previous = tl.full([], -1, tl.int32)
    for _ in range(tl.sum(valid.to(tl.int32), axis=0)):
        row = tl.min(tl.where(valid & (rows > previous), rows, 2147483647), axis=0)
        if STREAMING:
            tl.store(out + row.to(tl.int64) * hidden + cols, values, mask=cmask, cache_modifier=".cs")
        else:
            tl.store(out + row.to(tl.int64) * hidden + cols, values, mask=cmask)
        previous = row


@triton.jit
def _load_token_chunk(inp_ptr, token, row_stride, cols, cmask, STREAMING: tl.constexpr):
    """Columns `cols` of token row `token` (rows `row_stride` elements apart), as raw bits (evict-first when
    STREAMING: read once)."""
    if STREAMING:
        return tl.load(
            _as_bits(inp_ptr) + token.to(tl.int64) * row_stride + cols,
            mask=cmask,
            eviction_policy="evict_first",
        )
    return tl.load(_as_bits(inp_ptr) + token.to(tl.int64) * row_stride + cols, mask=cmask)


@triton.jit
def _dispatch_kernel(
    inp_ptr,  # [T, H] payload, moved as raw bits
    routing_ptr,  # [T, S] expert ids (read when not IS_MASK)
    ranks_ptr,  # [T, S] in-block ranks from _count_experts_kernel
    offsets_ptr,  # [B, E] int32 from _scan_counts_kernel
    totals_ptr,  # [E] int32 from _scan_counts_kernel
    probs_ptr,  # [T, S] (HAS_PROBS)
    scales_ptr,  # [T, C] row-wise scales (HAS_SCALES)
    num_tokens,
    hidden,
    inp_stride,  # row stride of inp
    num_slots,
    num_rows,
    num_experts,
    align,
    capacity,  # rows of every expert's block (HAS_CAPACITY)
    scale_cols,
    out_ptr,  # [N, H]
    out_probs_ptr,  # [N] (HAS_PROBS)
    out_scales_ptr,  # [N, C] (HAS_SCALES)
    row_map_ptr,  # [T, 2S + 2] int32
    tokens_per_expert_ptr,  # [E] int32
    pad_offsets_ptr,  # [E] int32
    IS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    SCALES_POW2: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    PADDED: tl.constexpr,
    HAS_CAPACITY: tl.constexpr,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    INP_STRIDE_ALIGN: tl.constexpr,
    STREAMING: tl.constexpr,
    GDC: tl.constexpr,
):
    """Assign rows and scatter tokens to them. Grid (T * cdiv(H, BLOCK_H) + NUM_FILL,).

    Token program (t, c) computes the rows of token t's slots (`_token_rows`, O(S) work: the row map needs
    no launch of its own, and is written here, not read back), loads columns [c*BLOCK_H,
    (c+1)*BLOCK_H) of token t once and stores them to each row; program (t, 0) also writes the token's
    row-map row and moves its probs and scales. The NUM_FILL programs after them zero the rows no token
    lands in (each expert's pad rows and the tail past `end`); fill program 0 writes the per-expert outputs.
    STREAMING marks the token rows evict-first and the row stores streaming (".cs"): each byte is touched
    once, so keeping it in L2 only displaces lines other programs still need (a knob: the autotuner decides).
    With GDC (programmatic dependent launch) programs may start while the scan runs: a token program loads
    its columns, then waits for the scan (and so for the count kernel) before it reads their outputs.
    """
    pid = tl.program_id(0)
    hidden, inp_stride, chunks = _token_chunks(hidden, inp_stride, HIDDEN_ALIGN, INP_STRIDE_ALIGN, BLOCK_H)
    token_programs = num_tokens * chunks
    if pid < token_programs:
        token = pid // chunks
        chunk = pid % chunks
        cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < hidden
        # The token rows are no output of the earlier launches: their load may overlap the scan (GDC).
        values = _load_token_chunk(inp_ptr, token, inp_stride, cols, cmask, STREAMING)
        if GDC:
            tl.extra.cuda.gdc_wait()
        _, _, start, _, end = _expert_layout(
            totals_ptr, num_experts, num_rows, align, capacity, EXPERTS_POW2, HAS_CAPACITY
        )
        slots = tl.arange(0, SLOTS_POW2)
        rows = _token_rows(
            routing_ptr,
            ranks_ptr,
            offsets_ptr,
            start,
            token,
            token // BLOCK_T,
            num_slots,
            num_experts,
            num_rows,
            capacity,
            slots,
            IS_MASK,
            HAS_CAPACITY,
        )
        valid = rows >= 0
        if chunk == 0:
            map_row = _map_row(row_map_ptr, token, num_slots)
            _write_lists(map_row, rows, valid, slots, num_slots)
            tl.store(map_row + 2 * num_slots + 1, end)
            if HAS_PROBS:
                probs = tl.load(_as_bits(probs_ptr) + token.to(tl.int64) * num_slots + slots, mask=valid)
                tl.store(_as_bits(out_probs_ptr) + rows, probs, mask=valid)
            if HAS_SCALES:
                scale_idx = tl.arange(0, SCALES_POW2)
                smask = scale_idx < scale_cols
                scales = tl.load(
                    _as_bits(scales_ptr) + token.to(tl.int64) * scale_cols + scale_idx, mask=smask
                )
                _store_to_rows(
                    _as_bits(out_scales_ptr), scales, rows, valid, scale_cols, scale_idx, smask, False
                )
        _store_to_rows(_as_bits(out_ptr), values, rows, valid, hidden, cols, cmask, STREAMING)
    else:
        if GDC:
            tl.extra.cuda.gdc_wait()
        experts, total, start, kept, end = _expert_layout(
            totals_ptr, num_experts, num_rows, align, capacity, EXPERTS_POW2, HAS_CAPACITY
        )
        fill = pid - token_programs
        if fill == 0:
            emask = experts < num_experts
            tl.store(tokens_per_expert_ptr + experts, kept, mask=emask)
            tl.store(pad_offsets_ptr + experts, start - (tl.cumsum(total, axis=0) - total), mask=emask)
        if PADDED:
            for expert in range(fill, num_experts, NUM_FILL):
                here = experts == expert
                _zero_rows(
                    _as_bits(out_ptr),
                    _as_bits(out_probs_ptr),
                    _as_bits(out_scales_ptr),
                    tl.sum(tl.where(here, start + tl.minimum(total, kept), 0), axis=0),
                    tl.sum(tl.where(here, start + kept, 0), axis=0),
                    FILL_ROWS,
                    hidden,
                    scale_cols,
                    HAS_PROBS,
                    HAS_SCALES,
                    FILL_ROWS,
                    BLOCK_H,
                    SCALES_POW2,
                )
        _zero_rows(
            _as_bits(out_ptr),
            _as_bits(out_probs_ptr),
            _as_bits(out_scales_ptr),
            end + fill * FILL_ROWS,
            num_rows,
            NUM_FILL * FILL_ROWS,
            hidden,
            scale_cols,
            HAS_PROBS,
            HAS_SCALES,
            FILL_ROWS,
            BLOCK_H,
            SCALES_POW2,
        )


@triton.jit
def _scatter_kernel(
    inp_ptr,  # [T, H] payload, moved as raw bits
    row_map_ptr,  # [T, 2S + 2] int32
    num_tokens,
    hidden,
    inp_stride,  # row stride of inp
    num_slots,
    num_rows,
    out_ptr,  # [N, H]
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    INP_STRIDE_ALIGN: tl.constexpr,
    STREAMING: tl.constexpr,
):
    """Scatter tokens through an existing row map (the backward of unweighted combine).
    Grid (T * cdiv(H, BLOCK_H) + NUM_FILL,): token program (t, c) stores columns [c*BLOCK_H, (c+1)*BLOCK_H)
    of token t to the row of each listed slot; the NUM_FILL programs after them zero the tail past `end`
    (NUM_FILL is 0 when the plan pre-zeroes the output)."""
    pid = tl.program_id(0)
    hidden, inp_stride, chunks = _token_chunks(hidden, inp_stride, HIDDEN_ALIGN, INP_STRIDE_ALIGN, BLOCK_H)
    token_programs = num_tokens * chunks
    if pid < token_programs:
        token = pid // chunks
        cols = (pid % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < hidden
        values = _load_token_chunk(inp_ptr, token, inp_stride, cols, cmask, STREAMING)
        map_row = _map_row(row_map_ptr, token, num_slots)
        count = _listed_count(map_row, num_slots)
        for position in range(count):
            row, live = _listed_row(map_row, position, count, num_rows)
            out = _as_bits(out_ptr) + row * hidden + cols
            # The live flag is made a vector first: the interpreter rejects a vector mask & a scalar one.
            mask = cmask & ((tl.zeros_like(cols) + live.to(tl.int32)) != 0)
            if STREAMING:
                tl.store(out, values, mask=mask, cache_modifier=".cs")
            else:
                tl.store(out, values, mask=mask)
    else:
        _zero_tail(
            _as_bits(out_ptr),
            row_map_ptr,
            pid - token_programs,
            num_slots,
            num_rows,
            hidden,
            NUM_FILL,
            FILL_ROWS,
            BLOCK_H,
        )


@triton.jit
def _slot_values(inp_ptr, row, live, inp_stride, cols, cmask, STREAMING: tl.constexpr):
    """Columns `cols` (`cmask`) of `row` when `live` (else zeros; nothing is read); evict-first when
    STREAMING (each row is read once)."""
    # The live flag is made a vector first: the interpreter rejects a vector mask & a scalar one.
    in_range = (tl.zeros_like(cols) + live.to(tl.int32)) != 0
    pointers = inp_ptr + row * inp_stride + cols
    if STREAMING:
        return tl.load(pointers, mask=cmask & in_range, other=0, eviction_policy="evict_first")
    return tl.load(pointers, mask=cmask & in_range, other=0)


@triton.jit
def _slot_weight(weight_row, slot, num_slots, acc_dtype: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    """w[t, slot] (0 for a slot outside [0, S), read from nothing), or 1 without weights."""
    if HAS_WEIGHTS:
        weight = tl.load(weight_row + slot, mask=(slot >= 0) & (slot < num_slots), other=0).to(acc_dtype)
    else:
        weight = tl.full([], 1, acc_dtype)
    return weight


@triton.jit
def _gather_prob(probs_bits, row, slot, live, slots, gathered, GATHER_PROBS: tl.constexpr):
    """`gathered` [SLOTS_POW2] with permuted_probs[row] (raw bits) placed at `slot` when `live`."""
    if GATHER_PROBS:
        prob = tl.load(probs_bits + row, mask=live, other=0)
        return tl.where(slots == slot, prob, gathered)
    return gathered


@triton.jit
def _combine_kernel(
    inp_ptr,  # [N, H] expert outputs
    row_map_ptr,  # [T, 2S + 2] int32
    weights_ptr,  # [T, S] merging probs (HAS_WEIGHTS)
    permuted_probs_ptr,  # [N] (GATHER_PROBS)
    num_tokens,
    hidden,
    inp_stride,  # row stride of inp
    num_slots,
    num_rows,  # N: listed rows outside [0, N) are ignored
    out_ptr,  # [T, H]
    out_probs_ptr,  # [T, S] (GATHER_PROBS)
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    GATHER_PROBS: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
    STREAMING: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    INP_STRIDE_ALIGN: tl.constexpr,
):
    """Gather-sum rows back to tokens. Grid (T * cdiv(H, BLOCK_H),).

    Program (t, c): acc = sum over the token's slots, in ascending slot order, of w[t, s] * inp[row(t, s)]
    (w = 1 without weights) on columns [c*BLOCK_H, (c+1)*BLOCK_H), accumulated in fp32 (fp64 for fp64 input)
    and stored in the input dtype. No atomics: every output element has one owner and a fixed order.
    With GATHER_PROBS, program (t, 0) also gathers permuted_probs[row(t, s)] into out_probs[t, s] (0 where
    the slot has no row), one scalar load per listed slot along the walk, and stores the [S] row once at
    the end: the probs gradient of dispatch.

    The walk follows the row map's lists (O(1) per step, whatever S) and is software-pipelined: a step
    issues the load of one row's values, then reads the next listed row (and slot) while that load is in
    flight; with LOOKAHEAD = 2 the values are loaded one step before they are
    added, so two row loads are in flight per program. The order of the additions never changes.
    STREAMING reads rows evict-first and stores the output streaming (a knob, as in `_dispatch_kernel`).
    """
    pid = tl.program_id(0)
    hidden, inp_stride, chunks = _token_chunks(hidden, inp_stride, HIDDEN_ALIGN, INP_STRIDE_ALIGN, BLOCK_H)
    token = pid // chunks
    chunk = pid % chunks
    acc_dtype: tl.constexpr = tl.float64 if inp_ptr.dtype.element_ty == tl.float64 else tl.float32
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    map_row = _map_row(row_map_ptr, token, num_slots)
    weight_row = weights_ptr + token.to(tl.int64) * num_slots
    # With GATHER_PROBS, program (t, 0) collects the probs of the listed slots as the walk reaches them.
    slots = tl.arange(0, SLOTS_POW2)
    probs_bits = _as_bits(permuted_probs_ptr)
    gathered = tl.zeros([SLOTS_POW2], dtype=probs_bits.dtype.element_ty)
    first_chunk = chunk == 0
    # Only weights and the probs gather need a listed entry's slot; a plain sum never reads the slot list.
    NEEDS_SLOT: tl.constexpr = HAS_WEIGHTS or GATHER_PROBS
    acc = tl.zeros([BLOCK_H], dtype=acc_dtype)
    # `position` is the list entry whose row the next load reads; (row, live, slot) are that entry's.
    position = tl.full([], 0, tl.int32)
    row, live = _listed_row(map_row, position, num_slots, num_rows)
    slot = _listed_slot(map_row, num_slots, position, num_slots, NEEDS_SLOT)
    count = _listed_count(map_row, num_slots)
    if LOOKAHEAD == 2:
        values = _slot_values(inp_ptr, row, live, inp_stride, cols, cmask, STREAMING)
        weight = _slot_weight(weight_row, slot, num_slots, acc_dtype, HAS_WEIGHTS)
        gathered = _gather_prob(probs_bits, row, slot, live & first_chunk, slots, gathered, GATHER_PROBS)
        position += 1
        row, live = _listed_row(map_row, position, num_slots, num_rows)
        slot = _listed_slot(map_row, num_slots, position, num_slots, NEEDS_SLOT)
    for _ in range(count):
        next_values = _slot_values(inp_ptr, row, live, inp_stride, cols, cmask, STREAMING)
        next_weight = _slot_weight(weight_row, slot, num_slots, acc_dtype, HAS_WEIGHTS)
        gathered = _gather_prob(probs_bits, row, slot, live & first_chunk, slots, gathered, GATHER_PROBS)
        position += 1
        row, live = _listed_row(map_row, position, num_slots, num_rows)
        slot = _listed_slot(map_row, num_slots, position, num_slots, NEEDS_SLOT)
        if LOOKAHEAD == 2:
            if HAS_WEIGHTS:
                acc += values.to(acc_dtype) * weight
            else:
                acc += values.to(acc_dtype)
            values = next_values
            weight = next_weight
        elif HAS_WEIGHTS:
            acc += next_values.to(acc_dtype) * next_weight
        else:
            acc += next_values.to(acc_dtype)
    out = out_ptr + token.to(tl.int64) * hidden + cols
    if STREAMING:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cmask, cache_modifier=".cs")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cmask)
    if GATHER_PROBS:
        # The chunk flag is made a vector first (the interpreter rejects a vector mask & a scalar one).
        here = (tl.zeros_like(slots) + first_chunk.to(tl.int32)) != 0
        probs_out = _as_bits(out_probs_ptr) + token.to(tl.int64) * num_slots + slots
        tl.store(probs_out, gathered, mask=(slots < num_slots) & here)


@triton.jit
def _combine_backward_kernel(
    grad_ptr,  # [T, H] gradient of the combine output
    row_map_ptr,  # [T, 2S + 2] int32
    inp_ptr,  # [N, H] combine input (expert outputs)
    weights_ptr,  # [T, S] merging probs
    num_tokens,
    hidden,
    grad_stride,  # row stride of grad
    inp_stride,  # row stride of inp
    num_slots,
    num_rows,
    grad_inp_ptr,  # [N, H]
    grad_weights_ptr,  # [T, S]
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    GRAD_STRIDE_ALIGN: tl.constexpr,
    INP_STRIDE_ALIGN: tl.constexpr,
    STREAMING: tl.constexpr,
    STEP: tl.constexpr,
):
    """Backward of weighted combine. Grid (T + NUM_FILL,).

    Token program t walks its listed slots (ascending), STEP of them at a time, and for each the whole hidden
    dimension: grad_inp[row] = g[t] * w[t, s] (computed in fp32, stored in the input dtype) and
    grad_weights[t, s] = sum_h inp[row, h] * g[t, h] (fp32); slots without a row get weight gradient 0.
    Fill programs zero the tail rows [end, N); with padding the plan pre-zeroes grad_inp instead.
    STEP > 1 keeps that many rows' loads in flight per program and reads each chunk of g[t] once for them
    (a tuning knob). STREAMING reads the forward input evict-first and stores grad_inp streaming (each
    touched once); the gradient row g[t] stays cacheable (a tuning knob, as in `_dispatch_kernel`).
    """
    pid = tl.program_id(0)
    hidden = _aligned(hidden, HIDDEN_ALIGN)
    grad_stride = _aligned(grad_stride, GRAD_STRIDE_ALIGN)
    inp_stride = _aligned(inp_stride, INP_STRIDE_ALIGN)
    if pid < num_tokens:
        token = pid
        acc_dtype: tl.constexpr = tl.float64 if inp_ptr.dtype.element_ty == tl.float64 else tl.float32
        map_row = _map_row(row_map_ptr, token, num_slots)
        slots = tl.arange(0, SLOTS_POW2)
        smask = slots < num_slots
        steps = tl.arange(0, STEP)
        grad_row = grad_ptr + token.to(tl.int64) * grad_stride
        weight_grads = tl.zeros([SLOTS_POW2], dtype=acc_dtype)
        weight_row = weights_ptr + token.to(tl.int64) * num_slots
        count = _listed_count(map_row, num_slots)
        # The next STEP listed entries' rows, slots and weights are read while the current ones' rows move.
        rows, live = _listed_row(map_row, steps, count, num_rows)  # [STEP]
        slot_ids = _listed_slot(map_row, num_slots, steps, count)
        weights = _slot_weight(weight_row, slot_ids, num_slots, acc_dtype, True)
        for position in range(0, count, STEP):
            next_rows, next_live = _listed_row(map_row, position + STEP + steps, count, num_rows)
            next_slot_ids = _listed_slot(map_row, num_slots, position + STEP + steps, count)
            next_weights = _slot_weight(weight_row, next_slot_ids, num_slots, acc_dtype, True)
            dot = tl.zeros([STEP, BLOCK_H], dtype=acc_dtype)
            for h0 in range(0, hidden, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                cmask = cols < hidden
                tile_mask = live[:, None] & cmask[None, :]  # [STEP, BLOCK_H]
                grad = tl.load(grad_row + cols, mask=cmask, other=0).to(acc_dtype)[None, :]
                scaled = (grad * weights[:, None]).to(grad_inp_ptr.dtype.element_ty)
                inp_tile = inp_ptr + rows[:, None] * inp_stride + cols[None, :]
                out_tile = grad_inp_ptr + rows[:, None] * hidden + cols[None, :]
                if STREAMING:
                    values = tl.load(inp_tile, mask=tile_mask, other=0, eviction_policy="evict_first")
                    tl.store(out_tile, scaled, mask=tile_mask, cache_modifier=".cs")
                else:
                    values = tl.load(inp_tile, mask=tile_mask, other=0)
                    tl.store(out_tile, scaled, mask=tile_mask)
                dot += values.to(acc_dtype) * grad
            sums = tl.sum(dot, axis=1)  # [STEP]
            # Listed slots are distinct and an unlisted entry's slot (-1) matches none.
            hits = slots[None, :] == slot_ids[:, None]  # [STEP, SLOTS_POW2]
            weight_grads += tl.sum(tl.where(hits, sums[:, None], 0), axis=0)
            rows, live, slot_ids, weights = next_rows, next_live, next_slot_ids, next_weights
        tl.store(
            grad_weights_ptr + token.to(tl.int64) * num_slots + slots,
            weight_grads.to(grad_weights_ptr.dtype.element_ty),
            mask=smask,
        )
    else:
        _zero_tail(
            grad_inp_ptr,
            row_map_ptr,
            pid - num_tokens,
            num_slots,
            num_rows,
            hidden,
            NUM_FILL,
            FILL_ROWS,
            BLOCK_H,
        )


# ----------------------------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------------------------


# The token blocks of the counts and in-block ranks (at most 128 tokens: mask ranks are stored as bytes) and
# the warps of the count and scan launches.
ROW_MAP_SPACE = SearchSpace("row_map", {"block_tokens": (16, 32, 64, 128), "num_warps": (4, 8)})
DISPATCH_SPACE = SearchSpace(
    "dispatch", {"block_bytes": (2048, 4096, 8192, 16384), "num_warps": (4, 8, 16), "streaming": (0, 1)}
)
COMBINE_SPACE = SearchSpace(
    "combine",
    {"block_h": (512, 1024, 2048, 4096), "num_warps": (2, 4, 8), "lookahead": (1, 2), "streaming": (0, 1)},
)
COMBINE_BACKWARD_SPACE = SearchSpace(
    "combine_backward",
    {"block_h": (512, 1024, 2048, 4096), "num_warps": (2, 4, 8), "streaming": (0, 1), "step": (1, 2, 4)},
)


def _warps_for(block_bytes: int) -> int:
    """Heuristic warps: one 16-byte vector per thread per row chunk, 4 to 8 warps."""
    return min(8, max(4, next_pow2(block_bytes // 512)))


def _num_fill(device: DeviceInfo, padded: bool, num_experts: int) -> int:
    # Padded buffers spread one expert's pad rows per program; unpadded ones only ever zero a tail.
    return min(max(num_experts, device.num_sms), 1024) if padded else device.num_sms


def expert_count_plan(
    *,
    num_tokens: int,
    num_slots: int,
    num_experts: int,
    is_mask: bool,
    routing_map_format: str = "bytemap",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> tuple[dict[str, Buffer], tuple[Launch, ...], int]:
    """The first two of dispatch's three launches: per-block expert histograms and in-block ranks of the
    routing input ("routing" -> "block_counts" [B, E], "block_ranks" [T, S]), then the column scan of the
    histograms into "block_offsets" [B, E] and "expert_totals" [E]; returns the buffers, the launches and
    block_tokens (B = T / block_tokens). O(T * S + B * E) work: linear in T * E. A mask given as a bitmap
    (routing_map_format "bitmap": uint8 [T, ceil(E / 8)], S = E) is read bit by bit in the count kernel;
    its config is the mask's (same features)."""
    heuristic_block = min(64, max(16, next_pow2(cdiv(num_tokens, 4 * device.num_sms))))
    features = dict(num_tokens=num_tokens, num_slots=num_slots, num_experts=num_experts, is_mask=int(is_mask))
    cfg = autotune.resolve(
        ROW_MAP_SPACE, dict(block_tokens=heuristic_block, num_warps=4), config, features, device
    )
    block_t = cfg["block_tokens"]
    if is_mask and block_t > 255:
        raise ValueError(f"row_map: block_tokens={block_t} exceeds 255 (mask ranks are stored as bytes)")
    num_blocks = cdiv(num_tokens, block_t)
    buffers = {
        "block_counts": Buffer((num_blocks, num_experts), "int32"),
        "block_ranks": Buffer((num_tokens, num_slots), "uint8" if is_mask else "int32"),
        "block_offsets": Buffer((num_blocks, num_experts), "int32"),
        "expert_totals": Buffer((num_experts,), "int32"),
    }
    if is_mask:
        tile_s = min(next_pow2(num_slots), 256)
        tiles = dict(TILE_T=max(1, min(block_t, _TILE_ELEMENTS // tile_s)), TILE_S=tile_s, BINS=1, CHUNK=1)
    else:
        tiles = dict(TILE_T=1, TILE_S=1, BINS=next_pow2(num_experts + 1), CHUNK=64)
    # Narrow expert tiles and tall block tiles: many scan programs, each only a few steps long.
    tile_e = min(next_pow2(num_experts), 16)
    # With no tokens the count launch has no programs: the scan alone writes zero totals.
    count = Launch(
        kernel=_count_experts_kernel,
        grid=(num_blocks,),
        args=("routing", num_tokens, num_slots, num_experts),
        outputs=("block_counts", "block_ranks"),
        constexprs=dict(
            IS_MASK=is_mask, BLOCK_T=block_t, **tiles, GDC=device.pdl, BITMAP=routing_map_format == "bitmap"
        ),
        num_warps=cfg["num_warps"],
    )
    scan = Launch(
        kernel=_scan_counts_kernel,
        grid=(cdiv(num_experts, tile_e),),
        args=("block_counts", num_blocks, num_experts),
        outputs=("block_offsets", "expert_totals"),
        constexprs=dict(TILE_B=max(1, _TILE_ELEMENTS // tile_e), TILE_E=tile_e, GDC=device.pdl),
        num_warps=cfg["num_warps"],
        pdl=device.pdl,
    )
    return buffers, (count, scan) if num_blocks else (scan,), block_t


def _data_config(hidden: int, num_slots: int, element_bytes: int, num_tokens: int, device, config):
    """A dispatch-space config (block bytes, warps, streaming) and the columns per program it gives."""
    features = dict(num_tokens=num_tokens, hidden=hidden, num_slots=num_slots, element_bytes=element_bytes)
    block_h = block_columns(hidden, 16384 // element_bytes)
    heuristic = dict(block_bytes=16384, num_warps=_warps_for(block_h * element_bytes), streaming=0)
    cfg = autotune.resolve(DISPATCH_SPACE, heuristic, config, features, device)
    return cfg, block_columns(hidden, cfg["block_bytes"] // element_bytes)


#: The sizes every op reading a row map takes from it: T its rows, S the slots its columns list.
_ROW_MAP_AXES = dict(num_tokens=("row_id_map", 0), num_slots=("row_id_map", 1, row_map_slots))


def _routing_slots(routing_columns, num_experts, routing_map_format: str):
    """S, the slots per token of a dispatch's routing input with `routing_columns` columns: its width, but
    for a bitmap (uint8 [T, ceil(E / 8)]) the E experts whose bits it packs."""
    return num_experts if routing_map_format == "bitmap" else routing_columns


@sized_by(
    Sizes(
        axes=dict(
            num_tokens=("inp", 0), hidden=("inp", 1), num_slots=("routing", 1), scale_cols=("scales", 1)
        ),
        present=dict(has_probs="probs"),
        element_bytes="inp",
    )
)
@cached
def dispatch_plan(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    num_experts: int,
    is_mask: bool,
    num_out_tokens: int | None,
    element_bytes: int,
    has_probs: bool,
    scale_cols: int | None,
    align_size: int | None = None,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, Mapping[str, int]] | None = None,
) -> Plan:
    """token_dispatch in three launches: expert histograms per token block, their scan, then one kernel that
    assigns every slot its row (writing the row map) and scatters tokens, probs and scales there.
    With `capacity` (instead of `num_out_tokens` and `align_size`) every expert owns `capacity` rows.

    Inputs: "inp" [T, H], "routing" [T, S], "probs" [T, S] or None, "scales" [T, C] or None. `num_slots`
    is the routing input's width: S, except for a mask given as a bitmap (is_mask, routing_map_format
    "bitmap": "routing" uint8 [T, ceil(E / 8)], bit e % 8 of byte e // 8), whose S = E slots are its bits.
    Results: output [N, H], permuted_probs [N], permuted_scales [N, C], row_id_map [T, 2S + 2],
    pad_offsets [E], tokens_per_expert [E] (rows per expert in the buffer, padding included); probs,
    scales and pad offsets are placeholders (Buffer.placeholder) without probs, scales and padding.
    `config` maps "row_map" (the token blocks of the counts and ranks) / "dispatch" to configs from their
    search spaces (defaults: the autotune cache, else heuristics).
    """
    config = config or {}
    num_rows = buffer_rows(num_out_tokens, num_experts, align_size, capacity)
    padded = align_size is not None or capacity is not None
    outputs = dispatch_outputs(
        num_tokens=num_tokens,
        hidden=hidden,
        num_slots=num_slots,
        num_experts=num_experts,
        num_out_tokens=num_out_tokens,
        align_size=align_size,
        capacity=capacity,
        has_probs=has_probs,
        scale_cols=scale_cols,
        routing_map_format=routing_map_format,
    )
    num_slots = _routing_slots(num_slots, num_experts, routing_map_format)
    buffers, launches, block_t = expert_count_plan(
        num_tokens=num_tokens,
        num_slots=num_slots,
        num_experts=num_experts,
        is_mask=is_mask,
        routing_map_format=routing_map_format,
        device=device,
        config=config.get("row_map"),
    )
    has_scales = scale_cols is not None
    buffers.update(outputs)
    # Unpadded, the pad offsets (all zero) are not a result: the kernel writes them to scratch.
    offsets = "pad_offsets" if padded else "unpadded_offsets"
    if not padded:
        buffers[offsets] = Buffer((num_experts,), "int32")
    cfg, block_h = _data_config(hidden, num_slots, element_bytes, num_tokens, device, config.get("dispatch"))
    slots_pow2 = next_pow2(num_slots)
    num_fill = _num_fill(device, padded, num_experts)
    launches += (
        Launch(
            kernel=_dispatch_kernel,
            grid=(num_tokens * column_programs(hidden, block_h) + num_fill,),
            args=(
                "inp",
                "routing",
                "block_ranks",
                "block_offsets",
                "expert_totals",
                "probs",
                "scales",
                num_tokens,
                hidden,
                RowStride("inp", "INP_STRIDE_ALIGN"),
                num_slots,
                num_rows,
                num_experts,
                align_size or 1,
                capacity or 0,
                scale_cols or 0,
            ),
            outputs=(
                "output",
                "permuted_probs",
                "permuted_scales",
                "row_id_map",
                "tokens_per_expert",
                offsets,
            ),
            constexprs=dict(
                IS_MASK=is_mask,
                BLOCK_T=block_t,
                BLOCK_H=block_h,
                SLOTS_POW2=slots_pow2,
                EXPERTS_POW2=next_pow2(num_experts),
                SCALES_POW2=next_pow2(max(scale_cols or 0, 1)),
                HAS_PROBS=has_probs,
                HAS_SCALES=has_scales,
                PADDED=padded,
                HAS_CAPACITY=capacity is not None,
                NUM_FILL=num_fill,
                FILL_ROWS=4,
                HIDDEN_ALIGN=alignment(hidden),
                STREAMING=bool(cfg["streaming"]),
                GDC=device.pdl,
            ),
            num_warps=cfg["num_warps"],
            pdl=device.pdl,
        ),
    )
    return Plan(buffers, launches, tuple(outputs))


def dispatch_outputs(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    num_experts: int,
    num_out_tokens: int | None,
    align_size: int | None,
    capacity: int | None,
    has_probs: bool,
    scale_cols: int | None,
    routing_map_format: str = "bytemap",
) -> dict[str, Buffer]:
    """dispatch_plan's results, in order: output, permuted_probs, permuted_scales, row_id_map, pad_offsets,
    tokens_per_expert. Shape arithmetic only, with no branch on any size, so that symbolic sizes
    (torch.compile, a data-dependent expert count) pass through it unguarded. The dispatch kernel writes
    every element (its fill programs run even when T = 0), so nothing starts zeroed. `num_slots` is the
    routing input's width, as in dispatch_plan."""
    num_rows = buffer_rows(num_out_tokens, num_experts, align_size, capacity)
    num_slots = _routing_slots(num_slots, num_experts, routing_map_format)
    has_scales = scale_cols is not None
    return dict(
        output=Buffer((num_rows, hidden), "like:inp"),
        permuted_probs=Buffer((num_rows,), "like:probs") if has_probs else Buffer.absent("float32"),
        permuted_scales=(
            Buffer((num_rows, scale_cols), "like:scales") if has_scales else Buffer.absent("float32")
        ),
        row_id_map=Buffer((num_tokens, row_map_columns(num_slots)), "int32"),
        pad_offsets=(
            Buffer((num_experts,), "int32")
            if align_size is not None or capacity is not None
            else Buffer.absent("int32")
        ),
        tokens_per_expert=Buffer((num_experts,), "int32"),
    )


def _mapped_rows_constexprs(block_h: int, num_slots: int, num_fill: int, hidden: int, streaming: int) -> dict:
    """Constexprs of the kernels that write token rows through an existing row map and zero its tail."""
    return dict(
        BLOCK_H=block_h,
        SLOTS_POW2=next_pow2(num_slots),
        NUM_FILL=max(num_fill, 1),
        FILL_ROWS=4,
        HIDDEN_ALIGN=alignment(hidden),
        STREAMING=bool(streaming),
    )


@sized_by(Sizes(axes=dict(_ROW_MAP_AXES, hidden=("grad", 1)), element_bytes="grad"))
@cached
def scatter_plan(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    num_rows: int,
    padded: bool,
    element_bytes: int,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Backward of unweighted combine: "grad" [T, H] scattered to "grad_input" [N, H] through "row_id_map".

    Without padding, fill programs zero the tail past `end`; with padding the output starts zeroed, since
    the pad rows' positions are not recorded in the row map. `config`: a "dispatch" config (the same
    loads and stores as dispatch's data movement).
    """
    empty = num_tokens == 0
    buffers = {"grad_input": Buffer((num_rows, hidden), "like:grad", zero=padded or empty)}
    if empty:
        return Plan(buffers, (), ("grad_input",))
    cfg, block_h = _data_config(hidden, num_slots, element_bytes, num_tokens, device, config)
    num_fill = 0 if padded else _num_fill(device, False, 0)
    launch = Launch(
        kernel=_scatter_kernel,
        grid=(num_tokens * column_programs(hidden, block_h) + num_fill,),
        args=(
            "grad",
            "row_id_map",
            num_tokens,
            hidden,
            RowStride("grad", "INP_STRIDE_ALIGN"),
            num_slots,
            num_rows,
        ),
        outputs=("grad_input",),
        constexprs=_mapped_rows_constexprs(block_h, num_slots, num_fill, hidden, cfg["streaming"]),
        num_warps=cfg["num_warps"],
    )
    return Plan(buffers, (launch,), ("grad_input",))


@sized_by(
    Sizes(
        axes=dict(_ROW_MAP_AXES, hidden=("inp", 1), num_rows=("inp", 0)),
        present=dict(has_weights="weights", gather_probs="permuted_probs"),
        element_bytes="inp",
        dtypes=dict(probs_dtype="permuted_probs"),
    )
)
@cached
def combine_plan(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    num_rows: int,
    element_bytes: int,
    has_weights: bool,
    gather_probs: bool,
    probs_dtype: str = "float32",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """token_combine (and the backward of dispatch).

    Inputs: "inp" [N, H] (N = num_rows), "row_id_map", "weights" [T, S] or None, "permuted_probs" [N] or
    None. Listed rows outside [0, N) add nothing.
    Results: output [T, H] and, with `gather_probs`, probs [T, S] (dtype `probs_dtype`).
    """
    # Weighted (combine) and unweighted (dispatch backward) sums, the latter with and without the probs
    # gather, are tuned apart: their best configs differ (the gather adds a load and registers per step).
    features = dict(
        num_tokens=num_tokens,
        hidden=hidden,
        num_slots=num_slots,
        element_bytes=element_bytes,
        weighted=int(has_weights),
        gather=int(gather_probs),
    )
    # Many slots per token: a deeper pipeline keeps more row loads in flight (the autotuner agrees).
    lookahead = 2 if num_slots > 8 else 1
    heuristic = dict(block_h=4096, num_warps=4, lookahead=lookahead, streaming=0)
    cfg = autotune.resolve(COMBINE_SPACE, heuristic, config, features, device)
    buffers = {
        "output": Buffer((num_tokens, hidden), "like:inp"),
        "probs": Buffer((num_tokens, num_slots), probs_dtype) if gather_probs else Buffer.absent(probs_dtype),
    }
    if num_tokens == 0:
        return Plan(buffers, (), ("output", "probs"))
    block_h = block_columns(hidden, cfg["block_h"])
    launch = Launch(
        kernel=_combine_kernel,
        grid=(num_tokens * column_programs(hidden, block_h),),
        args=(
            "inp",
            "row_id_map",
            "weights",
            "permuted_probs",
            num_tokens,
            hidden,
            RowStride("inp", "INP_STRIDE_ALIGN"),
            num_slots,
            num_rows,
        ),
        outputs=("output", "probs"),
        constexprs=dict(
            BLOCK_H=block_h,
            SLOTS_POW2=next_pow2(num_slots),
            HAS_WEIGHTS=has_weights,
            GATHER_PROBS=gather_probs,
            LOOKAHEAD=cfg["lookahead"],
            STREAMING=bool(cfg["streaming"]),
            HIDDEN_ALIGN=alignment(hidden),
        ),
        num_warps=cfg["num_warps"],
        fp_fusion=False,
    )
    return Plan(buffers, (launch,), ("output", "probs"))


@sized_by(
    Sizes(
        axes=dict(_ROW_MAP_AXES, hidden=("grad", 1), num_rows=("inp", 0)),
        element_bytes="inp",
    )
)
@cached
def combine_backward_plan(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    num_rows: int,
    padded: bool,
    element_bytes: int,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Backward of weighted combine.

    Inputs: "grad" [T, H], "row_id_map", "inp" [N, H] (forward input), "weights" [T, S].
    Results: grad_input [N, H] (zero on rows no token owns), grad_weights [T, S] (dtype of weights).
    """
    features = dict(num_tokens=num_tokens, hidden=hidden, num_slots=num_slots, element_bytes=element_bytes)
    heuristic = dict(
        block_h=2048, num_warps=_warps_for(block_columns(hidden, 2048) * element_bytes), streaming=0, step=1
    )
    cfg = autotune.resolve(COMBINE_BACKWARD_SPACE, heuristic, config, features, device)
    empty = num_tokens == 0
    buffers = {
        "grad_input": Buffer((num_rows, hidden), "like:inp", zero=padded or empty),
        "grad_weights": Buffer((num_tokens, num_slots), "like:weights"),
    }
    if empty:
        return Plan(buffers, (), ("grad_input", "grad_weights"))
    block_h = block_columns(hidden, cfg["block_h"])
    num_fill = 0 if padded else _num_fill(device, False, 0)
    launch = Launch(
        kernel=_combine_backward_kernel,
        grid=(num_tokens + num_fill,),
        args=(
            "grad",
            "row_id_map",
            "inp",
            "weights",
            num_tokens,
            hidden,
            RowStride("grad", "GRAD_STRIDE_ALIGN"),
            RowStride("inp", "INP_STRIDE_ALIGN"),
            num_slots,
            num_rows,
        ),
        outputs=("grad_input", "grad_weights"),
        constexprs=dict(
            _mapped_rows_constexprs(block_h, num_slots, num_fill, hidden, cfg["streaming"]), STEP=cfg["step"]
        ),
        num_warps=cfg["num_warps"],
        fp_fusion=False,
    )
    return Plan(buffers, (launch,), ("grad_input", "grad_weights"))
