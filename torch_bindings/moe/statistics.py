"""The MoE layer's routing statistics: its three losses (kernels/rules/moe.LOSSES), the dropped slots and the
per-expert loads of `MoEStats`, all global over the token group with no host sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import EPLayout, kept_slots
from moetriton.kernels.rules.moe import MoEStats

from ..router import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss
from .collectives import global_sum, group_size_and_rank
from .routing import Routing


def _sequence_balance(
    scores: Tensor, routing_map: Tensor, per_sequence: Tensor, topk: int, batch_shape: tuple[int, int]
) -> Tensor:
    """Sum over this rank's B sequences of DeepSeek-V3's sequence-wise balance (LOSSES, unscaled): scores
    [T, E] fp32 and routing_map [T, E] bool, masked rows zero, T = B * S (batch_shape = (B, S), spelled out:
    an empty batch cannot infer S); per_sequence [B]: the unmasked tokens n_b of each. A sequence without one
    adds zero."""
    batch, seq = batch_shape
    num_experts = scores.shape[1]
    routed = routing_map.reshape(batch, seq, num_experts).sum(1, dtype=torch.float32)  # [B, E]
    score_sums = scores.reshape(batch, seq, num_experts).sum(1)  # [B, E]
    # sum_e (E / (K n_b) routed_be) (score_sums_be / n_b)
    balance = (routed * score_sums).sum(1) * (num_experts / topk)  # [B]
    return (balance / per_sequence.float().square().clamp(min=1)).sum()


def routing_statistics(
    routing: Routing,
    valid: Tensor | None,
    layout: EPLayout,
    *,
    score_function: str,
    coefficients: tuple[float, float, float],
    batch_shape: tuple[int, int] | None,
    group,
    want_stats: bool,
    balance_counts: str = "routed",
) -> tuple[Tensor, Tensor, MoEStats | None]:
    """(aux_loss fp32 scalar, dropped int32 scalar, MoEStats or None), global over `group` (None: this rank).

    routing: this rank's tokens' (moetriton.torch.moe.routing.Routing: logits, the routing map with masked
    tokens' rows cleared, and routed, its column sums, which also size the exchange); valid [T] bool (None:
    every token counts); coefficients: (aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff); batch_shape:
    (B, S) of x [B, S, H] (for the sequence-wise loss); balance_counts: which counts the load-balancing
    losses weigh (moetriton.kernels.rules.moe.BALANCE_COUNTS). One all_reduce carries the routed and kept
    counts, the unmasked tokens, the sequences holding one (and with balance_counts="scores" the top-K
    counts of the scores); a second, differentiable, sums the three losses' partials. A rank without tokens
    still joins both: every rank reaches every collective whatever its batch, or the others would wait for
    it."""
    logits, routing_map, routed = routing.logits, routing.routing_map, routing.routed
    num_experts, topk = layout.num_experts, layout.topk
    balance_coeff, sequence_coeff, z_coeff = coefficients
    any_loss = any(coeff > 0 for coeff in coefficients)
    if layout.dropless and not any_loss and not want_stats:  # the plain layer: nothing to count or reduce
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        return zero, zero.to(torch.int32), None
    has_tokens = layout.num_tokens > 0
    scores = balance_map = None
    if has_tokens and (balance_coeff > 0 or sequence_coeff > 0):
        score_map, scores = fused_compute_score_for_moe_aux_loss(logits, topk, score_function)  # [T, E] fp32
        if valid is not None:
            scores = torch.where(valid[:, None], scores, 0.0)
            score_map = score_map & valid[:, None]
        balance_map = score_map if balance_counts == "scores" else routing_map
    kept = kept_slots(routed, layout)
    tokens = routed.new_full((1,), layout.num_tokens) if valid is None else valid.sum().reshape(1)
    per_sequence, sequences = None, routed.new_zeros(1)
    if sequence_coeff > 0:  # x is [B, S, H] (the layer checked it)
        batch, seq = batch_shape
        per_sequence = routed.new_full((batch,), seq) if valid is None else valid.reshape(batch, seq).sum(1)
        sequences = (per_sequence > 0).sum().reshape(1)
    # The switch loss's global counts: the routed ones, or those of the scores' top K (joining the same
    # collective on every rank, zeros where a rank has no tokens).
    balance_routed = routed
    extra = []
    if balance_coeff > 0 and balance_counts == "scores":
        balance_routed = routed.new_zeros(num_experts) if balance_map is None else balance_map.sum(0)
        extra = [balance_routed]
    group_size, _ = group_size_and_rank(group)
    if group_size > 1:
        counts = torch.cat([routed, kept, tokens, sequences, *extra])
        dist.all_reduce(counts, group=group)
        routed, kept = counts[:num_experts], counts[num_experts : 2 * num_experts]
        tokens, sequences = counts[2 * num_experts : 2 * num_experts + 2].unbind()
        balance_routed = counts[2 * num_experts + 2 :] if extra else routed
    else:
        tokens, sequences = tokens[0], sequences[0]
    dropped = (routed - kept).sum().to(torch.int32)
    losses = logits.new_zeros(3, dtype=torch.float32)
    if any_loss and has_tokens:
        # Every denominator is clamped to 1: a group of padding alone gives zero losses, not NaN.
        partials = list(losses.unbind())
        if balance_coeff > 0:
            # No unmasked token in the group: tokens is 0, and the op's loss is then 0.
            partials[0] = fused_moe_aux_loss(scores, balance_routed, tokens, num_experts, topk, balance_coeff)
        if sequence_coeff > 0:
            balance = _sequence_balance(scores, balance_map, per_sequence, topk, batch_shape)
            partials[1] = sequence_coeff * balance / sequences.clamp(min=1)
        if z_coeff > 0:
            square = torch.logsumexp(logits.float(), dim=-1).square()  # [T]
            if valid is not None:
                square = torch.where(valid, square, 0.0)
            partials[2] = z_coeff * square.sum() / tokens.clamp(min=1)
        losses = torch.stack(partials)
    if any_loss and group_size > 1:
        losses = global_sum(losses, group)
    aux_loss = losses.sum()
    if not want_stats:
        return aux_loss, dropped, None
    kept = kept.to(torch.int32)
    stats = MoEStats.of(losses, routed.to(torch.int32), kept, dropped, kept.float().mean())
    return aux_loss, dropped, stats
