"""Property tests of moetriton.jax's sort_chunks_by_index against the pure-JAX reference (the same
properties as the PyTorch side, on the shared strategies).

Rows, the row map and the probs match bit for bit; the gradient is the inverse permutation. Every example
runs jitted.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import moetriton.jax as mj
from moetriton.jax import reference
from tests.jax._helpers import assert_same, tokens
from tests.strategies import chunk_problems


@given(chunk_problems(), st.booleans())
def test_chunk_sort_matches_reference_and_inverts_in_backward(problem, with_probs):
    x = tokens(problem)
    sizes, order = jnp.asarray(problem.split_sizes), jnp.asarray(problem.sorted_indices)
    p = jnp.asarray(problem.probs) if with_probs else None
    got = jax.jit(mj.sort_chunks_by_index)(x, sizes, order, p)
    expected = jax.jit(reference.sort_chunks_by_index)(x, sizes, order, p)
    assert len(got) == 2 + with_probs
    for name, g, e in zip(("output", "row_id_map", "permuted_probs"), got, expected, strict=False):
        assert_same(g, e, name)
    if x.dtype.itemsize == 1:
        return
    weights = jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)

    def loss(x, p):
        result = mj.sort_chunks_by_index(x, sizes, order, p)
        value = (result[0].astype(jnp.float32) * weights.astype(jnp.float32)).sum()
        return value + ((result[2] * jnp.arange(x.shape[0])).sum() if with_probs else 0)

    grad_x, grad_p = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, p)
    dst = np.asarray(got[1])
    assert_same(grad_x, weights[dst], "grad inp")  # the gradient of a permutation is the inverse permutation
    if with_probs:
        assert_same(grad_p, jnp.arange(x.shape[0], dtype=p.dtype)[dst], "grad probs")
