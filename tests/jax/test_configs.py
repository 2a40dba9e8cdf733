"""Every config of every permutation kernel's search space runs through the JAX executor and computes the
reference result. On GPU this compiles each config through jax-triton (the configs the autotune cache can
hand the JAX bindings); under the interpreter num_warps has no effect, so configs differing only in it run
once."""

import jax.numpy as jnp
import numpy as np
import pytest

from moetriton import kernels
from moetriton.jax import reference
from moetriton.jax.executor import on_gpu, run_plan
from tests import _plans
from tests._plans import HIDDEN, NUM_EXPERTS, NUM_TOKENS, TOPK
from tests.jax._helpers import assert_reduced, assert_same

RNG = np.random.default_rng(11)
IDS = np.argsort(RNG.random((NUM_TOKENS, NUM_EXPERTS)), axis=1)[:, :TOPK].astype(np.int32)
IDS[3, 1] = -1
TOKENS = jnp.asarray(RNG.standard_normal((NUM_TOKENS, HIDDEN)), jnp.bfloat16)


def _run(plan: kernels.Plan, **inputs) -> dict:
    return dict(zip(plan.results, run_plan(plan, inputs), strict=True))


def _configs(name: str) -> list[dict]:
    return _plans.distinct_configs(name, interpreted=not on_gpu())


def _routing(kind: str) -> jnp.ndarray:
    if kind == "indices":
        return jnp.asarray(IDS)
    mask = np.zeros((NUM_TOKENS, NUM_EXPERTS), bool)
    np.put_along_axis(mask, np.maximum(IDS, 0), True, axis=1)
    return jnp.asarray(mask)


@pytest.mark.parametrize("kind", ["mask", "indices"])
@pytest.mark.parametrize("config", _configs("row_map") + _configs("dispatch"), ids=str)
def test_every_dispatch_config(kind, config):
    routing = _routing(kind)
    probs = jnp.asarray(RNG.random(routing.shape, dtype=np.float32))
    plan = _plans.sweep_dispatch_plan(kind, align_size=4, config=config)
    got = _run(plan, inp=TOKENS, routing=routing, probs=probs, scales=None)
    expected = reference.dispatch(
        TOKENS, routing, probs, None, NUM_EXPERTS, kind == "mask", NUM_TOKENS * TOPK, 4
    )
    names = ("output", "permuted_probs", "permuted_scales", "row_id_map", "pad_offsets", "tokens_per_expert")
    for result, value in zip(names, expected, strict=True):
        if value is not None:
            assert_same(got[result], value, result)


def _layout(align_size):
    _, _, _, row_map, _, _ = reference.dispatch(
        TOKENS, jnp.asarray(IDS), None, None, NUM_EXPERTS, False, NUM_TOKENS * TOPK, align_size
    )
    num_rows = kernels.buffer_rows(NUM_TOKENS * TOPK, NUM_EXPERTS, align_size)
    rows = jnp.asarray(RNG.standard_normal((num_rows, HIDDEN)), jnp.bfloat16)
    grad = jnp.asarray(RNG.standard_normal((NUM_TOKENS, HIDDEN)), jnp.bfloat16)
    weights = jnp.asarray(RNG.random((NUM_TOKENS, TOPK), dtype=np.float32))
    return row_map, rows, grad, weights


@pytest.mark.parametrize("config", _configs("combine"), ids=str)
def test_every_combine_config(config):
    row_map, rows, _, weights = _layout(None)
    plan = _plans.sweep_combine_plan(rows.shape[0], weighted=True, config=config)
    got = run_plan(plan, dict(inp=rows, row_id_map=row_map, weights=weights, permuted_probs=None))
    assert_reduced(got[0], reference.combine(rows, row_map, weights), "combine")


@pytest.mark.parametrize("align_size", [None, 4])
@pytest.mark.parametrize("config", _configs("combine_backward"), ids=str)
def test_every_combine_backward_config(align_size, config):
    row_map, rows, grad, weights = _layout(align_size)
    plan = _plans.sweep_combine_backward_plan(rows.shape[0], padded=align_size is not None, config=config)
    grad_input, grad_weights = run_plan(plan, dict(grad=grad, row_id_map=row_map, inp=rows, weights=weights))
    expected_input, expected_weights = reference.combine_backward(grad, row_map, rows, weights)
    assert_reduced(grad_input, expected_input, "grad_input")
    assert_reduced(grad_weights, expected_weights, "grad_weights")


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("config", _configs("sort_chunks"), ids=str)
def test_every_sort_chunks_config(backward, config):
    rows = jnp.asarray(RNG.standard_normal((_plans.SORT_ROWS, HIDDEN)), jnp.bfloat16)
    probs = jnp.asarray(RNG.random(_plans.SORT_ROWS, dtype=np.float32))
    sizes, order = jnp.array(_plans.SORT_SPLIT_SIZES, jnp.int32), jnp.array(_plans.SORT_ORDER, jnp.int32)
    plan = _plans.sweep_sort_chunks_plan(backward=backward, config=config)
    got = _run(plan, inp=rows, split_sizes=sizes, sorted_indices=order, probs=probs)
    expected = reference.sort_chunks(rows, sizes, order, probs, backward)
    for name, value in zip(("output", "row_id_map", "permuted_probs"), expected, strict=True):
        if value is not None:
            assert_same(got[name], value, name)
