"""Time the JAX MoE layer's dropless exchanges alone, on real dispatched rows, beside plain all_to_all.

    python -m benchmarks.exchange_jax [--shapes mixtral,dsv3] [--steps 10]

Per shape (MOE_LAYER_SHAPES, tokens per GPU as there, EP = every local GPU): the forward exchange then the
reverse one (dropless_forward + dropless_reverse of moetriton.jax.moe, inside shard_map) for each exchange
("ragged": jax.lax.ragged_all_to_all; "padded": all_to_all of blocks sized to the largest pair, with the
receiving side's compaction, which the layer skips), and two chained plain
jax.lax.all_to_all calls of T * K rows per GPU. GB/s = 2 * T * K * H * 2 bytes per GPU over the median
wall time, with this process's XLA_FLAGS (the study benchmarks.studies.exchange_jax_flags runs it under
XLA's ragged all-to-all flags). One JSON line per measurement, all of them in
<out>/<n>x_<gpu>/exchange_jax.csv (benchmarks.common).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

# JAX is imported where it runs (measure): benchmarks.common imports none.
from benchmarks.common import exchange_parser, layer_shape, shape_layout, write_results

ROWS: list[dict] = []  # the measurements, for the results file


def measure(shape_names: list[str], steps: int, num_tokens: int | None) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("ep",))
    for name in shape_names:
        measure_shape(layer_shape(name, num_tokens), mesh, steps)


def measure_shape(shape, mesh, steps: int) -> None:
    """Report every exchange of `shape` over `mesh` (one "ep" axis)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from benchmarks.moe_jax import Case, _config, _shard_mapped, median_ms
    from moetriton.jax import token_dispatch
    from moetriton.jax.moe import dropless_forward, dropless_reverse, exchange_sizes

    ep, tok = mesh.shape["ep"], PartitionSpec("ep")
    rows, hidden, num_experts = shape.num_tokens * shape.topk, shape.hidden, shape.num_experts
    layout = shape_layout(shape, ep)
    keys = jax.random.split(jax.random.key(0), 2)
    sharded = NamedSharding(mesh, tok)
    make_tokens = jax.jit(
        lambda: jax.random.normal(keys[0], (ep * shape.num_tokens, hidden), jnp.bfloat16),
        out_shardings=sharded,
    )
    # Uniform routing: K distinct experts per token.
    make_indices = jax.jit(
        lambda: (
            jax.random.uniform(keys[1], (ep * shape.num_tokens, num_experts))
            .argsort(1)[:, : shape.topk]
            .astype(jnp.int32)
        ),
        out_shardings=sharded,
    )

    def dispatch(tokens, indices):
        send, _, _, _, counts = token_dispatch(tokens, indices=indices, num_experts=num_experts)
        return send, counts

    run_dispatch = jax.jit(_shard_mapped(mesh, dispatch, (tok, tok), (tok, tok)))
    send, counts = run_dispatch(make_tokens(), make_indices())
    gigabytes = 2 * rows * hidden * 2 / 1e9
    base = _config(Case(shape, ep, None, 512), mesh)
    for exchange in ("ragged", "padded"):
        config = replace(base, exchange=exchange)

        def both(send, counts, config=config):
            sizes = exchange_sizes(jax.lax.all_gather(counts, "ep"), jax.lax.axis_index("ep"), layout)
            recv = dropless_forward(send, sizes, layout, config)
            return dropless_reverse(recv, sizes, layout, config)

        run = jax.jit(_shard_mapped(mesh, both, (tok, tok), tok))
        try:
            exact = bool(jnp.array_equal(run(send, counts), send))
            report(shape.name, exchange, median_ms(run, send, counts, steps=steps), gigabytes, exact=exact)
        except Exception as error:  # a flag variant may refuse to compile: report it, go on
            report(shape.name, exchange, None, gigabytes, error=f"{type(error).__name__}: {str(error)[:300]}")
    block = jax.jit(lambda: jnp.ones((ep * rows, hidden), jnp.bfloat16), out_shardings=sharded)()

    def plain(block):
        slabs = block.reshape(ep, -1, block.shape[1])
        for _ in range(2):
            slabs = jax.lax.all_to_all(slabs, "ep", 0, 0)
        return slabs.reshape(block.shape)

    run_plain = jax.jit(_shard_mapped(mesh, plain, (tok,), tok))
    report(shape.name, "plain", median_ms(run_plain, block, steps=steps), gigabytes)


def report(shape: str, exchange: str, ms: float | None, gigabytes: float, **extra) -> None:
    import jax

    devices = jax.devices()
    row = dict(device=devices[0].device_kind, gpus=len(devices), flags=os.environ.get("XLA_FLAGS", ""))
    row.update(shape=shape, exchange=exchange, ms=ms, **extra)
    if ms is not None:
        row["gbps"] = round(gigabytes / (ms * 1e-3), 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def main() -> int:
    args = exchange_parser(__doc__).parse_args()
    measure(args.shapes.split(","), args.steps, args.tokens)
    write_rows("exchange_jax", ROWS, args.out)
    return 0


def write_rows(name: str, rows: list[dict], root) -> None:
    """`rows` (JSON rows of `report`, errors among them) to <root>/<n>x_<gpu>/<name>.csv, the device and
    GPU count of the first measured row as the file's provenance; nothing without a measured row."""
    measured = [row for row in rows if "device" in row]
    if measured:
        device, gpus = measured[0]["device"], measured[0]["gpus"]
        rows = [{key: value for key, value in row.items() if key not in ("device", "gpus")} for row in rows]
        print(f"wrote {write_results(name, rows, device, gpus, root)}")


if __name__ == "__main__":
    sys.exit(main())
