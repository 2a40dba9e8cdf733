"""The JAX weight gradient of a row-permuted grouped GEMM, with its operands gathered by XLA or by the plan.

    python scripts/wgrad_gather.py

grouped_matmul's VJP computes the weight gradient of a product whose rows were read (lhs_rows) and written
(out_rows) through permutations from the operands gathered into product order. Timed here, jitted, at the
expert-parallel layers' receive-buffer sizes (65536 rows): the gathers as `jnp.take` before the plain
weight-gradient plan (what the VJP did before), the plan gathering its own operands with its row-gather
launches (what it does now), the plain plan on rows already in order (no gather), and the two `jnp.take`
gathers alone (best of three interleaved rounds). Results must be bitwise equal. GPU only.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from moetriton import kernels
from moetriton.jax._launch import device_info, run_plan

# (name, rows M, depth K, columns N, groups E): the EP = 2 layers' GEMMs (docs/moe.md).
SHAPES = (
    ("dsv3 gate_up", 65536, 7168, 4096, 128),
    ("dsv3 down", 65536, 2048, 7168, 128),
    ("mixtral gate_up", 65536, 4096, 28672, 4),
)


def _ms(function, *args, calls: int = 30) -> float:
    """Wall ms per call of `function`, calls back to back after warm-up, one sync."""
    for _ in range(3):
        jax.block_until_ready(function(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = function(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    print(f"# {jax.devices()[0].device_kind}; ms per call")
    for name, M, K, N, E in SHAPES:
        key_lhs, key_grad = jax.random.split(jax.random.PRNGKey(0))
        lhs = jax.random.normal(key_lhs, (M, K), jnp.bfloat16)
        grad = jax.random.normal(key_grad, (M, N), jnp.bfloat16)
        rows = jnp.asarray(np.random.default_rng(0).permutation(M), jnp.int32)
        sizes = jnp.full((E,), M // E, jnp.int32)
        dims = dict(num_rows=M, depth=K, num_cols=N, num_groups=E, element_bytes=2, device=device_info())
        plain = kernels.grouped_matmul_wgrad_plan(**dims)
        gathering = kernels.grouped_matmul_wgrad_plan(gather_lhs=True, gather_grad=True, **dims)

        def take(a, g, r):
            return jnp.take(a, r, axis=0, mode="clip"), jnp.take(g, r, axis=0, mode="clip")

        def xla_gathers(a, g, r, plain=plain, sizes=sizes):
            gathered_lhs, gathered_grad = take(a, g, r)
            return run_plan(plain, dict(lhs=gathered_lhs, grad=gathered_grad, group_sizes=sizes))[0]

        def plan_gathers(a, g, r, gathering=gathering, sizes=sizes):
            inputs = dict(lhs=a, grad=g, group_sizes=sizes, lhs_rows=r, out_rows=r)
            return run_plan(gathering, inputs)[0]

        def in_order(a, g, r, plain=plain, sizes=sizes):
            return run_plan(plain, dict(lhs=a, grad=g, group_sizes=sizes))[0]

        functions = [jax.jit(f) for f in (xla_gathers, plan_gathers, in_order, take)]
        times = [float("inf")] * len(functions)
        for _ in range(3):  # interleaved rounds, best of each: a first timing in a process can run slow
            times = [min(t, _ms(f, lhs, grad, rows)) for t, f in zip(times, functions, strict=True)]
        equal = bool(jnp.array_equal(functions[0](lhs, grad, rows), functions[1](lhs, grad, rows)))
        gathered_bytes = 2 * M * (K + N) * 2  # both operands read and written once
        bandwidth = gathered_bytes / times[3] / 1e9
        print(
            f"{name}: XLA gathers + wgrad {times[0]:.2f}, plan with its gathers {times[1]:.2f}, "
            f"rows in order {times[2]:.2f}; XLA gathers alone {times[3]:.2f} ms ({bandwidth:.2f} TB/s); "
            f"bitwise equal: {equal}",
            flush=True,
        )


if __name__ == "__main__":
    main()
