"""Token permutation kernels (dispatch / combine) and their launch plans.

Symbols: T tokens, H hidden, E experts, S slots per token, N rows of the permuted buffer, A alignment.

Slots. A routing input gives every token S slots: a mask [T, E] has one slot per expert (slot e -> expert e);
an index map [T, K] has one slot per top-k position (slot k -> expert indices[t, k], -1 = none). Per-slot
tensors (probs, merging probs, their gradients) have the routing input's layout: [T, E] or [T, K].

Row map. `row_id_map` is int32 [T, S + 1]: column s holds the destination row of slot s (padding applied),
or -1 when the slot has no row (not routed, or past the end of the buffer); column S holds `end`, the number
of leading buffer rows that carry tokens or padding (the same value on every token row, so each token shard
can read it locally). Rows are expert-major and stable in (token, slot) order:
    row(t, s) = start[e] + #{(t', s') < (t, s) : expert(t', s') == e},    e = expert(t, s)
where start[e] is the exclusive prefix sum of the per-expert counts, each rounded up to A when padding.

Buffer rows that receive no token (padding and the tail past `end`) are written with zeros by extra "fill"
programs appended to the grid of the kernels that produce permuted buffers; nothing is pre-zeroed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import triton
import triton.language as tl

from . import autotune
from ._plan import DEFAULT_DEVICE, Buffer, DeviceInfo, Launch, Plan, SearchSpace, cdiv, next_pow2

# Largest number of elements one program holds in a tile; keeps register use bounded for any E, K and H.
_TILE_ELEMENTS = 4096


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
def _aligned(value, ALIGN: tl.constexpr):
    """`value` rebuilt as a multiple of ALIGN, so that the compiler knows its divisibility (the plan sets
    ALIGN to a power of two dividing `value`). PyTorch's launcher tells Triton which integer arguments are
    multiples of 16; jax-triton does not, and without the hint the row addresses `row * hidden + cols` and the
    masks `cols < hidden` do not vectorise (the JAX combine ran 2.3x slower than the same kernel from
    PyTorch on the H100)."""
    return value // ALIGN * ALIGN


@triton.jit
def _count_experts_kernel(
    routing_ptr,  # [T, S] mask (S == E) or expert ids (S == K)
    num_tokens,
    num_slots,
    num_experts,
    counts_ptr,  # [B, E] int32: routed slots per (token block, expert)
    IS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILE_T: tl.constexpr,
    TILE_S: tl.constexpr,
    BINS: tl.constexpr,
):
    """Per-block expert histogram. Grid (B,): program b counts the slots of tokens [b*BLOCK_T, (b+1)*BLOCK_T).

    (Scalar arguments may arrive as constexprs: Triton specialises integers equal to 1. Kernels therefore
    widen the tensor side of an offset, never call methods on a scalar argument.)

    Masks are summed column by column in [TILE_T, TILE_S] tiles; expert ids go through `tl.histogram` with
    one extra bin that absorbs -1 (no expert). Index ranges are checked by a device assertion, compiled in
    only when the binding asks for checks.
    """
    block = tl.program_id(0)
    first = block * BLOCK_T
    last = tl.minimum(first + BLOCK_T, num_tokens)
    if IS_MASK:
        for s0 in range(0, num_slots, TILE_S):
            slots = s0 + tl.arange(0, TILE_S)
            acc = tl.zeros([TILE_S], dtype=tl.int32)
            for t0 in range(first, last, TILE_T):
                tokens = t0 + tl.arange(0, TILE_T)
                ok = (tokens[:, None] < last) & (slots[None, :] < num_slots)
                routed = tl.load(
                    _as_bits(routing_ptr) + tokens.to(tl.int64)[:, None] * num_slots + slots[None, :],
                    mask=ok,
                    other=0,
                )
                acc += tl.sum((routed != 0).to(tl.int32), axis=0)
            tl.store(counts_ptr + block * num_experts + slots, acc, mask=slots < num_slots)
    else:
        acc = tl.zeros([BINS], dtype=tl.int32)
        for t0 in range(first, last, TILE_T):
            tokens = t0 + tl.arange(0, TILE_T)
            slots = tl.arange(0, TILE_S)
            ok = (tokens[:, None] < last) & (slots[None, :] < num_slots)
            ids = tl.load(
                routing_ptr + tokens.to(tl.int64)[:, None] * num_slots + slots[None, :], mask=ok, other=-1
            )
            ids = ids.to(tl.int32)
            tl.device_assert((ids >= -1) & (ids < num_experts), "indices must lie in [-1, num_experts)")
            # -1 (and anything out of range) lands in bin num_experts, which is never stored.
            binned = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)
            acc += tl.histogram(tl.reshape(binned, [TILE_T * TILE_S]), BINS)
        bins = tl.arange(0, BINS)
        tl.store(counts_ptr + block * num_experts + bins, acc, mask=bins < num_experts)


@triton.jit
def _scan_counts_kernel(
    counts_ptr,  # [B, E] int32 from _count_experts_kernel
    num_blocks,
    num_experts,
    offsets_ptr,  # [B, E] int32: slots of expert e in blocks before b
    totals_ptr,  # [E] int32: slots of expert e in all blocks
    TILE_B: tl.constexpr,
    TILE_E: tl.constexpr,
):
    """Column scan of the block counts. Grid (cdiv(E, TILE_E),): program c walks down the B blocks for experts
    [c*TILE_E, (c+1)*TILE_E), writing exclusive prefix sums and column totals. O(B * E) work in all."""
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
    totals_ptr, offsets_ptr, block, num_experts, experts, emask, carry_padded, carry_plain, align
):
    """For a vector of experts: their slot counts, this block's offset inside each expert, and where each
    expert's (padded) block starts in the buffer. `carry_*` are the row counts of all lower experts."""
    total = tl.load(totals_ptr + experts, mask=emask, other=0)
    before = tl.load(offsets_ptr + block.to(tl.int64) * num_experts + experts, mask=emask, other=0)
    aligned = tl.cdiv(total, align) * align
    start = carry_padded + tl.cumsum(aligned, axis=0) - aligned
    plain_start = carry_plain + tl.cumsum(total, axis=0) - total
    return total, before, aligned, start, plain_start


@triton.jit
def _store_expert_outputs(
    tokens_per_expert_ptr,
    pad_offsets_ptr,
    pad_table_ptr,
    experts,
    emask,
    total,
    aligned,
    start,
    plain_start,
    num_rows,
):
    """Per-expert results, clamped to the buffer: rows kept, TE-style pad offsets, and the pad row ranges."""
    kept = tl.minimum(tl.maximum(num_rows - start, 0), aligned)
    tl.store(tokens_per_expert_ptr + experts, kept, mask=emask)
    tl.store(pad_offsets_ptr + experts, start - plain_start, mask=emask)
    tl.store(pad_table_ptr + 2 * experts, start + tl.minimum(total, kept), mask=emask)
    tl.store(pad_table_ptr + 2 * experts + 1, start + kept, mask=emask)


@triton.jit
def _assign_rows_kernel(
    routing_ptr,  # [T, S] mask or expert ids
    offsets_ptr,  # [B, E] int32 from _scan_counts_kernel
    totals_ptr,  # [E] int32 from _scan_counts_kernel
    num_tokens,
    num_slots,
    num_experts,
    num_rows,
    align,
    row_map_ptr,  # [T, S + 1] int32
    tokens_per_expert_ptr,  # [E] int32
    pad_offsets_ptr,  # [E] int32
    pad_table_ptr,  # [E, 2] int32: [first, last) pad rows of each expert
    IS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TILE_T: tl.constexpr,
    TILE_S: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Destination rows. Grid (B,): program b writes the row-map rows of tokens [b*BLOCK_T, (b+1)*BLOCK_T).

    Each program derives the expert starts from the totals (O(E)) and adds its block's offsets, then ranks
    its own slots: a running cumulative sum down each mask column, or, for expert ids, a comparison of
    every slot with the earlier slots of its chunk.
    Program 0 also writes the per-expert outputs.
    """
    block = tl.program_id(0)
    first = block * BLOCK_T
    last = tl.minimum(first + BLOCK_T, num_tokens)
    if IS_MASK:
        carry_padded = tl.full([], 0, tl.int32)
        carry_plain = tl.full([], 0, tl.int32)
        for s0 in range(0, num_slots, TILE_S):
            experts = s0 + tl.arange(0, TILE_S)
            emask = experts < num_slots
            total, before, aligned, start, plain_start = _expert_layout(
                totals_ptr, offsets_ptr, block, num_experts, experts, emask, carry_padded, carry_plain, align
            )
            if block == 0:
                _store_expert_outputs(
                    tokens_per_expert_ptr,
                    pad_offsets_ptr,
                    pad_table_ptr,
                    experts,
                    emask,
                    total,
                    aligned,
                    start,
                    plain_start,
                    num_rows,
                )
            carry_padded += tl.sum(aligned, axis=0)
            carry_plain += tl.sum(total, axis=0)
            base = start + before
            for t0 in range(first, last, TILE_T):
                tokens = t0 + tl.arange(0, TILE_T)
                ok = (tokens[:, None] < last) & emask[None, :]
                routed = tl.load(
                    _as_bits(routing_ptr) + tokens.to(tl.int64)[:, None] * num_slots + experts[None, :],
                    mask=ok,
                    other=0,
                )
                routed = (routed != 0).to(tl.int32)
                rows = base[None, :] + tl.cumsum(routed, axis=0) - routed
                rows = tl.where((routed != 0) & (rows < num_rows), rows, -1)
                tl.store(
                    row_map_ptr + tokens.to(tl.int64)[:, None] * (num_slots + 1) + experts[None, :],
                    rows,
                    mask=ok,
                )
                base += tl.sum(routed, axis=0)
        end = tl.minimum(carry_padded, num_rows)
    else:
        experts = tl.arange(0, BINS)
        emask = experts < num_experts
        zero = tl.full([], 0, tl.int32)
        total, before, aligned, start, plain_start = _expert_layout(
            totals_ptr, offsets_ptr, block, num_experts, experts, emask, zero, zero, align
        )
        if block == 0:
            _store_expert_outputs(
                tokens_per_expert_ptr,
                pad_offsets_ptr,
                pad_table_ptr,
                experts,
                emask,
                total,
                aligned,
                start,
                plain_start,
                num_rows,
            )
        end = tl.minimum(tl.sum(aligned, axis=0), num_rows)
        # base[e]: first row of this block's slots of expert e; bin num_experts collects "no expert".
        base = tl.where(emask, start + before, 0)
        # Slots are taken CHUNK at a time in (token, slot) order; a slot's rank among the chunk's slots of its
        # expert is a row sum of a [CHUNK, CHUNK] "same expert, earlier" matrix, and `base` carries the
        # counts of earlier chunks.
        positions = tl.arange(0, CHUNK)
        earlier = positions[None, :] < positions[:, None]
        for flat0 in range(first.to(tl.int64) * TILE_S, last.to(tl.int64) * TILE_S, CHUNK):
            flat = flat0 + positions
            tokens = flat // TILE_S
            slots = (flat % TILE_S).to(tl.int32)
            ok = (tokens < last) & (slots < num_slots)
            ids = tl.load(routing_ptr + tokens * num_slots + slots, mask=ok, other=-1).to(tl.int32)
            ids = tl.where(ok & (ids >= 0) & (ids < num_experts), ids, num_experts)
            rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
            rows = tl.gather(base, ids, 0) + rank
            rows = tl.where((ids < num_experts) & (rows < num_rows), rows, -1)
            tl.store(row_map_ptr + tokens * (num_slots + 1) + slots, rows, mask=ok)
            base += tl.histogram(ids, BINS)
    tokens = first + tl.arange(0, BLOCK_T)
    tl.store(
        row_map_ptr + tokens.to(tl.int64) * (num_slots + 1) + num_slots,
        tl.full([BLOCK_T], 0, tl.int32) + end,
        mask=tokens < last,
    )


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
def _fill_unused_rows(
    fill,
    row_map_ptr,
    pad_table_ptr,
    num_slots,
    num_rows,
    num_experts,
    hidden,
    scale_cols,
    out_ptr,
    out_probs_ptr,
    out_scales_ptr,
    HAS_PROBS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_PAD_TABLE: tl.constexpr,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCALES_POW2: tl.constexpr,
):
    """Fill program `fill` of NUM_FILL: zeroes its share of the pad rows of every expert and of the tail
    rows [end, N). `end` is read from the row map's last column (token 0)."""
    if HAS_PAD_TABLE:
        for expert in range(fill, num_experts, NUM_FILL):
            pad_first = tl.load(pad_table_ptr + 2 * expert)
            pad_last = tl.load(pad_table_ptr + 2 * expert + 1)
            _zero_rows(
                out_ptr,
                out_probs_ptr,
                out_scales_ptr,
                pad_first,
                pad_last,
                FILL_ROWS,
                hidden,
                scale_cols,
                HAS_PROBS,
                HAS_SCALES,
                FILL_ROWS,
                BLOCK_H,
                SCALES_POW2,
            )
    end = tl.load(row_map_ptr + num_slots)
    _zero_rows(
        out_ptr,
        out_probs_ptr,
        out_scales_ptr,
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
def _dispatch_kernel(
    inp_ptr,  # [T, H] payload, moved as raw bits
    row_map_ptr,  # [T, S + 1] int32
    probs_ptr,  # [T, S] (HAS_PROBS)
    scales_ptr,  # [T, C] row-wise scales (HAS_SCALES)
    pad_table_ptr,  # [E, 2] int32 pad row ranges (HAS_PAD_TABLE)
    num_tokens,
    hidden,
    num_slots,
    num_rows,
    num_experts,
    scale_cols,
    out_ptr,  # [N, H]
    out_probs_ptr,  # [N] (HAS_PROBS)
    out_scales_ptr,  # [N, C] (HAS_SCALES)
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    SCALES_POW2: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_PAD_TABLE: tl.constexpr,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    STREAMING: tl.constexpr,
):
    """Scatter tokens to their expert-major rows. Grid (T * cdiv(H, BLOCK_H) + NUM_FILL,).

    Token program (t, c) loads columns [c*BLOCK_H, (c+1)*BLOCK_H) of token t once and stores them to every
    row of the token's slots; program (t, 0) also moves the token's probs and scales. The NUM_FILL programs
    after them zero the rows no token lands in (see `_fill_unused_rows`). STREAMING marks the token rows
    evict-first and the row stores streaming (".cs"): each byte is touched once, so keeping it in L2 only
    displaces lines other programs still need (a tuning knob: the autotuner decides).
    """
    pid = tl.program_id(0)
    hidden = _aligned(hidden, HIDDEN_ALIGN)
    chunks = tl.cdiv(hidden, BLOCK_H)
    token_programs = num_tokens * chunks
    if pid < token_programs:
        token = pid // chunks
        chunk = pid % chunks
        inp = _as_bits(inp_ptr)
        out = _as_bits(out_ptr)
        cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < hidden
        if STREAMING:
            values = tl.load(
                inp + token.to(tl.int64) * hidden + cols, mask=cmask, eviction_policy="evict_first"
            )
        else:
            values = tl.load(inp + token.to(tl.int64) * hidden + cols, mask=cmask)
        map_row = row_map_ptr + token.to(tl.int64) * (num_slots + 1)
        slots = tl.arange(0, SLOTS_POW2)
        rows = tl.load(map_row + slots, mask=slots < num_slots, other=-1)
        valid = rows >= 0
        if HAS_PROBS and chunk == 0:
            probs = tl.load(_as_bits(probs_ptr) + token.to(tl.int64) * num_slots + slots, mask=valid)
            tl.store(_as_bits(out_probs_ptr) + rows, probs, mask=valid)
        if HAS_SCALES:
            scale_idx = tl.arange(0, SCALES_POW2)
            smask = scale_idx < scale_cols
            scales = tl.load(_as_bits(scales_ptr) + token.to(tl.int64) * scale_cols + scale_idx, mask=smask)
        previous = tl.full([], -1, tl.int32)
        for _ in range(tl.sum(valid.to(tl.int32), axis=0)):
            slot = tl.min(tl.where(valid & (slots > previous), slots, SLOTS_POW2), axis=0)
            row = tl.load(map_row + slot).to(tl.int64)
            if STREAMING:
                tl.store(out + row * hidden + cols, values, mask=cmask, cache_modifier=".cs")
            else:
                tl.store(out + row * hidden + cols, values, mask=cmask)
            if HAS_SCALES and chunk == 0:
                tl.store(_as_bits(out_scales_ptr) + row * scale_cols + scale_idx, scales, mask=smask)
            previous = slot
    else:
        _fill_unused_rows(
            pid - token_programs,
            row_map_ptr,
            pad_table_ptr,
            num_slots,
            num_rows,
            num_experts,
            hidden,
            scale_cols,
            _as_bits(out_ptr),
            _as_bits(out_probs_ptr),
            _as_bits(out_scales_ptr),
            HAS_PROBS,
            HAS_SCALES,
            HAS_PAD_TABLE,
            NUM_FILL,
            FILL_ROWS,
            BLOCK_H,
            SCALES_POW2,
        )


@triton.jit
def _combine_kernel(
    inp_ptr,  # [N, H] expert outputs
    row_map_ptr,  # [T, S + 1] int32
    weights_ptr,  # [T, S] merging probs (HAS_WEIGHTS)
    permuted_probs_ptr,  # [N] (GATHER_PROBS)
    num_tokens,
    hidden,
    num_slots,
    out_ptr,  # [T, H]
    out_probs_ptr,  # [T, S] (GATHER_PROBS)
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    GATHER_PROBS: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
):
    """Gather-sum rows back to tokens. Grid (T * cdiv(H, BLOCK_H),).

    Program (t, c): acc = sum over the token's slots, in ascending slot order, of w[t, s] * inp[row(t, s)]
    (w = 1 without weights) on columns [c*BLOCK_H, (c+1)*BLOCK_H), accumulated in fp32 (fp64 for fp64 input)
    and stored in the input dtype. No atomics: every output element has one owner and a fixed order.
    With GATHER_PROBS, program (t, 0) also gathers permuted_probs[row(t, s)] into out_probs[t, s] (0 where
    the slot has no row): the probs gradient of dispatch.
    """
    pid = tl.program_id(0)
    hidden = _aligned(hidden, HIDDEN_ALIGN)
    chunks = tl.cdiv(hidden, BLOCK_H)
    token = pid // chunks
    chunk = pid % chunks
    acc_dtype: tl.constexpr = tl.float64 if inp_ptr.dtype.element_ty == tl.float64 else tl.float32
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    map_row = row_map_ptr + token.to(tl.int64) * (num_slots + 1)
    slots = tl.arange(0, SLOTS_POW2)
    smask = slots < num_slots
    rows = tl.load(map_row + slots, mask=smask, other=-1)
    valid = rows >= 0
    if GATHER_PROBS and chunk == 0:
        gathered = tl.load(_as_bits(permuted_probs_ptr) + rows, mask=valid, other=0)
        tl.store(_as_bits(out_probs_ptr) + token.to(tl.int64) * num_slots + slots, gathered, mask=smask)
    acc = tl.zeros([BLOCK_H], dtype=acc_dtype)
    previous = tl.full([], -1, tl.int32)
    for _ in range(tl.sum(valid.to(tl.int32), axis=0)):
        slot = tl.min(tl.where(valid & (slots > previous), slots, SLOTS_POW2), axis=0)
        row = tl.load(map_row + slot).to(tl.int64)
        values = tl.load(inp_ptr + row * hidden + cols, mask=cmask, other=0).to(acc_dtype)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + token.to(tl.int64) * num_slots + slot).to(acc_dtype)
            acc += values * weight
        else:
            acc += values
        previous = slot
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _combine_backward_kernel(
    grad_ptr,  # [T, H] gradient of the combine output
    row_map_ptr,  # [T, S + 1] int32
    inp_ptr,  # [N, H] combine input (expert outputs)
    weights_ptr,  # [T, S] merging probs
    num_tokens,
    hidden,
    num_slots,
    num_rows,
    grad_inp_ptr,  # [N, H]
    grad_weights_ptr,  # [T, S]
    BLOCK_H: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    NUM_FILL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    HIDDEN_ALIGN: tl.constexpr,
    STREAMING: tl.constexpr,
):
    """Backward of weighted combine. Grid (T + NUM_FILL,).

    Token program t walks its slots in ascending order and, for each, the whole hidden dimension:
    grad_inp[row] = g[t] * w[t, s] (computed in fp32, stored in the input dtype) and
    grad_weights[t, s] = sum_h inp[row, h] * g[t, h] (fp32); slots without a row get weight gradient 0.
    Fill programs zero the tail rows [end, N); with padding the plan pre-zeroes grad_inp instead.
    STREAMING reads the forward input evict-first and stores grad_inp streaming (each touched once); the
    gradient row g[t], read once per slot, stays cacheable (a tuning knob, as in `_dispatch_kernel`).
    """
    pid = tl.program_id(0)
    hidden = _aligned(hidden, HIDDEN_ALIGN)
    if pid < num_tokens:
        token = pid
        acc_dtype: tl.constexpr = tl.float64 if inp_ptr.dtype.element_ty == tl.float64 else tl.float32
        map_row = row_map_ptr + token.to(tl.int64) * (num_slots + 1)
        slots = tl.arange(0, SLOTS_POW2)
        smask = slots < num_slots
        rows = tl.load(map_row + slots, mask=smask, other=-1)
        valid = rows >= 0
        grad_row = grad_ptr + token.to(tl.int64) * hidden
        weight_grads = tl.zeros([SLOTS_POW2], dtype=acc_dtype)
        previous = tl.full([], -1, tl.int32)
        for _ in range(tl.sum(valid.to(tl.int32), axis=0)):
            slot = tl.min(tl.where(valid & (slots > previous), slots, SLOTS_POW2), axis=0)
            row = tl.load(map_row + slot).to(tl.int64)
            weight = tl.load(weights_ptr + token.to(tl.int64) * num_slots + slot).to(acc_dtype)
            dot = tl.zeros([BLOCK_H], dtype=acc_dtype)
            for h0 in range(0, hidden, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                cmask = cols < hidden
                grad = tl.load(grad_row + cols, mask=cmask, other=0).to(acc_dtype)
                scaled = (grad * weight).to(grad_inp_ptr.dtype.element_ty)
                if STREAMING:
                    values = tl.load(
                        inp_ptr + row * hidden + cols, mask=cmask, other=0, eviction_policy="evict_first"
                    ).to(acc_dtype)
                    tl.store(grad_inp_ptr + row * hidden + cols, scaled, mask=cmask, cache_modifier=".cs")
                else:
                    values = tl.load(inp_ptr + row * hidden + cols, mask=cmask, other=0).to(acc_dtype)
                    tl.store(grad_inp_ptr + row * hidden + cols, scaled, mask=cmask)
                dot += values * grad
            weight_grads = tl.where(slots == slot, tl.sum(dot, axis=0), weight_grads)
            previous = slot
        tl.store(
            grad_weights_ptr + token.to(tl.int64) * num_slots + slots,
            weight_grads.to(grad_weights_ptr.dtype.element_ty),
            mask=smask,
        )
    else:
        _fill_unused_rows(
            pid - num_tokens,
            row_map_ptr,
            row_map_ptr,
            num_slots,
            num_rows,
            0,
            hidden,
            0,
            _as_bits(grad_inp_ptr),
            grad_inp_ptr,
            grad_inp_ptr,
            False,
            False,
            False,
            NUM_FILL,
            FILL_ROWS,
            BLOCK_H,
            1,
        )


# ----------------------------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------------------------


ROW_MAP_SPACE = SearchSpace("row_map", {"block_tokens": (16, 32, 64, 128, 256), "num_warps": (4, 8)})
DISPATCH_SPACE = SearchSpace(
    "dispatch", {"block_bytes": (2048, 4096, 8192, 16384), "num_warps": (4, 8, 16), "streaming": (0, 1)}
)
COMBINE_SPACE = SearchSpace("combine", {"block_h": (512, 1024, 2048, 4096), "num_warps": (4, 8, 16)})
COMBINE_BACKWARD_SPACE = SearchSpace(
    "combine_backward", {"block_h": (512, 1024, 2048, 4096), "num_warps": (4, 8, 16), "streaming": (0, 1)}
)


def _warps_for(block_bytes: int) -> int:
    """Heuristic warps: one 16-byte vector per thread per row chunk, 4 to 8 warps."""
    return min(8, max(4, next_pow2(block_bytes // 512)))


def _columns(hidden: int, block: int) -> int:
    """Columns per program: the configured block, no wider than the row (power of two, at least 16)."""
    return max(16, min(next_pow2(hidden), block))


def alignment(size: int) -> int:
    """The largest power of two up to 16 that divides `size`: what `_aligned` may assume about it (16 is
    the divisibility PyTorch's launcher infers, so both frameworks compile the same code)."""
    return math.gcd(size, 16)


def _num_fill(device: DeviceInfo, padded: bool, num_experts: int) -> int:
    # Padded buffers spread one expert's pad rows per program; unpadded ones only ever zero a tail.
    return min(max(num_experts, device.num_sms), 1024) if padded else device.num_sms


def buffer_rows(num_out_tokens: int, num_experts: int, align_size: int | None) -> int:
    """Rows of the permuted buffer: `num_out_tokens`, or with padding the static worst case
    floor((num_out_tokens + E * (A - 1)) / A) * A, which always holds the padded layout of
    `num_out_tokens` routed slots (the padded total is a multiple of A and at most that bound)."""
    if align_size is None:
        return num_out_tokens
    return (num_out_tokens + num_experts * (align_size - 1)) // align_size * align_size


def row_map_plan(
    *,
    num_tokens: int,
    num_slots: int,
    num_experts: int,
    is_mask: bool,
    num_rows: int,
    align_size: int,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> tuple[dict[str, Buffer], tuple[Launch, ...]]:
    """Buffers and launches that turn a routing input ("routing") into "row_id_map", "tokens_per_expert",
    "pad_offsets" and the internal "pad_table": per-block histograms, a column scan of them, then rows.
    Three launches, O(T * S + B * E) work with B = T / block_tokens blocks: linear in T * E."""
    heuristic_block = min(256, max(16, next_pow2(cdiv(num_tokens, 4 * device.num_sms))))
    features = dict(num_tokens=num_tokens, num_slots=num_slots, num_experts=num_experts, is_mask=int(is_mask))
    cfg = autotune.resolve(
        ROW_MAP_SPACE, dict(block_tokens=heuristic_block, num_warps=4), config, features, device
    )
    block_t = cfg["block_tokens"]
    num_blocks = cdiv(num_tokens, block_t)
    empty = num_tokens == 0
    buffers = {
        "block_counts": Buffer((num_blocks, num_experts), "int32"),
        "block_offsets": Buffer((num_blocks, num_experts), "int32"),
        "expert_totals": Buffer((num_experts,), "int32"),
        "row_id_map": Buffer((num_tokens, num_slots + 1), "int32"),
        "tokens_per_expert": Buffer((num_experts,), "int32", zero=empty),
        "pad_offsets": Buffer((num_experts,), "int32", zero=empty),
        "pad_table": Buffer((num_experts, 2), "int32", zero=empty),
    }
    if empty:
        return buffers, ()
    if is_mask:
        tile_s = min(next_pow2(num_slots), 256)
        bins = 1
    else:
        tile_s = next_pow2(num_slots)
        bins = next_pow2(num_experts + 1)
    tile_t = max(1, min(block_t, _TILE_ELEMENTS // tile_s))
    # Narrow expert tiles and tall block tiles: many scan programs, each only a few steps long.
    tile_e = min(next_pow2(num_experts), 16)
    common = dict(IS_MASK=is_mask, BLOCK_T=block_t, TILE_T=tile_t, TILE_S=tile_s, BINS=bins)
    count = Launch(
        kernel=_count_experts_kernel,
        grid=(num_blocks,),
        args=("routing", num_tokens, num_slots, num_experts),
        outputs=("block_counts",),
        constexprs=common,
        num_warps=cfg["num_warps"],
        checks=not is_mask,
    )
    scan = Launch(
        kernel=_scan_counts_kernel,
        grid=(cdiv(num_experts, tile_e),),
        args=("block_counts", num_blocks, num_experts),
        outputs=("block_offsets", "expert_totals"),
        constexprs=dict(TILE_B=max(1, _TILE_ELEMENTS // tile_e), TILE_E=tile_e),
        num_warps=cfg["num_warps"],
    )
    assign = Launch(
        kernel=_assign_rows_kernel,
        grid=(num_blocks,),
        args=(
            "routing",
            "block_offsets",
            "expert_totals",
            num_tokens,
            num_slots,
            num_experts,
            num_rows,
            align_size,
        ),
        outputs=("row_id_map", "tokens_per_expert", "pad_offsets", "pad_table"),
        constexprs=dict(common, CHUNK=64),
        num_warps=cfg["num_warps"],
    )
    return buffers, (count, scan, assign)


def _dispatch_launch(
    *,
    num_tokens,
    hidden,
    num_slots,
    num_rows,
    num_experts,
    scale_cols,
    element_bytes,
    has_probs,
    padded,
    pad_table: bool,
    args,
    outputs,
    device,
    config,
) -> Launch:
    """The scatter launch shared by dispatch and the unweighted combine backward."""
    block_h = _columns(hidden, 16384 // element_bytes)
    features = dict(num_tokens=num_tokens, hidden=hidden, num_slots=num_slots, element_bytes=element_bytes)
    heuristic = dict(block_bytes=16384, num_warps=_warps_for(block_h * element_bytes), streaming=0)
    cfg = autotune.resolve(DISPATCH_SPACE, heuristic, config, features, device)
    block_h = _columns(hidden, cfg["block_bytes"] // element_bytes)
    num_fill = _num_fill(device, padded and pad_table, num_experts)
    return Launch(
        kernel=_dispatch_kernel,
        grid=(num_tokens * cdiv(hidden, block_h) + num_fill,),
        args=(*args, num_tokens, hidden, num_slots, num_rows, num_experts, scale_cols),
        outputs=outputs,
        constexprs=dict(
            BLOCK_H=block_h,
            SLOTS_POW2=next_pow2(num_slots),
            SCALES_POW2=next_pow2(max(scale_cols, 1)),
            HAS_PROBS=has_probs,
            HAS_SCALES=scale_cols > 0,
            HAS_PAD_TABLE=pad_table,
            NUM_FILL=num_fill,
            FILL_ROWS=4,
            HIDDEN_ALIGN=alignment(hidden),
            STREAMING=bool(cfg["streaming"]),
        ),
        num_warps=cfg["num_warps"],
    )


def dispatch_plan(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    num_experts: int,
    is_mask: bool,
    num_out_tokens: int,
    align_size: int | None,
    element_bytes: int,
    has_probs: bool,
    scale_cols: int | None,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, Mapping[str, int]] | None = None,
) -> Plan:
    """token_dispatch: row map + scatter of tokens, probs and scales.

    Inputs: "inp" [T, H], "routing" [T, S], "probs" [T, S] or None, "scales" [T, C] or None.
    Results: output [N, H], permuted_probs [N], permuted_scales [N, C], row_id_map [T, S + 1],
    pad_offsets [E], tokens_per_expert [E] (rows per expert in the buffer, padding included).
    `config` maps "row_map" / "dispatch" to configs from their search spaces (defaults: heuristics).
    """
    config = config or {}
    num_rows = buffer_rows(num_out_tokens, num_experts, align_size)
    buffers, map_launches = row_map_plan(
        num_tokens=num_tokens,
        num_slots=num_slots,
        num_experts=num_experts,
        is_mask=is_mask,
        num_rows=num_rows,
        align_size=align_size or 1,
        device=device,
        config=config.get("row_map"),
    )
    has_scales = scale_cols is not None
    empty = num_tokens == 0
    buffers.update(
        output=Buffer((num_rows, hidden), "like:inp", zero=empty),
        permuted_probs=Buffer(
            (num_rows,) if has_probs else (0,), "like:probs" if has_probs else "float32", zero=empty
        ),
        permuted_scales=Buffer(
            (num_rows, scale_cols) if has_scales else (0,),
            "like:scales" if has_scales else "float32",
            zero=empty,
        ),
    )
    launches = map_launches
    if not empty:
        launches += (
            _dispatch_launch(
                num_tokens=num_tokens,
                hidden=hidden,
                num_slots=num_slots,
                num_rows=num_rows,
                num_experts=num_experts,
                scale_cols=scale_cols or 0,
                element_bytes=element_bytes,
                has_probs=has_probs,
                padded=align_size is not None,
                pad_table=align_size is not None,
                args=("inp", "row_id_map", "probs", "scales", "pad_table"),
                outputs=("output", "permuted_probs", "permuted_scales"),
                device=device,
                config=config.get("dispatch"),
            ),
        )
    results = (
        "output",
        "permuted_probs",
        "permuted_scales",
        "row_id_map",
        "pad_offsets",
        "tokens_per_expert",
    )
    return Plan(buffers, launches, results)


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
    the pad rows' positions are not recorded in the row map. `config`: a "dispatch" config.
    """
    empty = num_tokens == 0
    buffers = {
        "grad_input": Buffer((num_rows, hidden), "like:grad", zero=padded or empty),
        "unused_probs": Buffer((0,), "float32"),
        "unused_scales": Buffer((0,), "float32"),
    }
    if empty:
        return Plan(buffers, (), ("grad_input",))
    launch = _dispatch_launch(
        num_tokens=num_tokens,
        hidden=hidden,
        num_slots=num_slots,
        num_rows=num_rows,
        num_experts=0,
        scale_cols=0,
        element_bytes=element_bytes,
        has_probs=False,
        padded=padded,
        pad_table=False,
        args=("grad", "row_id_map", "grad", "grad", "row_id_map"),
        outputs=("grad_input", "unused_probs", "unused_scales"),
        device=device,
        config=config,
    )
    if padded:  # pre-zeroed: no fill programs
        launch = replace(launch, grid=(launch.grid[0] - launch.constexprs["NUM_FILL"],))
    return Plan(buffers, (launch,), ("grad_input",))


def combine_plan(
    *,
    num_tokens: int,
    hidden: int,
    num_slots: int,
    element_bytes: int,
    has_weights: bool,
    gather_probs: bool,
    probs_dtype: str = "float32",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """token_combine (and the backward of dispatch).

    Inputs: "inp" [N, H], "row_id_map", "weights" [T, S] or None, "permuted_probs" [N] or None.
    Results: output [T, H] and, with `gather_probs`, probs [T, S] (dtype `probs_dtype`).
    """
    features = dict(num_tokens=num_tokens, hidden=hidden, num_slots=num_slots, element_bytes=element_bytes)
    heuristic = dict(block_h=4096, num_warps=_warps_for(_columns(hidden, 4096) * element_bytes))
    cfg = autotune.resolve(COMBINE_SPACE, heuristic, config, features, device)
    buffers = {
        "output": Buffer((num_tokens, hidden), "like:inp"),
        "probs": Buffer((num_tokens, num_slots) if gather_probs else (0,), probs_dtype),
    }
    if num_tokens == 0:
        return Plan(buffers, (), ("output", "probs"))
    block_h = _columns(hidden, cfg["block_h"])
    launch = Launch(
        kernel=_combine_kernel,
        grid=(num_tokens * cdiv(hidden, block_h),),
        args=("inp", "row_id_map", "weights", "permuted_probs", num_tokens, hidden, num_slots),
        outputs=("output", "probs"),
        constexprs=dict(
            BLOCK_H=block_h,
            SLOTS_POW2=next_pow2(num_slots),
            HAS_WEIGHTS=has_weights,
            GATHER_PROBS=gather_probs,
            HIDDEN_ALIGN=alignment(hidden),
        ),
        num_warps=cfg["num_warps"],
        fp_fusion=False,
    )
    return Plan(buffers, (launch,), ("output", "probs"))


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
    heuristic = dict(block_h=2048, num_warps=_warps_for(_columns(hidden, 2048) * element_bytes), streaming=0)
    cfg = autotune.resolve(COMBINE_BACKWARD_SPACE, heuristic, config, features, device)
    empty = num_tokens == 0
    buffers = {
        "grad_input": Buffer((num_rows, hidden), "like:inp", zero=padded or empty),
        "grad_weights": Buffer((num_tokens, num_slots), "like:weights"),
    }
    if empty:
        return Plan(buffers, (), ("grad_input", "grad_weights"))
    block_h = _columns(hidden, cfg["block_h"])
    num_fill = 0 if padded else _num_fill(device, False, 0)
    launch = Launch(
        kernel=_combine_backward_kernel,
        grid=(num_tokens + num_fill,),
        args=("grad", "row_id_map", "inp", "weights", num_tokens, hidden, num_slots, num_rows),
        outputs=("grad_input", "grad_weights"),
        constexprs=dict(
            BLOCK_H=block_h,
            SLOTS_POW2=next_pow2(num_slots),
            NUM_FILL=max(num_fill, 1),
            FILL_ROWS=4,
            HIDDEN_ALIGN=alignment(hidden),
            STREAMING=bool(cfg["streaming"]),
        ),
        num_warps=cfg["num_warps"],
        fp_fusion=False,
    )
    return Plan(buffers, (launch,), ("grad_input", "grad_weights"))
