"""Grouped GEMM for JAX: `jax.lax.ragged_dot` semantics on moetriton's Triton kernels, with its VJP.

XLA (jaxlib 0.11) lowers ragged_dot on GPUs to zero-padded batched dots: E times the work and memory of the
grouped product, and always so for the weight gradient. `grouped_matmul` runs the kernels of
moetriton.kernels.grouped_gemm instead (compiled through jax-triton on GPU, interpreted under
TRITON_INTERPRET=1) and falls back to ragged_dot where neither runs. Never imports torch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moetriton import kernels
from moetriton.kernels.rules import grouped_gemm as rules

from ._sharding import on_explicit_mesh, row_sharding
from .executor import describe, run_builder, uses_kernels


def _forward(lhs, rhs, group_sizes, lhs_rows, out_rows, transpose_rhs: bool, zero_tail: bool) -> jax.Array:
    inputs = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, lhs_rows=lhs_rows, out_rows=out_rows)
    # Read as its transpose, rhs [E, N, K] gives the product's K columns from its middle axis.
    columns = dict(num_cols=rhs.shape[1]) if transpose_rhs else {}
    results = run_builder(
        kernels.grouped_matmul_plan, inputs, transpose_rhs=transpose_rhs, zero_tail=zero_tail, **columns
    )
    (out,) = results.values()
    return out


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_matmul(lhs, rhs, group_sizes, lhs_rows, out_rows, zero_tail: bool) -> jax.Array:
    return _forward(lhs, rhs, group_sizes, lhs_rows, out_rows, transpose_rhs=False, zero_tail=zero_tail)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, lhs_rows, out_rows, zero_tail):
    out = _grouped_matmul(lhs, rhs, group_sizes, lhs_rows, out_rows, zero_tail)
    return out, (lhs, rhs, group_sizes, lhs_rows, out_rows)


def _grouped_matmul_bwd(zero_tail, residuals, grad):
    lhs, rhs, group_sizes, lhs_rows, out_rows = residuals
    grad = grad.astype(lhs.dtype)
    # Row i of the product came from lhs[lhs_rows[i]] and went to out[out_rows[i]]: its input gradient reads
    # grad[out_rows[i]] and goes back to lhs_rows[i], the permutations swapped. The rows of lhs outside the
    # groups get zeros, or nothing without zero_tail (a caller that never reads those rows of the product
    # never reads their gradient either).
    grad_lhs = _forward(grad, rhs, group_sizes, out_rows, lhs_rows, transpose_rhs=True, zero_tail=zero_tail)
    inputs = dict(lhs=lhs, grad=grad, group_sizes=group_sizes, lhs_rows=lhs_rows, out_rows=out_rows)
    (grad_rhs,) = run_builder(kernels.grouped_matmul_wgrad_plan, inputs).values()
    return grad_lhs, grad_rhs, None, None, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _permuted_ragged_dot(lhs, rhs, group_sizes, lhs_rows, out_rows) -> jax.Array:
    """The same product from XLA's ragged_dot and row gathers, where the kernels do not run."""
    if lhs_rows is not None:
        lhs = lhs[lhs_rows]
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)
    if out_rows is not None:
        out = jnp.zeros_like(out).at[out_rows].set(out, unique_indices=True)
    return out


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_rows: jax.Array | None = None,
    out_rows: jax.Array | None = None,
    zero_tail: bool = True,
) -> jax.Array:
    """Grouped GEMM: the rows of `lhs`, split into consecutive groups of `group_sizes` rows, each times its
    group's matrix (`jax.lax.ragged_dot(lhs, rhs, group_sizes)` with the result in the input dtype),
    optionally reading and writing the rows through permutations (no copy of the rows before or after).

    Args:
        lhs: [M, K] bfloat16, float16 or float32.
        rhs: [E, K, N], same dtype as lhs.
        group_sizes: [E] integer rows per group (read on the device: any values work under jit; sizes are
            clipped to the rows present, so sum(group_sizes) > M never reads past lhs).
        lhs_rows: None, or [M] integer, a permutation of [0, M): row i of the product is
            lhs[lhs_rows[i]] @ rhs[group of i], i.e. the product of lhs[lhs_rows].
        out_rows: None, or [M] integer, a permutation of [0, M): row i of the product is stored at
            out[out_rows[i]]. With both, out[out_rows] = ragged_dot(lhs[lhs_rows], rhs, group_sizes).
            Entries are clipped into [0, M); anything but a permutation gives unspecified rows (never an
            access out of bounds). Neither gets a gradient.
        zero_tail: False leaves the rows of the product past sum(group_sizes) (and in the gradient, the
            rows of lhs they read) unwritten where the kernels run: unspecified values, for callers that
            never read them (the MoE layer's worst-case buffers), which saves their writes. The reference
            (ragged_dot) path writes zeros either way.

    Returns:
        [M, N] in lhs's dtype, accumulated in fp32 (fp32 inputs are multiplied in IEEE fp32, not TF32).
        Rows past sum(group_sizes) are zero (see zero_tail). Differentiable in lhs and rhs (the weight
        gradient of an empty group is zero); group_sizes gets no gradient.

    On a GPU the Triton kernels run through jax-triton, one device's operands per call (inside `shard_map`
    for sharded operands); under TRITON_INTERPRET=1 they are interpreted; elsewhere ragged_dot runs.

    Example:
        >>> rows = jnp.ones((6, 4), jnp.bfloat16)
        >>> weights = jnp.ones((2, 4, 3), jnp.bfloat16)
        >>> grouped_matmul(rows, weights, jnp.array([2, 3])).shape  # row 5 is past the groups: zeros
        (6, 3)
        >>> order = jnp.array([5, 0, 4, 1, 3, 2])  # the groups take rows 5, 0 and then 4, 1, 3
        >>> grouped_matmul(rows, weights, jnp.array([2, 3]), lhs_rows=order).shape
        (6, 3)
    """
    rules.check_grouped_matmul(
        lhs=describe(lhs),
        rhs=describe(rhs),
        group_sizes=describe(group_sizes),
        lhs_rows=describe(lhs_rows),
        out_rows=describe(out_rows),
    )
    group_sizes = group_sizes.astype(jnp.int32)
    lhs_rows, out_rows = (None if rows is None else rows.astype(jnp.int32) for rows in (lhs_rows, out_rows))
    product = partial(_grouped_matmul, zero_tail=bool(zero_tail)) if uses_kernels() else _permuted_ragged_dot
    # On a mesh of Explicit axes the product's rows are split as lhs's are.
    return on_explicit_mesh(product, row_sharding(lhs, 2))(lhs, rhs, group_sizes, lhs_rows, out_rows)
