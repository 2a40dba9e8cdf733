"""Where a moetriton.jax call spends its time on the GPU, beside the torch call of the same kernels.

    python scripts/profile_jax.py [--shapes dsv3,small] [--hlo FILE]

For each op and shape it prints: the wall time per op with a sync after every jit call (how
benchmarks/jax_cases.py times), the wall time per op with many jit calls queued before one sync (throughput,
host dispatch hidden), and every GPU activity (kernels, memsets, copies) that one op issues, recorded with
CUPTI through torch.profiler (CUPTI sees the work of every library in the process, XLA's included).
--hlo writes the optimised HLO of each timed function, to see what XLA put around the custom calls.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import torch

import moetriton.jax as mj
from moetriton.jax import ops
from moetriton.jax._sharding import call
from moetriton.kernels.shapes import NAMED_SHAPES

QUEUED_CALLS = 20


def _sync_ms(fn, args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _queued_ms(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(QUEUED_CALLS)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - start) / QUEUED_CALLS)
    return best * 1e3


def _activities(fn, args, calls: int = 5) -> list[tuple[str, int, float]]:
    """(name, count per call, µs per call) of every GPU activity, most expensive first."""
    jax.block_until_ready(fn(*args))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]][0] += 1
            totals[event.name[:90]][1] += event.device_time
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
    backward = ops.CombineBackward(num_shards=1, padded=False)
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
    torch.zeros(1, device="cuda")  # CUPTI needs a CUDA context of torch's too
    hlo = []
    for shape_name in args.shapes.split(","):
        shape = NAMED_SHAPES[shape_name]
        for op, fn, fn_args in _cases(shape):
            sync, queued = _sync_ms(fn, fn_args), _queued_ms(fn, fn_args)
            rows = _activities(fn, fn_args)
            print(
                f"\n== {op} {shape_name}: sync {sync:.4f} ms, queued {queued:.4f} ms, "
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
