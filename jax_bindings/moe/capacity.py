"""The capacity policy's EP row exchange of one token shard: fixed [L, C] slabs through one fixed-size
all_to_all (no size depends on data), its own inverse, around the experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import EPLayout

from .config import MoEConfig
from .experts import ExpertWeights, expert_major_rows, expert_mlp


def capacity_exchange(buffer: jax.Array, layout: EPLayout, config: MoEConfig) -> jax.Array:
    """Capacity policy, either direction: [EP * L * C, H] -> [EP * L * C, H], the [L, C] slab for rank r
    swapped with rank r's slab for this rank (the exchange is its own inverse)."""
    if layout.ep_size == 1:
        return buffer
    slabs = buffer.reshape(layout.ep_size, -1, buffer.shape[1])
    return jax.lax.all_to_all(slabs, config.ep_axis, 0, 0).reshape(buffer.shape)


def capacity_experts(send, experts: ExpertWeights, layout: EPLayout, config: MoEConfig):
    """Capacity, EP > 1: send buffer [E * C, H] = [EP, L, C] slabs -> expert outputs in the same rows,
    through the EP group's experts; the grouped GEMMs read the received [EP, L, C] rows in expert-major order
    and write the results back in the received order."""
    ep, local = layout.ep_size, layout.local_experts
    chunk_sizes = jnp.full((ep * local,), layout.capacity, jnp.int32)
    group_sizes = jnp.full((local,), ep * layout.capacity, jnp.int32)
    recv = capacity_exchange(send, layout, config)
    order = expert_major_rows(chunk_sizes, layout, False, recv.shape[0])
    return capacity_exchange(expert_mlp(recv, group_sizes, experts, config, order), layout, config)
