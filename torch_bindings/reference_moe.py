"""Dense single-process reference of the MoE layer (`moetriton.torch.moe`), for tests: fp32, a plain loop
over experts, no moetriton kernels (the router is moetriton.torch.reference_router), differentiable.

It takes the whole batch and every expert's weights (the EP ranks' local weights concatenated in rank
order). A capacity policy is emulated per token shard: the batch splits into `num_shards` equal shards in
order (the ranks of the token group), and in each shard every expert keeps its first C routed tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moetriton.kernels.rules.expert_parallel import shard_capacity
from moetriton.kernels.rules.moe import LayerOptions

from . import reference_router


def _expert(rows: Tensor, gate_up: Tensor, down: Tensor, activation: str) -> Tensor:
    hidden = rows @ gate_up
    if activation in ("swiglu", "geglu"):
        gate, up = hidden.chunk(2, dim=-1)
        act = (F.silu(gate) if activation == "swiglu" else F.gelu(gate)) * up
    else:
        act = F.gelu(hidden) if activation == "gelu" else F.relu(hidden)
    return act @ down


def moe_reference(
    x: Tensor,
    gate_weight: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    expert_bias: Tensor | None = None,
    shared_gate_up: Tensor | None = None,
    shared_down: Tensor | None = None,
    shared_gate: Tensor | None = None,
    num_shards: int = 1,
    **options,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of `moe` on the unsharded batch.

    Args:
        x: [..., H] all tokens (every rank's, in rank order); gate_weight [E, H]; gate_up [E, H, 2F] (or
            [E, H, F] non-gated); down [E, F, H]: every expert. Any float dtype; the math is fp32, except
            that the logits are rounded to x.dtype, as the layer's are.
        num_shards: token shards of the capacity policy (the token group's size).
        shared_gate_up [H, 2Fs] (or [H, Fs]), shared_down [Fs, H], shared_gate [H, 1]: the shared experts,
            a dense FFN of every token added to the routed output (times sigmoid(x @ shared_gate) per token).
        expert_bias and options (topk, score_function, ..., capacity_factor: the fields of
            `moetriton.kernels.rules.moe.LayerOptions`): `moe`'s.

    Returns:
        (out [..., H] fp32, aux_loss fp32 scalar, dropped int64 scalar: slots past the capacity).

    Example:
        >>> x = torch.randn(6, 8)
        >>> gate, gate_up, down = torch.randn(4, 8), torch.randn(4, 8, 8), torch.randn(4, 4, 8)
        >>> moe_reference(x, gate, gate_up, down, topk=2)[0].shape
        torch.Size([6, 8])
    """
    opts = LayerOptions(**options)
    topk, activation, aux_loss_coeff = opts.topk, opts.activation, opts.aux_loss_coeff
    num_experts, hidden = gate_weight.shape
    tokens = x.reshape(-1, hidden).float()  # [T, H]
    num_tokens = tokens.shape[0]
    if num_tokens % num_shards:
        raise ValueError(f"num_shards: expected a divisor of the token count {num_tokens}, got {num_shards}")
    # The layer's logits are in x.dtype (one rounding of an fp32 accumulation): round alike, so bf16 and fp16
    # inputs route the same tokens to the same experts here.
    logits = F.linear(tokens, gate_weight.float()).to(x.dtype).float()
    probs, routing_map = reference_router.fused_topk_with_score_function(
        logits,
        topk,
        use_pre_softmax=opts.use_pre_softmax,
        num_groups=opts.num_groups,
        group_topk=opts.group_topk,
        scaling_factor=opts.scaling_factor,
        score_function=opts.score_function,
        expert_bias=None if expert_bias is None else expert_bias.float(),
    )
    kept = routing_map.clone()  # [T, E]
    if opts.capacity_factor is not None:
        shard_tokens = num_tokens // num_shards
        capacity = shard_capacity(
            num_tokens, num_shards, num_experts, topk, opts.align_size, opts.capacity_factor
        )
        for start in range(0, num_tokens, max(shard_tokens, 1)):
            for expert in range(num_experts):
                routed = kept[start : start + shard_tokens, expert].nonzero().squeeze(1) + start
                kept[routed[capacity:], expert] = False
    out = torch.zeros_like(tokens)
    for expert in range(num_experts):
        rows = kept[:, expert].nonzero().squeeze(1)
        expert_out = _expert(tokens[rows], gate_up[expert].float(), down[expert].float(), activation)
        out = out.index_add(0, rows, probs[rows, expert, None].float() * expert_out)
    if shared_gate_up is not None:
        shared = _expert(tokens, shared_gate_up.float(), shared_down.float(), activation)  # [T, H]
        if shared_gate is not None:
            shared = torch.sigmoid(tokens @ shared_gate.float()) * shared
        out = out + shared
    aux_loss = torch.zeros((), dtype=torch.float32, device=x.device)
    if aux_loss_coeff > 0 and num_tokens > 0:  # no tokens: no loss (the layer's zero)
        _, scores = reference_router.fused_compute_score_for_moe_aux_loss(logits, topk, opts.score_function)
        tokens_per_expert = routing_map.sum(0).float()
        scale = aux_loss_coeff * num_experts / (topk * num_tokens**2)
        aux_loss = scale * (scores.sum(0) * tokens_per_expert).sum()
    dropped = (routing_map.sum() - kept.sum()).to(torch.int64)
    return out.reshape(x.shape), aux_loss, dropped
