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


@partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _clamp(x: jax.Array, low: float, high: float) -> jax.Array:
    """torch.clamp: NaN goes through, and the gradient passes where low <= x <= high (the bounds included;
    jnp.clip's splits at a bound, lax.clamp's stops there), 0 elsewhere and at NaN."""
    return jnp.where(x > high, high, jnp.where(x < low, low, x))


@_clamp.defjvp
def _clamp_jvp(low, high, primals, tangents):
    (x,), (tangent,) = primals, tangents
    return _clamp(x, low, high), jnp.where((x >= low) & (x <= high), tangent, jnp.zeros_like(tangent))


def _clamped_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """GPT-OSS's gated activation (moetriton.kernels.rules.activation), as transformers' GptOssExperts."""
    gate = _clamp(gate, -jnp.inf, rules.CLAMPED_SWIGLU_LIMIT)
    up = _clamp(up, -rules.CLAMPED_SWIGLU_LIMIT, rules.CLAMPED_SWIGLU_LIMIT)
    return (up + 1) * gate * jax.nn.sigmoid(rules.CLAMPED_SWIGLU_ALPHA * gate)


def _gated(function: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """function(gate) * up."""
    return lambda gate, up: function(gate) * up


#: activation name -> its function: of (gate, up), each [..., F], for a gated activation (GATED_ACTIVATIONS),
#: else of h [..., F].
ACTIVATIONS: dict[str, Callable[..., jax.Array]] = {
    "swiglu": _gated(jax.nn.silu),
    "geglu": _gated(partial(jax.nn.gelu, approximate=False)),
    "clamped_swiglu": _clamped_swiglu,
    "gelu": partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}


def apply_activation(h: jax.Array, activation: str) -> jax.Array:
    """The expert MLP's activation on the first GEMM's output h [N, 2F] ([gate | up], gated) or [N, F]; math
    in fp32, result in h.dtype. Zero rows give zero rows (padding stays inert)."""
    function = ACTIVATIONS[activation]
    h32 = h.astype(jnp.float32)
    if rules.GATED_ACTIVATIONS[activation]:
        ffn = h.shape[-1] // 2
        return function(h32[..., :ffn], h32[..., ffn:]).astype(h.dtype)
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
        hidden: [M, 2F] ([gate | up]) for "swiglu" / "geglu" / "clamped_swiglu", [M, F] for "gelu" /
            "relu"; bfloat16, float16 or float32.
        group_sizes: [E] integer, read on the device: rows [0, sum(group_sizes)) (clipped to M) are the
            groups' rows.
        activation: "swiglu", "geglu", "clamped_swiglu" (GPT-OSS's: (clip(up, -7, 7) + 1) * g *
            sigmoid(1.702 g), g = min(gate, 7), the gradient torch.clamp's:
            moetriton.kernels.rules.activation), "gelu" (exact, erf) or "relu".

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
