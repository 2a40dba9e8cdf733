"""Shapes of the permuted buffers and of the row map, from an op's static arguments: what the plans, the
bindings, the references and the MoE layer's sizes all compute them from (arithmetic on Python ints, and
elementwise on integer arrays of any framework)."""

from __future__ import annotations


def row_map_columns(num_slots: int) -> int:
    """Columns of the row map of S slots per token: the list of their rows, the list of the slots, the
    count of listed slots and `end`."""
    return 2 * num_slots + 2


def row_map_slots(columns: int) -> int:
    """S, the slots per token, of a row map with `columns` columns (see `row_map_columns`)."""
    return (columns - 2) // 2


def round_up(values, multiple: int):
    """`values` (a Python int, or an integer array of numpy, PyTorch or JAX) each rounded up to a multiple of
    `multiple`: per-expert row counts padded to the alignment."""
    return (values + (multiple - 1)) // multiple * multiple


def buffer_rows(
    num_out_tokens: int | None, num_experts: int, align_size: int | None, capacity: int | None = None
) -> int:
    """Rows of the permuted buffer: `num_out_tokens`, or with padding the static worst case
    floor((num_out_tokens + E * (A - 1)) / A) * A, which always holds the padded layout of
    `num_out_tokens` routed slots (the padded total is a multiple of A and at most that bound), or with a
    capacity E * capacity (`num_out_tokens` unused)."""
    if capacity is not None:
        return num_experts * capacity
    if align_size is None:
        return num_out_tokens
    return (num_out_tokens + num_experts * (align_size - 1)) // align_size * align_size


def bitmap_columns(num_experts: int) -> int:
    """Bytes per token of a bit-packed routing map of E experts (uint8 [T, ceil(E / 8)], bit e % 8 of byte
    e // 8 set when the token routes to expert e)."""
    return (num_experts + 7) // 8
