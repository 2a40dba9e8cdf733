"""Public PyTorch API: token_dispatch, token_combine, sort_chunks_by_index.

Every function takes tensors in any memory layout and returns what it returns for their contiguous copies.
Token tensors ([T, H] inputs and [N, H] expert rows, and the gradients autograd hands to the backward ops)
are read in place when their columns are unit stride (row slices, offset views, expanded rows); other layouts
of them, and every other tensor argument (routing, probs, indices, split sizes), are copied to contiguous
memory first. Results are dense.
"""

from __future__ import annotations

import torch

from moetriton.kernels import row_map_slots
from moetriton.kernels.rules import validation

from . import ops
from ._checks import Signature, describe, extremes, memoised, same_device, signature, values_checked


def _check_index_values(indices: torch.Tensor, num_experts: int) -> None:
    if indices.numel() and values_checked(indices):
        ((low, high),) = extremes(indices)
        validation.check_index_values(low, high, num_experts)


def _check_row_map_values(row_id_map: torch.Tensor, num_rows: int) -> None:
    if not row_id_map.numel() or not values_checked(row_id_map):
        return
    num_slots = row_map_slots(row_id_map.shape[1])
    # Columns [rows | slots | count | end]; with no slots the lists are empty (read as -1).
    parts = [row_id_map[:, :num_slots], row_id_map[:, num_slots : 2 * num_slots]]
    parts += [row_id_map[:, 2 * num_slots], row_id_map[:, 2 * num_slots + 1]]
    found = iter(extremes(*(part for part in parts if part.numel())))
    rows, slots, counts, ends = (next(found) if part.numel() else (-1, -1) for part in parts)
    validation.check_row_map_values(
        rows=rows, slots=slots, counts=counts, ends=ends, num_rows=num_rows, num_slots=num_slots
    )


def _symbolic_experts(num_experts) -> bool:
    """True while torch.compile traces, where the expert count may be symbolic (read from the data; dynamo
    presents it as an int): its rule is then `torch._check`, a deferred run-time assertion for a symbolic
    value, since guarding on a data-dependent size fails the trace. (Dynamo accepts only a message function
    without free variables.)"""
    if not torch.compiler.is_compiling() or not isinstance(num_experts, int):
        return False
    torch._check(num_experts >= 1, lambda: "num_experts: expected > 0")
    return True


@memoised
def _check_dispatch(
    *,
    inp: Signature,
    routing_map: Signature | None,
    indices: Signature | None,
    probs: Signature | None,
    scales: Signature | None,
    num_experts,
    num_out_tokens,
    align_size,
    capacity,
    symbolic_experts: bool,
) -> tuple[bool, int]:
    """(is_mask, num_experts) of valid token_dispatch arguments."""
    is_mask, _, num_experts = validation.check_dispatch(
        inp=describe(inp),
        routing_map=describe(routing_map),
        indices=describe(indices),
        num_experts=num_experts,
        num_out_tokens=num_out_tokens,
        probs=describe(probs),
        scales=describe(scales),
        align_size=align_size,
        capacity=capacity,
        symbolic_experts=symbolic_experts,
    )
    same_device(inp=inp, routing_map=routing_map, indices=indices, probs=probs, scales=scales)
    return is_mask, num_experts


@memoised
def _check_combine(
    *,
    inp: Signature,
    row_id_map: Signature,
    merging_probs: Signature | None,
    pad_offsets: Signature | None,
) -> None:
    validation.check_combine(
        inp=describe(inp),
        row_id_map=describe(row_id_map),
        merging_probs=describe(merging_probs),
        pad_offsets=describe(pad_offsets),
    )
    same_device(inp=inp, row_id_map=row_id_map, merging_probs=merging_probs, pad_offsets=pad_offsets)


@memoised
def _check_sort_chunks(
    *, inp: Signature, split_sizes: Signature, sorted_indices: Signature, probs: Signature | None
) -> None:
    validation.check_sort_chunks(
        inp=describe(inp),
        split_sizes=describe(split_sizes),
        sorted_indices=describe(sorted_indices),
        probs=describe(probs),
    )
    same_device(inp=inp, probs=probs)


def token_dispatch(
    inp: torch.Tensor,
    routing_map: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    probs: torch.Tensor | None = None,
    align_size: int | None = None,
    *,
    indices: torch.Tensor | None = None,
    num_experts: int | None = None,
    scales: torch.Tensor | None = None,
    capacity: int | None = None,
) -> tuple:
    """Permute tokens into expert-major order (MoE dispatch).

    Args:
        inp: [T, H] tokens; float32/float64/bfloat16/float16, or float8_e4m3fn/e5m2 payloads. Any layout;
            read in place when its columns are unit stride, else copied (see the module docstring).
        routing_map: [T, E] mask (bool or integer, nonzero = routed). Pass this or `indices`.
        num_out_tokens: rows of the output before padding (a Python int). Slots whose row would fall past
            the buffer are dropped (no row, weight 0 in combine), so `num_out_tokens` smaller than the routed
            count truncates the highest experts first, like TE's index map. Defaults to T * K with `indices`.
        probs: [T, E] (mask) or [T, K] (indices) routing probabilities, permuted alongside the tokens.
        align_size: pad every expert's block to a multiple of this (grouped-GEMM tiles). The buffer then has
            the static worst-case size floor((num_out_tokens + E * (A - 1)) / A) * A rows; pad rows and rows
            past the last expert are exactly zero in every output.
        indices: [T, K] int32/int64 expert ids, -1 = no expert. Needs `num_experts`. Ids are range-checked
            where their values are free to read (CPU tensors, or every call with MOETRITON_CHECK=1); elsewhere
            (GPU, torch.compile) an id outside [0, E) is no expert, like -1.
        num_experts: E; required with `indices`, implied by a mask.
        scales: [T, C] row-wise scales of FP8 payloads (any dtype), permuted like the rows.
        capacity: instead of `num_out_tokens` and `align_size`: every expert gets exactly `capacity` rows
            (N = E * capacity, expert e at rows [e * capacity, (e + 1) * capacity)); slots past the first
            `capacity` of their expert in (token, slot) order are dropped (no row, weight 0 in combine) and
            unused rows are zero. A static layout for fixed-size all-to-all exchanges.

    Returns:
        (output [N, H], permuted_probs [N] or None, row_id_map [T, 2S + 2] int32, pad_offsets [E] int32 or
        None (padding or capacity only), tokens_per_expert [E] int32 (rows per expert in the buffer,
        padding included)),
        plus permuted_scales [N, C] as a sixth element when `scales` is given. S = E for a mask, K for
        indices. Destination rows are expert-major, token order stable inside each expert. No host sync.

    Example:
        >>> x = torch.randn(4, 8)
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
        >>> out, _, row_id_map, _, counts = token_dispatch(x, mask, num_out_tokens=5)
        >>> counts.tolist()
        [2, 1, 2]
    """
    if num_out_tokens is None and indices is not None and capacity is None:
        num_out_tokens = indices.numel()
    is_mask, num_experts = _check_dispatch(
        inp=signature(inp),
        routing_map=signature(routing_map),
        indices=signature(indices),
        probs=signature(probs),
        scales=signature(scales),
        num_experts=num_experts,
        num_out_tokens=num_out_tokens,
        align_size=align_size,
        capacity=capacity,
        symbolic_experts=_symbolic_experts(num_experts),
    )
    routing = routing_map if is_mask else indices
    if not is_mask:
        _check_index_values(indices, num_experts)
    output, permuted_probs, permuted_scales, row_id_map, pad_offsets, tokens_per_expert = ops.DISPATCH(
        inp, routing, probs, scales, num_experts, is_mask, num_out_tokens, align_size, capacity
    )
    result = (
        output,
        permuted_probs if probs is not None else None,
        row_id_map,
        pad_offsets if align_size is not None or capacity is not None else None,
        tokens_per_expert,
    )
    return (*result, permuted_scales) if scales is not None else result


def token_combine(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather expert outputs back to tokens (MoE combine), optionally weighted.

    Args:
        inp: [N, H] expert outputs in the layout token_dispatch produced; float32/float64/bfloat16/float16.
        row_id_map: [T, 2S + 2] int32 from token_dispatch into a buffer of N = inp.shape[0] rows. Checked
            against inp where its values are free to read (CPU, or MOETRITON_CHECK=1); elsewhere entries
            naming rows outside [0, N) are ignored (docs/design.md, "Index data is never trusted").
        merging_probs: [T, S] weights in the routing layout ([T, E] for a mask, [T, K] for indices).
        pad_offsets: pass what token_dispatch returned when it padded (rows in row_id_map already include
            padding; this tells the backward that pad rows exist).

    Returns:
        [T, H] in inp.dtype: out[t] = sum over t's slots, in ascending slot order, of
        w[t, s] * inp[row(t, s)], accumulated in fp32 without atomics (bitwise reproducible).
        Tokens with no row get zeros.

    Example:
        >>> x = torch.randn(4, 8)
        >>> mask = torch.tensor([[1, 1], [1, 0], [0, 1], [0, 0]], dtype=torch.bool)
        >>> out, _, row_id_map, _, _ = token_dispatch(x, mask, num_out_tokens=4)
        >>> torch.equal(token_combine(out, row_id_map)[0], 2 * x[0])
        True
    """
    _check_combine(
        inp=signature(inp),
        row_id_map=signature(row_id_map),
        merging_probs=signature(merging_probs),
        pad_offsets=signature(pad_offsets),
    )
    _check_row_map_values(row_id_map, inp.shape[0])
    return ops.COMBINE(inp, row_id_map, merging_probs, pad_offsets is not None)


def sort_chunks_by_index(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> tuple:
    """Reorder row chunks: output chunk j is input chunk sorted_indices[j] (e.g. rank-major -> expert-major
    after an expert-parallel all-to-all).

    Args:
        inp: [N, H] rows; any float or FP8 dtype (moved bit for bit).
        split_sizes: [S] int32/int64 chunk sizes; rows past their sum stay in place. Host tensors are fine.
        sorted_indices: [S] int32/int64 permutation of [0, S). Sizes and order are checked where their
            values are free to read (CPU, or MOETRITON_CHECK=1); elsewhere sizes outside [0, N], a sum past
            N or an order that is not a permutation move nothing: zero output and probs, row_id_map -1.
        probs: optional [N] per-row values permuted alongside.

    Returns:
        (output [N, H], row_id_map [N] int32 destination of each input row[, permuted_probs [N]]).

    Example:
        >>> x = torch.arange(6.0).reshape(6, 1)
        >>> out, _ = sort_chunks_by_index(x, torch.tensor([2, 3, 1]), torch.tensor([2, 0, 1]))
        >>> out[:, 0].tolist()
        [5.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    """
    _check_sort_chunks(
        inp=signature(inp),
        split_sizes=signature(split_sizes),
        sorted_indices=signature(sorted_indices),
        probs=signature(probs),
    )
    # Sizes may come from the host (e.g. an all-to-all's splits): checked there for free.
    if values_checked(split_sizes) and values_checked(sorted_indices):
        validation.check_split_values(split_sizes.tolist(), sorted_indices.tolist(), inp.shape[0])
    if split_sizes.device != inp.device:
        split_sizes = split_sizes.to(inp.device, non_blocking=True)
    if sorted_indices.device != inp.device:
        sorted_indices = sorted_indices.to(inp.device, non_blocking=True)
    output, row_id_map, permuted_probs = ops.SORT_CHUNKS(inp, split_sizes, sorted_indices, probs, False)
    return (output, row_id_map) if probs is None else (output, row_id_map, permuted_probs)
