"""Grouped GEMM for JAX: `jax.lax.ragged_dot` semantics on moetriton's Triton kernels, with its VJP.

XLA (jaxlib 0.11) lowers ragged_dot on GPUs to zero-padded batched dots: E times the work and memory of the
grouped product, and always so for the weight gradient. `grouped_matmul` runs the kernels of
moetriton.kernels.grouped_gemm instead (compiled through jax-triton on GPU, interpreted under
TRITON_INTERPRET=1) and falls back to ragged_dot where neither runs. Never imports torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton import kernels
from moetriton.kernels import validation

from ._launch import describe, device_info, run_plan, uses_kernels


def _sizes(lhs: jax.Array, rhs: jax.Array, transposed: bool = False) -> dict[str, int]:
    num_groups, depth, num_cols = rhs.shape
    if transposed:
        depth, num_cols = num_cols, depth
    return dict(
        num_rows=lhs.shape[0],
        depth=depth,
        num_cols=num_cols,
        num_groups=num_groups,
        element_bytes=jnp.dtype(lhs.dtype).itemsize,
        device=device_info(),
    )


def _forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool) -> jax.Array:
    plan = kernels.grouped_matmul_plan(transpose_rhs=transpose_rhs, **_sizes(lhs, rhs, transpose_rhs))
    (out,) = run_plan(plan, dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes))
    return out


@jax.custom_vjp
def _grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return _forward(lhs, rhs, group_sizes, transpose_rhs=False)


def _grouped_matmul_fwd(lhs, rhs, group_sizes):
    return _grouped_matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(residuals, grad):
    lhs, rhs, group_sizes = residuals
    grad = grad.astype(lhs.dtype)
    grad_lhs = _forward(grad, rhs, group_sizes, transpose_rhs=True)
    plan = kernels.grouped_matmul_wgrad_plan(**_sizes(lhs, rhs))
    (grad_rhs,) = run_plan(plan, dict(lhs=lhs, grad=grad, group_sizes=group_sizes))
    return grad_lhs, grad_rhs, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Grouped GEMM: the rows of `lhs`, split into consecutive groups of `group_sizes` rows, each times its
    group's matrix (`jax.lax.ragged_dot(lhs, rhs, group_sizes)` with the result in the input dtype).

    Args:
        lhs: [M, K] bfloat16, float16 or float32.
        rhs: [E, K, N], same dtype as lhs.
        group_sizes: [E] integer rows per group (read on the device: any values work under jit; sizes are
            clipped to the rows present, so sum(group_sizes) > M never reads past lhs).

    Returns:
        [M, N] in lhs's dtype, accumulated in fp32 (fp32 inputs are multiplied in IEEE fp32, not TF32).
        Rows past sum(group_sizes) are zero. Differentiable in lhs and rhs (the weight gradient of an empty
        group is zero); group_sizes gets no gradient.

    On a GPU the Triton kernels run through jax-triton, one device's operands per call (inside `shard_map`
    for sharded operands); under TRITON_INTERPRET=1 they are interpreted; elsewhere ragged_dot runs.

    Example:
        >>> rows = jnp.ones((6, 4), jnp.bfloat16)
        >>> weights = jnp.ones((2, 4, 3), jnp.bfloat16)
        >>> grouped_matmul(rows, weights, jnp.array([2, 3])).shape  # row 5 is past the groups: zeros
        (6, 3)
    """
    validation.check_grouped_matmul(lhs=describe(lhs), rhs=describe(rhs), group_sizes=describe(group_sizes))
    group_sizes = group_sizes.astype(jnp.int32)
    if not uses_kernels():
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)
    return _grouped_matmul(lhs, rhs, group_sizes)
