"""The row map: how dispatch assigns every routed slot its row (expert histograms per token block, their
scan, each slot's row from both), how a token's row-map row is written and read, and the fill programs that
zero the rows no token lands in. Kernels and plans of the first two dispatch launches; jit helpers and plan
arithmetic the dispatch and combine kernels share. The format is the package docstring's."""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from .._jit import TILE_ELEMENTS, _aligned, _as_bits, _bitmap_flags
from ..rules.layout import row_map_slots
from ..runtime import autotune
from ..runtime.plan import DEFAULT_DEVICE, Buffer, DeviceInfo, Launch, SearchSpace, alignment, cdiv, next_pow2


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
    does this. The combine backward, which measured slower that way in a same-GPU A/B, bounds its loads
    by the count."""
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


# The token blocks of the counts and in-block ranks (at most 128 tokens: mask ranks are stored as bytes) and
# the warps of the count and scan launches.
ROW_MAP_SPACE = SearchSpace("row_map", {"block_tokens": (16, 32, 64, 128), "num_warps": (4, 8)})


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
        tiles = dict(TILE_T=max(1, min(block_t, TILE_ELEMENTS // tile_s)), TILE_S=tile_s, BINS=1, CHUNK=1)
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
        constexprs=dict(TILE_B=max(1, TILE_ELEMENTS // tile_e), TILE_E=tile_e, GDC=device.pdl),
        num_warps=cfg["num_warps"],
        pdl=device.pdl,
    )
    return buffers, (count, scan) if num_blocks else (scan,), block_t


#: The sizes every op reading a row map takes from it: T its rows, S the slots its columns list.
_ROW_MAP_AXES = dict(num_tokens=("row_id_map", 0), num_slots=("row_id_map", 1, row_map_slots))


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
