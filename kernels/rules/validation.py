"""Argument rules shared by both bindings.

Bindings describe arrays as (shape, dtype name) with numpy-style dtype names ("bfloat16", "float8_e4m3fn",
"bool", "int32", ...) and call these functions before launching. Every error names the argument and what
was expected. Rules on index values (expert ids, row maps, split sizes) take the values' extremes or
lists; the bindings decide when to read them: where reading is free (CPU arrays outside tracing), or on
every call when CHECK_VALUES is on. Elsewhere the kernels apply the index rule of docs/design.md ("Index
data is never trusted"): a bad index is ignored, never followed out of a buffer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import NamedTuple

from .expert_parallel import GATED_ACTIVATIONS
from .layout import bitmap_columns, row_map_slots

#: The debug switch MOETRITON_CHECK=1 (read at import): every call reads the index data it is given (expert
#: ids, row maps, split sizes and orders) and raises ValueError for values the rules below refuse, on the
#: GPU too, at the price of a device-to-host copy and a sync per call. Off by default: the hot path reads
#: no device value.
CHECK_VALUES = os.environ.get("MOETRITON_CHECK", "0") not in ("", "0")

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
MASK_DTYPES = ("bool", *INT_DTYPES)
INDEX_DTYPES = ("int32", "int64")
#: Layouts of a routing map: "bytemap" bool [T, E]; "bitmap" uint8 [T, ceil(E / 8)], bit e % 8 of byte
#: e // 8 set when the token routes to expert e (LSB first, unused high bits 0; TE's BITMAP_U8).
ROUTING_MAP_FORMATS = ("bytemap", "bitmap")
#: Other spellings a routing-map format is accepted in: TE's names (strings, or an enum member's name).
_FORMAT_ALIASES = {"bitmap_u8": "bitmap"}


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def not_an_array(value, expected: str) -> tuple[None, str]:
    """How a binding describes an argument that is not one of its arrays (a list, a numpy array given to
    PyTorch): the rules raise TypeError for it, naming the argument and `expected` (e.g. "a torch.Tensor")."""
    return None, f"expected {expected}, got {type(value).__module__}.{type(value).__qualname__}"


def require_array(name: str, description: tuple | None) -> None:
    """TypeError when `description` is `not_an_array`'s."""
    if description is not None and description[0] is None:
        raise TypeError(f"{name}: {description[1]}")


def check_array(name: str, shape: tuple[int, ...], dtype: str, *, ndim: int, dtypes: tuple[str, ...]) -> None:
    require_array(name, (shape, dtype))
    if len(shape) != ndim:
        _fail(name, f"expected a {ndim}-D array, got shape {tuple(shape)}")
    if dtype not in dtypes:
        _fail(name, f"expected dtype in {dtypes}, got {dtype}")


def check_dim(name: str, got: int, expected: int, what: str) -> None:
    if got != expected:
        _fail(name, f"expected {what} = {expected}, got {got}")


def check_positive(name: str, value: int | None, *, allow_zero: bool = False) -> None:
    if value is None:
        _fail(name, "required (a Python int)")
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(name, f"expected a Python int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        _fail(name, f"expected {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_routing_map_format(routing_map_format) -> str:
    """The neutral name ("bytemap" or "bitmap") of a routing-map format given as one of those strings, TE's
    "bitmap_u8", or an enum member named BYTEMAP or BITMAP_U8 (TE's RoutingMapFormat), in any case."""
    name = (
        routing_map_format
        if isinstance(routing_map_format, str)
        else getattr(routing_map_format, "name", None)
    )
    normalised = name.lower() if isinstance(name, str) else None
    normalised = _FORMAT_ALIASES.get(normalised, normalised)
    if normalised not in ROUTING_MAP_FORMATS:
        _fail(
            "routing_map_format",
            f"expected one of {ROUTING_MAP_FORMATS} (or TE's 'bitmap_u8' / RoutingMapFormat), "
            f"got {routing_map_format!r}",
        )
    return normalised


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
            _fail("routing_map_format", "'bitmap' describes a routing_map; got indices")
        check_array("routing_map", *routing_map, ndim=2, dtypes=("uint8",))
        check_dim("routing_map", routing_map[0][0], num_tokens, "shape[0] (tokens, as inp)")
        if num_experts is None:
            _fail("num_experts", "required with a bitmap routing_map (E cannot be read from ceil(E / 8))")
        check_positive("num_experts", num_experts)
        check_dim("routing_map", routing_map[0][1], bitmap_columns(num_experts), "shape[1] = ceil(E / 8)")
        num_slots = num_experts
    elif routing_map is not None:
        check_array("routing_map", *routing_map, ndim=2, dtypes=MASK_DTYPES)
        check_dim("routing_map", routing_map[0][0], num_tokens, "shape[0] (tokens, as inp)")
        num_slots = routing_map[0][1]
        if num_experts is not None and num_experts != num_slots:
            _fail("num_experts", f"expected {num_slots} (routing_map.shape[1]) or None, got {num_experts}")
        num_experts = num_slots
        check_positive("routing_map.shape[1] (num_experts)", num_experts)
    else:
        check_array("indices", *indices, ndim=2, dtypes=INDEX_DTYPES)
        check_dim("indices", indices[0][0], num_tokens, "shape[0] (tokens, as inp)")
        num_slots = indices[0][1]
        if num_out_tokens is None and capacity is None:
            num_out_tokens = num_tokens * num_slots
        if num_experts is None:
            _fail("num_experts", "required with indices (the number of experts E; ids lie in [-1, E))")
        if not symbolic_experts:
            check_positive("num_experts", num_experts)
    if capacity is not None:
        check_positive("capacity", capacity)
        if num_out_tokens is not None:
            _fail(
                "num_out_tokens",
                f"expected None with capacity (the buffer has E * capacity rows), got {num_out_tokens}",
            )
        if align_size is not None:
            _fail("align_size", "expected None with capacity (pad by choosing capacity a multiple of it)")
    else:
        check_positive("num_out_tokens", num_out_tokens, allow_zero=True)
    if probs is not None:
        check_array("probs", *probs, ndim=2, dtypes=FLOAT_DTYPES)
        if tuple(probs[0]) != (num_tokens, num_slots):
            _fail(
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
        _fail("row_id_map", f"expected shape [T, 2S + 2] (from token_dispatch), got {row_id_map[0]}")
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
            _fail(
                "merging_probs",
                f"expected shape {(num_tokens, num_slots)} (the routing layout of row_id_map), "
                f"got {tuple(merging_probs[0])}",
            )
    if pad_offsets is not None:
        check_array("pad_offsets", *pad_offsets, ndim=1, dtypes=INDEX_DTYPES)
    return num_tokens, num_slots


def check_sort_chunks(
    *,
    inp: tuple[tuple[int, ...], str],
    split_sizes: tuple[tuple[int, ...], str],
    sorted_indices: tuple[tuple[int, ...], str],
    probs: tuple[tuple[int, ...], str] | None,
) -> int:
    """Validates sort_chunks_by_index arguments; returns the number of splits."""
    check_array("inp", *inp, ndim=2, dtypes=FLOAT_DTYPES + FP8_DTYPES)
    check_array("split_sizes", *split_sizes, ndim=1, dtypes=INDEX_DTYPES)
    check_array("sorted_indices", *sorted_indices, ndim=1, dtypes=INDEX_DTYPES)
    num_splits = split_sizes[0][0]
    check_dim("sorted_indices", sorted_indices[0][0], num_splits, "length (as split_sizes)")
    if probs is not None:
        check_array("probs", *probs, ndim=1, dtypes=FLOAT_DTYPES)
        check_dim("probs", probs[0][0], inp[0][0], "length (rows of inp)")
    return num_splits


def check_index_values(min_id: int, max_id: int, num_experts: int) -> None:
    """Range rule of expert ids, for bindings that can read the values cheaply."""
    if min_id < -1 or max_id >= num_experts:
        _fail("indices", f"expected expert ids in [-1, {num_experts}), got values in [{min_id}, {max_id}]")


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
            _fail(
                "row_id_map",
                f"expected {expected}, got {what} in [{low}, {high}]: a map from another token_dispatch"
                " call, or not from token_dispatch?",
            )


def check_split_values(sizes: list[int], order: list[int], num_rows: int) -> None:
    """Value rules of chunk sort, for bindings that can read the values cheaply."""
    if any(size < 0 for size in sizes):
        _fail("split_sizes", f"expected sizes >= 0, got {sizes}")
    if sum(sizes) > num_rows:
        _fail("split_sizes", f"expected a sum <= {num_rows} (rows of inp), got {sum(sizes)}")
    if sorted(order) != list(range(len(sizes))):
        _fail("sorted_indices", f"expected a permutation of [0, {len(sizes)}), got {order}")


GROUPED_MATMUL_DTYPES = ("bfloat16", "float16", "float32")


def check_grouped_matmul(
    *,
    lhs: tuple[tuple[int, ...], str],
    rhs: tuple[tuple[int, ...], str],
    group_sizes: tuple[tuple[int, ...], str],
    lhs_rows: tuple[tuple[int, ...], str] | None = None,
    out_rows: tuple[tuple[int, ...], str] | None = None,
) -> None:
    """Validates grouped_matmul operands: lhs [M, K], rhs [E, K, N] of one float dtype, group_sizes [E]
    integers, E >= 1, the row permutations (None or [M] integers). Shape errors raise ValueError, dtype
    errors TypeError."""
    for name, description in (
        ("lhs", lhs),
        ("rhs", rhs),
        ("group_sizes", group_sizes),
        ("lhs_rows", lhs_rows),
        ("out_rows", out_rows),
    ):
        require_array(name, description)
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype), (sizes_shape, sizes_dtype) = lhs, rhs, group_sizes
    if len(lhs_shape) != 2 or len(rhs_shape) != 3 or len(sizes_shape) != 1:
        raise ValueError(
            "grouped_matmul: expected lhs [M, K], rhs [E, K, N] and group_sizes [E], got shapes "
            f"{lhs_shape}, {rhs_shape}, {sizes_shape}"
        )
    if lhs_shape[1] != rhs_shape[1] or rhs_shape[0] != sizes_shape[0]:
        raise ValueError(
            f"grouped_matmul: lhs {lhs_shape}, rhs {rhs_shape} and group_sizes {sizes_shape} disagree "
            "(need lhs [M, K], rhs [E, K, N], group_sizes [E])"
        )
    if rhs_shape[0] == 0:
        raise ValueError("grouped_matmul: rhs needs at least one group")
    if lhs_dtype != rhs_dtype or lhs_dtype not in GROUPED_MATMUL_DTYPES:
        raise TypeError(
            f"grouped_matmul: lhs and rhs must share one of bfloat16, float16, float32; got {lhs_dtype} "
            f"and {rhs_dtype}"
        )
    if not sizes_dtype.startswith(("int", "uint")):
        raise TypeError(f"grouped_matmul: group_sizes must be integers, got {sizes_dtype}")
    for name, rows in (("lhs_rows", lhs_rows), ("out_rows", out_rows)):
        if rows is None:
            continue
        if rows[0] != (lhs_shape[0],):
            raise ValueError(f"grouped_matmul: {name} must be [M] = ({lhs_shape[0]},), got {rows[0]}")
        if not rows[1].startswith(("int", "uint")):
            raise TypeError(f"grouped_matmul: {name} must be integers, got {rows[1]}")


def check_grouped_activation(
    *, hidden: tuple[tuple[int, ...], str], group_sizes: tuple[tuple[int, ...], str], activation: str
) -> None:
    """Validates grouped_activation's arguments: an activation of GATED_ACTIVATIONS, hidden [M, W] in
    bfloat16 / float16 / float32 (W even for a gated activation), group_sizes [E] integers. ValueError."""
    if activation not in GATED_ACTIVATIONS:
        _fail("activation", f"expected one of {tuple(GATED_ACTIVATIONS)}, got {activation!r}")
    require_array("hidden", hidden)
    require_array("group_sizes", group_sizes)
    (hidden_shape, hidden_dtype), (sizes_shape, sizes_dtype) = hidden, group_sizes
    if len(hidden_shape) != 2 or len(sizes_shape) != 1:
        raise ValueError(
            "grouped_activation: expected hidden [M, W] and group_sizes [E], got shapes"
            f" {tuple(hidden_shape)} and {tuple(sizes_shape)}"
        )
    if hidden_dtype not in GROUPED_MATMUL_DTYPES:
        _fail("hidden", f"expected bfloat16, float16 or float32, got {hidden_dtype}")
    if not sizes_dtype.startswith(("int", "uint")):
        _fail("group_sizes", f"expected an integer dtype, got {sizes_dtype}")
    if GATED_ACTIVATIONS[activation] and hidden_shape[1] % 2:
        _fail("hidden", f"expected an even width 2F for {activation!r}, got {hidden_shape[1]}")
