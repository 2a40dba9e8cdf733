"""Combine: the gather-sum of every token's rows (token_combine, and dispatch's backward without weights,
which also gathers the permuted probs' gradient) and the backward of weighted combine; their plans."""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from .._jit import _aligned, _as_bits, block_columns, column_programs
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
    _listed_count,
    _listed_row,
    _listed_slot,
    _map_row,
    _mapped_rows_constexprs,
    _num_fill,
    _token_chunks,
    _warps_for,
    _zero_tail,
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


COMBINE_SPACE = SearchSpace(
    "combine",
    {"block_h": (512, 1024, 2048, 4096), "num_warps": (2, 4, 8), "lookahead": (1, 2), "streaming": (0, 1)},
)


COMBINE_BACKWARD_SPACE = SearchSpace(
    "combine_backward",
    {"block_h": (512, 1024, 2048, 4096), "num_warps": (2, 4, 8), "streaming": (0, 1), "step": (1, 2, 4)},
)


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
