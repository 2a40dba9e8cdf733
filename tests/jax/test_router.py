"""JAX router ops against the pure-JAX reference (forward, gradients, jit, vmap, errors) and against the
PyTorch ops on the same inputs. On CPU the kernels run under the Triton interpreter via pure_callback."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from moetriton.jax import reference_router as reference
from moetriton.jax.router import (
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

from ..strategies import numpy_dtype
from ..strategies_router import AuxLossProblem, RouterProblem, aux_loss_problems, router_problems

# Kernels and references round fp32 differently in the last bits; after the cast to the output dtype that is
# at most about one unit in the last place.
RTOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


def _array(values: np.ndarray, dtype: str = "float32") -> jax.Array:
    return jnp.asarray(values.astype(numpy_dtype(dtype)))


def _assert_close(actual, expected, dtype: str, *, grad: bool = False) -> None:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    rtol = RTOL[dtype] * (10 if grad else 1)
    finite = np.nan_to_num(expected, nan=0.0, posinf=0.0, neginf=0.0)
    scale = float(np.abs(finite).max()) if finite.size else 0.0
    atol = rtol * max(scale, 1e-2) if grad else 1e-6 * max(scale, 1.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def _inputs(problem: RouterProblem) -> tuple[jax.Array, jax.Array | None]:
    bias = None if problem.bias is None else _array(problem.bias)
    return _array(problem.logits, problem.dtype), bias


def _cotangent(shape, dtype) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


@given(problem=router_problems())
def test_topk_matches_reference(problem: RouterProblem):
    logits, bias = _inputs(problem)
    kwargs = dict(problem.topk_kwargs(), expert_bias=bias, return_indices=True)

    def split(fn):
        """probs (differentiated) and (routing_map, indices) as auxiliary outputs."""
        return lambda x: (lambda out: (out[0], out[1:]))(fn(x, problem.topk, **kwargs))

    probs, vjp, (routing_map, indices) = jax.vjp(split(fused_topk_with_score_function), logits, has_aux=True)
    ref_probs, ref_vjp, (ref_map, ref_indices) = jax.vjp(
        split(reference.fused_topk_with_score_function), logits, has_aux=True
    )
    assert probs.shape == routing_map.shape == logits.shape and probs.dtype == logits.dtype
    assert indices.shape == (*problem.lead_shape, problem.topk) and indices.dtype == jnp.int32
    np.testing.assert_array_equal(routing_map, ref_map)
    np.testing.assert_array_equal(indices, ref_indices)
    assert bool((routing_map.sum(-1) == problem.topk).all())
    assert bool((probs[~routing_map] == 0).all())
    _assert_close(probs, ref_probs, problem.dtype)
    if problem.finite and probs.size:
        cotangent = _cotangent(probs.shape, probs.dtype)
        _assert_close(vjp(cotangent)[0], ref_vjp(cotangent)[0], problem.dtype, grad=True)


@given(problem=router_problems(groups=False, bias=False))
def test_aux_scores_match_reference(problem: RouterProblem):
    logits, _ = _inputs(problem)
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, problem.topk, problem.score_function)
    ref_map, ref_scores = reference.fused_compute_score_for_moe_aux_loss(
        logits, problem.topk, problem.score_function
    )
    assert scores.dtype == jnp.float32 and scores.shape == routing_map.shape == logits.shape
    np.testing.assert_array_equal(routing_map, ref_map)
    _assert_close(scores, ref_scores, "float32")
    if problem.finite and scores.size:
        cotangent = _cotangent(scores.shape, jnp.float32)

        def grad(fn):
            return jax.grad(lambda x: (fn(x, problem.topk, problem.score_function)[1] * cotangent).sum())(
                logits
            )

        expected = grad(reference.fused_compute_score_for_moe_aux_loss)
        _assert_close(grad(fused_compute_score_for_moe_aux_loss), expected, problem.dtype, grad=True)


@given(problem=aux_loss_problems())
def test_aux_loss_matches_reference(problem: AuxLossProblem):
    probs = _array(problem.probs, problem.dtype)
    counts = jnp.asarray(problem.tokens_per_expert)
    args = (problem.num_experts, problem.topk, problem.coeff)
    expected, ref_grad = jax.value_and_grad(
        lambda p: reference.fused_moe_aux_loss(p, counts, problem.total_num_tokens, *args).astype(jnp.float32)
    )(probs)
    for total in (problem.total_num_tokens, jnp.asarray(problem.total_num_tokens, jnp.int32)):
        loss, grad = jax.value_and_grad(lambda p, total=total: fused_moe_aux_loss(p, counts, total, *args))(
            probs
        )
        assert loss.shape == () and loss.dtype == probs.dtype
        _assert_close(loss, expected.astype(probs.dtype), problem.dtype)
        _assert_close(grad, ref_grad, problem.dtype)


@pytest.mark.parametrize("total", [0, 0.5, -3], ids=["zero", "half", "negative"])
@pytest.mark.parametrize("traced", [False, True])
def test_aux_loss_of_an_array_total_below_one_is_zero(total, traced):
    """An array total_num_tokens below 1 (no tokens: a traced or device count) gives a loss of exactly 0
    and a zero gradient, in the op and in the reference, even with NaN probs; a NaN total gives NaN. A
    Python int below 1 is refused (a static count, free to check)."""
    probs = jnp.asarray([[0.5, np.nan], [0.25, 0.75]], jnp.float32)
    counts = jnp.asarray([3, 1])
    count = jnp.asarray(total, jnp.float32 if total != int(total) else jnp.int32)
    for function in (fused_moe_aux_loss, reference.fused_moe_aux_loss):
        value_and_grad = jax.value_and_grad(lambda p, c, f=function: f(p, counts, c, 2, 1, 1.0))
        loss, grad = (jax.jit(value_and_grad) if traced else value_and_grad)(probs, count)
        assert float(loss) == 0 and not np.asarray(grad).any(), (function, loss, grad)
    nan_total = jnp.asarray(np.nan, jnp.float32)
    assert np.isnan(float(fused_moe_aux_loss(jnp.nan_to_num(probs), counts, nan_total, 2, 1, 1.0)))
    with pytest.raises(ValueError, match="total_num_tokens: expected an int in >= 1, got 0"):
        fused_moe_aux_loss(probs, counts, 0, 2, 1, 1.0)


def test_jit_and_vmap_match_eager():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 12)), jnp.float32)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal(12), jnp.float32)
    kwargs = dict(num_groups=4, group_topk=2, score_function="sigmoid", expert_bias=bias, return_indices=True)
    eager = fused_topk_with_score_function(logits, 4, **kwargs)
    jitted = jax.jit(lambda x: fused_topk_with_score_function(x, 4, **kwargs))(logits)
    mapped = jax.vmap(lambda x: fused_topk_with_score_function(x, 4, **kwargs))(logits)
    for a, b, c in zip(eager, jitted, mapped, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)

    def loss(x):
        return fused_topk_with_score_function(x, 4, **kwargs)[0][..., :6].sum()

    np.testing.assert_allclose(jax.vmap(jax.grad(loss))(logits), jax.grad(loss)(logits), rtol=1e-6, atol=1e-7)


def test_ties_and_nan_policy():
    _, _, indices = fused_topk_with_score_function(
        jnp.array([[1.0, 2.0, 3.0, 4.0] * 4]), 4, False, 4, 2, return_indices=True
    )
    assert indices.tolist() == [[3, 7, 2, 6]]
    probs, _, indices = fused_topk_with_score_function(
        jnp.array([[jnp.nan, 1.0, jnp.nan, 0.5, -jnp.inf]]), 4, return_indices=True
    )
    assert indices.tolist() == [[1, 3, 4, 0]]
    assert bool(jnp.isnan(probs[0, jnp.array([0, 1, 3, 4])]).all()) and probs[0, 2] == 0


def _aux_loss(**kwargs):
    args = dict(tokens_per_expert=jnp.zeros(8), total_num_tokens=4, num_experts=8, topk=2, coeff=1.0)
    return lambda x: fused_moe_aux_loss(x, **dict(args, **kwargs))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: fused_topk_with_score_function(x, 9), "topk: expected an int in [1, 8]"),
        (
            lambda x: fused_topk_with_score_function(x, 2, expert_bias=jnp.zeros(8)),
            "expert_bias: needs scores before the top-k to shift",
        ),
        (
            lambda x: fused_topk_with_score_function(x, 2, normalize_topk=False),
            "normalize_topk: False contradicts score_function 'softmax'",
        ),
        (lambda x: fused_topk_with_score_function(x, 2, group_score="max"), "group_score: needs groups"),
        (
            lambda x: fused_topk_with_score_function(x, 2, False, 4, 2, group_score="mean"),
            "group_score: expected one of",
        ),
        (
            lambda x: fused_topk_with_score_function(x, 2, False, 8, 2, group_score="top2_sum"),
            "group_score: 'top2_sum' scores a group by its top 2, but a group has 1 experts",
        ),
        (
            lambda x: fused_topk_with_score_function(x, 3, False, 4, 2),
            "group_topk: expected a divisor of topk",
        ),
        (lambda x: fused_topk_with_score_function(x.astype(jnp.int32), 2), "logits: expected dtype in"),
        (lambda x: fused_compute_score_for_moe_aux_loss(x, 2, "tanh"), "score_function: expected one of"),
        (_aux_loss(total_num_tokens=0), "total_num_tokens: expected an int in >= 1"),
        (_aux_loss(total_num_tokens=jnp.zeros(2)), "total_num_tokens: expected a 0-dim array"),
        (_aux_loss(tokens_per_expert=jnp.zeros(7)), "tokens_per_expert: expected shape (8,)"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError) as error:
        call(jnp.zeros((4, 8)))
    assert str(error.value).startswith(message)


def test_normalize_topk_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match=r"^normalize_topk: expected a bool or None"):
        fused_topk_with_score_function(jnp.zeros((4, 8)), 2, score_function="sigmoid", normalize_topk=1)


RECIPES = [
    dict(score_function="sigmoid", normalize_topk=False, num_groups=4, group_topk=2, group_score="top2_sum"),
    dict(score_function="sigmoid", normalize_topk=True, topk=1, bias=True, scaling_factor=2.5),
    dict(score_function="softmax", use_pre_softmax=True, normalize_topk=True, bias=True),
    dict(score_function="softmax", use_pre_softmax=True, num_groups=4, group_topk=2, group_score="max"),
    dict(score_function="sqrtsoftplus", normalize_topk=False, bias=True, routing_map_format="bitmap"),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda recipe: "-".join(map(str, recipe.values())))
def test_recipe_options(recipe):
    """normalize_topk, group_score, K = 1 and the bias with a softmax before the top-k: forward and
    gradient against the reference."""
    recipe = dict(recipe)
    topk, with_bias = recipe.pop("topk", 4), recipe.pop("bias", False)
    rng = np.random.default_rng(len(recipe))
    logits = jnp.asarray(rng.standard_normal((5, 12)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(12), jnp.float32) if with_bias else None
    kwargs = dict(recipe, expert_bias=bias, return_indices=True)

    def split(fn):
        return lambda x: (lambda out: (out[0], out[1:]))(fn(x, topk, **kwargs))

    probs, vjp, (routing_map, indices) = jax.vjp(split(fused_topk_with_score_function), logits, has_aux=True)
    ref_probs, ref_vjp, (ref_map, ref_indices) = jax.vjp(
        split(reference.fused_topk_with_score_function), logits, has_aux=True
    )
    np.testing.assert_array_equal(routing_map, ref_map)
    np.testing.assert_array_equal(indices, ref_indices)
    _assert_close(probs, ref_probs, "float32")
    cotangent = _cotangent(probs.shape, probs.dtype)
    _assert_close(vjp(cotangent)[0], ref_vjp(cotangent)[0], "float32", grad=True)


@given(problem=router_problems(max_tokens=6, patterns=("random", "ties")))
def test_matches_torch(problem: RouterProblem):
    """The same inputs give the same routing in both frameworks (one set of kernels)."""
    torch = pytest.importorskip("torch")
    from moetriton.torch import router as torch_router

    logits, bias = _inputs(problem)
    kwargs = dict(problem.topk_kwargs(), return_indices=True)
    ours = fused_topk_with_score_function(logits, problem.topk, expert_bias=bias, **kwargs)
    torch_logits = torch.from_numpy(problem.logits).to(getattr(torch, problem.dtype))
    torch_bias = None if problem.bias is None else torch.from_numpy(problem.bias)
    theirs = torch_router.fused_topk_with_score_function(
        torch_logits, problem.topk, expert_bias=torch_bias, **kwargs
    )
    np.testing.assert_array_equal(ours[1], theirs[1].numpy())
    np.testing.assert_array_equal(ours[2], theirs[2].numpy())
    _assert_close(ours[0], theirs[0].float().numpy(), problem.dtype)


# Router replay: routing_indices --------------------------------------------------------------------------

REPLAY_RECIPES = [
    dict(score_function="softmax"),
    dict(score_function="softmax", use_pre_softmax=True, normalize_topk=True, bias=True, groups=(4, 2)),
    dict(score_function="sigmoid", bias=True, groups=(4, 2), scaling_factor=2.5, routing_map_format="bitmap"),
    dict(score_function="sqrtsoftplus", normalize_topk=False, dtype="bfloat16"),
]


@pytest.mark.parametrize("recipe", REPLAY_RECIPES, ids=lambda recipe: "-".join(map(str, recipe.values())))
def test_replay_reproduces_an_earlier_call(recipe):
    """routing_indices = an earlier call's indices: with the same logits the routing map, indices and gradient
    are that call's exactly and probs within rounding (under jit too); with other logits the selection
    stays, and probs and gradient are the reference's weights of that selection."""
    recipe = dict(recipe)
    dtype, with_bias, groups = (
        recipe.pop("dtype", "float32"),
        recipe.pop("bias", False),
        recipe.pop("groups", None),
    )
    rng = np.random.default_rng(len(recipe) + with_bias)
    logits = _array(rng.standard_normal((2, 3, 12)), dtype)
    bias = _array(rng.standard_normal(12)) if with_bias else None
    kwargs = dict(recipe, expert_bias=bias, return_indices=True)
    if groups:
        kwargs.update(num_groups=groups[0], group_topk=groups[1])
    cotangent = _cotangent(logits.shape, logits.dtype)

    def run(fn, x, routing_indices=None):
        probs, vjp, rest = jax.vjp(
            lambda x: (lambda out: (out[0], out[1:]))(fn(x, 4, **kwargs, routing_indices=routing_indices)),
            x,
            has_aux=True,
        )
        return (probs, *rest, vjp(cotangent)[0])

    recorded = run(fused_topk_with_score_function, logits)
    replayed = run(fused_topk_with_score_function, logits, recorded[2])
    jitted = jax.jit(lambda x, ids: run(fused_topk_with_score_function, x, ids))(logits, recorded[2])
    for position, (actual, again, expected) in enumerate(zip(replayed, jitted, recorded, strict=True)):
        assert actual.dtype == again.dtype == expected.dtype
        if position == 0:  # probs: up to the order of the weights' fp32 sums (compiled, on a GPU)
            _assert_close(actual, expected, dtype)
            _assert_close(again, expected, dtype)
        else:  # the routing map, the indices and the gradient (the ordinary backward): exactly
            np.testing.assert_array_equal(actual, expected)
            np.testing.assert_array_equal(again, expected)

    other = _array(rng.standard_normal(logits.shape), dtype)
    probs, routing_map, indices, grad = run(fused_topk_with_score_function, other, recorded[2])
    expected = run(reference.fused_topk_with_score_function, other, recorded[2])
    np.testing.assert_array_equal(routing_map, recorded[1])
    np.testing.assert_array_equal(routing_map, expected[1])
    np.testing.assert_array_equal(indices, expected[2])
    _assert_close(probs, expected[0], dtype)
    _assert_close(grad, expected[3], dtype, grad=True)


@pytest.mark.parametrize(("score_function", "use_pre_softmax"), [("softmax", False), ("sigmoid", False)])
def test_replay_of_hostile_ids_matches_reference_and_torch(score_function, use_pre_softmax):
    """Ids outside [0, E) (negative, E, the int32 extremes) and repeats of an earlier slot's id select
    nothing: map, indices (-1 there), probs and gradient as the reference's, and as PyTorch's."""
    num_experts, topk = 10, 4
    ids = np.array(
        [
            [-1, 10, -7, 2**31 - 1],
            [3, 3, 3, 3],
            [0, 9, -(2**31), 9],
            [5, 4, 5, 11],
            [1, 2, 3, 4],
            [8, 8, 0, 1],
        ],
        np.int32,
    )
    logits = _array(np.random.default_rng(3).standard_normal((ids.shape[0], num_experts)))
    kwargs = dict(
        use_pre_softmax=use_pre_softmax,
        score_function=score_function,
        return_indices=True,
        routing_indices=ids,
    )
    ours = fused_topk_with_score_function(logits, topk, **kwargs)
    expected = reference.fused_topk_with_score_function(logits, topk, **kwargs)
    np.testing.assert_array_equal(ours[1], expected[1])
    np.testing.assert_array_equal(ours[2], expected[2])
    assert ours[2].tolist()[2] == [0, 9, -1, -1] and not np.asarray(ours[0][0]).any()
    _assert_close(ours[0], expected[0], "float32")

    def grad(fn):
        return jax.grad(lambda x: (fn(x, topk, **kwargs)[0] * _cotangent(logits.shape, logits.dtype)).sum())(
            logits
        )

    _assert_close(
        grad(fused_topk_with_score_function),
        grad(reference.fused_topk_with_score_function),
        "float32",
        grad=True,
    )
    torch = pytest.importorskip("torch")
    from moetriton.torch import router as torch_router

    # PyTorch on the device JAX runs on, so that both run the same kernel (or both the reference on CPU).
    device = os.environ["MOETRITON_TEST_DEVICE"]
    torch_kwargs = dict(kwargs, routing_indices=torch.from_numpy(ids).to(device))
    theirs = torch_router.fused_topk_with_score_function(
        torch.from_numpy(np.array(logits)).to(device), topk, **torch_kwargs
    )
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b.cpu().numpy())


@pytest.mark.parametrize(
    ("routing_indices", "message"),
    [
        (
            jnp.zeros((4, 1), jnp.int32),
            "routing_indices: expected shape (4, 2) (logits' leading dims, then topk",
        ),
        (
            jnp.zeros((4, 2)),
            "routing_indices: expected dtype in ('int32', 'int64') (expert ids), got float32",
        ),
        (jnp.zeros((8,), jnp.int32), "routing_indices: expected shape (4, 2)"),
    ],
)
def test_bad_routing_indices(routing_indices, message):
    with pytest.raises(ValueError) as error:
        fused_topk_with_score_function(jnp.zeros((4, 8)), 2, routing_indices=routing_indices)
    assert str(error.value).startswith(message)
