"""Aux-loss-free load balancing (DeepSeek-V3): the expert bias nudged towards the experts that received
fewer slots than the mean, from a step's routed counts, on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moetriton.kernels.rules.moe import bias_update_direction, check_bias_counts_value, check_bias_update

from .._checks import check_values


def update_expert_bias(expert_bias: jax.Array, routed: jax.Array, update_rate: float) -> jax.Array:
    """expert_bias + update_rate * sign(mean(routed) - routed), in fp32: experts below the mean load gain
    bias (are chosen more often), those above lose it (sign(0) = 0). The sign is exact for every count (an
    integer comparison in the counts' dtype, moetriton.kernels.rules.moe.bias_update_direction: no count is
    rounded to a float, nothing is widened, so int32 counts work without x64). Pure and jit-able, no host
    sync.

    Args:
        expert_bias: [E] float32/bfloat16/float16, the router's selection bias (sigmoid / sqrtsoftplus
            scores), e.g. a Flax MoEBlock's variables["moe"]["expert_bias"].
        routed: [E] integer counts (int8 ... int64, uint8 ... uint32, a JAX or numpy array or a list; a float
            dtype raises ValueError: a float count may already be rounded, as bf16 holds 257 as 256; numpy
            counts are compared on the host in their own dtype, so int64 ones are exact without x64), the
            slots routed to each expert in the step over every token shard that shares the bias
            (`MoEStats.routed` of `moe(..., return_stats=True)` is already that). Counts are >= 0: a
            negative one raises ValueError where its value is read for free (numpy and concrete CPU arrays;
            with MOETRITON_CHECK=1 any array, inside jit through a debug callback); traced or on a GPU it is
            not read, and the update is still the exact sign of mean - count.
        update_rate: a finite Python float >= 0 (DeepSeek-V3: 1e-3); static under jit.

    Returns:
        [E] float32, the new bias (a train-state update: nothing is mutated).

    Example:
        >>> update_expert_bias(jnp.zeros(4), jnp.array([1, 2, 3, 6]), 0.5).tolist()
        [0.5, 0.5, 0.0, -0.5]
    """
    expert_bias = jnp.asarray(expert_bias)
    # Host counts stay numpy: JAX without x64 would wrap int64 counts past 2^31 into int32.
    routed = routed if isinstance(routed, jax.Array) else np.asarray(routed)
    check_bias_update(
        expert_bias=(tuple(expert_bias.shape), jnp.dtype(expert_bias.dtype).name),
        routed=(tuple(routed.shape), np.dtype(routed.dtype).name),
        update_rate=update_rate,
    )
    if routed.size:
        check_values(lambda counts: check_bias_counts_value(int(counts.min())), routed)
    direction = jnp.asarray(bias_update_direction(routed))  # numpy counts: on the host, in their own dtype
    return expert_bias.astype(jnp.float32) + update_rate * direction
