"""Dense single-device reference of the MoE layer (`moetriton.jax.moe`): the test oracle.

Independent of the kernels and of any collective: the router is `moetriton.jax.reference_router`, every
token goes through its K experts in a plain loop over shards and slots (each slot gathers its expert's
weights), in fp32 at the highest matmul precision. Capacity drops are emulated per token shard: tokens split
into `num_shards` equal blocks in order (the layer's shards), and within a block each expert keeps C of its
routed slots, C = `shard_capacity(...)` (the layer's own formula): with drop_policy "position" those first in
(token, slot) order, with "probs" those of highest merging weight, ties to the earlier slot (a slot's rank is
counted pairwise against every other slot of its expert). The losses follow
`moetriton.kernels.rules.moe.LOSSES` term by term, in plain jnp. Never imports torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import shard_capacity
from moetriton.kernels.rules.moe import LayerOptions, MoEStats

from . import reference_router
from .activation import apply_activation

_HIGHEST = jax.lax.Precision.HIGHEST


def _expert(x, gate_up, down, activation: str, gate_up_bias=None, down_bias=None) -> jax.Array:
    """One slot per token: x [T, H] through per-token expert weights gate_up [T, H, 2F], down [T, F, H]
    and biases gate_up_bias [T, 2F], down_bias [T, H] where given."""
    hidden = jnp.einsum("th,thf->tf", x, gate_up, precision=_HIGHEST)
    if gate_up_bias is not None:
        hidden = hidden + gate_up_bias
    out = jnp.einsum("tf,tfh->th", apply_activation(hidden, activation), down, precision=_HIGHEST)
    return out if down_bias is None else out + down_bias


def _kept(
    indices: jax.Array, weights: jax.Array, routed: jax.Array, capacity: int | None, drop_policy: str
) -> jax.Array:
    """[T, K] bool: whether routed slot (t, k) keeps its place in one shard. indices, weights [T, K];
        routed [T, K] bool (False: a masked token's slot, which is never kept and takes no place). A slot's
        rank is the number of routed slots of the same expert that come before it: earlier in (token, slot)
        order ("position"), or of a higher weight, or of an equal weight and earlier ("probs"; NaN weighs less
    than every number and equals NaN). Kept: rank below
        `capacity` (every routed slot when None)."""
    if capacity is None:
        return routed
    experts, slot_weights, slot_routed = indices.reshape(-1), weights.reshape(-1), routed.reshape(-1)
    position = jnp.arange(experts.shape[0])
    # [slot, other]: `other` competes with `slot` for its expert's places.
    rivals = (experts[:, None] == experts[None, :]) & slot_routed[None, :]
    earlier = position[None, :] < position[:, None]
    if drop_policy == "position":
        before = earlier
    else:  # NaN below every number; equal weights (NaN and NaN included) to the earlier slot
        mine, theirs = slot_weights[:, None], slot_weights[None, :]
        heavier = (theirs > mine) | (jnp.isnan(mine) & ~jnp.isnan(theirs))
        equal = (theirs == mine) | (jnp.isnan(mine) & jnp.isnan(theirs))
        before = heavier | (equal & earlier)
    rank = jnp.sum(rivals & before, axis=1)
    return (slot_routed & (rank < capacity)).reshape(indices.shape)


def _losses(logits, routing_map, valid, batch: int, opts: LayerOptions) -> jax.Array:
    """[3] fp32: (load_balancing_loss, seq_load_balancing_loss, z_loss) of LOSSES, each times its
    coefficient, over the unmasked tokens (valid [T] bool; routing_map [T, E] with masked rows cleared).
    Zero with no unmasked token."""
    num_tokens, num_experts = logits.shape
    topk = opts.topk
    losses = [jnp.zeros((), jnp.float32)] * 3
    if num_tokens == 0:
        return jnp.stack(losses)
    score_map, scores = reference_router.fused_compute_score_for_moe_aux_loss(
        logits, topk, opts.score_function
    )
    scores = jnp.where(valid[:, None], scores, 0.0)  # [T, E]
    if opts.balance_counts == "scores":  # the scores' own top K, padding excluded (BALANCE_COUNTS)
        routing_map = score_map & valid[:, None]
    routed = routing_map.sum(0).astype(jnp.float32)  # [E]
    total = valid.sum().astype(jnp.float32)  # T
    safe_total = jnp.maximum(total, 1.0)
    if opts.aux_loss_coeff:
        balance = num_experts / (topk * safe_total**2) * jnp.sum(routed * scores.sum(0))
        losses[0] = jnp.where(total > 0, opts.aux_loss_coeff * balance, 0.0)
    if opts.seq_aux_loss_coeff:
        seq = num_tokens // batch
        summed, sequences = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
        for b in range(batch):
            rows = slice(b * seq, (b + 1) * seq)
            count = valid[rows].sum().astype(jnp.float32)  # n_b
            safe_count = jnp.maximum(count, 1.0)
            routed_b = routing_map[rows].sum(0).astype(jnp.float32)  # [E]
            fraction = num_experts / (topk * safe_count) * routed_b
            mean_score = scores[rows].sum(0) / safe_count
            summed += jnp.where(count > 0, jnp.sum(fraction * mean_score), 0.0)
            sequences += (count > 0).astype(jnp.float32)
        losses[1] = opts.seq_aux_loss_coeff * summed / jnp.maximum(sequences, 1.0)
    if opts.z_loss_coeff:
        squares = jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) ** 2, 0.0)
        losses[2] = opts.z_loss_coeff * squares.sum() / safe_total
    return jnp.stack(losses)


def moe_reference(
    x: jax.Array,
    gate: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    expert_bias: jax.Array | None = None,
    gate_bias: jax.Array | None = None,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    shared_gate_up: jax.Array | None = None,
    shared_down: jax.Array | None = None,
    shared_gate: jax.Array | None = None,
    token_mask: jax.Array | None = None,
    num_shards: int = 1,
    return_stats: bool = False,
    routing_indices: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array, MoEStats]:
    """Reference of `moetriton.jax.moe` on one device: same arrays, the options (topk, ...,
    capacity_factor, seq_aux_loss_coeff, z_loss_coeff, drop_policy: the fields of
    `moetriton.kernels.rules.moe.LayerOptions`) as keywords, no mesh (`num_shards` token shards only matter
    for capacity drops), same results (out [B, S, H] fp32, aux_loss fp32, dropped int32, and with
    `return_stats` the MoEStats).
    shared_gate_up [H, 2Fs] (or [H, Fs]), shared_down [Fs, H], shared_gate [H, 1]: the shared experts, a
    dense FFN of every token added to the routed output (times sigmoid(x @ shared_gate) per token).
    token_mask [B, S] bool: False tokens are routed nowhere, counted nowhere, output zero.
    gate_bias [E], gate_up_bias [E, 2F] (or [E, F]), down_bias [E, H]: the router's logit bias and the
    experts' projection biases. routing_indices [B, S, K]: the ids the reference router replays (a slot it
    refuses, index -1, takes no expert).

    Example:
        >>> out, aux_loss, dropped = moe_reference(x, gate, gate_up, down, topk=2, capacity_factor=1.0,
        ...                                        num_shards=4)
    """
    opts = LayerOptions(**options)
    topk, activation = opts.topk, opts.activation
    batch, seq, hidden = x.shape
    num_experts = gate.shape[1]
    num_tokens = batch * seq
    shard_tokens = num_tokens // num_shards
    capacity = shard_capacity(
        num_tokens, num_shards, num_experts, topk, opts.align_size, opts.capacity_factor
    )
    valid = jnp.ones(num_tokens, bool) if token_mask is None else jnp.asarray(token_mask).reshape(num_tokens)
    # Padding enters as zeros (NON_FINITE "padding"): what it holds reaches no result and no gradient.
    x_flat = jnp.where(valid[:, None], x.reshape(num_tokens, hidden).astype(jnp.float32), 0.0)
    logits = jnp.dot(x_flat, gate.astype(jnp.float32), precision=_HIGHEST)
    if gate_bias is not None:
        logits = logits + gate_bias.astype(jnp.float32)
    bias = None if expert_bias is None else jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
    probs, routing_map, indices = reference_router.fused_topk_with_score_function(
        logits,
        topk,
        opts.use_pre_softmax,
        opts.num_groups,
        opts.group_topk,
        opts.scaling_factor,
        opts.score_function,
        bias,
        return_indices=True,
        normalize_topk=opts.normalize_topk,
        group_score=opts.group_score,
        routing_indices=None
        if routing_indices is None
        else jnp.asarray(routing_indices).reshape(num_tokens, topk),
    )
    chosen = indices >= 0  # [T, K]: a replay's refused slot is -1
    weights = jnp.where(chosen, jnp.take_along_axis(probs, jnp.maximum(indices, 0), axis=1), 0.0)  # [T, K]
    routed = valid[:, None] & chosen  # [T, K]: slots that take an expert
    routing_map = routing_map & valid[:, None]
    outputs, kept_per_shard = [], []
    for shard in range(num_shards):
        rows = slice(shard * shard_tokens, (shard + 1) * shard_tokens)
        kept = _kept(indices[rows], weights[rows], routed[rows], capacity, opts.drop_policy)
        kept_per_shard.append(kept)
        out = jnp.zeros((shard_tokens, hidden), jnp.float32)
        for slot in range(topk):
            expert = indices[rows, slot]
            weight = weights[rows, slot, None]
            y = _expert(
                weight * x_flat[rows] if opts.probs_on_input else x_flat[rows],
                gate_up[expert].astype(jnp.float32),
                down[expert].astype(jnp.float32),
                activation,
                *(
                    None if bias is None else bias[expert].astype(jnp.float32)
                    for bias in (gate_up_bias, down_bias)
                ),
            )
            out += jnp.where(kept[:, slot, None], y if opts.probs_on_input else weight * y, 0.0)
        outputs.append(out)
    out = jnp.concatenate(outputs)  # [T, H]
    kept = jnp.concatenate(kept_per_shard) if kept_per_shard else routed  # [T, K]
    if shared_gate_up is not None:
        hidden_shared = jnp.dot(x_flat, shared_gate_up.astype(jnp.float32), precision=_HIGHEST)
        act = apply_activation(hidden_shared, activation)
        shared = jnp.dot(act, shared_down.astype(jnp.float32), precision=_HIGHEST)  # [T, H]
        if shared_gate is not None:
            shared *= jax.nn.sigmoid(jnp.dot(x_flat, shared_gate.astype(jnp.float32), precision=_HIGHEST))
        out += shared
    out = jnp.where(valid[:, None], out, 0.0)
    losses = _losses(logits, routing_map, valid, batch, opts)
    dropped = jnp.sum(routed & ~kept, dtype=jnp.int32)
    results = (out.reshape(batch, seq, hidden), losses.sum(), dropped)
    if not return_stats:
        return results
    experts = jnp.arange(num_experts)
    per_expert = indices.reshape(-1)[:, None] == experts[None, :]  # [T * K, E]
    routed_per_expert = jnp.sum(per_expert & routed.reshape(-1, 1), axis=0, dtype=jnp.int32)
    kept_per_expert = jnp.sum(per_expert & kept.reshape(-1, 1), axis=0, dtype=jnp.int32)
    mean_load = kept_per_expert.astype(jnp.float32).mean()
    stats = MoEStats.of(losses, routed_per_expert, kept_per_expert, dropped, mean_load)
    return (*results, stats)
