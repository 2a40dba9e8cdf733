"""Dense single-device reference of the MoE layer (`moetriton.jax.moe`): the test oracle.

Independent of the kernels and of any collective: the router is `moetriton.jax.reference_router`, every
token goes through its K experts in a plain loop over shards and slots (each slot gathers its expert's
weights), in fp32 at the highest matmul precision. Capacity drops are emulated per token shard: tokens split
into `num_shards` equal blocks in order (the layer's shards), and within a block each expert keeps its first
C routed slots in token order, C = `shard_capacity(...)` (the layer's own formula). Never imports torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import shard_capacity
from moetriton.kernels.rules.moe import LayerOptions

from . import reference_router
from .activation import apply_activation

_HIGHEST = jax.lax.Precision.HIGHEST


def _expert(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str) -> jax.Array:
    """One slot per token: x [T, H] through per-token expert weights gate_up [T, H, 2F], down [T, F, H]."""
    hidden = jnp.einsum("th,thf->tf", x, gate_up, precision=_HIGHEST)
    return jnp.einsum("tf,tfh->th", apply_activation(hidden, activation), down, precision=_HIGHEST)


def _kept(indices: jax.Array, num_experts: int, capacity: int | None) -> jax.Array:
    """[T, K] bool: whether slot (t, k) keeps its place: the slot's rank among its expert's slots in (token,
    slot) order is below `capacity` (all kept when None)."""
    if capacity is None:
        return jnp.ones(indices.shape, bool)
    one_hot = jax.nn.one_hot(indices.reshape(-1), num_experts, dtype=jnp.int32)  # [T * K, E]
    rank = (jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot
    return (rank.sum(1) < capacity).reshape(indices.shape)


def moe_reference(
    x: jax.Array,
    gate: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    expert_bias: jax.Array | None = None,
    shared_gate_up: jax.Array | None = None,
    shared_down: jax.Array | None = None,
    shared_gate: jax.Array | None = None,
    num_shards: int = 1,
    **options,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of `moetriton.jax.moe` on one device: same arrays, the options (topk, ...,
    capacity_factor: the fields of `moetriton.kernels.rules.moe.LayerOptions`) as keywords, no mesh
    (`num_shards` token shards only matter for capacity drops), same results (out [B, S, H] fp32,
    aux_loss fp32, dropped int32).
    shared_gate_up [H, 2Fs] (or [H, Fs]), shared_down [Fs, H], shared_gate [H, 1]: the shared experts, a
    dense FFN of every token added to the routed output (times sigmoid(x @ shared_gate) per token).

    Example:
        >>> out, aux_loss, dropped = moe_reference(x, gate, gate_up, down, topk=2, capacity_factor=1.0,
        ...                                        num_shards=4)
    """
    opts = LayerOptions(**options)
    topk, activation, aux_loss_coeff, score_function = (
        opts.topk,
        opts.activation,
        opts.aux_loss_coeff,
        opts.score_function,
    )
    batch, seq, hidden = x.shape
    num_experts = gate.shape[1]
    num_tokens = batch * seq
    shard_tokens = num_tokens // num_shards
    capacity = shard_capacity(
        num_tokens, num_shards, num_experts, topk, opts.align_size, opts.capacity_factor
    )
    x_flat = x.reshape(num_tokens, hidden).astype(jnp.float32)
    logits = jnp.dot(x_flat, gate.astype(jnp.float32), precision=_HIGHEST)
    bias = None if expert_bias is None else jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
    probs, routing_map, indices = reference_router.fused_topk_with_score_function(
        logits,
        topk,
        opts.use_pre_softmax,
        opts.num_groups,
        opts.group_topk,
        opts.scaling_factor,
        score_function,
        bias,
        return_indices=True,
    )
    weights = jnp.take_along_axis(probs, indices, axis=1)  # [T, K]
    outputs, dropped = [], jnp.zeros((), jnp.int32)
    for shard in range(num_shards):
        rows = slice(shard * shard_tokens, (shard + 1) * shard_tokens)
        kept = _kept(indices[rows], num_experts, capacity)
        dropped += jnp.sum(~kept, dtype=jnp.int32)
        out = jnp.zeros((shard_tokens, hidden), jnp.float32)
        for slot in range(topk):
            expert = indices[rows, slot]
            y = _expert(
                x_flat[rows],
                gate_up[expert].astype(jnp.float32),
                down[expert].astype(jnp.float32),
                activation,
            )
            out += jnp.where(kept[:, slot, None], weights[rows, slot, None] * y, 0.0)
        outputs.append(out)
    out = jnp.concatenate(outputs)  # [T, H]
    if shared_gate_up is not None:
        hidden_shared = jnp.dot(x_flat, shared_gate_up.astype(jnp.float32), precision=_HIGHEST)
        act = apply_activation(hidden_shared, activation)
        shared = jnp.dot(act, shared_down.astype(jnp.float32), precision=_HIGHEST)  # [T, H]
        if shared_gate is not None:
            shared *= jax.nn.sigmoid(jnp.dot(x_flat, shared_gate.astype(jnp.float32), precision=_HIGHEST))
        out += shared
    aux_loss = jnp.zeros((), jnp.float32)
    if aux_loss_coeff and num_tokens:  # no tokens: no loss (the layer's zero)
        _, scores = reference_router.fused_compute_score_for_moe_aux_loss(logits, topk, score_function)
        aux_loss = reference_router.fused_moe_aux_loss(
            scores, routing_map.sum(0), num_tokens, num_experts, topk, aux_loss_coeff
        ).astype(jnp.float32)
    return out.reshape(batch, seq, hidden), aux_loss, dropped
