"""Dispatch: the kernel that moves every token to the rows of its slots (after the row map's two launches)
and writes the row map, and the scatter through an existing row map (the backward of unweighted combine);
their plans."""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from .._jit import _as_bits, block_columns, column_programs
from ..rules.layout import buffer_rows, row_map_columns
from ..runtime import autotune
from ..runtime.plan import (
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
    next_pow2,
    sized_by,
)
from .row_map import (
    _ROW_MAP_AXES,
    _expert_layout,
    _listed_count,
    _listed_row,
    _map_row,
    _mapped_rows_constexprs,
    _num_fill,
    _token_chunks,
    _token_rows,
    _warps_for,
    _write_lists,
    _zero_rows,
    _zero_tail,
    expert_count_plan,
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


DISPATCH_SPACE = SearchSpace(
    "dispatch", {"block_bytes": (2048, 4096, 8192, 16384), "num_warps": (4, 8, 16), "streaming": (0, 1)}
)


def _data_config(hidden: int, num_slots: int, element_bytes: int, num_tokens: int, device, config):
    """A dispatch-space config (block bytes, warps, streaming) and the columns per program it gives."""
    features = dict(num_tokens=num_tokens, hidden=hidden, num_slots=num_slots, element_bytes=element_bytes)
    block_h = block_columns(hidden, 16384 // element_bytes)
    heuristic = dict(block_bytes=16384, num_warps=_warps_for(block_h * element_bytes), streaming=0)
    cfg = autotune.resolve(DISPATCH_SPACE, heuristic, config, features, device)
    return cfg, block_columns(hidden, cfg["block_bytes"] // element_bytes)


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
