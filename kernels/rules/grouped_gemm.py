"""Argument rules of the grouped GEMM (grouped_matmul), shared by the bindings."""

from __future__ import annotations

from .validation import require_array

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
