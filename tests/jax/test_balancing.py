"""Aux-loss-free load balancing (moetriton.jax.update_expert_bias): the update against numpy, its argument
errors, and one training step that feeds it the layer's routed counts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moetriton.jax as mj
from moetriton.jax.moe import update_expert_bias
from moetriton.kernels.rules.moe import MoEStats


def _expected(expert_bias: np.ndarray, routed: np.ndarray, update_rate: float) -> np.ndarray:
    load = routed.astype(np.float64)  # exact for the small counts of these tests
    return (expert_bias.astype(np.float64) + update_rate * np.sign(load.mean() - load)).astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("routed_dtype", [np.int32, np.int64, np.uint8])
def test_update_matches_numpy(seed, routed_dtype):
    """expert_bias + rate * sign(mean(routed) - routed) in fp32, from routed counts around an integer mean
    (loads above and below it, and at least one expert exactly at it: sign(0) = 0 keeps its bias)."""
    rng = np.random.default_rng(seed)
    mean, deltas = int(rng.integers(2, 6)), rng.integers(-2, 3, int(rng.integers(0, 4)))
    routed = rng.permutation(mean + np.concatenate([deltas, -deltas, [0]]))
    bias = rng.normal(0, 0.1, routed.shape[0]).astype(np.float32)
    rate = float(rng.choice([0.0, 2.0**-10, 0.25]))  # exact in fp32: numpy's fp64 sum rounds the same
    got = update_expert_bias(jnp.asarray(bias), jnp.asarray(routed.astype(routed_dtype)), rate)
    assert got.shape == routed.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), _expected(bias, routed, rate))


def test_ties_at_the_mean_and_balanced_loads_leave_the_bias():
    bias = jnp.asarray([0.5, -0.5, 0.0, 0.25])
    np.testing.assert_array_equal(
        np.asarray(update_expert_bias(bias, jnp.full(4, 7), 1e-3)), np.asarray(bias)
    )
    got = update_expert_bias(jnp.zeros(4), jnp.asarray([1, 2, 3, 6]), 0.5)  # mean 3: the third stays
    np.testing.assert_array_equal(np.asarray(got), [0.5, 0.5, 0.0, -0.5])


def test_update_under_jit_with_a_bf16_bias_returns_fp32():
    bias = jnp.asarray([0.5, 0.0, -0.25], jnp.bfloat16)
    routed = jnp.asarray([0, 3, 6], jnp.int32)
    got = jax.jit(update_expert_bias, static_argnums=2)(bias, routed, 0.125)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), [0.625, 0.0, -0.375])


def test_exported_from_moetriton_jax():
    """moetriton.jax exports the update and the stats record (the rules' own MoEStats)."""
    assert mj.update_expert_bias is update_expert_bias and "update_expert_bias" in mj.__all__
    assert mj.MoEStats is MoEStats and "MoEStats" in mj.__all__


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (dict(update_rate=-1e-3), ValueError, "update_rate: expected a finite number >= 0, got -0.001"),
        (dict(update_rate=float("nan")), ValueError, "update_rate: expected a finite number >= 0, got nan"),
        (dict(update_rate=float("inf")), ValueError, "update_rate: expected a finite number >= 0, got inf"),
        (dict(update_rate="1e-3"), TypeError, "update_rate: expected a Python float, got str"),
        (dict(update_rate=True), TypeError, "update_rate: expected a Python float, got bool"),
        (dict(update_rate=jnp.float32(1e-3)), TypeError, "update_rate: expected a Python float, got"),
        (
            dict(expert_bias=jnp.zeros((2, 2))),
            ValueError,
            "'float16')), got float32 [2, 2]",
        ),
        (
            dict(expert_bias=jnp.zeros(4, jnp.int32)),
            ValueError,
            "expert_bias: expected a float [E] (dtype in ('float32', 'bfloat16', 'float16')), got int32",
        ),
        (dict(routed=jnp.zeros(3, jnp.int32)), ValueError, "routed: expected [E] = [4], got [3]"),
        (dict(routed=jnp.zeros((1, 4), jnp.int32)), ValueError, "routed: expected [E] = [4], got [1, 4]"),
        (dict(routed=jnp.arange(4.0)), ValueError, "routed: expected integer counts (dtype in"),
        (dict(routed=jnp.arange(4, dtype=jnp.bfloat16)), ValueError, "got bfloat16: a float count may"),
        (dict(routed=np.ones(4, bool)), ValueError, "routed: expected integer counts (dtype in"),
        (dict(routed=np.array([3, -1, 2, 0])), ValueError, "routed: expected counts >= 0, got -1"),
        # A concrete JAX array is read where that is free, on the CPU (on a GPU only with MOETRITON_CHECK=1).
        (
            dict(routed=jax.device_put(jnp.asarray([3, -2, 2, 0]), jax.devices("cpu")[0])),
            ValueError,
            "routed: expected counts >= 0, got -2",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(arguments, error, message):
    valid = dict(expert_bias=jnp.zeros(4), routed=jnp.arange(4, dtype=jnp.int32), update_rate=1e-3)
    with pytest.raises(error, match=re.escape(message)):
        update_expert_bias(**{**valid, **arguments})


def _exact_directions(routed: list[int]) -> list[int]:
    """sign(mean - count) in Python integers: sign(sum - E * count)."""
    total = sum(routed)
    return [(total > len(routed) * count) - (total < len(routed) * count) for count in routed]


def test_counts_past_float_precision_keep_their_sign():
    """Counts that fp32 cannot hold apart: 2^24 + 1 is above the mean 2^24 (fp32 rounded it onto the
    mean, a zero update); int32 counts whose sum passes 2^31 (no overflow without x64); numpy int64 counts
    past 2^32 (compared on the host, not wrapped into int32)."""
    cases = [
        (jnp.asarray([2**24 + 1, 2**24 - 1, 2**24, 2**24], jnp.int32), [-1, 1, 0, 0]),
        (jnp.asarray([2**31 - 1, 2**31 - 2, 2**31 - 3, 5], jnp.int32), None),
        (np.array([2**40 + 1, 2**40 - 1, 2**40], np.int64), None),
        (np.array([2**33, 2**33 + 1], np.int64), [1, -1]),
    ]
    for routed, expected in cases:
        directions = _exact_directions([int(count) for count in np.asarray(routed)])
        assert expected is None or directions == expected
        got = update_expert_bias(jnp.zeros(routed.shape[0]), routed, 1.0)
        np.testing.assert_array_equal(np.asarray(got), directions, err_msg=str(routed))
        traced = jax.jit(update_expert_bias, static_argnums=2)(jnp.zeros(routed.shape[0]), routed, 1.0)
        if isinstance(routed, jax.Array):
            np.testing.assert_array_equal(np.asarray(traced), directions, err_msg=str(routed))


@given(counts=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8))
def test_directions_are_exact_for_any_int32_counts(counts):
    got = update_expert_bias(jnp.zeros(len(counts)), jnp.asarray(counts, jnp.int32), 1.0)
    np.testing.assert_array_equal(np.asarray(got), _exact_directions(counts))


def test_a_training_step_moves_the_bias_towards_underloaded_experts():
    """The Flax recipe of MoEBlock's docstring: one step applies the block with return_stats, takes the
    gradient step and returns the new "moe" collection; the bias moved by rate * sign(mean - routed) of the
    step's routed counts, padding excluded."""
    from flax import linen as nn

    from moetriton.jax.moe.flax import MoEBlock

    x = jax.random.normal(jax.random.key(1), (2, 3, 8))
    token_mask = jnp.asarray([[True, True, True], [True, False, False]])
    block = MoEBlock(
        num_experts=4, ffn_dim=4, topk=2, score_function="sigmoid", use_expert_bias=True, z_loss_coeff=1e-3
    )
    variables = nn.meta.unbox(block.init(jax.random.key(0), x))
    rate = 1e-2

    @jax.jit
    def train_step(variables, x, token_mask):
        def loss_fn(params):
            out, aux_loss, _, stats = block.apply(
                {**variables, "params": params}, x, token_mask, return_stats=True
            )
            return jnp.mean(out**2) + aux_loss, stats

        grads, stats = jax.grad(loss_fn, has_aux=True)(variables["params"])
        params = jax.tree.map(lambda p, g: p - 1e-2 * g, variables["params"], grads)
        bias = update_expert_bias(variables["moe"]["expert_bias"], stats.routed, rate)
        return {"params": params, "moe": {"expert_bias": bias}}, stats

    new_variables, stats = train_step(variables, x, token_mask)
    routed = np.asarray(stats.routed)
    assert routed.sum() == 2 * int(token_mask.sum()), routed
    expected = _expected(np.asarray(variables["moe"]["expert_bias"]), routed, rate)
    np.testing.assert_array_equal(np.asarray(new_variables["moe"]["expert_bias"]), expected)
