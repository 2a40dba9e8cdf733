"""The MoE layer's statistics: the losses (load balance, sequence-wise balance, z-loss), the dropped count and
the loads, global over the token shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import dropped_slots, kept_slots
from moetriton.kernels.rules.moe import MoEStats

from ..router import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss
from .config import MoEConfig


def _sequence_balance(scores, routing_map, per_sequence, topk: int):
    """Sum over this shard's B sequences of DeepSeek-V3's sequence-wise balance (LOSSES, unscaled):
    sum_e (E / (K n_b) routed_be) (1 / n_b sum_t score_te). scores [T, E] fp32 and routing_map [T, E] bool
    with masked rows zero, T = B * S; per_sequence [B]: unmasked tokens n_b. A sequence without one adds 0."""
    batch, num_experts = per_sequence.shape[0], scores.shape[1]
    routed = routing_map.reshape(batch, -1, num_experts).sum(1, dtype=jnp.float32)  # [B, E]
    score_sums = scores.reshape(batch, -1, num_experts).sum(1)  # [B, E]
    balance = (routed * score_sums).sum(1) * (num_experts / topk)  # [B]
    return (balance / jnp.maximum(per_sequence, 1).astype(jnp.float32) ** 2).sum()


def routing_statistics(logits, routing_map, valid, layout, config: MoEConfig, batch: int):
    """(aux_loss fp32 scalar, dropped int32 scalar, MoEStats with config.return_stats or None), all global
    over the token shards.

    logits [T, E] fp32 and routing_map [T, E] bool of this shard (masked rows cleared); valid [T] bool or None
    (every token counts); batch: B of the shard's x [B, S, H]. One psum carries the integer counts that are
    needed (routed and kept slots per expert, unmasked tokens, sequences holding one), a second the losses'
    partials. Without a mask the token counts are static. Every division is guarded: a group of padding
    alone gives zero losses, never NaN."""
    axes, return_stats = config.token_axes, config.return_stats

    def total(value):
        return jax.lax.psum(value, axes) if axes else value

    num_experts, topk = layout.num_experts, layout.topk
    balance_coeff, sequence_coeff = config.aux_loss_coeff, config.seq_aux_loss_coeff
    z_coeff = config.z_loss_coeff
    has_tokens = layout.num_tokens > 0  # the same on every shard: shards hold equal shapes
    routed = routing_map.sum(0, dtype=jnp.int32)  # [E]
    scores = balance_map = None
    if has_tokens and (balance_coeff or sequence_coeff):
        score_map, scores = fused_compute_score_for_moe_aux_loss(logits, topk, config.score_function)
        if valid is not None:
            scores = jnp.where(valid[:, None], scores, 0.0)  # [T, E] fp32
            score_map = score_map & valid[:, None]
        # The counts the load-balancing losses weigh the scores by (BALANCE_COUNTS).
        balance_map = score_map if config.balance_counts == "scores" else routing_map
    per_sequence = None
    counts = {}
    if (balance_coeff and has_tokens) or return_stats:
        counts["routed"] = routed
    if balance_coeff and has_tokens and config.balance_counts == "scores":
        counts["balance"] = balance_map.sum(0, dtype=jnp.int32)
    if return_stats:
        counts["kept"] = kept_slots(routed, layout).astype(jnp.int32)
    if valid is not None and has_tokens:
        if balance_coeff or z_coeff:
            counts["tokens"] = valid.sum(dtype=jnp.int32)[None]
        if sequence_coeff:
            per_sequence = valid.reshape(batch, -1).sum(1, dtype=jnp.int32)  # [B]
            counts["sequences"] = (per_sequence > 0).sum(dtype=jnp.int32)[None]
    if len(counts) == 1:
        counts = {name: total(value) for name, value in counts.items()}
    elif counts:  # one collective for every count
        sizes = [value.shape[0] for value in counts.values()]
        merged = total(jnp.concatenate(list(counts.values())))
        parts = jnp.split(merged, [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)])
        counts = dict(zip(counts, parts, strict=True))
    # Without a mask every token counts and every sequence holds one: static counts.
    tokens = counts["tokens"][0] if "tokens" in counts else layout.num_tokens * config.num_shards
    sequences = counts["sequences"][0] if "sequences" in counts else batch * config.num_shards
    if per_sequence is None and sequence_coeff and has_tokens:
        per_sequence = jnp.full((batch,), layout.num_tokens // batch, jnp.int32)

    partials = [None, None, None]  # this shard's share of each global loss
    if has_tokens and (balance_coeff or sequence_coeff):
        if balance_coeff:
            # No unmasked token in the group: a traced total of 0, and the op's loss is then 0.
            global_counts = counts.get("balance", counts.get("routed"))
            loss = fused_moe_aux_loss(scores, global_counts, tokens, num_experts, topk, balance_coeff)
            partials[0] = loss.astype(jnp.float32)
        if sequence_coeff:
            balance = _sequence_balance(scores, balance_map, per_sequence, topk)
            partials[1] = sequence_coeff * balance / jnp.maximum(sequences, 1).astype(jnp.float32)
    if has_tokens and z_coeff:
        squares = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2  # [T]
        if valid is not None:
            squares = jnp.where(valid, squares, 0.0)
        partials[2] = z_coeff * squares.sum() / jnp.maximum(tokens, 1).astype(jnp.float32)

    if not return_stats:
        present = [loss for loss in partials if loss is not None]
        aux_loss = sum(present[1:], present[0]) if present else jnp.zeros((), jnp.float32)
        return total(aux_loss), total(dropped_slots(routed, layout).astype(jnp.int32)), None
    zero = jnp.zeros((), jnp.float32)
    losses = jnp.stack([zero if loss is None else loss for loss in partials])  # [3]
    if any(loss is not None for loss in partials):
        losses = total(losses)
    routed, kept = counts["routed"], counts["kept"]
    dropped = (routed - kept).sum(dtype=jnp.int32)
    stats = MoEStats.of(losses, routed, kept, dropped, kept.astype(jnp.float32).mean())
    return losses.sum(), stats.dropped, stats
