"""Argument rules of the chunk sort (sort_chunks_by_index), shared by both bindings: shapes and dtypes, and
the value rules of split sizes and orders."""

from __future__ import annotations

from .validation import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, check_array, check_dim, fail


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


def check_split_values(sizes: list[int], order: list[int], num_rows: int) -> None:
    """Value rules of chunk sort, for bindings that can read the values cheaply."""
    if any(size < 0 for size in sizes):
        fail("split_sizes", f"expected sizes >= 0, got {sizes}")
    if sum(sizes) > num_rows:
        fail("split_sizes", f"expected a sum <= {num_rows} (rows of inp), got {sum(sizes)}")
    if sorted(order) != list(range(len(sizes))):
        fail("sorted_indices", f"expected a permutation of [0, {len(sizes)}), got {order}")
