"""JAX arrays are logically dense, but an op's operand can still be produced by a transpose or a slice of
what the caller holds, and `jax.grad(lambda x: op(x).sum())` hands the backward a broadcast cotangent. Every
public function gives for such operands what it gives for the dense array, on the path under test (jax-triton
on GPU, pure_callback and the interpreter on CPU), and `out.sum()` gives the reference's gradients.

The array passed to the jitted function is the storage (the transposed array, a taller or wider one); the
function takes the view inside the trace, so XLA, not the caller, decides how the operand reaches the op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moetriton.jax as mj
from moetriton.jax import reference, reference_router
from tests.jax._helpers import bits
from tests.strategies import LAYOUTS

T, H, E, K = 6, 40, 4, 2


def storage(x: np.ndarray, layout: str) -> np.ndarray:
    """What the caller holds for `x` in `layout`: the transpose, or a taller/wider array holding x."""
    if layout == "contiguous":
        return x
    if layout == "transposed":
        return np.ascontiguousarray(x.T) if x.ndim == 2 else x
    if layout == "row_slice":
        taller = np.zeros((2 * x.shape[0], *x.shape[1:]), x.dtype)
        taller[::2] = x
        return taller
    wider = np.zeros((x.shape[0], x.shape[1] + 3) if x.ndim == 2 else (x.shape[0] + 3,), x.dtype)
    wider[..., 1 : 1 + x.shape[-1]] = x
    return wider


def view(held: jax.Array, layout: str, ndim: int) -> jax.Array:
    """Inside the trace: the operand from what the caller holds (inverse of `storage`)."""
    if layout == "transposed":
        return held.T if ndim == 2 else held
    if layout == "row_slice":
        return held[::2]
    if layout == "column_slice":
        return held[..., 1:-2]
    return held


@dataclass(frozen=True)
class Case:
    name: str
    inputs: dict[str, np.ndarray]  # float inputs first; every input is relaid
    differentiable: tuple[str, ...]
    run: Callable[[object, dict], tuple]  # (api, inputs) -> float outputs


def _routing(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.argsort(-rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    ids[2, 1] = -1
    mask = np.zeros((T, E), bool)
    rows, cols = np.nonzero(ids >= 0)
    mask[rows, ids[rows, cols]] = True
    return dict(
        x=rng.standard_normal((T, H)).astype(np.float32),
        probs_e=rng.random((T, E)).astype(np.float32),
        probs_k=rng.random((T, K)).astype(np.float32),
        mask=mask,
        ids=ids,
    )


def _dispatch(kind: str, align_size: int | None) -> Case:
    def run(api, i):
        if kind == "mask":
            out = api.token_dispatch(i["x"], i["mask"], T * K, i["probs_e"], align_size)
        else:
            out = api.token_dispatch(
                i["x"], None, T * K, i["probs_k"], align_size, indices=i["ids"], num_experts=E
            )
        return out[0], out[1]

    return Case(
        f"dispatch-{kind}-align{align_size}",
        _routing(0),
        ("x", "probs_e" if kind == "mask" else "probs_k"),
        run,
    )


def _combine(weighted: bool) -> Case:
    routing = _routing(1)
    layout = reference.token_dispatch(jnp.asarray(routing["x"]), jnp.asarray(routing["mask"]), T * K, None, 4)
    rng = np.random.default_rng(2)
    inputs = dict(
        expert_out=rng.standard_normal(layout[0].shape).astype(np.float32),
        weights=routing["probs_e"],
        row_id_map=np.asarray(layout[2]),
        pad_offsets=np.asarray(layout[3]),
    )

    def run(api, i):
        weights = i["weights"] if weighted else None
        return (api.token_combine(i["expert_out"], i["row_id_map"], weights, i["pad_offsets"]),)

    return Case(
        f"combine-weighted{weighted}", inputs, ("expert_out", "weights") if weighted else ("expert_out",), run
    )


def _sort() -> Case:
    rng = np.random.default_rng(3)
    inputs = dict(
        rows=rng.standard_normal((13, H)).astype(np.float32),
        probs=rng.random(13).astype(np.float32),
        sizes=np.array([3, 0, 5, 2, 1], np.int32),
        order=np.array([2, 4, 0, 3, 1], np.int32),
    )

    def run(api, i):
        out = api.sort_chunks_by_index(i["rows"], i["sizes"], i["order"], i["probs"])
        return out[0], out[2]

    return Case("sort_chunks_by_index", inputs, ("rows", "probs"), run)


def _router() -> list[Case]:
    rng = np.random.default_rng(4)
    logits = dict(
        logits=rng.standard_normal((T, 8)).astype(np.float32), bias=rng.standard_normal(8).astype(np.float32)
    )
    aux = dict(probs=rng.random((T, 8)).astype(np.float32), counts=rng.integers(0, 9, 8).astype(np.int32))

    def topk(api, i):
        module = mj if api is mj else reference_router
        return module.fused_topk_with_score_function(
            i["logits"], 4, num_groups=4, group_topk=2, score_function="sigmoid", expert_bias=i["bias"]
        )[:1]

    def scores(api, i):
        module = mj if api is mj else reference_router
        return module.fused_compute_score_for_moe_aux_loss(i["logits"], 3, "softmax")[1:]

    def loss(api, i):
        module = mj if api is mj else reference_router
        return (module.fused_moe_aux_loss(i["probs"], i["counts"], T, 8, 3, 0.01),)

    return [
        Case("fused_topk_with_score_function", logits, ("logits",), topk),
        Case("fused_compute_score_for_moe_aux_loss", logits, ("logits",), scores),
        Case("fused_moe_aux_loss", aux, ("probs",), loss),
    ]


CASES = [
    *(_dispatch(kind, align) for kind in ("mask", "indices") for align in (None, 4)),
    _combine(False),
    _combine(True),
    _sort(),
    *_router(),
]


def _outputs_and_grads(case: Case, layout: str, api=mj):
    """Outputs of the public function and gradients of sum(outputs), inputs reaching it through `layout`."""
    names = list(case.inputs)
    ndims = {name: case.inputs[name].ndim for name in names}

    def loss(diff, rest):
        inputs = {name: view(held, layout, ndims[name]) for name, held in {**rest, **diff}.items()}
        outputs = case.run(api, inputs)
        return sum(jnp.sum(out) for out in outputs), outputs

    held = {name: jnp.asarray(storage(value, layout)) for name, value in case.inputs.items()}
    diff = {name: held[name] for name in case.differentiable}
    rest = {name: held[name] for name in names if name not in case.differentiable}
    grads, outputs = jax.jit(jax.grad(loss, has_aux=True))(diff, rest)
    # Gradients with respect to what the caller holds, mapped back to the operand's shape.
    grads = {name: view(grads[name], layout, ndims[name]) for name in case.differentiable}
    return outputs, grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_strided_operands_give_the_dense_results(case, layout):
    expected_out, expected_grads = _outputs_and_grads(case, "contiguous")
    got_out, got_grads = _outputs_and_grads(case, layout)
    for got, expected in zip(got_out, expected_out, strict=True):
        np.testing.assert_array_equal(bits(got), bits(expected), err_msg=case.name)
    for name in case.differentiable:
        np.testing.assert_array_equal(bits(got_grads[name]), bits(expected_grads[name]), err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_sum_loss_gradients_match_the_reference(case):
    _, got = _outputs_and_grads(case, "contiguous")
    _, expected = _outputs_and_grads(case, "contiguous", api=reference)
    for name in case.differentiable:
        assert np.isfinite(np.asarray(got[name])).all(), name
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(expected[name]), rtol=1e-5, atol=1e-5, err_msg=name
        )
