"""Property tests of moetriton.jax's token_dispatch / token_combine against the pure-JAX reference (the
same properties as the PyTorch side, on the shared strategies).

Data movement matches bit for bit; fp32 sums within a few last places (see _helpers.assert_reduced);
gradients are compared against jax.vjp of the reference. Every example runs jitted: one compile per
example is far cheaper than dispatching each JAX op eagerly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import moetriton.jax as mj
from moetriton.jax import reference
from moetriton.kernels import row_map_slots
from tests.jax._helpers import (
    assert_reduced,
    assert_same,
    bits,
    concat_shards,
    probs,
    split_into_shards,
    tokens,
)
from tests.strategies import FLOAT_DTYPES, routing_problems

_DISPATCH_NAMES = ("output", "permuted_probs", "row_id_map", "pad_offsets", "tokens_per_expert", "scales")


def _dispatcher(api, problem, num_out_tokens=None, **shards):
    """Jitted (inp, routing, probs, scales) -> api.token_dispatch results, with the problem's sizes."""
    where = "routing_map" if problem.kind == "mask" else "indices"
    extra = {} if problem.kind == "mask" else {"num_experts": problem.num_experts}

    def run(inp, routing, probs, scales):
        return api.token_dispatch(
            inp,
            num_out_tokens=problem.num_out_tokens if num_out_tokens is None else num_out_tokens,
            probs=probs,
            align_size=problem.align_size,
            scales=scales,
            **{where: routing},
            **extra,
            **shards,
        )

    return jax.jit(run)


def _dispatch_both(problem, with_probs=True, with_scales=False):
    args = (
        tokens(problem),
        jnp.asarray(problem.routing),
        probs(problem) if with_probs else None,
        jnp.arange(problem.num_tokens * 3, dtype=jnp.float32).reshape(-1, 3) if with_scales else None,
    )
    return _dispatcher(mj, problem)(*args), _dispatcher(reference, problem)(*args)


def _used_rows(row_id_map, num_rows: int) -> np.ndarray:
    rows = np.asarray(row_id_map[:, : row_map_slots(row_id_map.shape[1])])
    used = np.zeros(num_rows, bool)
    used[rows[rows >= 0]] = True
    return used


_combine = jax.jit(mj.token_combine)
_combine_ref = jax.jit(reference.token_combine)


@given(routing_problems(), st.booleans(), st.booleans())
def test_dispatch_matches_reference_bitwise(problem, with_probs, with_scales):
    got, expected = _dispatch_both(problem, with_probs, with_scales)
    assert len(got) == len(expected) == 5 + with_scales
    for name, g, e in zip(_DISPATCH_NAMES, got, expected, strict=False):
        assert_same(g, e, name)
    assert (got[1] is None) == (not with_probs)
    assert (got[3] is None) == (problem.align_size is None)


@given(routing_problems(padding=(True,)))
def test_rows_without_a_token_are_zero(problem):
    (output, permuted_probs, row_id_map, _, counts), _ = _dispatch_both(problem)
    used = _used_rows(row_id_map, output.shape[0])
    assert not bits(output)[~used].any()
    assert not bits(permuted_probs)[~used].any()
    assert int(counts.sum()) <= output.shape[0]
    if problem.align_size:
        assert (np.asarray(counts) % problem.align_size == 0).all()


@given(routing_problems(dtypes=FLOAT_DTYPES), st.booleans())
def test_combine_matches_reference(problem, weighted):
    (output, _, row_id_map, pad_offsets, _), _ = _dispatch_both(problem, with_probs=False)
    expert_out = output * 3 - 1  # any values; the dispatch output only supplies the layout
    weights = probs(problem) if weighted else None
    got = _combine(expert_out, row_id_map, weights, pad_offsets)
    expected = _combine_ref(expert_out, row_id_map, weights)
    assert_reduced(got, expected, "combine")


@given(routing_problems(dtypes=("float32",)))
def test_round_trip_with_normalised_weights_is_identity(problem):
    routed = problem.routing if problem.kind == "mask" else problem.routing >= 0
    problem = dataclasses.replace(problem, num_out_tokens=int(routed.sum()))
    (out, _, row_id_map, pad_offsets, _), _ = _dispatch_both(problem, with_probs=False)
    weights = jnp.asarray(routed / np.maximum(routed.sum(1, keepdims=True), 1), jnp.float32)
    back = _combine(out, row_id_map, weights, pad_offsets)
    expected = np.where(routed.any(1)[:, None], problem.tokens, 0)
    np.testing.assert_allclose(back, expected, rtol=1e-6, atol=1e-6)


def _pipeline(api, problem):
    dispatch = _dispatcher(api, problem)

    def run(x, routing, p, w):
        out, permuted_probs, row_id_map, pad_offsets, _ = dispatch(x, routing, p, None)
        # Elementwise work in fp32, so the comparison sees the ops' rounding, not bf16 arithmetic in XLA.
        wide = out.astype(jnp.float32)
        expert_out = (wide * 2 + permuted_probs[:, None] * jnp.square(wide)).astype(out.dtype)
        return api.token_combine(expert_out, row_id_map, w, pad_offsets)

    return run


def _close(got, expected, rtol: float, what: str) -> None:
    """Tolerance relative to the largest magnitude: sums with cancellation keep absolute, not relative,
    errors."""
    expected = np.asarray(expected, np.float32)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale, err_msg=what)


@given(routing_problems(dtypes=("float32", "bfloat16")))
def test_gradients_match_vjp_of_reference(problem):
    routing = jnp.asarray(problem.routing)
    x, p, w = tokens(problem), probs(problem), probs(problem)[::-1]
    rtol = 1e-5 if x.dtype == jnp.float32 else 2e-2
    outputs = []
    for api in (mj, reference):
        run = _pipeline(api, problem)

        def value_and_grads(x, p, w, run=run):
            y, vjp = jax.vjp(lambda x, p, w: run(x, routing, p, w), x, p, w)
            return y, vjp(jnp.linspace(-1, 1, y.size, dtype=jnp.float32).reshape(y.shape).astype(y.dtype))

        outputs.append(jax.jit(value_and_grads)(x, p, w))
    (y, grads), (y_ref, grads_ref) = outputs
    _close(y, y_ref, rtol, "combine output")
    for name, got, expected in zip(("inp", "probs", "merging_probs"), grads, grads_ref, strict=True):
        assert got.dtype == expected.dtype, name
        _close(got, expected, rtol, name)


@given(routing_problems(dtypes=FLOAT_DTYPES, padding=(True,)), st.booleans())
def test_combine_gradient_is_zero_off_the_token_rows(problem, weighted):
    (output, _, row_id_map, pad_offsets, _), _ = _dispatch_both(problem, with_probs=False)
    weights = probs(problem) if weighted else None

    def total(x):
        return mj.token_combine(x, row_id_map, weights, pad_offsets).astype(jnp.float32).sum()

    got = jax.jit(jax.grad(total))(output + 1)
    used = _used_rows(row_id_map, output.shape[0])
    assert not bits(got)[~used].any()
    if not weighted:  # the unweighted backward copies the cotangent (all ones) to every owned row
        np.testing.assert_array_equal(np.asarray(got, np.float32)[used], 1.0)


@given(routing_problems(dtypes=("float32",)), st.booleans())
def test_dispatch_backward_is_a_combine_of_the_cotangent(problem, with_probs):
    dispatch = _dispatcher(mj, problem)
    routing = jnp.asarray(problem.routing)
    p = probs(problem) if with_probs else None

    @jax.jit
    def run(x, p):
        forward = lambda x, p: dispatch(x, routing, p, None)[:3]
        (output, permuted_probs, row_id_map), vjp = jax.vjp(forward, x, p)
        g_out = jnp.arange(output.size, dtype=jnp.float32).reshape(output.shape) % 7 - 3
        g_probs = None if permuted_probs is None else jnp.arange(permuted_probs.size, dtype=jnp.float32)
        zero_map = np.zeros(row_id_map.shape, jax.dtypes.float0)
        return vjp((g_out, g_probs, zero_map)), reference.dispatch_backward(g_out, g_probs, row_id_map)

    (grad_x, grad_p), (grad_x_ref, grad_p_ref) = run(tokens(problem), p)
    assert_same(grad_x, grad_x_ref, "grad inp")  # sums of small integers: exact in any order
    assert_same(grad_p, grad_p_ref, "grad probs")


@given(routing_problems(max_tokens=12), st.sampled_from([2, 3]), st.booleans())
def test_num_shards_concatenates_per_shard_results(problem, num_shards, with_probs):
    problem = split_into_shards(problem, num_shards)
    x, routing = tokens(problem), jnp.asarray(problem.routing)
    p = probs(problem) if with_probs else None
    got = _dispatcher(mj, problem, num_shards=num_shards)(x, routing, p, None)
    # The reference with the per-shard num_out_tokens on each block of tokens.
    shard_dispatch = _dispatcher(reference, problem, problem.num_out_tokens // num_shards)
    shard = problem.num_tokens // num_shards
    blocks = [slice(i * shard, (i + 1) * shard) for i in range(num_shards)]
    expected = concat_shards(
        [shard_dispatch(x[b], routing[b], None if p is None else p[b], None) for b in blocks]
    )
    for name, g, e in zip(_DISPATCH_NAMES, got, expected, strict=False):
        assert_same(g, e, name)
    if x.dtype.itemsize > 1:
        back = jax.jit(lambda *a: mj.token_combine(*a, num_shards=num_shards))(got[0], got[2], None, got[3])
        kept = np.asarray(got[2][:, -2])  # the count of each token's slots with a row
        np.testing.assert_array_equal(np.asarray(back, np.float32), problem.tokens * kept[:, None])


def test_fp8_payload_moves_bit_for_bit_with_scales():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 256, (9, 32), dtype=np.uint8).view(np.dtype("float8_e4m3fn")))
    scales = jnp.asarray(rng.random((9, 2), dtype=np.float32))
    ids = jnp.asarray(rng.integers(-1, 5, (9, 2), dtype=np.int32))
    got = mj.token_dispatch(x, None, 18, indices=ids, num_experts=5, scales=scales, align_size=16)
    expected = reference.token_dispatch(x, None, 18, indices=ids, num_experts=5, scales=scales, align_size=16)
    for name, g, e in zip(_DISPATCH_NAMES, got, expected, strict=True):
        assert_same(g, e, name)  # NaN encodings included: moved untouched


def test_fp8_payload_gradient_is_the_rounded_fp32_combine():
    x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(4, 3) / 4).astype(jnp.float8_e5m2)
    ids = jnp.array([[0, 1], [1, -1], [1, 0], [-1, -1]], jnp.int32)

    def f(x):
        out = mj.token_dispatch(x, indices=ids, num_experts=2)[0]
        return (out.astype(jnp.float32) * jnp.arange(out.shape[0], dtype=jnp.float32)[:, None]).sum()

    grad = jax.jit(jax.grad(f))(x)
    assert grad.dtype == jnp.float8_e5m2
    rows = np.asarray(mj.token_dispatch(x, indices=ids, num_experts=2)[2][:, : ids.shape[1]])
    expected = np.where(rows >= 0, rows, 0).sum(1, keepdims=True) * np.ones((1, 3), np.float32)
    rounded = expected.astype(grad.dtype).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), rounded)


def test_argsort_baseline_equals_dispatch_and_combine():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((10, 6), dtype=np.float32))
    ids = jnp.asarray(np.argsort(rng.random((10, 5)), axis=1)[:, :2].astype(np.int32))
    w = jnp.asarray(rng.random((10, 2), dtype=np.float32))
    out, order, sizes = reference.argsort_dispatch(x, ids, 5)
    expected, _, row_id_map, _, counts = mj.token_dispatch(x, indices=ids, num_experts=5)
    assert_same(out, expected, "output")
    assert_same(sizes, counts, "group sizes")
    assert_reduced(reference.argsort_combine(out, order, w), mj.token_combine(out, row_id_map, w), "combine")
    round_trip = lambda x: reference.argsort_combine(*reference.argsort_dispatch(x, ids, 5)[:2], w).sum()
    grad = jax.grad(round_trip)(x)
    np.testing.assert_allclose(grad, jnp.broadcast_to(w.sum(1, keepdims=True), x.shape), rtol=1e-6)
