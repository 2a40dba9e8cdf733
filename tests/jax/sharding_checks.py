"""Sharded-execution checks, run in a subprocess with 8 host CPU devices (see test_sharding.py).

`python -m tests.jax.sharding_checks SCENARIO` builds the scenario's mesh, shards MoE inputs along the token
axis (and optionally the hidden axis), runs token_dispatch -> token_combine (forward and gradients) and
sort_chunks_by_index under jax.jit, and checks:

* values against the per-shard reference (the reference run on each token block, results concatenated), bit
  for bit for data movement and to fp32 rounding for sums, and against the unsharded op on one device (the
  kernels, interpreted), bit for bit;
* the output shardings: the token axis stays on the token mesh axes, the hidden axis on the hidden ones;
* the compiled program: no all-gather, all-to-all or collective-permute when the token shard count divides
  num_shards (the op runs locally), replicated results otherwise;
* jax.vmap over a batch axis sharded like the tokens: each device dispatches its own problems locally;
* on meshes of Explicit axes (jax.make_mesh's default), where the arrays' types carry their shardings, all
  of the above, and the grouped GEMM and activation on sharded rows.

XLA_FLAGS must give 8 host devices before JAX starts; the parent test sets it in the environment.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moetriton.jax as mj
from moetriton.jax import reference


@dataclasses.dataclass(frozen=True)
class Scenario:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    token_axes: tuple[str, ...]  # mesh axes the token axis is sharded over
    hidden_axes: tuple[str, ...] = ()  # mesh axes the hidden axis is sharded over
    num_shards: int = 0  # 0: the number of token shards
    shardy: bool = True
    local: bool = True  # whether the op runs without moving tokens between devices
    explicit: bool = False  # Explicit mesh axes (jax.make_mesh's default), else Auto


SCENARIOS = {
    "1d-2": Scenario((2,), ("data",), ("data",)),
    "1d-4-two-shards-per-device": Scenario((4,), ("data",), ("data",), num_shards=8),
    "1d-8": Scenario((8,), ("data",), ("data",)),
    "1d-8-fewer-shards-replicates": Scenario((8,), ("data",), ("data",), num_shards=4, local=False),
    "2d-tokens-on-both-axes": Scenario((2, 4), ("data", "model"), ("data", "model")),
    "2d-hidden-sharded": Scenario((2, 4), ("data", "model"), ("data",), ("model",)),
    "2d-hidden-sharded-gspmd": Scenario((4, 2), ("data", "model"), ("data",), ("model",), shardy=False),
}
#: Three of them on meshes of Explicit axes, where the arrays' types carry their shardings.
SCENARIOS.update(
    {
        f"{name}-explicit": dataclasses.replace(SCENARIOS[name], explicit=True)
        for name in ("1d-2", "1d-8-fewer-shards-replicates", "2d-hidden-sharded")
    }
)

NUM_TOKENS, HIDDEN, NUM_EXPERTS, TOPK, ALIGN = 24, 8, 5, 2, 4


def _spec(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _inputs(rng):
    x = jnp.asarray(rng.integers(-7, 8, (NUM_TOKENS, HIDDEN)).astype(np.float32))
    ids = np.argsort(rng.random((NUM_TOKENS, NUM_EXPERTS)), axis=1)[:, :TOPK].astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1
    probs = jnp.asarray(rng.random((NUM_TOKENS, TOPK), dtype=np.float32))
    return x, jnp.asarray(ids), probs, probs[::-1] + 0.5


def _pipeline(api, num_shards: int):
    """dispatch -> per-row expert work -> weighted combine; returns the dispatch results and the output."""
    # moetriton.jax takes the total over all shards; the reference runs one shard at a time.
    extra = {"num_shards": num_shards} if api is mj else {}
    num_out_tokens = NUM_TOKENS * TOPK // (1 if api is mj else num_shards)

    def run(x, ids, probs, merging):
        out, pp, row_id_map, pad_offsets, counts = api.token_dispatch(
            x, None, num_out_tokens, probs, ALIGN, indices=ids, num_experts=NUM_EXPERTS, **extra
        )
        expert_out = out * 3 + pp[:, None] * out
        combined = api.token_combine(expert_out, row_id_map, merging, pad_offsets, **extra)
        plain = api.token_combine(out, row_id_map, None, pad_offsets, **extra)
        return (out, pp, row_id_map, pad_offsets, counts), combined + plain

    return run


def _loss(run):
    return lambda x, ids, probs, merging: jnp.sum(run(x, ids, probs, merging)[1] ** 2)


def _per_shard_reference(num_shards: int, x, ids, probs, merging):
    run = _pipeline(reference, num_shards)
    grad = jax.grad(_loss(run), argnums=(0, 2, 3))
    shard = NUM_TOKENS // num_shards
    results, outputs, grads = [], [], []
    for i in range(num_shards):
        block = [a[i * shard : (i + 1) * shard] for a in (x, ids, probs, merging)]
        dispatched, combined = run(*block)
        results.append(dispatched)
        outputs.append(combined)
        grads.append(grad(*block))
    joined = tuple(jnp.concatenate(parts) for parts in zip(*results, strict=True))
    return joined, jnp.concatenate(outputs), tuple(jnp.concatenate(g) for g in zip(*grads, strict=True))


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _same(got, expected, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    np.testing.assert_array_equal(_bits(got), _bits(expected), err_msg=what)


def _close(got, expected, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-5, err_msg=what)


def _check_sharding(array, mesh, spec, what: str) -> None:
    expected = NamedSharding(mesh, spec)
    assert array.sharding.is_equivalent_to(expected, array.ndim), (what, array.sharding, spec)


def _check_collectives(compiled, local: bool, what: str) -> None:
    text = compiled.as_text()
    moved = [op for op in ("all-gather", "all-to-all", "collective-permute") if op in text]
    if local:
        assert not moved, f"{what}: tokens move between devices ({moved})"


def _check_sort(scenario: Scenario, mesh, num_shards: int, tokens, rng) -> None:
    rows, splits = 6, 3
    x = jnp.asarray(rng.standard_normal((num_shards * rows, HIDDEN), dtype=np.float32))
    sizes = np.concatenate([rng.multinomial(rows - 1, np.ones(splits) / splits) for _ in range(num_shards)])
    order = np.concatenate([rng.permutation(splits) for _ in range(num_shards)])
    probs = jnp.asarray(rng.random(num_shards * rows, dtype=np.float32))
    args = (x, jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32), probs)

    def sort(x, sizes, order, probs):
        return mj.sort_chunks_by_index(x, sizes, order, probs, num_shards=num_shards)

    def loss(x, sizes, order, probs):
        out, _, permuted = sort(x, sizes, order, probs)
        return jnp.sum(out * x) + jnp.sum(permuted * probs)

    unsharded = jax.jit(sort)(*args), jax.jit(jax.grad(loss, argnums=(0, 3)))(*args)
    payload = NamedSharding(mesh, P(tokens, _spec(scenario.hidden_axes)))
    token_shards = int(np.prod([mesh.shape[axis] for axis in scenario.token_axes]))
    # Split sizes shard with the rows when they divide evenly (always, when the op runs locally).
    per_row = NamedSharding(mesh, P(tokens) if len(sizes) % token_shards == 0 else P())
    placed = [jax.device_put(a, payload if a.ndim == 2 else per_row) for a in args]
    sharded_sort = jax.jit(sort)
    sharded = sharded_sort(*placed), jax.jit(jax.grad(loss, argnums=(0, 3)))(*placed)
    for name, got, expected in zip(("output", "row_id_map", "probs"), sharded[0], unsharded[0], strict=True):
        _same(got, expected, f"sort {name}")
    for name, got, expected in zip(("grad inp", "grad probs"), sharded[1], unsharded[1], strict=True):
        _same(got, expected, f"sort {name}")
    if scenario.local:
        _check_sharding(sharded[0][0], mesh, P(tokens, _spec(scenario.hidden_axes)), "sort output")
        _check_collectives(sharded_sort.lower(*placed).compile(), True, "sort")


def _check_vmap_over_sharded_batch(mesh, tokens, batch: int, rng) -> None:
    x = jnp.asarray(rng.integers(-7, 8, (batch, 6, HIDDEN)).astype(np.float32))
    ids = jnp.asarray(np.argsort(rng.random((batch, 6, NUM_EXPERTS)), axis=-1)[..., :TOPK].astype(np.int32))

    def dispatch(x, ids):
        return mj.token_dispatch(x, None, 6 * TOPK, None, ALIGN, indices=ids, num_experts=NUM_EXPERTS)

    batched = jax.jit(jax.vmap(dispatch))
    placed = [jax.device_put(a, NamedSharding(mesh, P(tokens))) for a in (x, ids)]
    got = batched(*placed)
    names = ("output", "permuted_probs", "row_id_map", "pad_offsets", "tokens_per_expert")
    for i in range(batch):
        for what, g, e in zip(names, got, dispatch(x[i], ids[i]), strict=True):
            if e is not None:
                _same(np.asarray(g)[i], e, f"vmap {what} of problem {i}")
    _check_sharding(got[0], mesh, P(tokens), "vmap output")
    _check_collectives(batched.lower(*placed).compile(), True, "vmap")


def _check_grouped_ops(mesh, tokens, rng) -> None:
    """grouped_matmul and grouped_activation (forward and gradients) on rows sharded over the token axes:
    the unsharded results, and rows split as the input's (on Explicit axes the types say so)."""
    rows = jnp.asarray(rng.standard_normal((NUM_TOKENS, HIDDEN), dtype=np.float32))
    weights = jnp.asarray(rng.standard_normal((3, HIDDEN, 2 * HIDDEN), dtype=np.float32))
    sizes = jnp.asarray([7, 0, NUM_TOKENS - 7], jnp.int32)  # every row in a group: all defined

    def layer(rows, weights):
        return mj.grouped_activation(mj.grouped_matmul(rows, weights, sizes), sizes, "swiglu")

    def loss(rows, weights):
        return jnp.sum(layer(rows, weights) ** 2)

    unsharded = jax.jit(layer)(rows, weights), jax.jit(jax.grad(loss, argnums=(0, 1)))(rows, weights)
    placed = jax.device_put(rows, NamedSharding(mesh, P(tokens))), weights
    sharded = jax.jit(layer)(*placed), jax.jit(jax.grad(loss, argnums=(0, 1)))(*placed)
    _close(sharded[0], unsharded[0], "grouped ops")
    for what, got, expected in zip(("grad rows", "grad weights"), sharded[1], unsharded[1], strict=True):
        _close(got, expected, f"grouped ops {what}")
    _check_sharding(sharded[0], mesh, P(tokens), "grouped ops")
    _check_sharding(sharded[1][0], mesh, P(tokens), "grouped ops grad rows")


def run(name: str) -> None:
    scenario = SCENARIOS[name]
    jax.config.update("jax_use_shardy_partitioner", scenario.shardy)
    size = int(np.prod(scenario.mesh_shape))
    assert len(jax.devices()) >= size, "set XLA_FLAGS=--xla_force_host_platform_device_count=8 first"
    kind = jax.sharding.AxisType.Explicit if scenario.explicit else jax.sharding.AxisType.Auto
    mesh = Mesh(
        np.array(jax.devices()[:size]).reshape(scenario.mesh_shape),
        scenario.axis_names,
        axis_types=(kind,) * len(scenario.axis_names),
    )
    token_shards = int(np.prod([mesh.shape[axis] for axis in scenario.token_axes]))
    num_shards = scenario.num_shards or token_shards
    tokens, hidden = _spec(scenario.token_axes), _spec(scenario.hidden_axes)
    rng = np.random.default_rng(0)
    args = _inputs(rng)

    expected_dispatch, expected_out, expected_grads = _per_shard_reference(num_shards, *args)
    run_op = _pipeline(mj, num_shards)
    grad_fn = jax.grad(_loss(run_op), argnums=(0, 2, 3))
    unsharded_dispatch, unsharded_out = jax.jit(run_op)(*args)

    token_major = NamedSharding(mesh, P(tokens))
    placed = (
        jax.device_put(args[0], NamedSharding(mesh, P(tokens, hidden))),
        *(jax.device_put(a, token_major) for a in args[1:]),
    )
    sharded_run = jax.jit(run_op)
    dispatched, out = sharded_run(*placed)
    sharded_grad = jax.jit(grad_fn)
    grads = sharded_grad(*placed)

    names = ("output", "permuted_probs", "row_id_map", "pad_offsets", "tokens_per_expert")
    for what, got, expected, kernel in zip(
        names, dispatched, expected_dispatch, unsharded_dispatch, strict=True
    ):
        _same(got, expected, f"{what} vs per-shard reference")
        _same(got, kernel, f"{what} vs unsharded op")
    _close(out, expected_out, "combine vs per-shard reference")
    _close(out, unsharded_out, "combine vs unsharded op")
    grad_names = ("grad inp", "grad probs", "grad merging")
    for what, got, expected in zip(grad_names, grads, expected_grads, strict=True):
        _close(got, expected, what)

    if scenario.local:
        for what, array, spec in (
            ("output", dispatched[0], P(tokens, hidden)),
            ("permuted_probs", dispatched[1], P(tokens)),
            ("row_id_map", dispatched[2], P(tokens)),
            ("tokens_per_expert", dispatched[4], P(tokens)),
            ("combine", out, P(tokens, hidden)),
            ("grad inp", grads[0], P(tokens, hidden)),
            ("grad probs", grads[1], P(tokens)),
        ):
            _check_sharding(array, mesh, spec, what)
    else:
        assert dispatched[0].sharding.is_fully_replicated, dispatched[0].sharding
    _check_collectives(sharded_run.lower(*placed).compile(), scenario.local, "forward")
    _check_collectives(sharded_grad.lower(*placed).compile(), scenario.local, "gradient")
    _check_sort(scenario, mesh, num_shards, tokens, rng)
    if scenario.local:
        _check_vmap_over_sharded_batch(mesh, tokens, token_shards, rng)
    if scenario.explicit:
        _check_grouped_ops(mesh, tokens, rng)
    print(f"{name}: ok")


if __name__ == "__main__":
    run(sys.argv[1])
