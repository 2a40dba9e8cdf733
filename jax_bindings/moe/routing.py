"""The MoE layer's routing stage: the router (logits, fused top-k, merging weights), the token mask and the
drop policy under a capacity."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import EPLayout

from ..router import fused_topk_with_score_function
from .config import MoEConfig
from .experts import dense_dot


def route(x_flat, gate, gate_bias, expert_bias, valid, config: MoEConfig, routing_indices=None):
    """(logits [T, E] fp32, merging weights [T, K] fp32, indices [T, K] int32, routing map [T, E] bool):
    logits = x_flat @ gate [H, E] (+ gate_bias [E], in fp32).
    valid [T] bool or None: a masked token's slots get index -1 (no expert), weight 0 and no routing-map
    row, so it takes no expert row, no capacity and no count. routing_indices [T, K] or None: the router's
    replay (a slot it refuses has index -1)."""
    logits = dense_dot(x_flat, gate.astype(x_flat.dtype))  # [T, E]
    if gate_bias is not None:
        logits = logits + gate_bias.astype(jnp.float32)
    probs, routing_map, indices = fused_topk_with_score_function(
        logits,
        config.topk,
        config.use_pre_softmax,
        config.num_groups,
        config.group_topk,
        config.scaling_factor,
        config.score_function,
        None if expert_bias is None else jax.lax.stop_gradient(expert_bias.astype(jnp.float32)),
        return_indices=True,
        normalize_topk=config.normalize_topk,
        group_score=config.group_score,
        routing_indices=routing_indices,
    )
    # -1 (a slot a replay refuses) would wrap around: such a slot has weight 0
    weights = jnp.where(indices >= 0, jnp.take_along_axis(probs, jnp.maximum(indices, 0), axis=1), 0.0)
    if valid is not None:
        weights = jnp.where(valid[:, None], weights, 0.0)
        indices = jnp.where(valid[:, None], indices, -1)
        routing_map = routing_map & valid[:, None]
    return logits, weights, indices, routing_map


def most_probable_slots(indices: jax.Array, weights: jax.Array, capacity: int, num_experts: int) -> jax.Array:
    """drop_policy "probs": indices [T, K] int32 with every slot its expert drops set to -1 (no expert), so
    that the dispatch's position capacity then keeps all the rest (no expert has more than `capacity` left).
    Each expert keeps its `capacity` slots of highest merging weight (weights [T, K]), NaN below every
    number and ties (-0.0 and +0.0, NaN and NaN) to the earlier slot in (token, slot) order
    (moetriton.kernels.rules.moe.NON_FINITE); slots already -1 (masked tokens) stay -1. Static shapes,
    deterministic."""
    flat = indices.reshape(-1)
    experts = jnp.where(flat >= 0, flat, num_experts)  # [T * K]; no expert sorts last and is never kept
    flat_weights = weights.reshape(-1).astype(jnp.float32)
    missing = jnp.isnan(flat_weights)
    # Canonical keys, as PyTorch's layer builds them: NaN as -inf (set apart by the second sort), -0.0 as
    # +0.0; the order is then the rule's whatever the sort does with NaN or signed zeros.
    flat_weights = jnp.where(missing, -jnp.inf, jnp.where(flat_weights == 0, 0.0, flat_weights))
    # Two stable sorts: by weight (descending; equal weights keep slot order), then by expert with NaN
    # weights after every number of the same expert.
    by_weight = jnp.argsort(-flat_weights, stable=True)
    group = 2 * experts + missing  # [T * K]
    order = by_weight[jnp.argsort(group[by_weight], stable=True)]  # expert-major, heaviest first
    counts = jnp.bincount(experts, length=num_experts + 1)
    starts = jnp.cumsum(counts) - counts  # where each expert's slots begin in `order`
    rank_in_order = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[experts[order]].astype(jnp.int32)
    rank = jnp.zeros_like(rank_in_order).at[order].set(rank_in_order, unique_indices=True)
    return jnp.where((rank < capacity).reshape(indices.shape), indices, -1)


def apply_drop_policy(
    indices: jax.Array, weights: jax.Array, layout: EPLayout, drop_policy: str
) -> jax.Array:
    """The indices [T, K] the dispatch runs: under a capacity with drop_policy "probs", every slot its expert
    drops set to -1 (`most_probable_slots`); the indices themselves otherwise ("position": the dispatch keeps
    each expert's first C slots in token order; dropless: every slot)."""
    if layout.dropless or drop_policy != "probs":
        return indices
    return most_probable_slots(indices, weights, layout.capacity, layout.num_experts)
