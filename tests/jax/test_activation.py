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
