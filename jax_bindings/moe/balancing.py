"""Aux-loss-free load balancing (DeepSeek-V3): the expert bias nudged towards the experts that received
fewer slots than the mean, from a step's routed counts, on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.moe import check_coefficient


def update_expert_bias(expert_bias: jax.Array, routed: jax.Array, update_rate: float) -> jax.Array:
    """expert_bias + update_rate * sign(mean(routed) - routed), in fp32: experts below the mean load gain
    bias (are chosen more often), those above lose it (sign(0) = 0). Pure and jit-able, no host sync.

    Args:
        expert_bias: [E] float, the router's selection bias (sigmoid / sqrtsoftplus scores), e.g. a Flax
            MoEBlock's variables["moe"]["expert_bias"].
        routed: [E] integer or float, slots routed to each expert in the step over every token shard that
            shares the bias (`MoEStats.routed` of `moe(..., return_stats=True)` is already that).
        update_rate: a finite Python float >= 0 (DeepSeek-V3: 1e-3); static under jit.

    Returns:
        [E] float32, the new bias (a train-state update: nothing is mutated).

    Example:
        >>> update_expert_bias(jnp.zeros(4), jnp.array([1, 2, 3, 6]), 0.5).tolist()
        [0.5, 0.5, 0.0, -0.5]
    """
    check_coefficient("update_rate", update_rate)
    expert_bias, routed = jnp.asarray(expert_bias), jnp.asarray(routed)
    if expert_bias.ndim != 1 or not jnp.issubdtype(expert_bias.dtype, jnp.floating):
        shape = list(expert_bias.shape)
        raise ValueError(f"expert_bias: expected a float [E], got {expert_bias.dtype} {shape}")
    if list(routed.shape) != list(expert_bias.shape):
        raise ValueError(f"routed: expected [E] = {list(expert_bias.shape)}, got {list(routed.shape)}")
    load = routed.astype(jnp.float32)
    return expert_bias.astype(jnp.float32) + update_rate * jnp.sign(load.mean() - load)
