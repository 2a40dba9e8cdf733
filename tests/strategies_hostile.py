"""Hostile index data (framework-neutral numpy), for the index rule of docs/design.md: every index a kernel
reads from data is checked against the buffer it addresses, and a bad one is ignored, never followed.

Each strategy draws a small problem whose index arrays hold values a user can build by mistake or on
purpose: out of range on either side, negative, huge (past int32 where the dtype allows), duplicated, and
maps from another call (a dispatch into more rows than the buffer given to combine). Shapes stay small: the
kernels run under the Triton interpreter on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

INT32_MAX = 2**31 - 1


def _bad_values(limit: int, wide: bool) -> list[int]:
    """Values outside [0, limit) (or [-1, limit)), near and far, as int32 allows; int64 ones with `wide`."""
    values = [-(2**31), -7, -2, limit, limit + 1, limit + 100, 2**28, INT32_MAX]
    if wide:
        values += [2**32, 2**32 + 1, 2**40, -(2**40)]
    return values


@dataclass(frozen=True)
class RowMapProblem:
    """A row map [T, 2S + 2] for a buffer of `num_rows` rows, corrupted by `corruption`."""

    num_tokens: int
    num_slots: int
    num_rows: int
    hidden: int
    corruption: str
    row_map: np.ndarray  # [T, 2S + 2] int32
    rows: np.ndarray  # [N, H] float32 (combine input)
    weights: np.ndarray  # [T, S] float32
    grad: np.ndarray  # [T, H] float32 (the gradient of combine's output)
    permuted_probs: np.ndarray  # [N] float32 (the probs cotangent of dispatch's backward)


ROW_MAP_CORRUPTIONS = ("rows", "slots", "counts", "end", "foreign", "duplicates", "random", "valid")


def _valid_row_map(rng: np.random.Generator, num_tokens: int, num_slots: int, num_rows: int) -> np.ndarray:
    """A map token_dispatch could write: each token lists some distinct slots (ascending) with distinct
    rows below num_rows, then -1; the count; and end (the rows used)."""
    columns = 2 * num_slots + 2
    row_map = np.full((num_tokens, columns), -1, np.int64)
    free = rng.permutation(num_rows)
    used = 0
    for token in range(num_tokens):
        count = int(rng.integers(0, min(num_slots, num_rows - used) + 1))
        slots = np.sort(rng.choice(num_slots, size=count, replace=False))
        row_map[token, :count] = free[used : used + count]
        row_map[token, num_slots : num_slots + count] = slots
        row_map[token, 2 * num_slots] = count
        used += count
    row_map[:, 2 * num_slots + 1] = min(num_rows, used + int(rng.integers(0, 3)))
    return row_map


@st.composite
def row_map_problems(draw, corruptions: tuple[str, ...] = ROW_MAP_CORRUPTIONS) -> RowMapProblem:
    num_tokens = draw(st.integers(1, 6))
    num_slots = draw(st.integers(1, 4))
    num_rows = draw(st.integers(1, 12))
    hidden = draw(st.sampled_from([1, 8, 20]))
    corruption = draw(st.sampled_from(corruptions))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row_map = _valid_row_map(rng, num_tokens, num_slots, num_rows)
    lists = row_map[:, : 2 * num_slots]
    picks = rng.random((num_tokens, num_slots)) < 0.5
    if corruption == "rows":
        bad = rng.choice(_bad_values(num_rows, False), size=picks.shape)
        lists[:, :num_slots] = np.where(picks, bad, lists[:, :num_slots])
    elif corruption == "slots":
        bad = rng.choice(_bad_values(num_slots, False), size=picks.shape)
        lists[:, num_slots:] = np.where(picks, bad, lists[:, num_slots:])
    elif corruption == "counts":
        row_map[:, 2 * num_slots] = rng.choice(
            [-(2**31), -3, 0, num_slots, num_slots + 5, INT32_MAX], num_tokens
        )
    elif corruption == "end":
        row_map[:, 2 * num_slots + 1] = rng.choice([-(2**31), -100, 0, num_rows + 5, INT32_MAX])
    elif corruption == "foreign":
        # The map of a dispatch into a buffer three times as tall: rows past this buffer.
        row_map = _valid_row_map(rng, num_tokens, num_slots, 3 * num_rows)
    elif corruption == "duplicates":
        lists[:, :num_slots] = np.where(picks, lists[0, 0], lists[:, :num_slots])
        lists[:, num_slots:] = np.where(picks, lists[0, num_slots], lists[:, num_slots:])
        row_map[:, 2 * num_slots] = num_slots
    elif corruption == "random":
        row_map = rng.choice(_bad_values(num_rows, False) + list(range(-1, num_rows)), size=row_map.shape)
    return RowMapProblem(
        num_tokens=num_tokens,
        num_slots=num_slots,
        num_rows=num_rows,
        hidden=hidden,
        corruption=corruption,
        row_map=row_map.astype(np.int32),
        rows=rng.normal(size=(num_rows, hidden)).astype(np.float32),
        weights=rng.random((num_tokens, num_slots)).astype(np.float32),
        grad=rng.normal(size=(num_tokens, hidden)).astype(np.float32),
        permuted_probs=rng.random(num_rows).astype(np.float32),
    )


def row_owners(problem: RowMapProblem) -> tuple[np.ndarray, np.ndarray]:
    """(owner token [N] (-1: none), entries naming each row [N]) under the index rule: a token's first
    clamp(count, 0, S) entries, those with a row in [0, N)."""
    num_slots, num_rows = problem.num_slots, problem.num_rows
    owner = np.full(num_rows, -1)
    named = np.zeros(num_rows, np.int64)
    for token, entries in enumerate(problem.row_map):
        count = min(max(int(entries[2 * num_slots]), 0), num_slots)
        for row in entries[:count]:
            if 0 <= row < num_rows:
                owner[row] = token
                named[row] += 1
    return owner, named


def clamped_end(problem: RowMapProblem) -> int:
    """Where the zero fill of an unpadded backward starts: token 0's `end`, clamped into [0, N]."""
    return min(max(int(problem.row_map[0, -1]), 0), problem.num_rows)


@dataclass(frozen=True)
class IdsProblem:
    """Expert ids [T, K] (int32 or int64) with values outside [-1, E) mixed in."""

    num_tokens: int
    num_experts: int
    hidden: int
    ids: np.ndarray
    tokens: np.ndarray  # [T, H] float32
    probs: np.ndarray  # [T, K] float32


@st.composite
def ids_problems(draw, dtypes: tuple[str, ...] = ("int32", "int64")) -> IdsProblem:
    num_tokens = draw(st.integers(1, 8))
    num_experts = draw(st.integers(1, 5))
    topk = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    good = rng.integers(-1, num_experts, (num_tokens, topk))
    bad = rng.choice(_bad_values(num_experts, dtype == "int64"), size=(num_tokens, topk))
    ids = np.where(rng.random((num_tokens, topk)) < 0.4, bad, good).astype(dtype)
    return IdsProblem(
        num_tokens=num_tokens,
        num_experts=num_experts,
        hidden=draw(st.sampled_from([4, 16])),
        ids=ids,
        tokens=rng.normal(size=(num_tokens, 16)).astype(np.float32),
        probs=rng.random((num_tokens, topk)).astype(np.float32),
    )


@dataclass(frozen=True)
class SplitProblem:
    """Chunk sort arguments over N rows: split sizes and an order, a partition or not."""

    num_rows: int
    hidden: int
    sizes: np.ndarray  # [S]
    order: np.ndarray  # [S]
    rows: np.ndarray  # [N, H] float32
    probs: np.ndarray  # [N] float32


SPLIT_CORRUPTIONS = ("overrun", "huge", "negative", "repeated", "missing", "out_of_range", "valid")


def is_partition(sizes: np.ndarray, order: np.ndarray, num_rows: int) -> bool:
    """The rule's partition: sizes in [0, N] summing to at most N, the order a permutation of [0, S)."""
    sizes = [int(size) for size in sizes]
    return (
        all(0 <= size <= num_rows for size in sizes)
        and sum(sizes) <= num_rows
        and sorted(int(index) for index in order) == list(range(len(sizes)))
    )


@st.composite
def split_problems(draw, dtypes: tuple[str, ...] = ("int32", "int64")) -> SplitProblem:
    num_rows = draw(st.integers(1, 12))
    num_splits = draw(st.integers(1, 5))
    hidden = draw(st.sampled_from([1, 8, 20]))
    corruption = draw(st.sampled_from(SPLIT_CORRUPTIONS))
    dtype = draw(st.sampled_from(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cuts = np.sort(rng.integers(0, num_rows + 1, num_splits))
    sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int64)
    order = rng.permutation(num_splits).astype(np.int64)
    slot = int(rng.integers(num_splits))
    if corruption == "overrun":
        sizes[slot] += num_rows
    elif corruption == "huge":
        sizes[slot] = 2**32 + 3 if dtype == "int64" else INT32_MAX
    elif corruption == "negative":
        sizes[slot] = -int(rng.integers(1, 2**31 - 1))
    elif corruption == "repeated" and num_splits > 1:
        order[slot] = order[(slot + 1) % num_splits]
    elif corruption == "missing":
        order[slot] = num_splits + int(rng.integers(0, 3))
    elif corruption == "out_of_range":
        order[slot] = rng.choice([-1, -(2**31), INT32_MAX])
    return SplitProblem(
        num_rows=num_rows,
        hidden=hidden,
        sizes=sizes.astype(dtype),
        order=order.astype(dtype),
        rows=rng.normal(size=(num_rows, hidden)).astype(np.float32),
        probs=rng.random(num_rows).astype(np.float32),
    )


@st.composite
def group_sizes(draw, num_rows: int, num_groups: int) -> np.ndarray:
    """Group sizes [E] int64 for M rows, with negative, oversized and past-int32 entries mixed in."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    good = rng.integers(0, num_rows + 1, num_groups)
    bad = rng.choice([-(2**40), -5, num_rows + 3, 2**32 + 1, 2**40], num_groups)
    return np.where(rng.random(num_groups) < 0.5, bad, good).astype(np.int64)


def clip_group_sizes(sizes: np.ndarray, num_rows: int) -> list[int]:
    """The grouped kernels' rule: each size clipped into [0, M], then the groups cut at M."""
    clipped, start = [], 0
    for size in sizes:
        size = min(max(int(size), 0), num_rows)
        clipped.append(min(size, num_rows - start))
        start += clipped[-1]
    return clipped
