"""Argument rules of the permutation family (token_dispatch, token_combine, the row map), shared by both
bindings: shapes, dtypes and static arguments, and the value rules of expert ids and row maps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from .layout import bitmap_columns, row_map_slots
from .validation import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INDEX_DTYPES,
    MASK_DTYPES,
    check_array,
    check_dim,
    check_positive,
    check_routing_map_format,
    fail,
)

#: The results of the dispatch op (dispatch_plan's, and the references' `dispatch`), in order.
DISPATCH_RESULTS = (
    "output",
    "permuted_probs",
    "permuted_scales",
    "row_id_map",
    "pad_offsets",
    "tokens_per_expert",
)


class DispatchConfig(NamedTuple):
    """token_dispatch's static arguments, complete: what the dispatch op of each binding, dispatch_plan and
    the references' `dispatch` take beside the arrays (after inp, routing, probs, scales, in this order)."""

    num_experts: int  # E
    is_mask: bool  # the routing is a mask [T, E] (or its bitmap), else expert ids [T, K]
    num_out_tokens: int | None  # rows before padding; unused with a capacity
    align_size: int | None
    capacity: int | None
    routing_map_format: str = "bytemap"  # "bitmap": the mask is bit-packed

    @property
    def padded(self) -> bool:
        """Whether the buffer has pad rows (padding or a capacity): pad_offsets is then a result."""
        return self.align_size is not None or self.capacity is not None

    def with_reference_defaults(self, routing_shape: tuple[int, ...]) -> DispatchConfig:
        """These arguments completed, unchecked, as the framework references take them for a routing input
        of `routing_shape`: E read from a [T, E] mask (a bitmap's E is given), num_out_tokens every slot
        (T * S) when None and there is no capacity."""
        num_experts, num_out_tokens = self.num_experts, self.num_out_tokens
        if self.is_mask and self.routing_map_format != "bitmap":
            num_experts = routing_shape[1]
        if num_out_tokens is None and self.capacity is None:
            num_out_tokens = routing_shape[0] * num_experts if self.is_mask else math.prod(routing_shape)
        return self._replace(num_experts=num_experts, num_out_tokens=num_out_tokens)

    def results(self, op_results: Sequence, *, has_probs: bool, has_scales: bool) -> tuple:
        """token_dispatch's results from the dispatch op's (DISPATCH_RESULTS, in order): (output,
        permuted_probs or None, row_id_map, pad_offsets or None (padding or capacity only),
        tokens_per_expert), plus permuted_scales as a sixth element when scales were given."""
        output, permuted_probs, permuted_scales, row_id_map, pad_offsets, tokens_per_expert = op_results
        # `padded` spelled out: this runs on every eager call, where a property call is measurable.
        padded = self.align_size is not None or self.capacity is not None
        result = (
            output,
            permuted_probs if has_probs else None,
            row_id_map,
            pad_offsets if padded else None,
            tokens_per_expert,
        )
        return (*result, permuted_scales) if has_scales else result


def check_dispatch(
    *,
    inp: tuple[tuple[int, ...], str],
    routing_map: tuple[tuple[int, ...], str] | None,
    indices: tuple[tuple[int, ...], str] | None,
    num_experts: int | None,
    num_out_tokens: int | None,
    probs: tuple[tuple[int, ...], str] | None,
    scales: tuple[tuple[int, ...], str] | None,
    align_size: int | None,
    capacity: int | None = None,
    symbolic_experts: bool = False,
    routing_map_format: str = "bytemap",
) -> DispatchConfig:
    """Validates token_dispatch arguments; returns them complete: E read from a [T, E] mask, num_out_tokens
    T * K by default with indices (and no capacity), the routing-map format by its neutral name.

    `symbolic_experts`: num_experts is a symbolic size (torch.compile, data-dependent), whose value the
    binding checks at run time; here it is only required to be present. `routing_map_format` (any spelling
    `check_routing_map_format` takes): "bitmap" takes routing_map as uint8 [T, ceil(E / 8)] with
    `num_experts` given (E cannot be read from the packed width), S = E.
    """
    routing_map_format = check_routing_map_format(routing_map_format)
    check_array("inp", *inp, ndim=2, dtypes=FLOAT_DTYPES + FP8_DTYPES)
    num_tokens = inp[0][0]
    if (routing_map is None) == (indices is None):
        raise ValueError("routing_map / indices: pass exactly one of them")
    if routing_map_format == "bitmap":
        if routing_map is None:
            fail("routing_map_format", "'bitmap' describes a routing_map; got indices")
        check_array("routing_map", *routing_map, ndim=2, dtypes=("uint8",))
        check_dim("routing_map", routing_map[0][0], num_tokens, "shape[0] (tokens, as inp)")
        if num_experts is None:
            fail("num_experts", "required with a bitmap routing_map (E cannot be read from ceil(E / 8))")
        check_positive("num_experts", num_experts)
        check_dim("routing_map", routing_map[0][1], bitmap_columns(num_experts), "shape[1] = ceil(E / 8)")
        num_slots = num_experts
    elif routing_map is not None:
        check_array("routing_map", *routing_map, ndim=2, dtypes=MASK_DTYPES)
        check_dim("routing_map", routing_map[0][0], num_tokens, "shape[0] (tokens, as inp)")
        num_slots = routing_map[0][1]
        if num_experts is not None and num_experts != num_slots:
            fail("num_experts", f"expected {num_slots} (routing_map.shape[1]) or None, got {num_experts}")
        num_experts = num_slots
        check_positive("routing_map.shape[1] (num_experts)", num_experts)
    else:
        check_array("indices", *indices, ndim=2, dtypes=INDEX_DTYPES)
        check_dim("indices", indices[0][0], num_tokens, "shape[0] (tokens, as inp)")
        num_slots = indices[0][1]
        if num_out_tokens is None and capacity is None:
            num_out_tokens = num_tokens * num_slots
        if num_experts is None:
            fail("num_experts", "required with indices (the number of experts E; ids lie in [-1, E))")
        if not symbolic_experts:
            check_positive("num_experts", num_experts)
    if capacity is not None:
        check_positive("capacity", capacity)
        if num_out_tokens is not None:
            fail(
                "num_out_tokens",
                f"expected None with capacity (the buffer has E * capacity rows), got {num_out_tokens}",
            )
        if align_size is not None:
            fail("align_size", "expected None with capacity (pad by choosing capacity a multiple of it)")
    else:
        check_positive("num_out_tokens", num_out_tokens, allow_zero=True)
    if probs is not None:
        check_array("probs", *probs, ndim=2, dtypes=FLOAT_DTYPES)
        if tuple(probs[0]) != (num_tokens, num_slots):
            fail(
                "probs",
                f"expected shape {(num_tokens, num_slots)} (one per routing slot), got {tuple(probs[0])}",
            )
    if scales is not None:
        check_array("scales", *scales, ndim=2, dtypes=FLOAT_DTYPES + FP8_DTYPES + ("uint8", "int8", "int32"))
        check_dim("scales", scales[0][0], num_tokens, "shape[0] (tokens, as inp)")
    if align_size is not None:
        check_positive("align_size", align_size)
    return DispatchConfig(
        num_experts, routing_map is not None, num_out_tokens, align_size, capacity, routing_map_format
    )


def check_row_map(row_id_map: tuple[tuple[int, ...], str]) -> tuple[int, int]:
    """Returns (num_tokens, num_slots) of a row_id_map made by token_dispatch."""
    check_array("row_id_map", *row_id_map, ndim=2, dtypes=("int32",))
    columns = row_id_map[0][1]
    if columns < 2 or columns % 2:
        fail("row_id_map", f"expected shape [T, 2S + 2] (from token_dispatch), got {row_id_map[0]}")
    return row_id_map[0][0], row_map_slots(columns)


def check_combine(
    *,
    inp: tuple[tuple[int, ...], str],
    row_id_map: tuple[tuple[int, ...], str],
    merging_probs: tuple[tuple[int, ...], str] | None,
    pad_offsets: tuple[tuple[int, ...], str] | None,
) -> tuple[int, int]:
    """Validates token_combine arguments; returns (num_tokens, num_slots)."""
    check_array("inp", *inp, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_slots = check_row_map(row_id_map)
    if merging_probs is not None:
        check_array("merging_probs", *merging_probs, ndim=2, dtypes=FLOAT_DTYPES)
        if tuple(merging_probs[0]) != (num_tokens, num_slots):
            fail(
                "merging_probs",
                f"expected shape {(num_tokens, num_slots)} (the routing layout of row_id_map), "
                f"got {tuple(merging_probs[0])}",
            )
    if pad_offsets is not None:
        check_array("pad_offsets", *pad_offsets, ndim=1, dtypes=INDEX_DTYPES)
    return num_tokens, num_slots


def check_index_values(min_id: int, max_id: int, num_experts: int) -> None:
    """Range rule of expert ids, for bindings that can read the values cheaply."""
    if min_id < -1 or max_id >= num_experts:
        fail("indices", f"expected expert ids in [-1, {num_experts}), got values in [{min_id}, {max_id}]")


def row_map_parts(row_id_map):
    """The parts of a row map [T, 2S + 2] (a numpy, PyTorch or JAX array) that `check_row_map_values`
    bounds, by its argument names: rows [T, S] and slots [T, S] (the two lists), counts [T], ends [T]."""
    num_slots = row_map_slots(row_id_map.shape[1])
    return dict(
        rows=row_id_map[:, :num_slots],
        slots=row_id_map[:, num_slots : 2 * num_slots],
        counts=row_id_map[:, 2 * num_slots],
        ends=row_id_map[:, 2 * num_slots + 1],
    )


def check_row_map_values(
    *,
    rows: tuple[int, int],
    slots: tuple[int, int],
    counts: tuple[int, int],
    ends: tuple[int, int],
    num_rows: int,
    num_slots: int,
) -> None:
    """Value rule of a row_id_map [T, 2S + 2] used with a buffer of `num_rows` rows, from the (min, max) of
    its listed rows, listed slots, counts and `end` column: what token_dispatch writes for a buffer of at
    most that many rows. A map from a dispatch into more rows, or written by hand, is refused here;
    kernels given one ignore the entries they cannot follow."""
    expectations = (
        ("rows", rows, -1, num_rows - 1, f"listed rows in [-1, {num_rows}) (inp has {num_rows} rows)"),
        ("slots", slots, -1, num_slots - 1, f"listed slots in [-1, {num_slots})"),
        ("counts", counts, 0, num_slots, f"counts (column {2 * num_slots}) in [0, {num_slots}]"),
        ("end", ends, 0, num_rows, f"end (last column) in [0, {num_rows}]"),
    )
    for what, (low, high), lowest, highest, expected in expectations:
        if low < lowest or high > highest:
            fail(
                "row_id_map",
                f"expected {expected}, got {what} in [{low}, {high}]: a map from another token_dispatch"
                " call, or not from token_dispatch?",
            )
