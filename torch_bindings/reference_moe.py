"""Dense single-process reference of the MoE layer (`moetriton.torch.moe`), for tests: fp32, a plain loop
over experts, no moetriton kernels (the router is moetriton.torch.reference_router), differentiable.

It takes the whole batch and every expert's weights (the EP ranks' local weights concatenated in rank
order). A capacity policy is emulated per token shard: the batch splits into `num_shards` equal shards in
order (the ranks of the token group), and in each shard every expert keeps its first C routed tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import shard_capacity
from moetriton.kernels.rules.moe import LayerOptions, MoEStats

from . import reference, reference_router


def _expert(
    rows: Tensor, gate_up: Tensor, down: Tensor, activation: str, gate_up_bias=None, down_bias=None
) -> Tensor:
    """One FFN in fp32 (no rounding), each bias added to its projection where given."""
    hidden = rows @ gate_up if gate_up_bias is None else rows @ gate_up + gate_up_bias.float()
    out = reference.activate(hidden, activation) @ down
    return out if down_bias is None else out + down_bias.float()


def moe_reference(
    x: Tensor,
    gate_weight: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    expert_bias: Tensor | None = None,
    gate_bias: Tensor | None = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    shared_gate_up: Tensor | None = None,
    shared_down: Tensor | None = None,
    shared_gate: Tensor | None = None,
    token_mask: Tensor | None = None,
    num_shards: int = 1,
    return_stats: bool = False,
    routing_indices: Tensor | None = None,
    **options,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, MoEStats]:
    """Reference of `moe` on the unsharded batch.

    Args:
        x: [..., H] all tokens (every rank's, in rank order); gate_weight [E, H]; gate_up [E, H, 2F] (or
            [E, H, F] non-gated); down [E, F, H]: every expert. Any float dtype; the math is fp32, except
            that the logits are rounded to x.dtype, as the layer's are.
        num_shards: token shards of the capacity policy (the token group's size).
        shared_gate_up [H, 2Fs] (or [H, Fs]), shared_down [Fs, H], shared_gate [H, 1]: the shared experts,
            a dense FFN of every token added to the routed output (times sigmoid(x @ shared_gate) per token).
        routing_indices: [..., K] expert ids the router replays (the reference router's replay).
        gate_bias [E], gate_up_bias [E, 2F] (or [E, F]), down_bias [E, H]: the router's logit bias and the
            experts' projection biases (every expert's).
        expert_bias, token_mask, return_stats and options (topk, score_function, ..., drop_policy: the
            fields of `moetriton.kernels.rules.moe.LayerOptions`): `moe`'s.

    Returns:
        (out [..., H] fp32, aux_loss fp32 scalar, dropped int64 scalar: slots past the capacity), and with
        return_stats the MoEStats (int64 counts) as kernels/rules/moe.py defines them.

    Example:
        >>> x = torch.randn(6, 8)
        >>> gate, gate_up, down = torch.randn(4, 8), torch.randn(4, 8, 8), torch.randn(4, 4, 8)
        >>> moe_reference(x, gate, gate_up, down, topk=2)[0].shape
        torch.Size([6, 8])
    """
    opts = LayerOptions(**options)
    topk, activation = opts.topk, opts.activation
    num_experts, hidden = gate_weight.shape
    tokens = x.reshape(-1, hidden).float()  # [T, H]
    num_tokens = tokens.shape[0]
    if num_tokens % num_shards:
        raise ValueError(f"num_shards: expected a divisor of the token count {num_tokens}, got {num_shards}")
    valid = torch.ones(num_tokens, dtype=torch.bool) if token_mask is None else token_mask.reshape(-1).cpu()
    # Padding enters as zeros (NON_FINITE "padding"): what it holds reaches no result and no gradient.
    tokens = torch.where(valid.to(tokens.device)[:, None], tokens, 0.0)
    # The layer's logits are in x.dtype (one rounding of an fp32 accumulation): round alike, so bf16 and fp16
    # inputs route the same tokens to the same experts here.
    router_bias = None if gate_bias is None else gate_bias.float()
    logits = F.linear(tokens, gate_weight.float(), router_bias).to(x.dtype).float()
    probs, routing_map = reference_router.fused_topk_with_score_function(
        logits,
        topk,
        use_pre_softmax=opts.use_pre_softmax,
        num_groups=opts.num_groups,
        group_topk=opts.group_topk,
        scaling_factor=opts.scaling_factor,
        score_function=opts.score_function,
        expert_bias=None if expert_bias is None else expert_bias.float(),
        normalize_topk=opts.normalize_topk,
        group_score=opts.group_score,
        routing_indices=None if routing_indices is None else routing_indices.reshape(num_tokens, topk),
    )
    routing_map = routing_map & valid.to(routing_map.device)[:, None]  # padding is routed nowhere
    kept = routing_map.clone()  # [T, E]
    if opts.capacity_factor is not None:
        shard_tokens = num_tokens // num_shards
        capacity = shard_capacity(
            num_tokens, num_shards, num_experts, topk, opts.align_size, opts.capacity_factor
        )
        for start in range(0, num_tokens, max(shard_tokens, 1)):
            for expert in range(num_experts):
                routed = kept[start : start + shard_tokens, expert].nonzero().squeeze(1) + start
                if opts.drop_policy == "probs":  # highest probability first, NaN last, earlier first on ties
                    weights = [probs[token, expert].item() for token in routed.tolist()]
                    order = sorted(
                        range(len(routed)),
                        key=lambda i: (
                            math.isnan(weights[i]),
                            0.0 if math.isnan(weights[i]) else -weights[i],
                            i,
                        ),
                    )
                    routed = routed[order]
                kept[routed[capacity:], expert] = False
    out = torch.zeros_like(tokens)
    for expert in range(num_experts):
        rows = kept[:, expert].nonzero().squeeze(1)
        biases = [None if bias is None else bias[expert] for bias in (gate_up_bias, down_bias)]
        weights = probs[rows, expert, None].float()
        if opts.probs_on_input:  # expert(w x): the weight scales the input
            expert_out = _expert(
                weights * tokens[rows], gate_up[expert].float(), down[expert].float(), activation, *biases
            )
        else:
            expert_out = weights * _expert(
                tokens[rows], gate_up[expert].float(), down[expert].float(), activation, *biases
            )
        out = out.index_add(0, rows, expert_out)
    if shared_gate_up is not None:
        shared = _expert(tokens, shared_gate_up.float(), shared_down.float(), activation)  # [T, H]
        if shared_gate is not None:
            shared = torch.sigmoid(tokens @ shared_gate.float()) * shared
        out = out + torch.where(valid.to(out.device)[:, None], shared, 0.0)
    losses = _losses(logits, routing_map, valid, opts, tuple(x.shape[:2]) if x.dim() == 3 else None)
    routed_counts, kept_counts = routing_map.sum(0), kept.sum(0)
    dropped = (routed_counts - kept_counts).sum()
    result = out.reshape(x.shape), sum(losses), dropped
    if not return_stats:
        return result
    stats = MoEStats.of(losses, routed_counts, kept_counts, dropped, kept_counts.float().mean())
    return *result, stats


def _losses(
    logits: Tensor, routing_map: Tensor, valid: Tensor, opts: LayerOptions, sequences: tuple[int, int] | None
):
    """The three weighted losses of LOSSES (fp32 scalars, zero where the coefficient is), straight from
    their definitions over the unmasked tokens; sequences: (B, S) of x [B, S, H]."""
    num_experts, topk = logits.shape[1], opts.topk
    score_map, scores = reference_router.fused_compute_score_for_moe_aux_loss(
        logits, topk, opts.score_function
    )
    device = logits.device
    valid = valid.to(device)
    if opts.balance_counts == "scores":  # the scores' own top K, padding excluded (BALANCE_COUNTS)
        routing_map = score_map & valid[:, None]
    count = int(valid.sum())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    balance = sequence = z_loss = zero
    if opts.aux_loss_coeff > 0 and count:
        load = routing_map.sum(0).float()
        balance = opts.aux_loss_coeff * num_experts / (topk * count**2) * (scores[valid].sum(0) * load).sum()
    if opts.seq_aux_loss_coeff > 0:
        per_sequence = []
        for sequence_valid, sequence_map, sequence_scores in zip(
            valid.reshape(sequences),
            routing_map.reshape(*sequences, num_experts),
            scores.reshape(*sequences, num_experts),
            strict=True,
        ):
            length = int(sequence_valid.sum())
            if length:  # a sequence of padding alone is no sequence
                load = num_experts / (topk * length) * sequence_map.sum(0).float()
                mean_score = sequence_scores[sequence_valid].sum(0) / length
                per_sequence.append((load * mean_score).sum())
        if per_sequence:
            sequence = opts.seq_aux_loss_coeff * torch.stack(per_sequence).mean()
    if opts.z_loss_coeff > 0 and count:
        z_loss = opts.z_loss_coeff * torch.logsumexp(logits[valid], dim=-1).square().mean()
    return balance, sequence, z_loss
