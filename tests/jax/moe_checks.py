"""Expert-parallel MoE layer checks, run in a subprocess with 8 host CPU devices (see test_moe.py) or on GPUs.

`python -m tests.jax.moe_checks CHECK` runs one check and prints "CHECK: ok". Every check compares
`moetriton.jax.moe` (forward, aux loss, dropped count, and the gradients of x, gate, gate_up, down and the
shared experts' weights where a problem has them) with
the dense single-device reference `moetriton.jax.reference_moe`, on a mesh of (data, ep) devices:

* mesh-DxE: problems drawn from tests/strategies_moe.py on a D x E mesh, each run dropless without and with
  alignment and under a capacity factor small enough to overflow;
* overflow: capacity with forced overflow, the dropped count checked against a count made here with numpy;
* one-expert / empty-experts: every token on the experts of EP rank 0 (the dropless worst case the receive
  buffer is sized for, alignment included), and whole EP ranks without tokens;
* determinism: two runs of the jitted layer and its gradient are bitwise equal;
* exchanges (GPUs only): exchange="ragged" and "padded" against the reference and each other, bitwise;
* exchange-blocks: the padded exchange with each block size it picks (balanced to skewed routing) against a
  numpy simulation, with the gradient of its round trip;
* shared-experts: shared experts (with and without the per-token gate, gated and ungated activations,
  dropless and capacity) on meshes 1x2 and 2x2, and the Flax block's replicated shared parameters;
* flax: the Flax MoEBlock on a mesh with logical-axis rules equals the functional layer;
* errors: mesh-dependent argument errors;
* options-DxE: the losses (seq_aux_loss_coeff, z_loss_coeff), token_mask, drop_policy="probs" (exact ties
  included) and return_stats's MoEStats, with and without capacity and shared experts, and the psums each
  option set compiles to;
* benchmark: benchmarks/moe_jax.py's baseline against the layer, and one step of its command line;
* explicit-mesh: meshes of Explicit axes (jax.make_mesh's default) against the reference and bit for bit
  against Auto axes, inputs unplaced or sharded on the mesh, and the Flax block initialised on one;
* hostile-1x2: the hostile family (tests/strategies_moe_hostile.py) on a 1 x 2 mesh: every bad argument
  refused before anything runs, and the data-dependent cases against the reference;
* pipeline: dropless in token chunks (pipeline_chunks) with shared experts, a mask and the losses on meshes
  1x2 and 2x2 (1x2 alone on two GPUs), against the reference and bitwise repeatable (on GPUs through both
  exchanges).

On CPU the exchange is the padded all_to_all fallback (XLA:CPU has no ragged all-to-all); on GPUs "auto"
picks the ragged all-to-all. XLA_FLAGS must give 8 host devices before JAX starts; the parent test sets it.
"""

from __future__ import annotations

import csv
import dataclasses
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from jax.sharding import Mesh

from moetriton.jax import reference_router
from moetriton.jax.moe import moe
from moetriton.jax.reference_moe import moe_reference
from moetriton.kernels.rules.expert_parallel import ep_layout, gate_up_width
from moetriton.kernels.rules.moe import SHARED_WEIGHTS, MoEStats
from tests.strategies_moe import (
    MoEProblem,
    moe_problems,
    with_biases,
    with_probs_on_input,
    with_shared_experts,
)
from tests.strategies_moe_hostile import record

_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck), print_blob=True
)


def make_mesh(data: int, ep: int, explicit: bool | tuple[bool, bool] = False) -> Mesh:
    """A data x EP mesh of Auto axes, or of Explicit ones (jax.make_mesh's default on JAX >= 0.7); a pair
    says it per axis (data, EP)."""
    devices = jax.devices()
    assert len(devices) >= data * ep, "set XLA_FLAGS=--xla_force_host_platform_device_count=8 first"
    kinds = tuple(
        jax.sharding.AxisType.Explicit if kind else jax.sharding.AxisType.Auto
        for kind in (explicit if isinstance(explicit, tuple) else (explicit, explicit))
    )
    return Mesh(np.array(devices[: data * ep]).reshape(data, ep), ("data", "ep"), axis_types=kinds)


def _arrays(problem: MoEProblem) -> tuple[jax.Array, ...]:
    """(x, gate, gate_up, down, then the shared experts' weights and the biases the problem has, in SHARED
    and BIASES order)."""
    arrays = (problem.x, problem.gate, problem.gate_up, problem.down, *problem.shared_weights.values())
    arrays += tuple(problem.biases.values())
    return tuple(jnp.asarray(a) for a in arrays)


#: Differentiable layer arguments in `_arrays` order.
ARGUMENTS = ("x", "gate", "gate_up", "down", *SHARED_WEIGHTS)


def _options(problem: MoEProblem, options: dict | None = None) -> dict:
    """The layer's and the reference's options: the problem's, aux_loss_coeff 1e-2, then `options`."""
    expert_bias = None if problem.expert_bias is None else jnp.asarray(problem.expert_bias)
    return dict(problem.layer_options(aux_loss_coeff=1e-2), expert_bias=expert_bias, **(options or {}))


def step(layer, cotangent, num_arrays: int = 4):
    """jit of (x, gate, gate_up, down, shared weights...) -> ((loss, (out, aux_loss, dropped[, stats])),
    gradients): one compiled program for the forward results and every gradient, loss = <out, cotangent> +
    aux loss."""

    def loss(*arrays):
        results = layer(*arrays)
        return jnp.sum(results[0].astype(jnp.float32) * cotangent) + results[1], results

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(num_arrays)), has_aux=True))


def layer_and_reference(
    problem: MoEProblem,
    mesh: Mesh | None,
    *,
    options: dict | None = None,
    token_mask: np.ndarray | None = None,
    stats: bool = False,
    **extra,
):
    """(layer, reference): functions of (x, gate, gate_up, down, the problem's shared weights) -> (out,
    aux_loss, dropped[, MoEStats with `stats`]). `options` (losses, drop_policy, ...) and `token_mask`
    [B, S] bool go to both, `extra` to the layer only. Without a mesh the layer runs on one device without
    collectives."""
    options = _options(problem, options)
    if token_mask is not None:
        options["token_mask"] = jnp.asarray(token_mask)
    if stats:
        options["return_stats"] = True
    num_shards = 1 if mesh is None else mesh.size
    placement = {} if mesh is None else dict(mesh=mesh, ep_axis="ep", data_axes=("data",))

    shared_names = (*problem.shared_weights, *problem.biases)

    def layer(x, gate, gate_up, down, *shared):
        shared = dict(zip(shared_names, shared, strict=True))
        return moe(x, gate, gate_up, down, **placement, **options, **extra, **shared)

    def reference(x, gate, gate_up, down, *shared):
        shared = dict(zip(shared_names, shared, strict=True))
        return moe_reference(x, gate, gate_up, down, num_shards=num_shards, **options, **shared)

    return layer, reference


def _close(got, expected, what: str, rtol: float = 2e-5) -> None:
    expected = np.asarray(expected, np.float32)
    scale = float(np.max(np.abs(expected), initial=1.0))
    np.testing.assert_allclose(
        np.asarray(got, np.float32), expected, rtol=rtol, atol=rtol * scale, err_msg=what
    )


def _check_stats(got: MoEStats, expected: MoEStats, results: tuple, what: str) -> None:
    """MoEStats against the reference's: losses to fp32 rounding, counts exactly; and against the layer's
    own results: aux_loss the sum of the losses, dropped the third output, loads from kept."""
    assert isinstance(got, MoEStats), (type(got), what)
    for name in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss", "mean_load"):
        value = getattr(got, name)
        assert value.shape == () and value.dtype == jnp.float32, (name, value, what)
        _close(value, getattr(expected, name), f"stats.{name} of {what}")
    for name in ("routed", "kept", "dropped", "max_load"):
        value = getattr(got, name)
        assert value.dtype == jnp.int32, (name, value.dtype, what)
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(getattr(expected, name)), f"{name} {what}"
        )
    _close(got.load_balancing_loss + got.seq_load_balancing_loss + got.z_loss, results[1], f"aux sum {what}")
    assert int(got.dropped) == int(results[2]), what
    assert int(got.max_load) == int(got.kept.max()) and (got.kept <= got.routed).all(), what


def check_against_reference(problem: MoEProblem, mesh: Mesh | None, **call) -> tuple:
    """Forward, aux loss, dropped count, the stats (with `stats`) and every gradient of the layer against
    the reference; returns the layer's (forward results, gradients). `call`: `layer_and_reference`'s
    keywords (options, token_mask, stats, layer-only extras); with a mask, masked tokens' output rows and x
    gradients must be exactly zero. A bf16 compute `dtype` gets bf16 tolerances."""
    token_mask, stats = call.get("token_mask"), call.get("stats", False)
    rtol, grad_rtol = (2e-5, 1e-4) if call.get("dtype") is None else (3e-2, 5e-2)
    layer, reference = layer_and_reference(problem, mesh, **call)
    arrays = _arrays(problem)
    what = f"{problem} on mesh {None if mesh is None else dict(mesh.shape)} {call}"
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=problem.x.shape).astype(np.float32))
    # Progress on stdout: a crash inside XLA's compiler then shows which program it was compiling.
    print(f"layer step: {what}", flush=True)
    (_, got), grads = step(layer, cotangent, len(arrays))(*arrays)
    print("reference step", flush=True)
    (_, expected), expected_grads = step(reference, cotangent, len(arrays))(*arrays)
    assert len(got) == (4 if stats else 3), what
    _close(got[0], expected[0], f"out of {what}", rtol)
    _close(got[1], expected[1], f"aux loss of {what}")
    assert got[0].shape == problem.x.shape and got[0].dtype == arrays[0].dtype, what
    assert got[1].shape == () and got[1].dtype == jnp.float32, what
    assert got[2].dtype == jnp.int32, what
    assert int(got[2]) == int(expected[2]), (int(got[2]), int(expected[2]), what)
    if stats:
        _check_stats(got[3], expected[3], got, what)
    names = ("x", "gate", "gate_up", "down", *problem.shared_weights, *problem.biases)
    for name, g, e in zip(names, grads, expected_grads, strict=True):
        _close(g, e, f"grad {name} of {what}", grad_rtol)
    if token_mask is not None:
        padding = ~np.asarray(token_mask)
        assert (np.asarray(got[0])[padding] == 0).all(), f"masked output rows of {what}"
        assert (np.asarray(grads[0])[padding] == 0).all(), f"masked x gradient rows of {what}"
    return got, grads


def expected_dropped(problem: MoEProblem, num_shards: int) -> int:
    """Dropped slots counted with numpy: route with the reference, count each shard's slots per expert."""
    logits = problem.x.reshape(-1, problem.hidden) @ problem.gate
    _, _, indices = reference_router.fused_topk_with_score_function(
        jnp.asarray(logits, jnp.float32),
        problem.topk,
        num_groups=problem.num_groups,
        group_topk=problem.group_topk,
        score_function=problem.score_function,
        expert_bias=None if problem.expert_bias is None else jnp.asarray(problem.expert_bias),
        return_indices=True,
    )
    shard_tokens = problem.num_tokens // num_shards
    capacity = ep_layout(
        num_tokens=shard_tokens,
        num_experts=problem.num_experts,
        topk=problem.topk,
        ep_size=1,
        align_size=problem.align_size,
        capacity_factor=problem.capacity_factor,
    ).capacity
    dropped = 0
    for block in np.split(np.asarray(indices), num_shards):
        counts = np.bincount(block.reshape(-1), minlength=problem.num_experts)
        dropped += int(np.maximum(counts - capacity, 0).sum())
    return dropped


def fixed_problem(
    data: int, ep: int, *, routing: str, topk: int, align_size: int | None, capacity_factor=None
) -> MoEProblem:
    """A problem with a chosen routing pattern: "rank0" sends every token to experts 0 .. K-1, all on EP
    rank 0; "empty_ranks" never routes to the experts of odd EP ranks."""
    rng = np.random.default_rng(7)
    shards, local = data * ep, 2
    hidden, ffn, num_experts = 8, 8, ep * local
    x = np.abs(rng.normal(size=(2 * shards, 3, hidden))).astype(np.float32)
    gate = rng.normal(0, 0.3, (hidden, num_experts)).astype(np.float32)
    if routing == "rank0":
        gate[:, :topk] += 2.0
    else:
        for expert in range(num_experts):
            if (expert // local) % 2:
                gate[:, expert] -= 3.0
    return MoEProblem(
        batch=2 * shards,
        seq=3,
        hidden=hidden,
        ffn=ffn,
        num_experts=num_experts,
        topk=topk,
        score_function="softmax",
        num_groups=None,
        group_topk=None,
        align_size=align_size,
        capacity_factor=capacity_factor,
        routing=routing,
        x=x,
        gate=gate,
        gate_up=rng.normal(0, 0.3, (num_experts, hidden, 2 * ffn)).astype(np.float32),
        down=rng.normal(0, 0.3, (num_experts, ffn, hidden)).astype(np.float32),
        expert_bias=None,
    )


# Checks ---------------------------------------------------------------------------------------------------


def check_mesh(data: int, ep: int, examples: int) -> None:
    mesh = make_mesh(data, ep)

    @settings(max_examples=examples, **_SETTINGS)
    @given(moe_problems(shards=data * ep, max_experts_per_shard=2))
    def run(problem):
        assume(problem.topk > 1 and problem.seq > 1)  # not the simplest problem, which Hypothesis draws first
        for align_size, capacity_factor in ((None, None), (4, None), (problem.align_size, 0.25)):
            variant = dataclasses.replace(problem, align_size=align_size, capacity_factor=capacity_factor)
            check_against_reference(variant, mesh)

    run()


def check_overflow() -> None:
    ep = min(4, len(jax.devices()))  # 4 CPU devices; 2 GPUs suffice
    mesh = make_mesh(1, ep)
    for routing, align_size in (("rank0", 2), ("empty_ranks", None)):
        problem = fixed_problem(1, ep, routing=routing, topk=2, align_size=align_size, capacity_factor=0.5)
        dropped = expected_dropped(problem, mesh.size)
        assert dropped > 0, "the problem must overflow"
        got, _ = check_against_reference(problem, mesh)
        assert int(got[2]) == dropped, (int(got[2]), dropped)


def check_routing_extremes(data: int, ep: int) -> None:
    """On a data x EP mesh: all tokens on EP rank 0's experts (K = L = 2 at EP 4: the dropless worst case,
    alignment included) and whole ranks without a token."""
    # One mesh per process: with jaxlib 0.11.2 XLA's compiler crashed (SIGSEGV in backend_compile_and_load,
    # on four H100s and on CPU devices) compiling the fourth of these programs after the first three in one
    # process; each compiles alone and in any pair (docs/moe.md).
    for routing, align_size in (("rank0", 4 if ep == 4 else None), ("empty_ranks", None if ep == 4 else 4)):
        print(f"routing {routing} on data {data} x EP {ep}, align_size {align_size}", flush=True)
        problem = fixed_problem(data, ep, routing=routing, topk=2, align_size=align_size)
        check_against_reference(problem, make_mesh(data, ep))


def check_no_tokens(capacity_factor: float | None) -> None:
    """No tokens at all, dropless or under a capacity (one per process, as for the routing extremes)."""
    problem = fixed_problem(1, 2, routing="rank0", topk=2, align_size=2, capacity_factor=capacity_factor)
    empty = dataclasses.replace(problem, batch=0, x=problem.x[:0])
    check_against_reference(empty, make_mesh(1, 2), stats=capacity_factor is not None)


def check_determinism() -> None:
    mesh = make_mesh(2, 2)
    problem = fixed_problem(2, 2, routing="empty_ranks", topk=2, align_size=2)
    layer, _ = layer_and_reference(problem, mesh)
    arrays = _arrays(problem)
    cotangent = jnp.ones(problem.x.shape, jnp.float32)
    run = step(layer, cotangent)
    first, second = run(*arrays), run(*arrays)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_exchanges() -> None:
    """The ragged all-to-all and the padded fallback against the reference and each other, bitwise (GPUs:
    XLA:CPU has no ragged all-to-all)."""
    assert jax.default_backend() == "gpu", "the ragged all-to-all needs GPUs"
    mesh = make_mesh(1, min(len(jax.devices()), 4))
    for routing in ("rank0", "empty_ranks"):
        problem = fixed_problem(1, mesh.size, routing=routing, topk=2, align_size=4)
        padded = check_against_reference(problem, mesh, exchange="padded")
        ragged = check_against_reference(problem, mesh, exchange="ragged")
        for a, b in zip(jax.tree.leaves(ragged), jax.tree.leaves(padded), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _routed_counts(rng, layout, skew: int) -> np.ndarray:
    """[EP, E] padded rows per expert of every rank's send buffer, from top-K routing of random scores where
    the first `skew` tokens of every rank prefer the experts of EP rank 0; skew -1 (K = 2): token t prefers
    an expert of rank t % EP and one of rank (t + EP / 2) % EP (balanced ranks)."""
    counts = []
    for _ in range(layout.ep_size):
        scores = rng.random((layout.num_tokens, layout.num_experts))
        scores[: max(skew, 0), : layout.local_experts] += 2
        if skew < 0:
            ep, local, tokens = layout.ep_size, layout.local_experts, np.arange(layout.num_tokens)
            scores[tokens, tokens % ep * local] += 2
            scores[tokens, (tokens + ep // 2) % ep * local + local - 1] += 2
        chosen = np.argsort(-scores, axis=1)[:, : layout.topk]
        routed = np.bincount(chosen.reshape(-1), minlength=layout.num_experts)
        counts.append(-(-routed // layout.align) * layout.align)
    return np.stack(counts).astype(np.int32)


def check_exchange_blocks() -> None:
    """The padded dropless exchange with each block size it chooses, from balanced routing to every token
    on one rank's experts: the received buffer and the round trip against a numpy simulation of the
    exchange, the chosen size against the largest pair, and the gradient of the round trip (the custom
    VJPs: each direction's transpose is the other)."""
    ep, hidden = min(4, len(jax.devices())), 2  # 4 CPU devices; 2 GPUs suffice
    mesh = make_mesh(1, ep)
    for align_size in (None, 2):
        # 11 tokens: all on rank 0's two experts fill the worst case with alignment 2 (11 + 1 rows each).
        layout = ep_layout(num_tokens=11, num_experts=2 * ep, topk=2, ep_size=ep, align_size=align_size)
        chosen = _exchange_blocks_round_trips(mesh, layout, hidden)
        last = len(layout.exchange_block_rows) - 1
        assert last in chosen and len(chosen) >= 3, (chosen, layout.exchange_block_rows)
        assert align_size or 0 in chosen, (chosen, layout.exchange_block_rows)


def _exchange_blocks_round_trips(mesh: Mesh, layout, hidden: int) -> set[int]:
    """Round trips of `check_exchange_blocks` over routings from balanced to skewed; the block indices
    chosen."""
    from jax.sharding import NamedSharding, PartitionSpec

    from moetriton.jax.moe import MoEConfig, dropless_forward, dropless_reverse, exchange_sizes

    ep = layout.ep_size
    block_rows = layout.exchange_block_rows
    config = MoEConfig(
        **dict.fromkeys(("num_groups", "group_topk", "scaling_factor", "align_size", "capacity_factor")),
        topk=2,
        score_function="softmax",
        use_pre_softmax=False,
        aux_loss_coeff=0.0,
        activation="swiglu",
        dtype="float32",
        mesh=mesh,
        ep_axis="ep",
        data_axes=(),
        exchange="padded",
        num_shards=ep,
        ep_size=ep,
    )

    def round_trip(send, weights, counts_all):
        sizes = exchange_sizes(counts_all, jax.lax.axis_index("ep"), layout)

        def loss(send):
            recv = dropless_forward(send, sizes, layout, config)
            back = dropless_reverse(recv, sizes, layout, config)
            return jnp.sum(back * weights), (recv, back)

        grad, (recv, back) = jax.grad(loss, has_aux=True)(send)
        return recv, back, grad, sizes["block_index"][None]

    tokens, replicated = PartitionSpec("ep"), PartitionSpec()
    run = jax.jit(
        jax.shard_map(
            round_trip,
            mesh=mesh,
            in_specs=(tokens, tokens, replicated),
            out_specs=(tokens,) * 4,
            check_vma=False,
        )
    )
    rng = np.random.default_rng(3)
    send_rows = layout.send_rows
    rows = np.arange(ep * send_rows, dtype=np.float32).reshape(ep, send_rows, 1)
    send = np.concatenate([rows + 1, -rows - 1], axis=2)  # [EP, S, H]: every row tells where it left
    weights = rng.normal(size=send.shape).astype(np.float32)
    sharded = NamedSharding(mesh, tokens)
    chosen = set()
    for skew in range(-1, layout.num_tokens + 1):
        counts_all = _routed_counts(rng, layout, skew)
        per_pair = counts_all.reshape(ep, ep, -1).sum(2)  # [source, destination]
        recv, back, grad, index = run(
            jax.device_put(send.reshape(-1, hidden), sharded),
            jax.device_put(weights.reshape(-1, hidden), sharded),
            jnp.asarray(counts_all),
        )
        index = np.asarray(index)
        expected_index = int(np.searchsorted(block_rows, per_pair.max()))
        assert (index == expected_index).all(), (index, expected_index, per_pair.max(), block_rows)
        chosen.add(expected_index)
        recv = np.asarray(recv).reshape(ep, layout.recv_rows, hidden)
        back = np.asarray(back).reshape(ep, send_rows, hidden)
        grad = np.asarray(grad).reshape(ep, send_rows, hidden)
        starts = np.cumsum(per_pair, axis=1) - per_pair  # where each pair starts in its source's buffer
        for dst in range(ep):
            arrived = np.concatenate(
                [send[src, starts[src, dst] : starts[src, dst] + per_pair[src, dst]] for src in range(ep)]
            )
            expected = np.zeros((layout.recv_rows, hidden), np.float32)
            expected[: len(arrived)] = arrived
            np.testing.assert_array_equal(recv[dst], expected)
        for src in range(ep):
            sent = counts_all[src].sum()
            np.testing.assert_array_equal(back[src, :sent], send[src, :sent])
            np.testing.assert_array_equal(back[src, sent:], 0)
            np.testing.assert_array_equal(grad[src, :sent], weights[src, :sent])
            np.testing.assert_array_equal(grad[src, sent:], 0)
    return chosen


def check_shared_experts() -> None:
    """Shared experts on meshes 1x2 and 2x2 (replicated weights, gradients summed over the token shards):
    gated and ungated activations, with and without the gate, dropless and capacity; then the Flax block
    with shared experts: parameters replicated by the default rules, its result the functional layer's."""
    from flax import linen as nn

    from moetriton.jax.moe.flax import MoEBlock, init_sharded

    for (data, ep), gate, activation, capacity_factor in (
        ((1, 2), True, "swiglu", None),
        ((1, 2), False, "gelu", 0.5),
        ((2, 2), True, "relu", None),
    ):
        problem = fixed_problem(
            data, ep, routing="empty_ranks", topk=2, align_size=2, capacity_factor=capacity_factor
        )
        check_against_reference(
            with_shared_experts(problem, gate=gate, activation=activation), make_mesh(data, ep)
        )
    mesh = make_mesh(2, 2)
    x = jnp.asarray(fixed_problem(2, 2, routing="empty_ranks", topk=2, align_size=2).x)
    options = dict(topk=2, aux_loss_coeff=1e-2, mesh=mesh, ep_axis="ep", data_axes=("data",))
    block = MoEBlock(num_experts=4, ffn_dim=8, num_shared_experts=2, shared_expert_gate=True, **options)
    params = nn.meta.unbox(init_sharded(block, jax.random.key(0), x, mesh=mesh)["params"])
    shared = {name: params[name] for name in ARGUMENTS[4:]}
    assert [shared[name].shape for name in shared] == [(8, 32), (16, 8), (8, 1)], shared
    for name, weight in shared.items():
        assert all(axis is None for axis in weight.sharding.spec), (name, weight.sharding)
    out = jax.jit(block.apply)({"params": params}, x)
    expected = moe(x, params["gate"], params["gate_up"], params["down"], **options, **shared)
    for a, b in zip(out, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_model_recipes() -> None:
    """GPT-OSS's router bias and expert projection biases on meshes 1x2 and 2x2, dropless (aligned:
    padding rows inside the groups) and under a capacity (empty and dropped slots add no bias), with
    padding tokens, against the reference: every gradient, the biases' included (the router bias
    replicated, the experts' sharded with them); Llama 4's top-1 weight on the expert's input alike;
    then the Linen block and the NNX module with biases: sharded by the default rules, their results the
    functional layer's."""
    from flax import linen as nn
    from flax import nnx

    from moetriton.jax.moe.flax import MoEBlock, init_sharded
    from moetriton.jax.moe.nnx import MoE

    for (data, ep), activation, capacity_factor, masked in (
        ((1, 2), "clamped_swiglu", None, True),
        ((2, 2), "swiglu", 0.5, False),
        ((1, 2), "gelu", 0.5, True),
    ):
        problem = fixed_problem(
            data, ep, routing="empty_ranks", topk=2, align_size=2, capacity_factor=capacity_factor
        )
        width = gate_up_width(activation, problem.ffn)
        problem = dataclasses.replace(problem, activation=activation, gate_up=problem.gate_up[..., :width])
        mask = padding_mask(problem.batch, problem.seq) if masked else None
        check_against_reference(with_biases(problem), make_mesh(data, ep), token_mask=mask)
        check_against_reference(with_probs_on_input(problem), make_mesh(data, ep), token_mask=mask)
    mesh = make_mesh(2, 2)
    x = jnp.asarray(fixed_problem(2, 2, routing="empty_ranks", topk=2, align_size=2).x)
    options = dict(topk=2, mesh=mesh, ep_axis="ep", data_axes=("data",))
    flags = dict(use_gate_bias=True, use_projection_biases=True)
    block = MoEBlock(num_experts=4, ffn_dim=8, **flags, **options)
    params = nn.meta.unbox(init_sharded(block, jax.random.key(0), x, mesh=mesh)["params"])
    module = MoE(8, num_experts=4, ffn_dim=8, rngs=nnx.Rngs(0), **flags, **options)
    expected_specs = {"gate_bias": (None,), "gate_up_bias": ("ep", None), "down_bias": ("ep", None)}
    for name, spec in expected_specs.items():
        assert tuple(params[name].sharding.spec) == spec, (name, params[name].sharding)
        assert tuple(getattr(module, name)[...].sharding.spec) == spec, name
        assert not np.asarray(params[name]).any(), f"{name} starts at zero"
    rng = np.random.default_rng(3)
    params = {
        name: value + rng.normal(0, 0.5, value.shape).astype(np.float32) for name, value in params.items()
    }
    for name in expected_specs:
        getattr(module, name)[...] = params[name]
    biases = {name: params[name] for name in expected_specs}
    for module_weights, apply in (
        (params, lambda: jax.jit(block.apply)({"params": params}, x)),
        ({name: getattr(module, name)[...] for name in ("gate", "gate_up", "down")}, lambda: module(x)),
    ):
        weights = [module_weights[name] for name in ("gate", "gate_up", "down")]
        expected = moe(x, *weights, **options, **biases)
        for a, b in zip(apply(), expected, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


#: The FP8 layer against the fp32 reference: the relative error (in norm) of the output and of every
#: gradient that FP8 operands give here, measured 0.02-0.1; a wrong row, expert or scale is of order 1.
FP8_LAYER_ERROR = 0.2


def check_fp8(ep: int = 2) -> None:
    """fp8="tensorwise" and "blockwise" on a 1 x `ep` mesh (one device without one), dropless (the padded
    exchange's rows read in order) and under a capacity (rows gathered to expert-major and scattered back),
    with GPT-OSS's biases: the output and every gradient within FP8_LAYER_ERROR of the fp32 reference; the
    aux loss and the dropped count as the router gives them."""
    mesh = make_mesh(1, ep) if ep > 1 else None
    for recipe in ("tensorwise", "blockwise"):
        for capacity_factor in (None, 0.5):
            problem = with_biases(
                fixed_problem(
                    1, ep, routing="empty_ranks", topk=2, align_size=None, capacity_factor=capacity_factor
                )
            )
            layer, reference = layer_and_reference(problem, mesh, fp8=recipe)
            arrays = _arrays(problem)
            cotangent = jnp.asarray(np.random.default_rng(1).normal(size=problem.x.shape).astype(np.float32))
            (_, got), grads = step(layer, cotangent, len(arrays))(*arrays)
            (_, expected), expected_grads = step(reference, cotangent, len(arrays))(*arrays)
            what = f"fp8={recipe} capacity_factor={capacity_factor} on {ep} devices"
            assert int(got[2]) == int(expected[2]), what
            _close(got[1], expected[1], f"aux loss of {what}")
            names = ("out", *ARGUMENTS[:4], *problem.biases)
            errors = {
                name: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
                for name, a, b in zip(names, (got[0], *grads), (expected[0], *expected_grads), strict=True)
            }
            assert max(errors.values()) < FP8_LAYER_ERROR, (what, errors)


def check_pipeline() -> None:
    """Dropless in token chunks on meshes 1x2 and (with 4 devices) 2x2: 2 and 3 chunks and more chunks than
    a shard's tokens, with shared experts, a padding mask and the losses, against the reference; the same
    bits on a second run of the same chunking; on GPUs also through the ragged exchange."""
    exchanges = ("padded", "ragged") if jax.default_backend() == "gpu" else ("padded",)
    for data, ep in ((1, 2), (2, 2))[: 2 if len(jax.devices()) >= 4 else 1]:
        mesh = make_mesh(data, ep)
        problem = fixed_problem(data, ep, routing="empty_ranks", topk=2, align_size=2)
        shared = with_shared_experts(problem, gate=True)
        shard_tokens = problem.num_tokens // mesh.size
        for chunks in (2, 3, shard_tokens + 1):
            for exchange in exchanges:
                options = dict(ALL_LOSSES, pipeline_chunks=chunks)
                mask = padding_mask(problem.batch, problem.seq)
                first = check_against_reference(
                    shared, mesh, options=options, token_mask=mask, stats=True, exchange=exchange
                )
                second = check_against_reference(
                    shared, mesh, options=options, token_mask=mask, stats=True, exchange=exchange
                )
                for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_flax() -> None:
    from flax import linen as nn

    from moetriton.jax.moe.flax import MoEBlock, init_sharded

    mesh = make_mesh(2, 2)
    problem = fixed_problem(2, 2, routing="empty_ranks", topk=2, align_size=2)
    x = jnp.asarray(problem.x)
    # The block and the functional layer take the same options: its result is the layer's on its params.
    options = dict(topk=2, align_size=2, aux_loss_coeff=1e-2, mesh=mesh, ep_axis="ep", data_axes=("data",))
    block = MoEBlock(num_experts=problem.num_experts, ffn_dim=problem.ffn, **options)
    variables = init_sharded(block, jax.random.key(0), x, mesh=mesh)
    params = nn.meta.unbox(variables["params"])
    for name in ("gate_up", "down"):
        assert tuple(params[name].sharding.spec) == ("ep", None, None), (name, params[name].sharding)
    out, aux_loss, dropped = jax.jit(block.apply)(variables, x)
    expected = moe(x, params["gate"], params["gate_up"], params["down"], **options)
    for a, b in zip((out, aux_loss, dropped), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The new options pass through: losses, drop policy, token mask and stats, the same as the layer's.
    options = dict(options, capacity_factor=0.5, drop_policy="probs", **ALL_LOSSES)
    block = MoEBlock(num_experts=problem.num_experts, ffn_dim=problem.ffn, **options)
    mask = jnp.asarray(padding_mask(problem.batch, problem.seq))
    got = jax.jit(partial(block.apply, return_stats=True))(variables, x, mask)
    expected = moe(
        x, params["gate"], params["gate_up"], params["down"], token_mask=mask, return_stats=True, **options
    )
    assert isinstance(got[3], MoEStats) and len(got) == 4, got
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_errors() -> None:
    mesh = make_mesh(1, 2)
    problem = fixed_problem(1, 2, routing="rank0", topk=2, align_size=None)
    x, gate, gate_up, down = _arrays(problem)
    cases = [
        (dict(gate=gate[:, :3], gate_up=gate_up[:3], down=down[:3]), "num_experts: expected a multiple of"),
        (dict(ep_axis="experts"), "ep_axis: expected a mesh axis name"),
        (dict(data_axes=("batch",)), "data_axes: expected a mesh axis name"),
        (dict(data_axes=("ep",)), "data_axes: expected distinct axes"),
        (dict(x=x[:1]), "x: expected a batch size B that is a multiple of the token shards 2"),
    ]
    for change, message in cases:
        arguments = dict(x=x, gate=gate, gate_up=gate_up, down=down, topk=2, mesh=mesh, ep_axis="ep")
        arguments.update(change)
        try:
            moe(**arguments)
        except ValueError as error:
            assert message in str(error), (message, str(error))
        else:
            raise AssertionError(f"no error for {change}")


#: Every loss at once, each with a weight that makes it matter (LOSSES of moetriton.kernels.rules.moe).
ALL_LOSSES = dict(aux_loss_coeff=1e-2, seq_aux_loss_coeff=3e-2, z_loss_coeff=1e-3)


def padding_mask(batch: int, seq: int, seed: int = 5) -> np.ndarray:
    """[B, S] bool token mask: sequence 0 all padding (no token, no sequence in the sequence-wise mean),
    sequence 1 all tokens, the others about 70% tokens."""
    mask = np.random.default_rng(seed).random((batch, seq)) < 0.7
    mask[0], mask[1] = False, True
    return mask


def with_ties(problem: MoEProblem) -> MoEProblem:
    """`problem` with exact routing ties inside every token shard: token 1 of each sequence repeats token 0,
    and sequence 1 repeats sequence 0 (the same rows give the same weights bit for bit)."""
    x = problem.x.copy()
    x[:, 1] = x[:, 0]
    x[1::2] = x[0::2]
    return dataclasses.replace(problem, x=x)


def _all_reduces(layer, problem: MoEProblem) -> int:
    """all_reduce ops (psums) in the layer's forward program."""
    return jax.jit(layer).lower(*_arrays(problem)).as_text().count("all_reduce")


def check_options(data: int, ep: int) -> None:
    """The losses, token_mask, drop_policy and return_stats on a data x EP mesh, against the reference
    (forward, aux loss, dropped, every stats field, gradients): masks with every loss, dropless and under
    capacity with both policies (exact ties included), with shared experts; then the collectives: without
    return_stats, no psum beyond what the options need."""
    mesh = make_mesh(data, ep)
    base = fixed_problem(data, ep, routing="empty_ranks", topk=2, align_size=2)
    capacity = dataclasses.replace(base, capacity_factor=0.5)
    mask = padding_mask(base.batch, base.seq)
    cases = [
        (base, ALL_LOSSES, mask),
        (capacity, dict(ALL_LOSSES, drop_policy="probs"), mask),
        (with_shared_experts(capacity, gate=True), dict(ALL_LOSSES, drop_policy="position"), mask),
        (with_ties(dataclasses.replace(capacity, align_size=None)), dict(drop_policy="probs"), None),
        (with_ties(capacity), dict(z_loss_coeff=1e-3, drop_policy="probs"), mask),
    ]
    for problem, options, token_mask in cases:
        print(
            f"options {options}, mask {token_mask is not None}, capacity {problem.capacity_factor}",
            flush=True,
        )
        got, _ = check_against_reference(problem, mesh, options=options, token_mask=token_mask, stats=True)
        assert problem.capacity_factor is None or int(got[2]) > 0, "the capacity cases must drop slots"
    check_against_reference(base, mesh, options=ALL_LOSSES, token_mask=mask)  # the three outputs alone
    # psums: aux_loss and dropped by default; one more for the routed counts of the load-balancing loss
    # (with a mask the token count travels with them); return_stats sums the counts and the losses instead.
    for options, mask_or_none, stats, expected in (
        (dict(aux_loss_coeff=0.0), None, False, 2),
        (dict(), None, False, 3),
        (dict(), mask, False, 3),
        (ALL_LOSSES, mask, False, 3),
        (dict(aux_loss_coeff=0.0), None, True, 1),
        (ALL_LOSSES, mask, True, 2),
    ):
        layer, _ = layer_and_reference(base, mesh, options=options, token_mask=mask_or_none, stats=stats)
        found = _all_reduces(layer, base)
        assert found == expected, (options, mask_or_none is not None, stats, found, expected)


def check_explicit_mesh() -> None:
    """Meshes of Explicit axes (what jax.make_mesh makes by default): on 1 x 2 the layer with shared experts,
    a mask, every loss and the statistics against the reference; on 1 x 2, 2 x 2 under a capacity, and
    2 x 2 of an Auto data and an Explicit EP axis, forward and gradients bit for bit equal to the same mesh
    with Auto axes, with inputs unplaced and already sharded on the mesh (the types then carry their
    shardings; the output is sharded as the tokens). Then the Flax block initialised with init_sharded on
    an Explicit mesh equals the functional layer."""
    from flax import linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    from moetriton.jax.moe.flax import MoEBlock, init_sharded

    for (data, ep), capacity_factor, explicit_axes in (
        ((1, 2), None, True),
        ((2, 2), 0.5, True),
        ((2, 2), None, (False, True)),  # Auto data axis, Explicit EP axis
    ):
        problem = fixed_problem(
            data, ep, routing="empty_ranks", topk=2, align_size=2, capacity_factor=capacity_factor
        )
        problem = with_shared_experts(problem, gate=True)
        call = dict(options=ALL_LOSSES, token_mask=padding_mask(problem.batch, problem.seq), stats=True)
        explicit = make_mesh(data, ep, explicit=explicit_axes)
        if (data, ep) == (1, 2):
            check_against_reference(problem, explicit, **call)
        arrays = _arrays(problem)
        cotangent = jnp.asarray(np.random.default_rng(1).normal(size=problem.x.shape).astype(np.float32))
        expected = step(layer_and_reference(problem, make_mesh(data, ep), **call)[0], cotangent, len(arrays))
        expected = expected(*arrays)
        specs = (PartitionSpec(("data", "ep")), PartitionSpec(), PartitionSpec("ep"), PartitionSpec("ep"))
        specs += (PartitionSpec(),) * (len(arrays) - 4)
        placed = [
            jax.device_put(array, NamedSharding(explicit, spec))
            for array, spec in zip(arrays, specs, strict=True)
        ]
        layer = layer_and_reference(problem, explicit, **call)[0]
        run = step(layer, cotangent, len(arrays))
        for inputs in (arrays, placed):
            # The layer's own output: a jit around it places its outputs itself (JAX 0.11 replicates one
            # over the Auto axes its type does not name, unless told its out_shardings).
            output = layer(*inputs)[0]
            assert output.sharding.is_equivalent_to(placed[0].sharding, 3), output.sharding
            (_, results), grads = run(*inputs)  # not the loss: its sum over the tokens is the test's own
            (_, expected_results), expected_grads = expected
            for a, b in zip(
                jax.tree.leaves((results, grads)),
                jax.tree.leaves((expected_results, expected_grads)),
                strict=True,
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mesh = make_mesh(2, 2, explicit=True)
    x = jnp.asarray(fixed_problem(2, 2, routing="empty_ranks", topk=2, align_size=2).x)
    options = dict(topk=2, aux_loss_coeff=1e-2, mesh=mesh, ep_axis="ep", data_axes=("data",))
    block = MoEBlock(num_experts=4, ffn_dim=8, num_shared_experts=1, **options)
    params = nn.meta.unbox(init_sharded(block, jax.random.key(0), x, mesh=mesh)["params"])
    assert tuple(params["gate_up"].sharding.spec) == ("ep", None, None), params["gate_up"].sharding
    out = jax.jit(block.apply)({"params": params}, x)
    shared = {name: params[name] for name in ("shared_gate_up", "shared_down")}
    expected = moe(x, params["gate"], params["gate_up"], params["down"], **options, **shared)
    for a, b in zip(out, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _hostile_results(function, call, names) -> dict:
    """`function`'s (the layer's or the reference's, of the arrays `names` in order) forward, stats and
    gradients of <out, cotangent> + aux_loss on a hostile call, as the family compares them (numpy)."""
    present = {name: jnp.asarray(value) for name, value in call.arrays.items() if value is not None}
    cotangent = jnp.asarray(np.random.default_rng(7).normal(size=call.arrays["x"].shape).astype(np.float32))
    rest = {name: value for name, value in present.items() if name not in names}

    def loss(*weights):
        results = function(**dict(zip(names, weights, strict=True)), **rest)
        return jnp.sum(results[0] * cotangent) + results[1], results

    run = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True))
    (_, (out, aux_loss, dropped, stats)), grads = run(*(present[name] for name in names))
    return record(out, aux_loss, dropped, stats._asdict(), dict(zip(names, grads, strict=True)))


def check_hostile() -> None:
    """The hostile family on a 1 x 2 mesh (tests/strategies_moe_hostile.py): every bad argument refused
    before anything runs, naming the argument; then the data-dependent cases (NaN tokens in one shard,
    overflowing tokens, a shard of padding alone, overflowing and mostly unused capacity slabs, every option
    on) against the dense reference, with padding and slot-less experts exactly zero; the first of them also
    on a mesh of Explicit axes."""
    from tests.strategies_moe_hostile import (
        REFUSED,
        base_arrays,
        check_invariants,
        expert_parallel_calls,
        same_results,
    )

    mesh = make_mesh(1, 2)
    placement = dict(mesh=mesh, ep_axis="ep", data_axes=("data",))
    for case, refusal in REFUSED.items():
        call = {**base_arrays(), "topk": 2, **refusal.change}
        arrays = {name: jnp.asarray(v) if isinstance(v, np.ndarray) else v for name, v in call.items()}
        try:
            moe(**arrays, **placement)
        except (TypeError, ValueError) as error:
            assert isinstance(error, refusal.error), (case, error)
            assert str(error).startswith(f"{refusal.named('jax')}:"), (case, error)
        else:
            raise AssertionError(f"{case}: no error on the mesh")
    for index, call in enumerate(expert_parallel_calls(2, unequal=False)):
        names = [name for name in ("x", "gate", "gate_up", "down", *SHARED_WEIGHTS) if name in call.arrays]
        print(f"hostile {call.corruption} {call.options}", flush=True)
        expected = _hostile_results(partial(moe_reference, num_shards=2, **call.options), call, names)
        meshes = [mesh] + [make_mesh(1, 2, explicit=True)] * (index == 0)
        for on in meshes:
            got = _hostile_results(partial(moe, **call.options, **dict(placement, mesh=on)), call, names)
            same_results(got, expected, call, f"{call.corruption} {call.options} on {on.axis_types}")
            check_invariants(call, got)


def check_benchmark() -> None:
    """benchmarks/moe_jax.py: its MaxText-style baseline computes the same layer as moetriton's (to bf16
    rounding) on EP = 2, and its command line runs one step of both implementations (EP = 1, the cheapest
    to compile) and writes the CSV; on GPUs the profile puts every GPU activity in one stage or "other"."""
    from benchmarks import moe_jax

    mesh = moe_jax.make_mesh(2)
    for shape in moe_jax.TINY_SHAPES.values():
        case = moe_jax.Case(shape, 2, None, seq=16)
        arrays = moe_jax.make_inputs(case, mesh)
        got = jax.jit(moe_jax.baseline_layer(case, mesh))(*arrays)
        expected = jax.jit(moe_jax.moetriton_layer(case, mesh))(*arrays)
        _close(got[0], expected[0], f"baseline output of {shape.name}", 3e-2)
        _close(got[1], expected[1], f"baseline aux loss of {shape.name}", 1e-3)
    with tempfile.TemporaryDirectory() as out:
        argv = ["--tiny", "--steps", "1", "--shapes", "mixtral", "--ep", "1", "--out", out]
        assert moe_jax.main(argv) == 0
        with next(Path(out).glob("*/moe_jax.csv")).open() as file:
            rows = list(csv.DictReader(file))
    assert [row["impl"] for row in rows] == ["moetriton", "maxtext"], rows
    assert all(float(row["step_ms"]) > 0 and not row["error"] for row in rows), rows
    assert float(rows[0]["routing_share"]) > 0 and float(rows[0]["gemm_tflops"]) > 0, rows[0]
    if jax.default_backend() == "gpu":
        shares = [float(rows[0][f"{stage}_share"]) for stage in (*moe_jax.STAGES, "other")]
        assert abs(sum(shares) - 1) < 1e-3 and float(rows[0]["gpu_busy_ms"]) > 0, rows[0]


CHECKS = {
    "mesh-1x1": lambda: check_mesh(1, 1, 2),
    "mesh-1x2": lambda: check_mesh(1, 2, 2),
    "mesh-1x4": lambda: check_mesh(1, 4, 1),
    "mesh-1x8": lambda: check_mesh(1, 8, 1),
    "mesh-2x2": lambda: check_mesh(2, 2, 1),
    "mesh-2x4": lambda: check_mesh(2, 4, 1),
    "overflow": check_overflow,
    "routing-extremes-1x4": lambda: check_routing_extremes(1, 4),
    "routing-extremes-2x2": lambda: check_routing_extremes(2, 2),
    "no-tokens": lambda: check_no_tokens(None),
    "no-tokens-capacity": lambda: check_no_tokens(1.0),
    "determinism": check_determinism,
    "exchanges": check_exchanges,
    "exchange-blocks": check_exchange_blocks,
    "shared-experts": check_shared_experts,
    "flax": check_flax,
    "errors": check_errors,
    "benchmark": check_benchmark,
    "options-1x2": lambda: check_options(1, 2),
    "options-2x2": lambda: check_options(2, 2),
    "pipeline": check_pipeline,
    "model-recipes": check_model_recipes,
    "fp8-1x2": check_fp8,
    "explicit-mesh": check_explicit_mesh,
    "hostile-1x2": check_hostile,
}

#: Devices each check needs.
DEVICES = {
    name: int(np.prod([int(n) for n in name[5:].split("x")])) for name in CHECKS if name.startswith("mesh")
}
DEVICES.update(
    {
        "overflow": 2,
        "routing-extremes-1x4": 4,
        "routing-extremes-2x2": 4,
        "no-tokens": 2,
        "no-tokens-capacity": 2,
        "determinism": 4,
        "exchanges": 2,
        "exchange-blocks": 2,
        "shared-experts": 4,
        "flax": 4,
        "errors": 2,
        "benchmark": 2,
        "options-1x2": 2,
        "options-2x2": 4,
        "pipeline": 2,
        "model-recipes": 4,
        "fp8-1x2": 2,
        "explicit-mesh": 4,
        "hostile-1x2": 2,
    }
)


if __name__ == "__main__":
    # Exact fp32 matmuls on GPU too (no TF32): routing must not flip between the layer and the reference.
    jax.config.update("jax_default_matmul_precision", "highest")
    name = sys.argv[1]
    CHECKS[name]()
    print(f"{name}: ok")
