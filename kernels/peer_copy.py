"""Peer copies of the PyTorch peer exchange: rows pulled from, and pushed into, the other GPUs' memory.

On GPUs of one host that reach each other's memory (NVLink peer access), every rank can read a peer's send
buffer, or write into it, from its own kernels: each source rank's buffer [S, H] sits at the same offset of
a symmetric allocation, and a table [EP] of device addresses (one per rank, the rank's own included) names
them. That lets one copy both move a row between GPUs and put it where the grouped GEMMs read it, where the
all-to-all path moves rows source-major and then chunk-sorts them to expert-major and back (two more copies
of every row per direction).

The receiving rank's rows are expert-major: chunk (j, p) = j * EP + p holds the rows that source p's buffer
holds for local expert j (`chunk_sizes`), starting at row `source_offsets[j * EP + p]` of p's buffer
(moetriton.kernels.rules.expert_parallel.peer_chunks). Row i of the receiving layout therefore maps to one
(source, source row) pair; both kernels find it from the chunk sizes:

* `_pull_rows_kernel` (the receiver gathers): out[i] = buffer_p[row]; optionally the rows' probs alongside,
  or, for the backward of the weighted combine (SCALE_DOT), out[i] = w[i] * buffer_p[row] and
  dots[i] = <buffer_p[row], saved[i]> in fp32 (the merging weight's gradient, over whole rows).
* `_push_rows_kernel` (the receiver scatters back): buffer_p[row] = rows[i], optionally with probs.

Neither kernel synchronises with the peers: the caller orders them against the peers' writes and reads
(the binding's barriers on the symmetric allocation).
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ._jit import _chunk_of_rows
from .runtime.plan import Buffer, Launch, Plan, cached, cdiv, next_pow2

#: Launch configuration of both copies: rows per program (the chunk lookup compares rows x next_pow2(EP * L)
#: entries), bytes of a row a program moves per step, warps.
DEFAULT_CONFIG = {"rows": 4, "block_bytes": 4096, "num_warps": 4}


@triton.jit
def _program_rows(
    chunk_sizes_ptr,
    source_offsets_ptr,
    peer_rows_ptr,
    num_rows,
    num_chunks,
    num_sources,
    source_rows,
    ELEMENT: tl.constexpr,
    HIDDEN: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
):
    """This program's receiving rows [ROWS]: (rows, valid, their source rank and row of its buffer (int64),
    pointers [ROWS, 1] to those rows' starts in the source's buffer, their offsets [ROWS, 1] in the
    receiving layout). A row is valid when it lies inside the chunks and below R, and its source row inside
    the source's buffer ([0, source_rows)); chunk sizes are read as clipped into [0, R], in their own dtype
    before narrowing, so no address comes from an unchecked size or offset."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    chunks = tl.arange(0, CHUNKS_POW2)
    in_table = chunks < num_chunks
    sizes = tl.load(chunk_sizes_ptr + chunks, mask=in_table, other=0)
    sizes = tl.minimum(tl.maximum(sizes, 0), num_rows).to(tl.int32)
    chunk, start = _chunk_of_rows(rows, sizes, in_table, CHUNKS_POW2)
    # The total in int64 and the chunk bound: a table of many large sizes may wrap the int32 running ends
    # (then rows land in wrong chunks, but never past the table or the source's buffer).
    total = tl.minimum(tl.sum(sizes.to(tl.int64), axis=0), num_rows)
    inside = (rows < total) & (rows < num_rows) & (chunk < num_chunks)
    source = chunk % num_sources
    offset = tl.load(source_offsets_ptr + chunk, mask=inside, other=0).to(tl.int64)
    peer_row = offset + (rows - start)
    valid = inside & (peer_row >= 0) & (peer_row < source_rows)
    base = tl.load(peer_rows_ptr + source, mask=valid, other=0).to(tl.pointer_type(ELEMENT))
    return (
        rows,
        valid,
        source,
        peer_row,
        base[:, None] + peer_row[:, None] * HIDDEN,
        rows.to(tl.int64)[:, None] * HIDDEN,
    )


@triton.jit
def _peer_probs(peer_probs_ptr, source, peer_row, rows, valid, num_rows, ELEMENT: tl.constexpr):
    """(pointers [ROWS] to the rows' probs in their sources' buffers, the mask of the rows whose probs this
    program moves: column program 0's valid rows)."""
    mine = valid & (rows < tl.where(tl.program_id(1) == 0, num_rows, 0))
    base = tl.load(peer_probs_ptr + source, mask=mine, other=0).to(tl.pointer_type(ELEMENT))
    return base + peer_row, mine


@triton.jit
def _pull_rows_kernel(
    peer_rows_ptr,  # [EP] int64: address of each source's rows [S, H]
    peer_probs_ptr,  # [EP] int64: address of each source's probs [S] (HAS_PROBS)
    chunk_sizes_ptr,  # [EP * L] integer, expert-major chunks
    source_offsets_ptr,  # [EP * L] integer
    saved_ptr,  # [R, H] (SCALE_DOT)
    weights_ptr,  # [R] float (SCALE_DOT)
    num_rows,  # R
    num_chunks,
    num_sources,
    source_rows,  # S: rows of every source's buffer
    out_ptr,  # [R, H]
    out_probs_ptr,  # [R] (HAS_PROBS)
    dots_ptr,  # [R] float32 (SCALE_DOT)
    HIDDEN: tl.constexpr,
    ROWS: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    SCALE_DOT: tl.constexpr,
):
    """Grid (cdiv(R, ROWS), cdiv(H, SPAN)). Program (b, c) gathers columns [c*SPAN, (c+1)*SPAN) of
    receiving rows [b*ROWS, (b+1)*ROWS) from their sources, BLOCK_H columns a step (SCALE_DOT: SPAN = H, so
    that one program holds a row's whole dot product: no atomics, the same sum every run). Program (b, 0)
    also moves the probs."""
    element = out_ptr.dtype.element_ty
    rows, valid, source, peer_row, source_pointers, out_rows = _program_rows(
        chunk_sizes_ptr,
        source_offsets_ptr,
        peer_rows_ptr,
        num_rows,
        num_chunks,
        num_sources,
        source_rows,
        element,
        HIDDEN,
        ROWS,
        CHUNKS_POW2,
    )
    if SCALE_DOT:
        weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        dot = tl.zeros([ROWS], dtype=tl.float32)
    first = tl.program_id(1) * SPAN
    # Every receiving row is written: rows without a valid source row get zeros.
    written = rows < num_rows
    for step in tl.static_range(0, SPAN, BLOCK_H):
        cols = first + step + tl.arange(0, BLOCK_H)
        mask = valid[:, None] & (cols < HIDDEN)[None, :]
        values = tl.load(source_pointers + cols[None, :], mask=mask, other=0)
        if SCALE_DOT:
            grad = values.to(tl.float32)
            saved = tl.load(saved_ptr + out_rows + cols[None, :], mask=mask, other=0).to(tl.float32)
            dot += tl.sum(grad * saved, axis=1)
            values = (grad * weight[:, None]).to(element)
        tl.store(out_ptr + out_rows + cols[None, :], values, mask=written[:, None] & (cols < HIDDEN)[None, :])
    if SCALE_DOT:
        tl.store(dots_ptr + rows, dot, mask=written)
    if HAS_PROBS:
        peer_probs, mine = _peer_probs(
            peer_probs_ptr, source, peer_row, rows, valid, num_rows, out_probs_ptr.dtype.element_ty
        )
        first_column = rows < tl.where(tl.program_id(1) == 0, num_rows, 0)
        tl.store(out_probs_ptr + rows, tl.load(peer_probs, mask=mine, other=0), mask=first_column)


@triton.jit
def _push_rows_kernel(
    rows_ptr,  # [R, H] receiving-layout rows
    probs_ptr,  # [R] (HAS_PROBS)
    chunk_sizes_ptr,  # [EP * L] integer
    source_offsets_ptr,  # [EP * L] integer
    peer_rows_ptr,  # [EP] int64: address of each source's rows [S, H]
    peer_probs_ptr,  # [EP] int64 (HAS_PROBS)
    num_rows,
    num_chunks,
    num_sources,
    source_rows,  # S: rows of every source's buffer
    HIDDEN: tl.constexpr,
    ROWS: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """The inverse of `_pull_rows_kernel` without SCALE_DOT: every receiving row stored back to its row of
    its source's buffer. Grid (cdiv(R, ROWS), cdiv(H, SPAN)), programs as the pull's."""
    rows, valid, source, peer_row, target_rows, local_rows = _program_rows(
        chunk_sizes_ptr,
        source_offsets_ptr,
        peer_rows_ptr,
        num_rows,
        num_chunks,
        num_sources,
        source_rows,
        rows_ptr.dtype.element_ty,
        HIDDEN,
        ROWS,
        CHUNKS_POW2,
    )
    first = tl.program_id(1) * SPAN
    for step in tl.static_range(0, SPAN, BLOCK_H):
        cols = first + step + tl.arange(0, BLOCK_H)
        mask = valid[:, None] & (cols < HIDDEN)[None, :]
        values = tl.load(rows_ptr + local_rows + cols[None, :], mask=mask, other=0)
        tl.store(target_rows + cols[None, :], values, mask=mask)
    if HAS_PROBS:
        peer_probs, mine = _peer_probs(
            peer_probs_ptr, source, peer_row, rows, valid, num_rows, probs_ptr.dtype.element_ty
        )
        tl.store(peer_probs, tl.load(probs_ptr + rows, mask=mine, other=0), mask=mine)


def _sizes(
    name: str, num_rows: int, num_chunks: int, num_sources: int, source_rows: int, hidden: int
) -> tuple[int, int, int, int, int]:
    """(R, EP * L, EP, S, H), the sizes both plans validate and launch with, else ValueError."""
    if (
        min(num_rows, hidden, source_rows) < 0
        or num_sources < 1
        or num_chunks < 1
        or num_chunks % num_sources
    ):
        raise ValueError(
            f"{name}: expected R, S, H >= 0 and EP * L chunks for EP >= 1 sources, got R={num_rows},"
            f" S={source_rows}, H={hidden}, {num_chunks} chunks, EP={num_sources}"
        )
    return num_rows, num_chunks, num_sources, source_rows, hidden


def _launch(
    kernel,
    inputs: tuple,
    outputs: tuple,
    sizes: tuple[int, int, int, int, int],
    element_bytes: int,
    whole_rows: bool,
    config: Mapping[str, int] | None,
    **flags: bool,
) -> Launch:
    """A launch of either kernel over R = num_rows rows (`sizes` from `_sizes`; arguments: the inputs, R,
    the chunks, EP, S, the outputs): a program moves ROWS rows, SPAN columns of them (whole rows where it
    reduces over them), BLOCK_H columns a step; `config` overrides DEFAULT_CONFIG's entries."""
    num_rows, num_chunks, num_sources, source_rows, hidden = sizes
    config = {**DEFAULT_CONFIG, **(config or {})}
    rows = config["rows"]
    block_h = min(next_pow2(max(hidden, 1)), max(config["block_bytes"] // element_bytes, 16))
    span = cdiv(hidden, block_h) * block_h if whole_rows else block_h
    return Launch(
        kernel=kernel,
        grid=(cdiv(num_rows, rows), max(cdiv(hidden, span), 1)),
        args=(*inputs, num_rows, num_chunks, num_sources, source_rows),
        outputs=outputs,
        constexprs=dict(
            HIDDEN=hidden, ROWS=rows, SPAN=span, BLOCK_H=block_h, CHUNKS_POW2=next_pow2(num_chunks), **flags
        ),
        num_warps=config["num_warps"],
    )


@cached
def pull_rows_plan(
    *,
    num_rows: int,
    num_chunks: int,
    num_sources: int,
    source_rows: int,
    hidden: int,
    dtype: str,
    element_bytes: int,
    probs_dtype: str | None = None,
    scale_dot: bool = False,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Gather R = num_rows receiving rows from their sources' buffers (module doc).

    Inputs: "peer_rows" [EP] int64 addresses of the sources' rows [S, H] of `dtype` (S = source_rows);
    "chunk_sizes", "source_offsets" [EP * L] integer (expert-major chunks, sum of chunk_sizes = R; a row
    whose chunk or source row falls outside R or S is not read and comes out zero); with `probs_dtype`,
    "peer_probs" [EP] int64 addresses of the sources' probs [S]; with `scale_dot`, "saved" [R, H] of
    `dtype` and "weights" [R] (any float dtype, read as fp32).
    Results: "out" [R, H] of `dtype`; "out_probs" [R] of `probs_dtype` (with probs_dtype); "dots" [R]
    float32 (with scale_dot). Every row and prob is written. `config`: DEFAULT_CONFIG entries to override.
    """
    sizes = _sizes("pull_rows", num_rows, num_chunks, num_sources, source_rows, hidden)
    if probs_dtype is not None and scale_dot:
        raise ValueError("pull_rows: probs and scale_dot are exclusive")
    buffers = {"out": Buffer((num_rows, hidden), dtype)}
    results = ["out"]
    if probs_dtype is not None:
        buffers["out_probs"] = Buffer((num_rows,), probs_dtype)
        results.append("out_probs")
    else:
        buffers["out_probs"] = Buffer.absent("float32")
    if scale_dot:
        buffers["dots"] = Buffer((num_rows,), "float32")
        results.append("dots")
    else:
        buffers["dots"] = Buffer.absent("float32")
    if num_rows == 0:
        return Plan(buffers, (), tuple(results))
    launch = _launch(
        _pull_rows_kernel,
        ("peer_rows", "peer_probs", "chunk_sizes", "source_offsets", "saved", "weights"),
        ("out", "out_probs", "dots"),
        sizes,
        element_bytes,
        whole_rows=scale_dot,
        config=config,
        HAS_PROBS=probs_dtype is not None,
        SCALE_DOT=scale_dot,
    )
    return Plan(buffers, (launch,), tuple(results))


@cached
def push_rows_plan(
    *,
    num_rows: int,
    num_chunks: int,
    num_sources: int,
    source_rows: int,
    hidden: int,
    element_bytes: int,
    has_probs: bool,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Scatter R = num_rows receiving rows back into their sources' buffers (module doc).

    Inputs: "rows" [R, H], "chunk_sizes", "source_offsets" [EP * L] integer, "peer_rows" [EP] int64
    addresses of the sources' rows [S, H] (rows' dtype, S = source_rows; rows whose chunk or source row
    falls outside R or S are not written); with `has_probs`, "probs" [R] and "peer_probs"
    [EP] addresses of the sources' probs [S] (probs' dtype). No results: the rows land in the peers'
    buffers, and only those rows are written. `config`: DEFAULT_CONFIG entries to override.
    """
    sizes = _sizes("push_rows", num_rows, num_chunks, num_sources, source_rows, hidden)
    if num_rows == 0:
        return Plan({}, (), ())
    launch = _launch(
        _push_rows_kernel,
        ("rows", "probs", "chunk_sizes", "source_offsets", "peer_rows", "peer_probs"),
        (),
        sizes,
        element_bytes,
        whole_rows=False,
        config=config,
        HAS_PROBS=has_probs,
    )
    return Plan({}, (launch,), ())
