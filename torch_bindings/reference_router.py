"""Pure-PyTorch reference of the router ops: vectorised, differentiable, independent of the kernels.

Used as the test oracle (tests differentiate it with autograd), as the CPU fallback when the Triton
interpreter is off, and as the eager benchmark baseline. Semantics are those of moetriton.kernels.router:
selection ranks scores descending with ties to the lowest index and NaN below every number (built here
from two stable sorts, not from the kernels' integer keys); group scores add each group's top scores in
descending order; weights use the unbiased score. Math runs in fp32 (fp64 for fp64 input, so gradcheck
can verify the reference itself); results are cast to the logits dtype.
"""

from __future__ import annotations

import torch

from moetriton.kernels.rules.router import group_score_count, normalizes_topk

from .reference import pack_bitmap, unpack_bitmap

EPSILON = 1e-20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rank(scores: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """Column order of every row of `scores` [N, n]: numbers by value descending, then NaN, then
    `excluded` entries; ties in ascending column order (-0.0 ties +0.0)."""
    tier = torch.isnan(scores).to(torch.int8)
    if excluded is not None:
        tier = torch.where(excluded, 2, tier)
    value = torch.where(tier == 0, scores, float("-inf"))
    by_value = torch.sort(value, dim=-1, descending=True, stable=True).indices
    by_tier = torch.sort(tier.gather(-1, by_value), dim=-1, stable=True).indices
    return by_value.gather(-1, by_tier)


def _activation(x: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    return torch.sqrt(torch.nn.functional.softplus(x))  # softplus(x) = x past 20, as the kernels


def _group_excluded(
    select: torch.Tensor, topk: int, num_groups: int, group_topk: int, group_score: str
) -> torch.Tensor:
    """[T, E] True for experts outside each token's group_topk best groups (group score: the sum of the
    group's top `group_score_count` selection scores, added in descending order)."""
    num_tokens, num_experts = select.shape
    size = num_experts // num_groups
    grouped = select.reshape(num_tokens * num_groups, size)
    per_group = group_score_count(group_score, topk, group_topk)
    best = grouped.gather(-1, rank(grouped)[:, :per_group]).reshape(num_tokens, num_groups, per_group)
    group_score = best[..., 0]
    for i in range(1, per_group):
        group_score = group_score + best[..., i]
    chosen = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=select.device)
    chosen.scatter_(-1, rank(group_score)[:, :group_topk], True)
    return ~chosen.repeat_interleave(size, dim=-1)


def replayed_selection(routing_indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map [T, E] bool, kept ids [T, K] int32) of given expert ids [T, K]: a slot keeps its id when
    it lies in [0, E) and no earlier slot of its row holds the same id; other slots select nothing (-1)."""
    ids = routing_indices.long()
    num_slots = ids.shape[-1]
    earlier = torch.ones(num_slots, num_slots, dtype=torch.bool, device=ids.device).tril(-1)
    repeated = ((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)
    kept = (ids >= 0) & (ids < num_experts) & ~repeated
    # Slots that select nothing write the extra column E, which is dropped.
    columns = torch.where(kept, ids, num_experts)
    routing_map = torch.zeros(ids.shape[0], num_experts + 1, dtype=torch.bool, device=ids.device)
    routing_map.scatter_(-1, columns, True)
    return routing_map[:, :num_experts], torch.where(kept, ids, -1).to(torch.int32)


def weights_from_map(
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    scaling_factor: float,
    score_function: str,
    normalize_topk: bool | None = None,
) -> torch.Tensor:
    """Differentiable probs [T, E] (logits dtype) of the experts a routing map selects."""
    x = logits.to(_compute_dtype(logits.dtype))
    if score_function == "softmax" and not use_pre_softmax:
        weights = torch.softmax(x.masked_fill(~routing_map, float("-inf")), dim=-1)
        weights = torch.where(routing_map, weights, 0.0)
    else:
        score = torch.softmax(x, dim=-1) if score_function == "softmax" else _activation(x, score_function)
        weights = torch.where(routing_map, score, 0.0)
        if normalizes_topk(score_function, use_pre_softmax, topk, normalize_topk):
            weights = torch.where(routing_map, weights / (weights.sum(-1, keepdim=True) + EPSILON), 0.0)
    return (weights * scaling_factor).to(logits.dtype)


def _selection(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk: int,
    num_groups: int,
    group_topk: int,
    use_pre_softmax: bool,
    score_function: str,
    group_score: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map [T, E] bool, indices [T, K] int64 by rank) the router chooses for [T, E] logits."""
    x = logits.detach().to(_compute_dtype(logits.dtype))
    if score_function == "softmax":
        select = torch.softmax(x, dim=-1) if use_pre_softmax else x
    else:
        select = _activation(x, score_function)
    if expert_bias is not None:
        select = select + expert_bias.to(select.dtype)
    excluded = _group_excluded(select, topk, num_groups, group_topk, group_score) if group_topk else None
    indices = rank(select, excluded)[:, :topk]
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map.scatter_(-1, indices, True)
    return routing_map, indices


def topk_forward(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk: int,
    use_pre_softmax: bool,
    num_groups: int,
    group_topk: int,
    scaling_factor: float,
    score_function: str,
    return_indices: bool,
    routing_map_format: str = "bytemap",
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    routing_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moetriton::router_topk on [T, E] logits: (probs, routing_map, indices [T, K] or [T, 0] int32).
    num_groups = group_topk = 0: no groups. The map is bool [T, E], or packed ("bitmap"). With
    `routing_indices` [T, K] the selection is `replayed_selection`'s (groups and bias unused)."""
    if routing_indices is not None:
        routing_map, indices = replayed_selection(routing_indices, logits.shape[-1])
    else:
        routing_map, indices = _selection(
            logits, expert_bias, topk, num_groups, group_topk, use_pre_softmax, score_function, group_score
        )
    probs = weights_from_map(
        logits, routing_map, topk, use_pre_softmax, scaling_factor, score_function, normalize_topk
    )
    if routing_map_format == "bitmap":
        routing_map = pack_bitmap(routing_map)
    return probs, routing_map, indices[:, : topk if return_indices else 0].to(torch.int32)


def _vjp(fn, primal: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    # torch.func, not torch.autograd: inside a custom op's implementation autograd dispatch is off.
    _, vjp = torch.func.vjp(fn, primal)
    return vjp(cotangent)[0]


def topk_backward(
    grad_probs: torch.Tensor,
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    scaling_factor: float,
    score_function: str,
    routing_map_format: str = "bytemap",
    normalize_topk: bool | None = None,
) -> torch.Tensor:
    """moetriton::router_topk_backward: grad_logits [T, E] by autograd of weights_from_map (the map
    unpacked first when it is a "bitmap")."""
    if routing_map_format == "bitmap":
        routing_map = unpack_bitmap(routing_map, logits.shape[1])
    return _vjp(
        lambda x: weights_from_map(
            x, routing_map, topk, use_pre_softmax, scaling_factor, score_function, normalize_topk
        ),
        logits,
        grad_probs.to(logits.dtype),
    )


def aux_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Differentiable aux-loss scores [..., E] in fp32 (fp64 for fp64 logits)."""
    x = logits.to(_compute_dtype(logits.dtype))
    if score_function == "softmax":
        return torch.softmax(x, dim=-1)
    act = _activation(x, score_function)
    return act / (act.sum(-1, keepdim=True) + EPSILON)


def aux_scores_forward(
    logits: torch.Tensor, topk: int, score_function: str, routing_map_format: str = "bytemap"
) -> tuple[torch.Tensor, torch.Tensor]:
    """moetriton::router_aux_scores on [T, E] logits: (routing_map (bool, or packed: "bitmap"), scores
    fp32)."""
    scores = aux_scores(logits.detach(), score_function).float()
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map.scatter_(-1, rank(scores)[:, :topk], True)
    return pack_bitmap(routing_map) if routing_map_format == "bitmap" else routing_map, scores


def aux_scores_backward(grad_scores: torch.Tensor, logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """moetriton::router_aux_scores_backward: grad_logits by autograd of aux_scores."""
    return _vjp(lambda x: aux_scores(x, score_function).float(), logits, grad_scores.float())


def aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """0-dim loss in probs.dtype: C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c],
    C = num_experts * coeff / (topk * total_num_tokens^2); 0 (and a zero gradient) for a total below 1."""
    dtype = _compute_dtype(probs.dtype)
    total = (
        total_num_tokens.to(dtype)
        if isinstance(total_num_tokens, torch.Tensor)
        else torch.tensor(float(total_num_tokens), dtype=dtype, device=probs.device)
    )
    no_tokens = total < 1
    total = torch.where(no_tokens, 1, total)  # the other branch's gradient must stay finite
    column_sums = probs.to(dtype).sum(0)
    loss = (column_sums * tokens_per_expert.to(dtype)).sum() * (num_experts * coeff / topk) / (total * total)
    return torch.where(no_tokens, 0, loss).to(probs.dtype)


def aux_loss_backward(
    grad_loss: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total: torch.Tensor | None,
    num_rows: int,
    num_cols: int,
    probs_dtype: torch.dtype,
    total_int: int,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """moetriton::router_aux_loss_backward: grad_probs by autograd of aux_loss (`total_int` when `total`
    is None)."""
    zeros = torch.zeros((num_rows, num_cols), dtype=probs_dtype, device=tokens_per_expert.device)
    total_num_tokens = total_int if total is None else total
    return _vjp(
        lambda p: aux_loss(p, tokens_per_expert, total_num_tokens, num_experts, topk, coeff),
        zeros,
        grad_loss.to(probs_dtype),
    )


# Public-API mirrors (what tests differentiate and benchmarks time) ------------------------------------------


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    routing_map_format: str = "bytemap",
    *,
    return_indices: bool = False,
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    routing_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Reference of moetriton.torch.router.fused_topk_with_score_function (differentiable in logits;
    routing_map_format "bytemap" or "bitmap"; `routing_indices` [..., K] replays a selection)."""
    num_experts = logits.shape[-1]
    flat = logits.reshape(-1, num_experts)
    use_pre_softmax = use_pre_softmax and score_function == "softmax"
    scale = 1.0 if scaling_factor is None else scaling_factor
    _, routing_map, indices = topk_forward(
        flat,
        expert_bias,
        topk,
        use_pre_softmax,
        num_groups or 0,
        group_topk or 0,
        scale,
        score_function,
        True,
        group_score=group_score,
        routing_indices=None if routing_indices is None else routing_indices.reshape(-1, topk),
    )
    probs = weights_from_map(flat, routing_map, topk, use_pre_softmax, scale, score_function, normalize_topk)
    if routing_map_format == "bitmap":
        routing_map = pack_bitmap(routing_map)
    result = (probs.reshape(logits.shape), routing_map.reshape(*logits.shape[:-1], routing_map.shape[-1]))
    if return_indices:
        result += (indices.reshape(*logits.shape[:-1], topk),)
    return result


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str, routing_map_format: str = "bytemap"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of moetriton.torch.router.fused_compute_score_for_moe_aux_loss: (routing_map, scores)."""
    num_experts = logits.shape[-1]
    routing_map, _ = aux_scores_forward(
        logits.reshape(-1, num_experts), topk, score_function, routing_map_format
    )
    map_shape = (*logits.shape[:-1], routing_map.shape[-1])
    return routing_map.reshape(map_shape), aux_scores(logits, score_function).float()


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int | torch.Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Reference of moetriton.torch.router.fused_moe_aux_loss."""
    return aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)
