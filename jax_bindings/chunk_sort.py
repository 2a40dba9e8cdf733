"""The chunk sort in JAX: sort_chunks_by_index and the sharded op it runs (forward and its inverse, which is
its backward), defined by what one row shard computes.

The public function has the same name, arguments, results and row_id_map format as moetriton.torch's, plus a
keyword-only `num_shards` (static) that gives it per-shard semantics: with num_shards = n, the row axis of
the rows and probs, and the sizes and the order, are n equal blocks, each block is sorted as an independent
call, and every result is the concatenation of the n blocks' results along its first axis. See docs/jax.md.
A shard runs the kernel's launch plan (compiled on GPU, interpreted on CPU) or the pure-JAX reference;
`_sharding` turns the one-shard definition into unsharded, partitioned and batched execution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from moetriton import kernels
from moetriton.kernels.rules import chunk_sort as rules

from . import reference
from ._checks import check_shards, check_values
from ._sharding import HIDDEN, ShardedOp, call, explicit_results, on_explicit_mesh
from .executor import described, run_builder

_op = dataclasses.dataclass(frozen=True, kw_only=True)


@_op
class SortChunks(ShardedOp):
    """sort_chunks_by_index: output chunk j is input chunk sorted_indices[j]; `backward` applies the inverse
    permutation (a gather through the same map) and returns no map."""

    has_probs: bool
    backward: bool

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "inp": ("r", HIDDEN),
        "split_sizes": ("c",),
        "sorted_indices": ("c",),
        "probs": ("r",),
        "output": ("r", HIDDEN),
        "row_id_map": ("r",),
        "permuted_probs": ("r",),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return ("inp", "split_sizes", "sorted_indices") + ("probs",) * self.has_probs

    @property
    def results(self) -> tuple[str, ...]:
        return ("output",) + ("row_id_map",) * (not self.backward) + ("permuted_probs",) * self.has_probs

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        inp, sizes, order, probs = (
            arrays.get(name) for name in ("inp", "split_sizes", "sorted_indices", "probs")
        )
        if use_kernels:
            inputs = dict(inp=inp, split_sizes=sizes, sorted_indices=order, probs=probs)
            out = run_builder(kernels.sort_chunks_plan, inputs, backward=self.backward)
        else:
            values = reference.sort_chunks(inp, sizes, order, probs, self.backward)
            out = dict(zip(("output", "row_id_map", "permuted_probs"), values, strict=True))
        return {name: out[name] for name in self.results}


# public functions ----------------------------------------------------------------------------------------


def _split_rule(num_shards: int, num_rows: int) -> Callable[[np.ndarray, np.ndarray], None]:
    def rule(sizes: np.ndarray, order: np.ndarray) -> None:
        for shard_sizes, shard_order in zip(
            np.split(sizes, num_shards), np.split(order, num_shards), strict=True
        ):
            rules.check_split_values(shard_sizes.tolist(), shard_order.tolist(), num_rows)

    return rule


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sort_chunks(op: SortChunks, inp, split_sizes, sorted_indices, probs):
    return call(op, *(x for x in (inp, split_sizes, sorted_indices, probs) if x is not None))


def _sort_chunks_fwd(op, inp, split_sizes, sorted_indices, probs):
    return _sort_chunks(op, inp, split_sizes, sorted_indices, probs), (split_sizes, sorted_indices)


def _sort_chunks_bwd(op, residuals, cotangents):
    split_sizes, sorted_indices = residuals
    named = dict(zip(op.results, cotangents, strict=True))
    inverse = dataclasses.replace(op, backward=True)
    probs = (named["permuted_probs"],) if op.has_probs else ()
    args = (named["output"], split_sizes, sorted_indices, *probs)
    grads = dict(zip(inverse.results, call(inverse, *args), strict=True))
    return grads["output"], None, None, grads.get("permuted_probs")


_sort_chunks.defvjp(_sort_chunks_fwd, _sort_chunks_bwd)


def sort_chunks_by_index(
    inp: jax.Array,
    split_sizes: jax.Array,
    sorted_indices: jax.Array,
    probs: jax.Array | None = None,
    *,
    num_shards: int = 1,
) -> tuple:
    """Reorder row chunks: output chunk j is input chunk sorted_indices[j] (e.g. rank-major -> expert-major
    after an expert-parallel all-to-all).

    Args:
        inp: [N, H] rows; any float or FP8 dtype (moved bit for bit).
        split_sizes: [n * S] int32/int64 chunk sizes, shard-major; a shard's rows past their sum stay put.
        sorted_indices: [n * S] int32/int64, each shard's S entries a permutation of [0, S).
        probs: optional [N] per-row values permuted alongside.
        num_shards: n, a static Python int: each of the n row blocks is sorted by its own S sizes and indices.
            Sizes and indices are checked when their values are free to read (concrete CPU arrays, or
            MOETRITON_CHECK=1); elsewhere a shard whose sizes leave [0, N / n], sum past it, or whose order
            is not a permutation moves nothing: zero rows and probs, row_id_map -1, zero gradient.

    Returns:
        (output [N, H], row_id_map [N] int32 destination of each input row within its shard's block[,
        permuted_probs [N]]).

    Example:
        >>> x = jnp.arange(6.0).reshape(6, 1)
        >>> out, _ = sort_chunks_by_index(x, jnp.array([2, 3, 1]), jnp.array([2, 0, 1]))
        >>> out[:, 0].tolist()
        [5.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    """
    rules.check_sort_chunks(
        **described(inp=inp, split_sizes=split_sizes, sorted_indices=sorted_indices, probs=probs)
    )
    check_shards(
        num_shards, ("inp", "shape[0]", inp.shape[0]), ("split_sizes", "its length", split_sizes.shape[0])
    )
    check_values(_split_rule(num_shards, inp.shape[0] // num_shards), split_sizes, sorted_indices)
    op = SortChunks(num_shards=num_shards, has_probs=probs is not None, backward=False)
    arrays = (
        jnp.asarray(inp),
        jnp.asarray(split_sizes),
        jnp.asarray(sorted_indices),
        None if probs is None else jnp.asarray(probs),
    )
    results = on_explicit_mesh(partial(_sort_chunks, op), explicit_results(op, *arrays))(*arrays)
    return tuple(results)
