"""JAX benchmarks of the permutation ops on a named shape: moetriton beside pure-JAX baselines.

Routing as in torch_cases: every token picks K distinct experts uniformly at random (dropless,
num_out_tokens = T * K), bf16 tokens, fp32 probs, a [T, E] bool mask for moetriton. The baseline is
MaxText's formulation ("jax-argsort", moetriton.jax.reference.argsort_dispatch / argsort_combine): the same
routing as [T, K] expert ids, a stable argsort, gathers only, a [T, K, H] weighted sum in fp32; its output
rows equal moetriton's. Chunk sort's baseline is the pure-JAX reference ("jax-ref"), skipped with --quick.

Timing (GPU only; results() returns [] elsewhere): benchmarks.timing.time_jax runs each function on R
independent input sets inside one jax.jit (R chosen so the sets exceed twice the L2, so no call finds its
inputs cached) and reports the median GPU span of a run divided by R, read with CUPTI, with the run queued
behind other GPU work: what the op costs inside a training step's jit, comparable with the PyTorch
CUDA-graph times. The note adds the span with the GPU idle at dispatch ("cold": gaps while the GPU waits for
the host to launch each custom call count) and the host wall time with a sync after every run (Python
dispatch and sync latency included). XLA may overlap or fuse work across the R calls of a baseline (it never
does for moetriton's custom calls), so baseline times are if anything flattering.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.shapes import MoEShape

from .common import Result, token_bytes
from .timing import input_sets, time_jax

DTYPE = jnp.bfloat16


def _routing(shape: MoEShape, key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(mask [T, E], the same routing as ids [T, K] in ascending expert order, probs [T, E] fp32)."""
    score_key, probs_key = jax.random.split(key)
    scores = jax.random.uniform(score_key, (shape.num_tokens, shape.num_experts))
    ids = jnp.sort(jax.lax.top_k(scores, shape.topk)[1], axis=1).astype(jnp.int32)
    mask = jnp.zeros(scores.shape, bool).at[jnp.arange(shape.num_tokens)[:, None], ids].set(True)
    return mask, ids, jax.random.uniform(probs_key, scores.shape, jnp.float32)


def results(shape: MoEShape, quick: bool = False) -> list[Result]:
    import moetriton.jax as mj
    from moetriton.jax import permutation, reference
    from moetriton.jax._sharding import call
    from moetriton.jax.executor import on_gpu

    if not on_gpu():
        return []
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K
    eb = jnp.dtype(DTYPE).itemsize
    map_bytes = T * (E + 1) * 4
    out: list[Result] = []

    def add(op: str, impl: str, fn: Callable, sets: list[tuple], nbytes: int, note: str) -> None:
        timing = time_jax(fn, sets)
        note = f"{note}; cold {timing.cold_ms:.4f} ms, wall {timing.wall_ms:.4f} ms synced"
        out.append(Result(op, "jax", impl, shape.name, timing.device_ms, nbytes, note))

    def make_sets(nbytes: int, build: Callable[[jax.Array], tuple]) -> list[tuple]:
        return [build(key) for key in jax.random.split(jax.random.key(0), input_sets(nbytes))]

    # dispatch: mask + probs -> permuted tokens + probs (map building included)
    dispatch_bytes = (
        token_bytes(T, H, eb) + T * E + T * E * 4 + token_bytes(N, H, eb) + N * 4 + map_bytes + E * 4
    )

    def make_dispatch(key):
        x_key, routing_key = jax.random.split(key)
        mask, ids, probs = _routing(shape, routing_key)
        return jax.random.normal(x_key, (T, H), DTYPE), mask, ids, probs

    sets = make_sets(dispatch_bytes, make_dispatch)
    add(
        "dispatch",
        "moetriton",
        lambda x, mask, ids, probs: mj.token_dispatch(x, mask, N, probs),
        sets,
        dispatch_bytes,
        f"map + permute + probs; {len(sets)} calls per jit",
    )

    def argsort_dispatch(x, mask, ids, probs):
        output, order, group_sizes = reference.argsort_dispatch(x, ids, E)
        return output, jnp.take_along_axis(probs, ids, axis=1).reshape(-1)[order], order, group_sizes

    add(
        "dispatch",
        "jax-argsort",
        argsort_dispatch,
        sets,
        dispatch_bytes,
        f"MaxText-style argsort + gathers, probs gathered too; {len(sets)} calls per jit",
    )

    # combine with merging probs, and its backward
    combine_bytes = token_bytes(N, H, eb) + map_bytes + T * E * 4 + token_bytes(T, H, eb)
    combine_bwd_bytes = token_bytes(T, H, eb) + 2 * token_bytes(N, H, eb) + map_bytes + 2 * T * E * 4

    def make_combine(key):
        out_key, grad_key, routing_key = jax.random.split(key, 3)
        mask, ids, probs = _routing(shape, routing_key)
        _, _, row_map, _, _ = mj.token_dispatch(jnp.zeros((T, 1), DTYPE), mask, N)
        _, order, _ = reference.argsort_dispatch(jnp.zeros((T, 1), DTYPE), ids, E)
        expert_out = jax.random.normal(out_key, (N, H), DTYPE)
        grad = jax.random.normal(grad_key, (T, H), DTYPE)
        return expert_out, row_map, probs, grad, order, jnp.take_along_axis(probs, ids, axis=1)

    sets = make_sets(combine_bwd_bytes, make_combine)
    add(
        "combine",
        "moetriton",
        lambda expert_out, row_map, probs, *_: mj.token_combine(expert_out, row_map, probs),
        sets,
        combine_bytes,
        f"merging probs; {len(sets)} calls per jit",
    )
    add(
        "combine",
        "jax-argsort",
        lambda expert_out, _, __, ___, order, weights: reference.argsort_combine(expert_out, order, weights),
        sets,
        combine_bytes,
        f"MaxText-style inverse gather + fp32 weighted sum; {len(sets)} calls per jit",
    )
    backward = permutation.CombineBackward(num_shards=1, padded=False)
    add(
        "combine_bwd",
        "moetriton",
        lambda expert_out, row_map, probs, grad, *_: call(backward, grad, row_map, expert_out, probs),
        sets,
        combine_bwd_bytes,
        f"act grad + probs grad; {len(sets)} calls per jit",
    )

    def argsort_combine_bwd(expert_out, _, __, grad, order, weights):
        _, vjp = jax.vjp(lambda x, w: reference.argsort_combine(x, order, w), expert_out, weights)
        return vjp(grad)

    add(
        "combine_bwd",
        "jax-argsort",
        argsort_combine_bwd,
        sets,
        combine_bwd_bytes,
        f"jax.vjp of the argsort combine; {len(sets)} calls per jit",
    )

    # chunk sort: rank-major -> expert-major, as after an all-to-all over min(8, E) ranks
    ranks = min(8, E)
    sort_bytes = 2 * token_bytes(N, H, eb) + N * 4

    def make_sort(key):
        x_key, cut_key = jax.random.split(key)
        cuts = jnp.sort(jax.random.randint(cut_key, (E - 1,), 0, N + 1))
        sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, cuts.dtype), cuts, jnp.full(1, N, cuts.dtype)]))
        order = jnp.arange(E).reshape(ranks, E // ranks).T.reshape(-1)
        return jax.random.normal(x_key, (N, H), DTYPE), sizes.astype(jnp.int32), order.astype(jnp.int32)

    sets = make_sets(sort_bytes, make_sort)
    add(
        "chunk_sort",
        "moetriton",
        mj.sort_chunks_by_index,
        sets,
        sort_bytes,
        f"{E} chunks; {len(sets)} calls per jit",
    )
    if not quick:
        add(
            "chunk_sort",
            "jax-ref",
            reference.sort_chunks_by_index,
            sets,
            sort_bytes,
            f"searchsorted map + scatter; {len(sets)} calls per jit",
        )
    return out
