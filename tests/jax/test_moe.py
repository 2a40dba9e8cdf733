"""The expert-parallel MoE layer (moetriton.jax.moe, the Flax MoEBlock) against its dense reference.

Mesh checks run in subprocesses (tests/jax/moe_checks.py) with 8 host CPU devices: the flag must reach JAX
before it starts, and never reaches this process's JAX. There the exchange is the padded all_to_all fallback
(XLA:CPU has no ragged all-to-all). The kernels run under the Triton interpreter in this process and in the
checks of INTERPRETED; the interpreter serialises every shard's launches (about a second per shard and
layer call), so the other CPU mesh checks run the ops' pure-JAX reference, the CPU fallback without the
interpreter: they test the layer's exchange, sorts, GEMMs and gradients on up to 8 devices. On a machine with
GPUs the same checks run compiled kernels on as many GPUs as they need, with the exchange "auto" picks there
(padded on one host), and the exchanges check compares the ragged all-to-all with the padded one.
Single-device checks (no mesh) and argument errors run in this process.
"""

import csv
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings

from moetriton.jax.moe import moe
from moetriton.jax.moe.exchange import resolve_exchange
from moetriton.jax.moe.routing import most_probable_slots
from moetriton.kernels.rules.moe import MoEStats
from tests.jax._helpers import gpu_count, run_python
from tests.jax.moe_checks import (
    ALL_LOSSES,
    CHECKS,
    DEVICES,
    check_against_reference,
    check_fp8,
    fixed_problem,
    padding_mask,
    with_ties,
)
from tests.strategies_moe import (
    PROBS_POLICY_EXPERTS,
    kept_by_weight,
    moe_problems,
    probs_policy_slots,
    with_shared_experts,
)
from tests.strategies_router import skip_unless_interpreter_runs

INTERPRETED = {"mesh-1x1", "mesh-1x2", "overflow", "errors", "options-1x2", "fp8-1x2"}
#: Checks of ops with no pure-JAX reference (the FP8 GEMMs): on CPU devices they need the interpreter.
KERNELS_ONLY = {"fp8-1x2"}


def _run_check(name: str, env: dict) -> None:
    # -X faulthandler: a crash shows its stack
    result = run_python(["-X", "faulthandler", "-m", "tests.jax.moe_checks", name], env, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{name}: ok" in result.stdout


@pytest.mark.parametrize("name", sorted(set(CHECKS) - {"exchanges"}))
def test_moe_on_cpu_devices(name):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    if name not in INTERPRETED:
        env.pop("TRITON_INTERPRET", None)
    if name in KERNELS_ONLY:
        skip_unless_interpreter_runs(name)
        env["TRITON_INTERPRET"] = "1"
    _run_check(name, env)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(CHECKS) - {"exchanges"}))
def test_moe_on_gpus(name):
    if gpu_count() < DEVICES[name]:
        pytest.skip(f"MoE check {name} needs {DEVICES[name]} GPUs, found {gpu_count()}")
    _run_check(name, dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))


@pytest.mark.gpu
def test_ragged_exchange_on_gpus():
    """The ragged all-to-all path exists only on GPUs (XLA:CPU lacks ragged-all-to-all)."""
    if gpu_count() < 2:
        pytest.skip("the ragged all-to-all exchange needs 2 GPUs (XLA:CPU has no ragged-all-to-all)")
    _run_check("exchanges", dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))


@settings(max_examples=2)
@given(moe_problems())
def test_one_device_without_mesh_matches_reference(problem):
    assume(problem.topk > 1 and problem.seq > 1)  # skip the simplest problem, which Hypothesis draws first
    for align_size, capacity_factor in ((None, None), (2, 0.25)):
        variant = dataclasses.replace(problem, align_size=align_size, capacity_factor=capacity_factor)
        with jax.default_matmul_precision("highest"):  # no TF32 on GPU: routing must match the reference
            check_against_reference(variant, None)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_no_tokens_on_one_device_with_every_option(capacity_factor):
    """An empty batch with shared experts, a token mask, every loss and the statistics: zeros out, the
    reference's losses and counts, zero-sized or zero gradients (the layer builds no router, dispatch or
    exchange for it)."""
    problem = fixed_problem(1, 1, routing="rank0", topk=2, align_size=2, capacity_factor=capacity_factor)
    empty = with_shared_experts(dataclasses.replace(problem, batch=0, x=problem.x[:0]), gate=True)
    mask = np.zeros((0, problem.seq), bool)
    got, grads = check_against_reference(empty, None, options=ALL_LOSSES, token_mask=mask, stats=True)
    assert got[0].shape == (0, problem.seq, problem.hidden) and int(got[2]) == 0
    assert all(not np.asarray(g).any() for g in grads), "no token: every gradient is zero"


@pytest.mark.parametrize("chunks", [2, 3, 7])
def test_pipeline_chunks_on_one_device_match_reference(chunks):
    """Dropless in token chunks (7: more chunks than the 6 tokens) with shared experts, a mask and every
    loss: the reference's results and gradients, the same bits on a second run."""
    problem = with_shared_experts(fixed_problem(1, 1, routing="rank0", topk=2, align_size=2), gate=True)
    mask = padding_mask(problem.batch, problem.seq)
    options = dict(ALL_LOSSES, pipeline_chunks=chunks)
    with jax.default_matmul_precision("highest"):
        first = check_against_reference(problem, None, options=options, token_mask=mask, stats=True)
        second = check_against_reference(problem, None, options=options, token_mask=mask, stats=True)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_router_replay_of_the_router_s_own_choice_is_the_same_call(capacity_factor):
    """routing_indices = the ids the router itself chooses on these logits: outputs, losses and every
    gradient bit for bit those of the call without them."""
    from moetriton.jax import fused_topk_with_score_function
    from moetriton.jax.moe.experts import dense_dot

    problem = fixed_problem(1, 1, routing="random", topk=2, align_size=2)
    x, gate, gate_up, down = map(jnp.asarray, (problem.x, problem.gate, problem.gate_up, problem.down))
    options = dict(topk=2, score_function="sigmoid", aux_loss_coeff=1e-2, capacity_factor=capacity_factor)
    logits = dense_dot(x.reshape(-1, x.shape[-1]), gate)
    chosen = fused_topk_with_score_function(logits, 2, score_function="sigmoid", return_indices=True)[2]
    cotangent = jnp.asarray(np.random.default_rng(0).normal(size=x.shape).astype(np.float32))

    def loss(x, gate, gate_up, down, routing_indices):
        out, aux_loss, dropped = moe(x, gate, gate_up, down, **options, routing_indices=routing_indices)
        return jnp.sum(out * cotangent) + aux_loss, (out, aux_loss, dropped)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    free = step(x, gate, gate_up, down, None)
    replayed = step(x, gate, gate_up, down, chosen.reshape(*x.shape[:2], 2))
    for a, b in zip(jax.tree.leaves(replayed), jax.tree.leaves(free), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_layer_tracks_the_reference_on_one_device():
    check_fp8(ep=1)


def test_expert_mlp_rebuilding_the_activation_keeps_the_gradients_bit_for_bit():
    """expert_mlp rematerialises the activation output in the backward: its output and every gradient
    equal those of the same ops without the checkpoint bit for bit, and the activation output [N, F] is not
    among the residuals while the gate/up output [N, 2F] is."""
    from jax._src.ad_checkpoint import saved_residuals

    from moetriton.jax.activation import grouped_activation
    from moetriton.jax.grouped_gemm import grouped_matmul
    from moetriton.jax.moe.config import MoEConfig
    from moetriton.jax.moe.experts import ExpertWeights, expert_mlp

    rng = np.random.default_rng(0)
    rows, hidden, ffn = 9, 8, 6
    x = jnp.asarray(rng.normal(size=(rows, hidden)).astype(np.float32))
    gate_up = jnp.asarray(rng.normal(0, 0.3, (3, hidden, 2 * ffn)).astype(np.float32))
    down = jnp.asarray(rng.normal(0, 0.3, (3, ffn, hidden)).astype(np.float32))
    sizes = jnp.asarray([3, 0, 5])  # the last row lies past the groups
    cotangent = jnp.asarray(rng.normal(size=(rows, hidden)).astype(np.float32))
    config = MoEConfig(
        topk=1, dtype="float32", mesh=None, ep_axis=None, data_axes=(), exchange="ragged", num_shards=1,
        ep_size=1,
    )  # fmt: skip

    def fused(x, gate_up, down):
        return expert_mlp(x, sizes, ExpertWeights(gate_up, down), config)

    def unfused(x, gate_up, down):
        h = grouped_matmul(x, gate_up, sizes, zero_tail=False)
        return grouped_matmul(grouped_activation(h, sizes, "swiglu"), down, sizes, zero_tail=False)

    results = []
    for function in (fused, unfused):
        out, vjp = jax.vjp(function, x, gate_up, down)
        grad_x, grad_gate_up, grad_down = vjp(cotangent)
        # rows past the groups are unspecified (zero_tail=False), forward and backward
        results.append((out[:8], grad_x[:8], grad_gate_up, grad_down))
    for got, expected in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    kept = [residual.shape for residual, _ in saved_residuals(fused, x, gate_up, down)]
    assert (rows, ffn) not in kept and (rows, 2 * ffn) in kept, kept


def test_bf16_compute_matches_fp32_reference():
    problem = fixed_problem(1, 1, routing="empty_ranks", topk=2, align_size=4)
    with jax.default_matmul_precision("highest"):
        check_against_reference(problem, None, dtype="bfloat16")


@pytest.mark.parametrize(
    ("gate", "activation", "capacity_factor"),
    [(False, "swiglu", None), (True, "gelu", None), (True, "swiglu", 0.5), (False, "relu", 0.5)],
)
def test_shared_experts_on_one_device_match_reference(gate, activation, capacity_factor):
    """Forward, aux loss, dropped count and every gradient, the shared weights' included."""
    problem = fixed_problem(1, 1, routing="rank0", topk=2, align_size=2, capacity_factor=capacity_factor)
    with jax.default_matmul_precision("highest"):
        check_against_reference(with_shared_experts(problem, gate=gate, activation=activation), None)


def test_zero_shared_experts_leave_the_routed_output_bitwise():
    """The shared output is added in fp32: shared experts that output zeros change no bit of the layer.
    Small integer tokens and gate: every logit is exact whatever GEMM XLA picks for the router in either
    program (its autotuner may choose differently per compilation, and fp32 sums in another order round
    differently)."""
    rng = np.random.default_rng(1)
    arguments = _args(
        x=jnp.asarray(rng.integers(-3, 4, size=(2, 3, 8)), jnp.float32),
        gate=jnp.asarray(rng.integers(-2, 3, size=(8, 4)), jnp.float32),
    )
    arguments["gate_up"] = jnp.ones_like(arguments["gate_up"])
    arguments["down"] = jnp.ones_like(arguments["down"])
    routed = moe(**arguments)
    shared = moe(
        **arguments,
        shared_gate_up=jnp.ones((8, 16)),
        shared_down=jnp.zeros((8, 8)),
        shared_gate=jnp.ones((8, 1)),
    )
    for got, expected in zip(shared, routed, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def _one_device_problem(**change):
    """A tiny one-device problem: x [4, 3, 8], E = 4 with K = 2, experts 2 and 3 never chosen (so a capacity
    overflows), or `change`d."""
    problem = fixed_problem(1, 2, routing="empty_ranks", topk=2, align_size=2)
    return dataclasses.replace(problem, **change)


@pytest.mark.parametrize(
    "options",
    [
        dict(aux_loss_coeff=1e-2),
        dict(aux_loss_coeff=0.0, seq_aux_loss_coeff=3e-2),
        dict(aux_loss_coeff=0.0, z_loss_coeff=1e-3),
        ALL_LOSSES,
    ],
    ids=["load-balancing", "sequence", "z", "all"],
)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_each_loss_on_one_device_matches_reference(options, score_function):
    """Each loss alone and all three: aux_loss, every MoEStats field (the other losses zero) and the
    gradients the losses add."""
    problem = _one_device_problem(score_function=score_function)
    with jax.default_matmul_precision("highest"):
        got, _ = check_against_reference(problem, None, options=options, stats=True)
    stats = got[3]
    for name, coeff in (
        ("load_balancing_loss", "aux_loss_coeff"),
        ("seq_load_balancing_loss", "seq_aux_loss_coeff"),
        ("z_loss", "z_loss_coeff"),
    ):
        assert (float(getattr(stats, name)) > 0) == bool(options.get(coeff)), (name, stats)


@pytest.mark.parametrize(
    ("capacity_factor", "drop_policy", "shared", "options"),
    [
        (None, "position", False, ALL_LOSSES),
        (0.5, "position", False, ALL_LOSSES),
        (0.5, "probs", False, ALL_LOSSES),
        (0.5, "probs", True, dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3)),
        (None, "position", True, dict(seq_aux_loss_coeff=3e-2)),
    ],
)
def test_token_mask_on_one_device_matches_reference(capacity_factor, drop_policy, shared, options):
    """Padding (a whole sequence of it, and scattered tokens) takes no expert slot, no capacity, no count
    and no loss; its output rows and x gradients are exactly zero (checked by check_against_reference)."""
    problem = _one_device_problem(capacity_factor=capacity_factor)
    if shared:
        problem = with_shared_experts(problem, gate=True)
    mask = padding_mask(problem.batch, problem.seq)
    with jax.default_matmul_precision("highest"):
        got, _ = check_against_reference(
            problem, None, options=dict(options, drop_policy=drop_policy), token_mask=mask, stats=True
        )
    assert int(got[3].routed.sum()) == problem.topk * int(mask.sum()), got[3]


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_balance_counts_on_one_device_match_reference(capacity_factor):
    """With an expert bias steering the selection: balance_counts "routed" (the routed slots) and "scores"
    (the top K of the scores themselves) each give the reference's losses, statistics and gradients, and
    different losses; the routed counts in the statistics are the same either way."""
    bias = np.array([-1.0, 0.0, 0.0, 1.0], np.float32)  # moves slots from expert 0 to expert 3
    problem = _one_device_problem(score_function="sigmoid", expert_bias=bias, capacity_factor=capacity_factor)
    mask = padding_mask(problem.batch, problem.seq)
    stats = {}
    with jax.default_matmul_precision("highest"):
        for counts in ("routed", "scores"):
            options = dict(ALL_LOSSES, balance_counts=counts)
            got, _ = check_against_reference(problem, None, options=options, token_mask=mask, stats=True)
            stats[counts] = got[3]
    np.testing.assert_array_equal(np.asarray(stats["routed"].routed), np.asarray(stats["scores"].routed))
    for name in ("load_balancing_loss", "seq_load_balancing_loss"):
        assert float(getattr(stats["routed"], name)) != float(getattr(stats["scores"], name)), name


@pytest.mark.parametrize(
    "recipe",
    [
        dict(
            score_function="sigmoid", num_groups=2, group_topk=1, group_score="top2_sum", normalize_topk=False
        ),
        dict(score_function="softmax", use_pre_softmax=True, normalize_topk=True),
        dict(score_function="softmax", use_pre_softmax=True, num_groups=2, group_topk=1, group_score="max"),
    ],
    ids=["deepseek_v3", "ernie", "deepseek_v2"],
)
def test_router_recipes_on_one_device_match_reference(recipe):
    """normalize_topk, group_score and the bias with a softmax before the top-k reach the layer's router:
    outputs and gradients as the reference's, and the Flax block passes them as the layer does."""
    flax = pytest.importorskip("flax")
    from moetriton.jax.moe.flax import MoEBlock

    bias = np.array([0.3, -0.2, 0.1, -0.4], np.float32)
    problem = _one_device_problem(expert_bias=bias)  # the recipe comes in the options
    options = dict(recipe, scaling_factor=2.5)
    with jax.default_matmul_precision("highest"):
        check_against_reference(problem, None, options=options)
    block = MoEBlock(num_experts=4, ffn_dim=problem.ffn, topk=2, use_expert_bias=True, **options)
    x = jnp.asarray(problem.x)
    variables = block.init(jax.random.key(0), x)
    variables = dict(variables, moe={"expert_bias": jnp.asarray(bias)})
    params = flax.linen.meta.unbox(variables["params"])
    out = block.apply(variables, x)[0]
    gate, gate_up, down = (params[name] for name in ("gate", "gate_up", "down"))
    expected = moe(x, gate, gate_up, down, topk=2, expert_bias=jnp.asarray(bias), **options)[0]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_all_padding_gives_zeros_without_nan():
    """Every token masked: zero output, zero losses (no division by zero), zero counts, zero gradients."""
    problem = _one_device_problem(capacity_factor=0.5)
    mask = np.zeros((problem.batch, problem.seq), bool)
    with jax.default_matmul_precision("highest"):
        got, grads = check_against_reference(problem, None, options=ALL_LOSSES, token_mask=mask, stats=True)
    for leaf in jax.tree.leaves((got, grads)):
        np.testing.assert_array_equal(np.asarray(leaf), 0)


def test_padding_content_reaches_nothing():
    """Whatever padding holds (NaN, huge values) changes no bit of the results or gradients: the layer with
    NaN padding equals the layer with zero padding."""
    problem = _one_device_problem(capacity_factor=0.5)
    mask = padding_mask(problem.batch, problem.seq)
    arguments = _problem_arguments(problem, token_mask=jnp.asarray(mask), return_stats=True, **ALL_LOSSES)
    x = np.where(mask[..., None], problem.x, 0.0).astype(np.float32)
    poisoned = np.where(mask[..., None], problem.x, np.nan).astype(np.float32)

    def run(x):
        def loss(x, gate):
            results = moe(x, gate, **{k: v for k, v in arguments.items() if k not in ("x", "gate")})
            return jnp.sum(results[0]) + results[1], results

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            jnp.asarray(x), arguments["gate"]
        )

    for a, b in zip(jax.tree.leaves(run(poisoned)), jax.tree.leaves(run(x)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_mask_of_all_tokens_changes_nothing():
    """token_mask all True gives the layer without a mask: the same output bit for bit, the same losses to
    fp32 rounding (a traced token count instead of a static one)."""
    problem = _one_device_problem(capacity_factor=0.5)
    arguments = _problem_arguments(problem, return_stats=True, drop_policy="probs", **ALL_LOSSES)
    full = jnp.ones((problem.batch, problem.seq), bool)
    masked, unmasked = moe(**arguments, token_mask=full), moe(**arguments)
    np.testing.assert_array_equal(np.asarray(masked[0]), np.asarray(unmasked[0]))
    for a, b in zip(jax.tree.leaves(masked[1:]), jax.tree.leaves(unmasked[1:]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


# C = 3, 5, 2, 6: in each, two slots of equal weight straddle some expert's cut, so the tie rule decides.
@pytest.mark.parametrize(("align_size", "capacity_factor"), [(None, 0.5), (None, 0.75), (2, 0.25), (2, 0.75)])
def test_probs_policy_with_exact_ties_matches_reference(align_size, capacity_factor):
    """drop_policy="probs" keeps each expert's C heaviest slots, equal weights (duplicated tokens) to the
    earlier slot, against the reference's pairwise ranking, alignment rounding C up or not; and it keeps
    other slots than "position"."""
    problem = with_ties(_one_device_problem(align_size=align_size, capacity_factor=capacity_factor))
    with jax.default_matmul_precision("highest"):
        probs, _ = check_against_reference(problem, None, options=dict(drop_policy="probs"), stats=True)
        position, _ = check_against_reference(problem, None, options=dict(drop_policy="position"), stats=True)
    assert int(probs[2]) > 0 and int(probs[2]) == int(position[2]), (probs[2], position[2])
    for name in ("routed", "kept"):
        np.testing.assert_array_equal(
            np.asarray(getattr(probs[3], name)), np.asarray(getattr(position[3], name))
        )
    assert not np.array_equal(np.asarray(probs[0]), np.asarray(position[0])), (
        "the policies kept the same slots"
    )


def test_probs_policy_on_identical_tokens_is_the_position_policy():
    """Every token the same: every weight ties, so "probs" keeps the earliest slots, as "position" does."""
    problem = _one_device_problem(capacity_factor=0.5)
    x = np.broadcast_to(problem.x[:1, :1], problem.x.shape).copy()
    arguments = _problem_arguments(dataclasses.replace(problem, x=x), return_stats=True)
    probs, position = moe(**arguments, drop_policy="probs"), moe(**arguments, drop_policy="position")
    assert int(probs[2]) > 0, probs[2]
    for a, b in zip(jax.tree.leaves(probs), jax.tree.leaves(position), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed", range(6))
def test_most_probable_slots_match_numpy(seed):
    """The two stable sorts of drop_policy="probs" against a per-expert ranking in numpy: random experts
    (-1: masked slots), weights drawn from few values (many exact ties; NaN, -inf and -0.0 among them:
    NaN below every number, -0.0 tied with +0.0), capacities from 0 to all slots."""
    indices, weights = probs_policy_slots(seed)
    tokens, topk = indices.shape
    keep = jax.jit(most_probable_slots, static_argnums=3)  # capacity traced: one program for them all
    for capacity in range(tokens * topk + 1):
        got = keep(indices, weights, capacity, PROBS_POLICY_EXPERTS)
        expected = kept_by_weight(indices, weights, capacity, PROBS_POLICY_EXPERTS)
        np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"capacity {capacity}")


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_stats_on_one_device_match_reference(capacity_factor):
    """Stats without any loss: routed and kept counts (kept = routed when dropless), dropped, max and mean
    load, and zero losses; the first three outputs are those of the call without return_stats."""
    problem = _one_device_problem(capacity_factor=capacity_factor)
    with jax.default_matmul_precision("highest"):
        got, _ = check_against_reference(problem, None, options=dict(aux_loss_coeff=0.0), stats=True)
    stats = got[3]
    assert isinstance(stats, MoEStats)
    if capacity_factor is None:
        np.testing.assert_array_equal(np.asarray(stats.kept), np.asarray(stats.routed))
    else:
        assert int(stats.dropped) > 0, stats
    assert int(stats.routed.sum()) == problem.num_tokens * problem.topk, stats
    assert float(stats.mean_load) == float(stats.kept.sum()) / problem.num_experts, stats
    arguments = _problem_arguments(problem, aux_loss_coeff=1e-2)
    with_stats, without = moe(**arguments, return_stats=True), moe(**arguments)
    assert len(without) == 3
    for a, b in zip(with_stats[:3], without, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flax_block_passes_the_options_through():
    """MoEBlock's loss, drop-policy attributes, token_mask and return_stats give the functional layer's
    results on the block's parameters, bit for bit."""
    from flax import linen as nn

    from moetriton.jax.moe.flax import MoEBlock

    problem = _one_device_problem()
    x, mask = jnp.asarray(problem.x), jnp.asarray(padding_mask(problem.batch, problem.seq))
    options = dict(topk=2, capacity_factor=0.5, drop_policy="probs", **ALL_LOSSES)
    block = MoEBlock(num_experts=4, ffn_dim=8, num_shared_experts=1, **options)
    variables = block.init(jax.random.key(0), x)
    params = nn.meta.unbox(variables["params"])
    got = block.apply(variables, x, mask, return_stats=True)
    shared = {name: params[name] for name in ("shared_gate_up", "shared_down")}
    expected = moe(
        x,
        params["gate"],
        params["gate_up"],
        params["down"],
        token_mask=mask,
        return_stats=True,
        **options,
        **shared,
    )
    assert isinstance(got[3], MoEStats)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(block.apply(variables, x)) == 3


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            dict(drop_policy="random"),
            ValueError,
            "drop_policy: expected one of ('position', 'probs'), got 'random'",
        ),
        (dict(seq_aux_loss_coeff=-1.0), ValueError, "seq_aux_loss_coeff: expected a finite number >= 0"),
        (dict(z_loss_coeff=float("nan")), ValueError, "z_loss_coeff: expected a finite number >= 0, got nan"),
        (dict(z_loss_coeff="1e-3"), TypeError, "z_loss_coeff: expected a Python float, got str"),
    ],
)
def test_flax_block_refuses_bad_options(options, error, message):
    from moetriton.jax.moe.flax import MoEBlock

    block = MoEBlock(num_experts=4, ffn_dim=4, topk=2, **options)
    with pytest.raises(error, match=re.escape(message)):
        block.init(jax.random.key(0), jnp.zeros((2, 3, 8)))


def _problem_arguments(problem, **options) -> dict:
    """moe's arguments for a problem (no shared experts), its options and `options`."""
    return dict(
        x=jnp.asarray(problem.x),
        gate=jnp.asarray(problem.gate),
        gate_up=jnp.asarray(problem.gate_up),
        down=jnp.asarray(problem.down),
        **dict(problem.layer_options(aux_loss_coeff=0.0), **options),
    )


def test_flax_block_refuses_bad_shared_expert_options():
    from moetriton.jax.moe.flax import MoEBlock

    x = jnp.zeros((2, 3, 8))
    for options, message in (
        (dict(num_shared_experts=-1), "num_shared_experts: expected an int >= 0, got -1"),
        (dict(shared_expert_gate=True), "shared_expert_gate: expected False without shared experts"),
    ):
        block = MoEBlock(num_experts=4, ffn_dim=4, topk=2, **options)
        with pytest.raises(ValueError, match=re.escape(message)):
            block.init(jax.random.key(0), x)


def _args(**change):
    rng = np.random.default_rng(0)
    hidden, ffn, experts = 8, 4, 4
    arguments = dict(
        x=jnp.asarray(rng.normal(size=(2, 3, hidden)), jnp.float32),
        gate=jnp.zeros((hidden, experts)),
        gate_up=jnp.zeros((experts, hidden, 2 * ffn)),
        down=jnp.zeros((experts, ffn, hidden)),
        topk=2,
    )
    arguments.update(change)
    return arguments


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=jnp.zeros((6, 8))), "x: expected rank 3 [B, S, H]"),
        (
            dict(x=jnp.zeros((2, 3, 8), jnp.int32)),
            "x: expected dtype in ('float32', 'bfloat16', 'float16'), got int32",
        ),
        (dict(gate=jnp.zeros((7, 4))), "x: expected [..., H] with H = 7 (as gate [H, E])"),
        (dict(gate_up=jnp.zeros((4, 8, 7))), "gate_up: expected [n, H, 2F] = [4, 8, 8]"),
        (dict(gate_up=jnp.zeros((3, 8, 8))), "gate_up: expected [n, H, 2F] = [4, 8, 8] (n = 4 experts held"),
        (dict(down=jnp.zeros((4, 8, 8))), "gate_up: expected [n, H, 2F] = [4, 8, 16]"),
        (dict(activation="relu"), "gate_up: expected [n, H, F] = [4, 8, 4]"),
        (dict(topk=5), "topk: expected <= num_experts = 4"),
        (dict(topk=0), "topk: expected an int >= 1"),
        (dict(capacity_factor=0.0), "capacity_factor: expected a finite number > 0"),
        (dict(capacity_factor=-1.0), "capacity_factor: expected a finite number > 0"),
        (dict(capacity_factor="full"), "capacity_factor: expected None (dropless) or a number > 0"),
        (dict(align_size=0), "align_size: expected None or an int >= 1"),
        (dict(activation="tanh"), "activation: expected one of"),
        (dict(score_function="softplus"), "score_function: expected one of"),
        (dict(expert_bias=jnp.zeros(4)), "expert_bias: only supported with score_function 'sigmoid'"),
        (dict(expert_bias=jnp.zeros(3), score_function="sigmoid"), "expert_bias: expected [E] = [4]"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff: expected a finite number >= 0"),
        (dict(seq_aux_loss_coeff=-0.5), "seq_aux_loss_coeff: expected a finite number >= 0, got -0.5"),
        (dict(seq_aux_loss_coeff=float("nan")), "seq_aux_loss_coeff: expected a finite number >= 0, got nan"),
        (dict(z_loss_coeff=-1.0), "z_loss_coeff: expected a finite number >= 0, got -1.0"),
        (dict(z_loss_coeff=float("inf")), "z_loss_coeff: expected a finite number >= 0, got inf"),
        (dict(drop_policy="capacity"), "drop_policy: expected one of ('position', 'probs'), got 'capacity'"),
        (
            dict(token_mask=jnp.ones((2, 4), bool)),
            "token_mask: expected bool [2, 3] (x's leading shape), got bool",
        ),
        (
            dict(token_mask=jnp.ones((6,), bool)),
            "token_mask: expected bool [2, 3] (x's leading shape), got bool [6]",
        ),
        (
            dict(token_mask=jnp.ones((2, 3), jnp.int32)),
            "token_mask: expected bool [2, 3] (x's leading shape), got int32",
        ),
        (
            dict(token_mask=np.ones((2, 3), np.float32)),
            "token_mask: expected bool [2, 3] (x's leading shape), got float32",
        ),
        (dict(exchange="nccl"), "exchange: expected one of"),
        (dict(balance_counts="bias"), "balance_counts: expected one of ('routed', 'scores'), got 'bias'"),
        (dict(pipeline_chunks=0), "pipeline_chunks: expected an int >= 1, got 0"),
        (
            dict(pipeline_chunks=2, capacity_factor=1.0),
            "pipeline_chunks: expected 1 with capacity_factor=1.0 (chunks are dropless only), got 2",
        ),
        (dict(data_axes=("data",)), "data_axes: expected () without a mesh"),
        (dict(shared_down=jnp.zeros((6, 8))), "shared_gate_up: expected an array: shared_gate_up and"),
        (
            dict(shared_gate_up=jnp.zeros((8, 12)), shared_down=jnp.zeros((6, 7))),
            "shared_down: expected [Fs, H] with H = 8, got shape [6, 7]",
        ),
        (
            dict(shared_gate_up=jnp.zeros((8, 6)), shared_down=jnp.zeros((6, 8))),
            "shared_gate_up: expected [H, 2Fs] = [8, 12] (Fs = 6 from shared_down), got [8, 6]",
        ),
        (dict(shared_gate=jnp.zeros((8, 1))), "shared_gate: expected None without shared_gate_up"),
        (
            dict(shared_gate_up=jnp.zeros((8, 12), jnp.int32), shared_down=jnp.zeros((6, 8))),
            "shared_gate_up: expected dtype in ('float32', 'bfloat16', 'float16'), got int32",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        moe(**_args(**change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(seq_aux_loss_coeff="0.1"), "seq_aux_loss_coeff: expected a Python float, got str"),
        (dict(z_loss_coeff=True), "z_loss_coeff: expected a Python float, got bool"),
        (dict(z_loss_coeff=jnp.float32(0.1)), "z_loss_coeff: expected a Python float, got"),
        (dict(return_stats=1), "return_stats: expected a bool, got int"),
    ],
)
def test_bad_option_types_raise_type_errors(change, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        moe(**_args(**change))


def test_exchange_names_resolve_to_the_two_exchanges():
    assert [resolve_exchange(name) for name in ("auto", "padded", "ragged", "all_to_all")] == [
        "padded",
        "padded",
        "ragged",
        "ragged",
    ]


def test_importing_moetriton_jax_does_not_import_flax():
    code = "import sys, moetriton.jax; assert 'flax' not in sys.modules; import moetriton.jax.moe.flax"
    result = run_python(["-c", code], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_ep_example_runs_and_matches_reference():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = run_python(["examples/jax_moe_ep.py", "--small"], env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok"), result.stdout[-4000:]


@pytest.mark.parametrize("limit, expect_error", [(300, False), (0.5, True)], ids=["in-time", "overrun"])
def test_benchmark_isolated_rows(tmp_path, limit, expect_error):
    """benchmarks/moe_jax.py --isolate: each row in a child process; a row that overruns its limit is an
    error row and the run goes on (a hung collective cannot stall the rest)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    argv = ["--tiny", "--steps", "1", "--shapes", "mixtral", "--ep", "1", "--impl", "moetriton"]
    result = run_python(
        ["-m", "benchmarks.moe_jax", *argv, "--isolate", str(limit), "--out", str(tmp_path)], env
    )
    with next(tmp_path.glob("*/moe_jax.csv")).open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 1 and rows[0]["impl"] == "moetriton", result.stdout[-4000:] + result.stderr[-4000:]
    if expect_error:
        assert result.returncode == 1 and rows[0]["error"].startswith("timed out after 0.5 s"), rows
    else:
        assert result.returncode == 0 and not rows[0]["error"] and float(rows[0]["step_ms"]) > 0, rows


@pytest.mark.parametrize("timeout, expect_rows", [(240, True), (2, False)], ids=["in-time", "overrun"])
def test_benchmark_process_group(tmp_path, timeout, expect_rows):
    """benchmarks/moe_jax.py --processes 2: two processes of one CPU device each (gloo) measure the layer at
    EP = 2 and process 0 writes the rows, marked processes = 2; a group past its time limit is killed and
    the exit status is 1."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"  # on a machine with GPUs too: a group of N processes takes N GPUs
    argv = ["--processes", "2", "--tiny", "--steps", "1", "--shapes", "mixtral", "--timeout", str(timeout)]
    result = run_python(["-m", "benchmarks.moe_jax", *argv, "--out", str(tmp_path)], env, timeout=300)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    with next(tmp_path.glob("*/moe_jax.csv")).open() as file:
        rows = list(csv.DictReader(file))
    if not expect_rows:
        assert result.returncode == 1 and not rows and "exit statuses" in result.stdout, output
        return
    assert result.returncode == 0 and [row["impl"] for row in rows] == ["moetriton", "maxtext"], output
    for row in rows:
        assert (row["ep"], row["processes"], row["error"]) == ("2", "2", ""), row
        assert float(row["step_ms"]) > 0 and float(row["gemm_tflops"]) > 0, row
    assert rows[0]["stage_method"] == "per-stage jitted fwd+bwd timings", rows[0]
    assert float(rows[0]["routing_share"]) > 0 and float(rows[0]["a2a_moved_ratio"]) >= 1, rows[0]


def test_profiled_exchange_and_its_exposed_part(monkeypatch):
    """benchmarks.moe_jax.profiled_stage_ms on synthetic GPU activities of 2 devices over PROFILED_STEPS
    steps: the exchange time per GPU and step, and the part of it with nothing else running beside it
    (an overlapping GEMM and a nested router kernel count once)."""
    from benchmarks import moe_jax, timing

    steps = moe_jax.PROFILED_STEPS
    by_device = {
        0: [
            ("ncclDevKernel_SendRecv", 0.0, 10.0),
            ("_grouped_matmul_kernel", 5.0, 8.0),
            ("_topk_forward_kernel", 6.0, 7.0),
            ("ncclDevKernel_SendRecv", 20.0, 30.0),
            ("_grouped_matmul_kernel", 25.0, 40.0),
        ],
        1: [("ncclDevKernel_SendRecv", 0.0, 20.0), ("fusion_1", 30.0, 35.0)],
    }
    calls = []
    monkeypatch.setattr(timing, "gpu_activities_by_device", lambda runs: (runs(), by_device)[1])
    stages, least_ms, _, (exchange_ms, exposed_ms) = moe_jax.profiled_stage_ms(
        lambda x: calls.append(x) or x, (jnp.zeros(()),), 2
    )
    assert len(calls) == steps
    per_step = 1e-3 / (2 * steps)  # µs over both GPUs and every step -> ms per GPU and step
    assert exchange_ms == pytest.approx((20 + 20) * per_step)
    assert exposed_ms == pytest.approx((12 + 20) * per_step)
    assert stages["all_to_all"] == pytest.approx(40 * per_step)
    assert least_ms == pytest.approx(20 * 1e-3 / steps)
