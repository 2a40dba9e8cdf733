"""The expert activation on the JAX layer's worst-case buffers: moetriton.jax.grouped_activation beside XLA's
elementwise activation (apply_activation), forward + backward.

    python -m benchmarks.activation_jax [--shapes mixtral,dsv3] [--ep 2] [--out ROOT]

At EP ranks the dropless receive buffer holds M = EP x T x K rows (the worst case), of which a balanced
routing fills T x K: `filled` is that share (1/EP), and "full" fills every row. XLA streams all M rows
whatever the fill; the kernels stream the groups' rows. Bytes that must move per step: the filled rows of
hidden [M, 2F] read twice (forward, backward), act [M, F] written and its cotangent read once, the hidden
gradient [M, 2F] written once. Steady-state GPU time from one jitted program of several input sets
(benchmarks.timing.time_jax), GB/s over those bytes and % of the copy ceiling (COPY_TBPS, the H100's
measured read+write copy bandwidth). Writes <out>/<gpu>/activation_jax.csv (benchmarks.common). GPU only.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from moetriton.jax import grouped_activation
from moetriton.jax.activation import apply_activation
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES

from .common import shapes_parser, write_results
from .timing import input_sets, time_jax

COPY_TBPS = 3.0
COLUMNS = ("shape", "ep", "rows", "filled", "impl", "ms", "gbps", "ceiling_pct")


def _step(function):
    def step(hidden, grad):
        out, vjp = jax.vjp(function, hidden)
        return out, vjp(grad)[0]

    return step


def measure(name: str, ep: int) -> list[dict]:
    shape = MOE_LAYER_SHAPES[name]
    routed = shape.num_tokens * shape.topk
    rows, ffn = ep * routed, shape.ffn
    element = 2  # bf16
    results = []
    for filled in sorted({routed, rows}):
        group_sizes = jnp.full((shape.num_experts // ep,), filled // (shape.num_experts // ep), jnp.int32)
        group_sizes = group_sizes.at[0].add(filled - int(group_sizes.sum()))
        bytes_moved = filled * (2 * 2 * ffn + ffn + ffn + 2 * ffn) * element
        sets = []
        for seed in range(input_sets(bytes_moved, maximum=4)):
            keys = jax.random.split(jax.random.key(seed))
            hidden = jax.random.normal(keys[0], (rows, 2 * ffn), jnp.bfloat16)
            grad = jax.random.normal(keys[1], (rows, ffn), jnp.bfloat16)
            sets.append((hidden, grad))
        impls = {
            "xla": _step(lambda h: apply_activation(h, "swiglu")),
            "moetriton": _step(lambda h, sizes=group_sizes: grouped_activation(h, sizes, "swiglu")),
        }
        for impl, step in impls.items():
            ms = time_jax(step, sets).device_ms
            gbps = bytes_moved / (ms * 1e-3) / 1e9
            results.append(
                dict(
                    shape=name,
                    ep=ep,
                    rows=rows,
                    filled=round(filled / rows, 3),
                    impl=impl,
                    ms=round(ms, 4),
                    gbps=round(gbps, 1),
                    ceiling_pct=round(100 * gbps / (COPY_TBPS * 1e3), 1),
                )
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = shapes_parser(__doc__, "mixtral,dsv3")
    parser.add_argument("--ep", type=int, default=2)
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("benchmarks.activation_jax: GPU only")
        return 1
    rows = []
    for name in args.shapes.split(","):
        for row in measure(name, args.ep):
            print(" ".join(f"{key}={row[key]}" for key in COLUMNS), flush=True)
            rows.append(row)
    device = jax.devices()[0].device_kind
    print(f"wrote {write_results('activation_jax', rows, device, 1, args.out, columns=list(COLUMNS))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
