"""Bit-packed routing maps in JAX: the router packs them after its float kernel and unpacks them before its
backward's; dispatch reads them in place.

Every bitmap result is held to the bool map's from the same logits, bit for bit (map, probs, aux scores
and gradients, interpreted and compiled: the float math is the same kernel for both formats, see
docs/router.md), and the packed layout to numpy's packbits(bitorder="little"), an implementation of its
own; under jax.jit and jax.vmap too. On a GPU, TransformerEngine's test sizes run too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moetriton.jax as mj
from moetriton import kernels
from moetriton.jax import executor, reference, reference_router
from tests.strategies_router import large_bitmap_cases

# (E, K, groups, group_topk): E a multiple of 8, not one, below 8, 1; groups of a power-of-two size and not.
_SHAPES = [(16, 3, None, None), (12, 4, 2, 2), (5, 2, None, None), (1, 1, None, None), (24, 4, 3, 1)]


def _logits(num_tokens: int, num_experts: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (num_tokens, num_experts))


def _packbits(mask: jax.Array) -> np.ndarray:
    return np.packbits(np.asarray(mask), axis=1, bitorder="little")


def _topk_and_grad(logits, topk, groups, group_topk, routing_map_format, score_function="sigmoid"):
    def route(x):
        return mj.fused_topk_with_score_function(
            x, topk, False, groups, group_topk, 2.0, score_function, None, routing_map_format
        )

    probs, routing_map = route(logits)
    weights = jnp.linspace(-1, 1, probs.size).reshape(probs.shape)
    grad = jax.grad(lambda x: (route(x)[0] * weights).sum())(logits)
    return probs, routing_map, grad


@pytest.mark.parametrize("num_tokens", [0, 5])
@pytest.mark.parametrize(("num_experts", "topk", "groups", "group_topk"), _SHAPES)
def test_topk_bitmap_is_the_packed_bytemap_with_the_same_gradients(
    num_tokens, num_experts, topk, groups, group_topk
):
    logits = _logits(num_tokens, num_experts)
    probs, mask, grad = _topk_and_grad(logits, topk, groups, group_topk, "bytemap")
    packed_probs, bitmap, packed_grad = _topk_and_grad(logits, topk, groups, group_topk, "bitmap")
    assert bitmap.dtype == jnp.uint8 and bitmap.shape == (num_tokens, (num_experts + 7) // 8)
    np.testing.assert_array_equal(np.asarray(bitmap), _packbits(mask))
    np.testing.assert_array_equal(packed_probs, probs)
    np.testing.assert_array_equal(packed_grad, grad)


def _assert_aux_scores_bitwise(num_tokens, num_experts, topk, score_function):
    """The aux scores and their gradient, the bitmap call under jax.jit."""
    logits = _logits(num_tokens, num_experts, seed=1)

    def scores_of(routing_map_format):
        def scores(x):
            return mj.fused_compute_score_for_moe_aux_loss(x, topk, score_function, routing_map_format)

        grad = jax.grad(lambda x: (scores(x)[1] ** 2).sum())(logits)
        return (*scores(logits), grad)

    mask, scores, grad = scores_of("bytemap")
    bitmap, packed_scores, packed_grad = jax.jit(scores_of, static_argnums=0)("bitmap")
    np.testing.assert_array_equal(np.asarray(bitmap), _packbits(mask))
    np.testing.assert_array_equal(packed_scores, scores)
    np.testing.assert_array_equal(packed_grad, grad)


@pytest.mark.parametrize(("num_experts", "topk"), [(16, 3), (11, 4), (1, 1)])
def test_aux_scores_bitmap_is_the_packed_bytemap_under_jit(num_experts, topk):
    _assert_aux_scores_bitwise(6, num_experts, topk, "softmax")


@pytest.mark.skipif(not executor.on_gpu(), reason="sizes for compiled kernels (the interpreter is slow)")
@large_bitmap_cases
def test_large_bitmap_results_are_bitwise_the_bytemaps(
    num_tokens, num_experts, topk, groups, group_topk, score_function
):
    """TransformerEngine's bitmap test sizes and DeepSeek-V3's router: top-k probs and gradient, aux scores
    and their gradient."""
    logits = _logits(num_tokens, num_experts, seed=num_experts)
    probs, mask, grad = _topk_and_grad(logits, topk, groups, group_topk, "bytemap", score_function)
    packed_probs, bitmap, packed_grad = _topk_and_grad(
        logits, topk, groups, group_topk, "bitmap", score_function
    )
    np.testing.assert_array_equal(np.asarray(bitmap), _packbits(mask))
    np.testing.assert_array_equal(packed_probs, probs)
    np.testing.assert_array_equal(packed_grad, grad)
    _assert_aux_scores_bitwise(num_tokens, num_experts, topk, score_function)


def test_backward_ignores_bits_past_the_last_expert():
    """The top-k gradient from a bitmap whose unused high bits are all set equals the clean bitmap's."""
    logits = _logits(5, 11, seed=9)
    grad_probs = jax.random.normal(jax.random.PRNGKey(10), (5, 11))
    _, bitmap = mj.fused_topk_with_score_function(logits, 3, routing_map_format="bitmap")
    options = dict(topk=3, use_pre_softmax=False, scaling_factor=1.0, score_function="softmax")
    grads = [
        executor.run_builder(
            kernels.topk_backward_plan,
            dict(grad_probs=grad_probs, logits=logits, routing_map=routing),
            routing_map_format="bitmap",
            **options,
        )["grad_logits"]
        for routing in (bitmap, bitmap.at[:, -1].set(bitmap[:, -1] | jnp.uint8(0xF8)))
    ]
    np.testing.assert_array_equal(grads[1], grads[0])


def test_vmap_packs_each_problem():
    logits = jnp.stack([_logits(4, 10, seed=2), _logits(4, 10, seed=3)])
    bitmaps = jax.vmap(lambda x: mj.fused_topk_with_score_function(x, 3, routing_map_format="bitmap")[1])(
        logits
    )
    assert bitmaps.shape == (2, 4, 2)
    for problem, bitmap in zip(logits, bitmaps, strict=True):
        _, mask = mj.fused_topk_with_score_function(problem, 3)
        np.testing.assert_array_equal(np.asarray(bitmap), _packbits(mask))


def test_references_pack_like_numpy_and_agree_with_the_kernels():
    logits = _logits(7, 13, seed=4)
    _, mask = reference_router.fused_topk_with_score_function(logits, 4, score_function="sigmoid")
    _, bitmap = reference_router.fused_topk_with_score_function(
        logits, 4, score_function="sigmoid", routing_map_format="bitmap"
    )
    np.testing.assert_array_equal(np.asarray(bitmap), _packbits(mask))
    np.testing.assert_array_equal(reference.unpack_bitmap(bitmap, 13), mask)
    _, kernel_bitmap = mj.fused_topk_with_score_function(
        logits, 4, score_function="sigmoid", routing_map_format="bitmap"
    )
    np.testing.assert_array_equal(kernel_bitmap, bitmap)


def _dispatch(tokens, routing, probs, num_experts, extra, align_size, capacity):
    rows = None if capacity is not None else tokens.shape[0] * 3

    def run(x, p):
        return mj.token_dispatch(x, routing, rows, p, align_size, capacity=capacity, **extra)

    def loss(x, p):
        result = run(x, p)
        return (result[0] ** 2).sum() + (result[1] ** 2).sum()

    return jax.jit(run)(tokens, probs), jax.grad(loss, argnums=(0, 1))(tokens, probs)


@pytest.mark.parametrize("num_experts", [16, 11, 1])
@pytest.mark.parametrize(("align_size", "capacity"), [(None, None), (4, None), (None, 2)])
@pytest.mark.parametrize("garbage", [False, True])
def test_dispatch_from_a_bitmap_equals_dispatch_from_the_mask(num_experts, align_size, capacity, garbage):
    """All results and gradients; with `garbage` every unused high bit of the last byte is set (E = 16 has
    none)."""
    logits = _logits(9, num_experts, seed=5)
    probs, mask = mj.fused_topk_with_score_function(logits, min(3, num_experts))
    _, bitmap = mj.fused_topk_with_score_function(logits, min(3, num_experts), routing_map_format="bitmap")
    if garbage and num_experts % 8:
        bitmap = bitmap.at[:, -1].set(bitmap[:, -1] | jnp.uint8(0xFF << (num_experts % 8) & 0xFF))
    tokens = jax.random.normal(jax.random.PRNGKey(6), (9, 16))
    expected = _dispatch(tokens, mask, probs, num_experts, {}, align_size, capacity)
    extra = dict(num_experts=num_experts, routing_map_format="bitmap")
    got = _dispatch(tokens, bitmap, probs, num_experts, extra, align_size, capacity)
    for mine, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine, theirs)


def test_reference_dispatch_reads_the_bitmap_like_the_kernels():
    logits = _logits(9, 11, seed=7)
    probs, mask = mj.fused_topk_with_score_function(logits, 3)
    tokens = jax.random.normal(jax.random.PRNGKey(8), (9, 16))
    bitmap = reference.pack_bitmap(mask)
    kwargs = dict(num_experts=11, routing_map_format="bitmap")
    expected = reference.token_dispatch(tokens, bitmap, 27, probs, **kwargs)
    got = mj.token_dispatch(tokens, bitmap, 27, probs, **kwargs)
    for mine, theirs in zip(got, expected, strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize(
    ("routing_map", "kwargs", "message"),
    [
        (jnp.zeros((4, 2), jnp.uint8), dict(num_experts=20), r"routing_map: expected shape\[1\] = ceil"),
        (jnp.zeros((4, 2), jnp.uint8), {}, "num_experts: required with a bitmap"),
        (jnp.zeros((4, 2), bool), dict(num_experts=12), "routing_map: expected dtype in"),
    ],
)
def test_bad_bitmaps_are_refused_with_clear_errors(routing_map, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mj.token_dispatch(jnp.zeros((4, 8)), routing_map, 4, routing_map_format="bitmap", **kwargs)


def test_bad_formats_are_refused_with_clear_errors():
    with pytest.raises(ValueError, match="routing_map_format: expected one of"):
        mj.fused_topk_with_score_function(_logits(2, 4), 2, routing_map_format="bits")
