"""Shared hypothesis strategies (framework-neutral: numpy arrays plus sizes).

`routing_problems()` draws a routing problem: tokens, a mask or index map over E experts, probs, a dtype,
padding and an output size, including the corner cases the design lists: empty experts, every token on one
expert, tokens with no expert, K = E, T in {0, 1}, H = 0 and odd H, fp8 payloads, index maps with -1,
truncation.
Arrays come from a seeded numpy generator, so examples stay small to shrink and cheap to draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes ships with jax
    ml_dtypes = None

PAYLOAD_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
#: Memory layouts an input can arrive in, same values (see tests/torch/_helpers.relayout):
#: "transposed" storage (column-major), "row_slice" (every other row of a taller buffer), "column_slice"
#: (an interior column range of a wider buffer: a row stride and an unaligned start).
LAYOUTS = ("contiguous", "transposed", "row_slice", "column_slice")
#: Layouts of cotangents: also "expanded" (one value broadcast with stride 0, the gradient of `out.sum()`).
COTANGENT_LAYOUTS = (*LAYOUTS, "expanded")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PATTERNS = ("random", "one_expert", "no_expert", "all_experts", "empty_experts", "sparse")


@dataclass(frozen=True)
class RoutingProblem:
    num_tokens: int
    hidden: int
    num_experts: int
    topk: int
    kind: str  # "mask" or "indices"
    pattern: str
    dtype: str
    align_size: int | None
    num_out_tokens: int
    tokens: np.ndarray  # [T, H] float32 values (cast to `dtype` by the caller)
    routing: np.ndarray  # [T, E] bool or [T, K] int32
    probs: np.ndarray  # [T, S] float32

    @property
    def num_slots(self) -> int:
        return self.routing.shape[1]

    @property
    def routed(self) -> int:
        return int(self.routing.sum()) if self.kind == "mask" else int((self.routing >= 0).sum())


def _topk_ids(
    rng: np.random.Generator, num_tokens: int, num_experts: int, topk: int, pattern: str
) -> np.ndarray:
    """[T, K] distinct expert ids per token, shaped by `pattern`; -1 marks a slot with no expert."""
    scores = rng.random((num_tokens, num_experts))
    if pattern == "one_expert":
        scores[:, rng.integers(num_experts)] += 2.0
    if pattern == "empty_experts" and num_experts > topk:
        banned = rng.choice(num_experts, size=max(1, (num_experts - topk) // 2), replace=False)
        scores[:, banned] -= 2.0
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :topk].astype(np.int32)
    if pattern == "no_expert" and num_tokens:
        ids[rng.random(num_tokens) < 0.5] = -1
    if pattern == "sparse":
        ids[rng.random(ids.shape) < 0.3] = -1
    return ids


def _payload(rng: np.random.Generator, num_tokens: int, hidden: int) -> np.ndarray:
    # Small integers times powers of two: exact in every float dtype, fp8 included, so casts lose nothing.
    mantissa = rng.integers(-7, 8, size=(num_tokens, hidden))
    return (mantissa * 2.0 ** rng.integers(-3, 3, size=(num_tokens, hidden))).astype(np.float32)


@st.composite
def routing_problems(
    draw,
    *,
    max_tokens: int = 24,
    max_hidden: int = 40,
    max_experts: int = 9,
    kinds: tuple[str, ...] = ("mask", "indices"),
    dtypes: tuple[str, ...] = PAYLOAD_DTYPES,
    padding: tuple[bool, ...] = (False, True),
) -> RoutingProblem:
    num_tokens = draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, max_tokens)))
    hidden = draw(st.one_of(st.sampled_from([0, 1, 3, 8, 16]), st.integers(1, max_hidden)))
    num_experts = draw(st.integers(1, max_experts))
    pattern = draw(st.sampled_from(PATTERNS))
    topk = num_experts if pattern == "all_experts" else draw(st.integers(1, num_experts))
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    align_size = draw(st.sampled_from([None, 1, 2, 4, 16])) if draw(st.sampled_from(padding)) else None
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    ids = _topk_ids(rng, num_tokens, num_experts, topk, pattern)
    if kind == "mask":
        routing = np.zeros((num_tokens, num_experts), dtype=bool)
        rows, cols = np.nonzero(ids >= 0)
        routing[rows, ids[rows, cols]] = True
    else:
        routing = ids
    routed = int(routing.sum()) if kind == "mask" else int((routing >= 0).sum())
    capacity = draw(st.sampled_from(["exact", "exact", "tail", "truncate"]))
    num_out_tokens = {
        "exact": routed,
        "tail": routed + draw(st.integers(1, 5)),
        "truncate": max(0, routed - draw(st.integers(1, 4))),
    }[capacity]
    probs = rng.random(routing.shape).astype(np.float32)
    return RoutingProblem(
        num_tokens=num_tokens,
        hidden=hidden,
        num_experts=num_experts,
        topk=topk,
        kind=kind,
        pattern=pattern,
        dtype=dtype,
        align_size=align_size,
        num_out_tokens=num_out_tokens,
        tokens=_payload(rng, num_tokens, hidden),
        routing=routing,
        probs=probs,
    )


@dataclass(frozen=True)
class ChunkProblem:
    num_rows: int
    hidden: int
    dtype: str
    split_sizes: np.ndarray  # [S] int64
    sorted_indices: np.ndarray  # [S] int64
    rows: np.ndarray  # [N, H] float32
    probs: np.ndarray  # [N] float32


@st.composite
def chunk_problems(draw, *, max_splits: int = 12, max_rows: int = 40, dtypes=PAYLOAD_DTYPES) -> ChunkProblem:
    num_splits = draw(st.integers(0, max_splits))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = rng.integers(0, 6, size=num_splits)
    if num_splits and draw(st.booleans()):
        sizes[rng.random(num_splits) < 0.3] = 0  # empty chunks
    extra = draw(st.integers(0, 4))  # rows past the chunks, which stay in place
    num_rows = min(int(sizes.sum()) + extra, max_rows + extra)
    if sizes.sum() > num_rows:
        sizes[:] = 0
    hidden = draw(st.one_of(st.sampled_from([0, 1, 5, 8]), st.integers(1, 24)))
    return ChunkProblem(
        num_rows=num_rows,
        hidden=hidden,
        dtype=draw(st.sampled_from(dtypes)),
        split_sizes=sizes.astype(np.int64),
        sorted_indices=rng.permutation(num_splits).astype(np.int64),
        rows=_payload(rng, num_rows, hidden),
        probs=rng.random(num_rows).astype(np.float32),
    )


def numpy_dtype(name: str):
    """numpy dtype for a dtype name (bfloat16 and fp8 through ml_dtypes)."""
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return getattr(ml_dtypes, name)
    return np.dtype(name)


def layouts(cotangent: bool = False) -> st.SearchStrategy[str]:
    """A memory layout for the inputs (or, with `cotangent`, for a gradient handed to a backward op)."""
    return st.sampled_from(COTANGENT_LAYOUTS if cotangent else LAYOUTS)
