"""Where a moetriton.jax call spends its time on the GPU, beside the torch call of the same kernels.

    python -m benchmarks.profile_jax [--shapes dsv3,small] [--hlo FILE]

For each op and shape it prints the times of benchmarks.timing.time_jax (host wall time with a sync per call;
GPU span queued behind other work and with an idle GPU) and every GPU activity (kernels, memsets, copies)
that one op issues, recorded with CUPTI through torch.profiler (CUPTI sees the work of every library in the
process, XLA's included).
--hlo writes the optimised HLO of each timed function, to see what XLA put around the custom calls.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import jax
import jax.numpy as jnp

import moetriton.jax as mj
from benchmarks.timing import gpu_activities, time_jax
from moetriton.jax import permutation
from moetriton.jax._sharding import call
from moetriton.kernels.rules.shapes import NAMED_SHAPES


def _activities(fn, args, calls: int = 5) -> list[tuple[str, float, float]]:
    """(name, count per call, µs per call) of every GPU activity, most expensive first."""
    jax.block_until_ready(fn(*args))

    def runs() -> None:
        for _ in range(calls):
            jax.block_until_ready(fn(*args))

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, start, end in gpu_activities(runs):
        totals[name[:90]][0] += 1
        totals[name[:90]][1] += end - start
    rows = [(name, count / calls, micros / calls) for name, (count, micros) in totals.items()]
    return sorted(rows, key=lambda row: -row[2])


def _cases(shape):
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K
    keys = jax.random.split(jax.random.key(0), 4)
    scores = jax.random.uniform(keys[0], (T, E))
    ids = jax.lax.top_k(scores, K)[1]
    mask = jnp.zeros((T, E), bool).at[jnp.arange(T)[:, None], ids].set(True)
    probs = jax.random.uniform(keys[1], (T, E), jnp.float32)
    x = jax.random.normal(keys[2], (T, H), jnp.bfloat16)
    expert_out = jax.random.normal(keys[3], (N, H), jnp.bfloat16)
    row_map = mj.token_dispatch(jnp.zeros((T, 1), jnp.bfloat16), mask, N)[2]
    backward = permutation.CombineBackward(num_shards=1, padded=False)
    sizes = jnp.full((E,), N // E, jnp.int32)
    order = jnp.arange(E, dtype=jnp.int32)[::-1]
    yield "dispatch", jax.jit(lambda x, m, p: mj.token_dispatch(x, m, N, p)), (x, mask, probs)
    yield "combine", jax.jit(lambda y, r, p: mj.token_combine(y, r, p)), (expert_out, row_map, probs)
    yield (
        "combine_bwd",
        jax.jit(lambda g, r, y, p: call(backward, g, r, y, p)),
        (x, row_map, expert_out, probs),
    )
    yield "chunk_sort", jax.jit(mj.sort_chunks_by_index), (expert_out, sizes, order)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv3,small")
    parser.add_argument("--hlo", type=Path)
    args = parser.parse_args()
    hlo = []
    for shape_name in args.shapes.split(","):
        shape = NAMED_SHAPES[shape_name]
        for op, fn, fn_args in _cases(shape):
            timing = time_jax(fn, [fn_args])
            rows = _activities(fn, fn_args)
            print(
                f"\n== {op} {shape_name}: wall {timing.wall_ms:.4f} ms synced, GPU span "
                f"{timing.device_ms:.4f} ms queued / {timing.cold_ms:.4f} ms cold, "
                f"GPU activities {sum(r[2] for r in rows) / 1e3:.4f} ms"
            )
            for name, count, micros in rows:
                print(f"   {micros:9.1f} us  x{count:g}  {name}")
            if args.hlo:
                hlo.append(f"==== {op} {shape_name}\n{fn.lower(*fn_args).compile().as_text()}")
    if args.hlo:
        args.hlo.write_text("\n".join(hlo))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
