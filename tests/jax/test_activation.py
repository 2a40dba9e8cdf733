"""moetriton.jax.grouped_activation against apply_activation (XLA, every row) on the groups' rows:
forward and gradient, every activation and dtype, under jit; bad arguments. On CPU the kernels run under the
Triton interpreter (the conftest sets it), on a GPU compiled; the kernels' unwritten tails are tested in
tests/kernels/test_activation.py."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetriton.jax import grouped_activation
from moetriton.jax.activation import ACTIVATIONS, apply_activation
from moetriton.kernels.rules.activation import GATED_ACTIVATIONS

_TOLERANCE = {"float32": 1e-5, "bfloat16": 2**-7, "float16": 2**-10}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(("rows", "sizes"), [(20, [6, 0, 9]), (8, [5, 7]), (5, [0])])
def test_groups_rows_match_xla(activation, dtype, rows, sizes):
    ffn = 40
    width = 2 * ffn if GATED_ACTIVATIONS[activation] else ffn
    rng = np.random.default_rng(rows + width)
    hidden = jnp.asarray(2 * rng.standard_normal((rows, width)), dtype)
    grad = jnp.asarray(rng.standard_normal((rows, ffn)), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int16)
    valid = min(sum(sizes), rows)

    @partial(jax.jit, static_argnums=0)
    def both(function, h):
        out, vjp = jax.vjp(function, h)
        return out, vjp(grad)[0]

    out, grad_hidden = both(lambda h: grouped_activation(h, group_sizes, activation), hidden)
    expected_out, expected_grad = both(lambda h: apply_activation(h, activation), hidden)
    assert out.shape == (rows, ffn) and out.dtype == hidden.dtype and grad_hidden.dtype == hidden.dtype
    for name, got, want in (("out", out, expected_out), ("grad", grad_hidden, expected_grad)):
        want = np.asarray(want[:valid], np.float64)
        scale = max(float(np.abs(want).max(initial=0.0)), 1.0)
        np.testing.assert_allclose(
            np.asarray(got[:valid], np.float64), want, rtol=0, atol=_TOLERANCE[dtype] * scale, err_msg=name
        )


@pytest.mark.parametrize(
    ("hidden", "sizes", "activation", "match"),
    [
        ((4, 8), (2,), "tanh", "activation: expected one of"),
        ((4, 7), (2,), "swiglu", "even width"),
        ((4,), (2,), "relu", r"hidden \[M, W\]"),
        ((4, 8), (2, 1), "relu", r"group_sizes \[E\]"),
    ],
)
def test_bad_arguments(hidden, sizes, activation, match):
    with pytest.raises(ValueError, match=match):
        grouped_activation(jnp.zeros(hidden, jnp.bfloat16), jnp.zeros(sizes, jnp.int32), activation)


def test_bad_dtypes():
    with pytest.raises(ValueError, match="hidden: expected bfloat16"):
        grouped_activation(jnp.zeros((4, 8), jnp.int32), jnp.zeros((2,), jnp.int32), "relu")
    with pytest.raises(ValueError, match="group_sizes: expected an integer"):
        grouped_activation(jnp.zeros((4, 8), jnp.float32), jnp.zeros((2,), jnp.float32), "relu")


def _clamped_swiglu_numpy(hidden: np.ndarray, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GPT-OSS's activation (transformers' GptOssExperts._apply_gate: alpha 1.702, limit 7) and its
    gradient, derived by hand in float64, torch.clamp's rule: a clamp passes the gradient where its input
    lies within the bounds, the bounds included, and nowhere at NaN."""
    gate, up = np.split(hidden.astype(np.float64), 2, axis=1)
    grad = grad.astype(np.float64)
    clamped_gate, clamped_up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    sigmoid = 1 / (1 + np.exp(-1.702 * clamped_gate))
    out = (clamped_up + 1) * clamped_gate * sigmoid
    slope = sigmoid * (1 + 1.702 * clamped_gate * (1 - sigmoid))
    with np.errstate(invalid="ignore"):
        grad_gate = np.where(gate <= 7.0, grad * (clamped_up + 1) * slope, 0.0)
        grad_up = np.where((up >= -7.0) & (up <= 7.0), grad * clamped_gate * sigmoid, 0.0)
    return out, np.concatenate([grad_gate, grad_up], axis=1)


def _clamped_swiglu_both(hidden: jax.Array, grad: jax.Array, group_sizes: jax.Array, kernels: bool):
    """(out, grad_hidden) of grouped_activation (kernels) or apply_activation (XLA), under jit."""

    @jax.jit
    def both(h):
        if kernels:
            out, vjp = jax.vjp(lambda x: grouped_activation(x, group_sizes, "clamped_swiglu"), h)
        else:
            out, vjp = jax.vjp(lambda x: apply_activation(x, "clamped_swiglu"), h)
        return out, vjp(grad)[0]

    return both(hidden)


@pytest.mark.parametrize("kernels", [True, False], ids=["grouped", "xla"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_clamped_swiglu_matches_the_formula_past_and_at_the_limit(kernels, dtype):
    """Values past +-7 (a quarter of 6 N(0, 1)) and exactly +-7 (every 7th), where the clamps' gradient
    rule decides: the kernels and the XLA path both follow torch.clamp's."""
    rows, ffn, sizes = 9, 24, [4, 3]
    rng = np.random.default_rng(7)
    values = 6 * rng.standard_normal((rows, 2 * ffn))
    values.reshape(-1)[::7] = 7.0 * np.sign(values.reshape(-1)[::7])
    hidden = jnp.asarray(values, dtype)
    grad = jnp.asarray(rng.standard_normal((rows, ffn)), dtype)
    out, grad_hidden = _clamped_swiglu_both(hidden, grad, jnp.asarray(sizes, jnp.int32), kernels)
    valid = sum(sizes)
    expected = _clamped_swiglu_numpy(np.asarray(hidden[:valid], np.float64), np.asarray(grad[:valid]))
    for name, got, want in zip(("out", "grad"), (out, grad_hidden), expected, strict=True):
        atol = _TOLERANCE[dtype] * max(float(np.abs(want).max()), 1.0)
        np.testing.assert_allclose(np.asarray(got[:valid], np.float64), want, rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("kernels", [True, False], ids=["grouped", "xla"])
def test_clamped_swiglu_nan_inputs_go_through_as_in_torch(kernels):
    """A NaN gate or up gives a NaN output; its own gradient is 0, the other half's NaN unless that half is
    clamped (gate > 7, |up| > 7), then 0."""
    nan = np.nan
    gate = [nan, nan, nan, 1.0, 9.0, -9.0, 7.0, nan]
    up = [1.0, 8.0, -7.0, nan, nan, nan, -7.0, nan]
    hidden = np.asarray([gate + up], np.float32)
    grad = np.asarray([[1.0, 2.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0]], np.float32)
    got = _clamped_swiglu_both(jnp.asarray(hidden), jnp.asarray(grad), jnp.asarray([1], jnp.int32), kernels)
    expected = _clamped_swiglu_numpy(hidden, grad)
    assert np.isnan(expected[0]).sum() == 7 and np.isnan(expected[1]).sum() == 6
    for name, value, want in zip(("out", "grad"), got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(value, np.float64), want, rtol=1e-6, atol=1e-6, err_msg=name)
