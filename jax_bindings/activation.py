"""The expert MLP's activation for JAX: `apply_activation` (XLA, every row) and `grouped_activation` (the
rows of the groups only, on moetriton.kernels.activation's Triton kernels). Never imports torch."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from moetriton.kernels.activation import activation_backward_plan, activation_plan
from moetriton.kernels.rules import activation as rules

from ._sharding import on_explicit_mesh, row_sharding
from .executor import describe, run_builder, uses_kernels

#: activation name -> its function (applied to the gate half when the activation is gated: GATED_ACTIVATIONS).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "swiglu": jax.nn.silu,
    "geglu": partial(jax.nn.gelu, approximate=False),
    "gelu": partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}


def apply_activation(h: jax.Array, activation: str) -> jax.Array:
    """The expert MLP's activation on the first GEMM's output h [N, 2F] (gated) or [N, F]; math in fp32,
    result in h.dtype. Zero rows give zero rows (padding stays inert)."""
    function = ACTIVATIONS[activation]
    h32 = h.astype(jnp.float32)
    if rules.GATED_ACTIVATIONS[activation]:
        ffn = h.shape[-1] // 2
        return (function(h32[..., :ffn]) * h32[..., ffn:]).astype(h.dtype)
    return function(h32).astype(h.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _grouped_activation(hidden, group_sizes, activation: str) -> jax.Array:
    inputs = dict(hidden=hidden, group_sizes=group_sizes)
    (out,) = run_builder(activation_plan, inputs, activation=activation).values()
    return out


def _grouped_activation_fwd(hidden, group_sizes, activation):
    return _grouped_activation(hidden, group_sizes, activation), (hidden, group_sizes)


def _grouped_activation_bwd(activation, residuals, grad):
    hidden, group_sizes = residuals
    inputs = dict(hidden=hidden, grad=grad.astype(hidden.dtype), group_sizes=group_sizes)
    (grad_hidden,) = run_builder(activation_backward_plan, inputs, activation=activation).values()
    return grad_hidden, None


_grouped_activation.defvjp(_grouped_activation_fwd, _grouped_activation_bwd)


def grouped_activation(hidden: jax.Array, group_sizes: jax.Array, activation: str) -> jax.Array:
    """`apply_activation` on the rows below sum(group_sizes) only, for buffers sized for a worst case whose
    tail nobody reads (the MoE layer's; pair it with `grouped_matmul(..., zero_tail=False)`).

    Args:
        hidden: [M, 2F] ([gate | up]) for "swiglu" / "geglu", [M, F] for "gelu" / "relu"; bfloat16, float16
            or float32.
        group_sizes: [E] integer, read on the device: rows [0, sum(group_sizes)) (clipped to M) are the
            groups' rows.
        activation: "swiglu", "geglu", "gelu" (exact, erf) or "relu".

    Returns:
        [M, F] in hidden's dtype, math in fp32. Where the kernels run (GPU, TRITON_INTERPRET=1) the rows at
        and past sum(group_sizes) are not written (unspecified), in the output and in the gradient; the
        XLA path elsewhere computes every row. Differentiable in hidden.

    Example:
        >>> hidden = jnp.ones((6, 8), jnp.bfloat16)
        >>> grouped_activation(hidden, jnp.array([2, 3]), "swiglu").shape  # rows 0-4 computed
        (6, 4)
    """
    rules.check_grouped_activation(
        hidden=describe(hidden), group_sizes=describe(group_sizes), activation=activation
    )
    if not uses_kernels() or group_sizes.shape[0] == 0:
        return apply_activation(hidden, activation)
    activate = partial(_grouped_activation, activation=activation)
    return on_explicit_mesh(activate, row_sharding(hidden, 2))(hidden, group_sizes.astype(jnp.int32))
