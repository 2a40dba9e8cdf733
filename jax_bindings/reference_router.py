"""Pure-JAX reference of the router ops: vectorised, differentiable, independent of the kernels.

The test oracle (tests differentiate it with jax.grad), the CPU fallback when the Triton interpreter is off
(and on CPU inside partitioned computations) and the benchmark baseline. Semantics are those of
moetriton.kernels.router: selection ranks scores descending with ties to the lowest index and NaN below
every number (here one three-key lax.sort, not the kernels' integer keys); group scores add each group's
top scores in descending order; weights use the unbiased score. Math runs in fp32 (fp64 for fp64 input
under jax_enable_x64); results are cast to the logits dtype. Never imports torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.router import group_score_count, normalizes_topk

from .reference import pack_bitmap, unpack_bitmap

EPSILON = 1e-20


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def rank(scores: jax.Array, excluded: jax.Array | None = None) -> jax.Array:
    """Column order of every row of `scores` [N, n]: numbers by value descending, then NaN, then
    `excluded` entries; ties in ascending column order (lax.sort treats -0.0 as +0.0)."""
    scores = jax.lax.stop_gradient(scores)
    tier = jnp.isnan(scores).astype(jnp.int8)
    if excluded is not None:
        tier = jnp.where(excluded, jnp.int8(2), tier)
    value = jnp.where(tier == 0, scores, -jnp.inf)
    columns = jnp.broadcast_to(jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape)
    return jax.lax.sort((tier, -value, columns), dimension=scores.ndim - 1, num_keys=3)[2]


def _activation(x: jax.Array, score_function: str) -> jax.Array:
    if score_function == "sigmoid":
        return jax.nn.sigmoid(x)
    # softplus(x) = x past 20 (PyTorch's threshold); the inner where keeps exp finite for a NaN-free grad.
    softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.where(x > 20.0, 0.0, x))))
    return jnp.sqrt(softplus)


def _mask_from(indices: jax.Array, shape: tuple[int, int]) -> jax.Array:
    rows = jnp.arange(shape[0])[:, None]
    return jnp.zeros(shape, dtype=bool).at[rows, indices].set(True)


def _group_excluded(
    select: jax.Array, topk: int, num_groups: int, group_topk: int, group_score: str
) -> jax.Array:
    """[T, E] True for experts outside each token's group_topk best groups (group score: the sum of the
    group's top `group_score_count` selection scores, added in descending order)."""
    num_tokens, num_experts = select.shape
    size = num_experts // num_groups
    grouped = select.reshape(num_tokens * num_groups, size)
    per_group = group_score_count(group_score, topk, group_topk)
    best = jnp.take_along_axis(grouped, rank(grouped)[:, :per_group], axis=-1)
    best = best.reshape(num_tokens, num_groups, per_group)
    group_score = best[..., 0]
    for i in range(1, per_group):
        group_score = group_score + best[..., i]
    chosen = _mask_from(rank(group_score)[:, :group_topk], (num_tokens, num_groups))
    return ~jnp.repeat(chosen, size, axis=-1)


def replayed_selection(routing_indices: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(routing_map [T, E] bool, kept ids [T, K] int32) of given expert ids [T, K]: a slot keeps its id when
    it lies in [0, E) and no earlier slot of its row holds the same id; other slots select nothing (-1)."""
    ids = routing_indices
    num_slots = ids.shape[-1]
    earlier = jnp.tril(jnp.ones((num_slots, num_slots), dtype=bool), -1)
    repeated = ((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)
    kept = (ids >= 0) & (ids < num_experts) & ~repeated
    # Slots that select nothing write the extra column E, which is dropped.
    columns = jnp.where(kept, ids, num_experts)
    routing_map = _mask_from(columns, (ids.shape[0], num_experts + 1))[:, :num_experts]
    return routing_map, jnp.where(kept, ids, -1).astype(jnp.int32)


def weights_from_map(
    logits: jax.Array,
    routing_map: jax.Array,
    topk: int,
    use_pre_softmax: bool,
    scaling_factor: float,
    score_function: str,
    normalize_topk: bool | None = None,
) -> jax.Array:
    """Differentiable probs [T, E] (logits dtype) of the experts a routing map selects."""
    x = logits.astype(_compute_dtype(logits.dtype))
    if score_function == "softmax" and not use_pre_softmax:
        weights = jax.nn.softmax(jnp.where(routing_map, x, -jnp.inf), axis=-1)
        weights = jnp.where(routing_map, weights, 0.0)
    else:
        score = jax.nn.softmax(x, axis=-1) if score_function == "softmax" else _activation(x, score_function)
        weights = jnp.where(routing_map, score, 0.0)
        if normalizes_topk(score_function, use_pre_softmax, topk, normalize_topk):
            weights = jnp.where(routing_map, weights / (weights.sum(-1, keepdims=True) + EPSILON), 0.0)
    return (weights * scaling_factor).astype(logits.dtype)


def _selection(
    logits: jax.Array,
    expert_bias: jax.Array | None,
    topk: int,
    num_groups: int,
    group_topk: int,
    use_pre_softmax: bool,
    score_function: str,
    group_score: str,
) -> tuple[jax.Array, jax.Array]:
    """(routing_map [T, E] bool, indices [T, K] by rank) the router chooses for [T, E] logits."""
    x = logits.astype(_compute_dtype(logits.dtype))
    if score_function == "softmax":
        select = jax.nn.softmax(x, axis=-1) if use_pre_softmax else x
    else:
        select = _activation(x, score_function)
    if expert_bias is not None:
        select = select + expert_bias.astype(select.dtype)
    excluded = _group_excluded(select, topk, num_groups, group_topk, group_score) if group_topk else None
    indices = rank(select, excluded)[:, :topk]
    return _mask_from(indices, logits.shape), indices


def topk_forward(
    logits: jax.Array,
    expert_bias: jax.Array | None,
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
    routing_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router top-k on [T, E] logits: (probs, routing_map, indices [T, K] or [T, 0] int32).
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
    return probs, routing_map, indices[:, : topk if return_indices else 0].astype(jnp.int32)


def topk_backward(
    grad_probs: jax.Array,
    logits: jax.Array,
    routing_map: jax.Array,
    topk: int,
    use_pre_softmax: bool,
    scaling_factor: float,
    score_function: str,
    routing_map_format: str = "bytemap",
    normalize_topk: bool | None = None,
) -> jax.Array:
    """grad_logits [T, E] by differentiating weights_from_map (the map unpacked first when it is a
    "bitmap")."""
    if routing_map_format == "bitmap":
        routing_map = unpack_bitmap(routing_map, logits.shape[1])
    _, vjp = jax.vjp(
        lambda x: weights_from_map(
            x, routing_map, topk, use_pre_softmax, scaling_factor, score_function, normalize_topk
        ),
        logits,
    )
    return vjp(grad_probs.astype(logits.dtype))[0]


def aux_scores(logits: jax.Array, score_function: str) -> jax.Array:
    """Differentiable aux-loss scores [..., E] in fp32 (fp64 for fp64 logits)."""
    x = logits.astype(_compute_dtype(logits.dtype))
    if score_function == "softmax":
        return jax.nn.softmax(x, axis=-1)
    act = _activation(x, score_function)
    return act / (act.sum(-1, keepdims=True) + EPSILON)


def aux_scores_forward(
    logits: jax.Array, topk: int, score_function: str, routing_map_format: str = "bytemap"
) -> tuple[jax.Array, jax.Array]:
    """Aux-loss scores of [T, E] logits: (routing_map (bool, or packed: "bitmap"), scores fp32)."""
    scores = aux_scores(logits, score_function).astype(jnp.float32)
    routing_map = _mask_from(rank(scores)[:, :topk], logits.shape)
    return pack_bitmap(routing_map) if routing_map_format == "bitmap" else routing_map, scores


def aux_scores_backward(grad_scores: jax.Array, logits: jax.Array, score_function: str) -> jax.Array:
    """grad_logits by differentiating aux_scores."""
    _, vjp = jax.vjp(lambda x: aux_scores(x, score_function).astype(jnp.float32), logits)
    return vjp(grad_scores.astype(jnp.float32))[0]


def aux_loss(
    probs: jax.Array,
    tokens_per_expert: jax.Array,
    total_num_tokens: int | jax.Array,
    num_experts: int,
    topk: int,
    coeff: float,
) -> jax.Array:
    """0-dim fp32 loss (fp64 for fp64 probs): C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c],
    C = num_experts * coeff / (topk * total_num_tokens^2); 0 (and a zero gradient) for a total below 1."""
    dtype = _compute_dtype(probs.dtype)
    total = jnp.asarray(total_num_tokens).astype(dtype)
    no_tokens = total < 1
    total = jnp.where(no_tokens, 1, total)  # the other branch's gradient must stay finite
    column_sums = probs.astype(dtype).sum(0)
    loss = (
        (column_sums * tokens_per_expert.astype(dtype)).sum() * (num_experts * coeff / topk) / (total * total)
    )
    return jnp.where(no_tokens, 0, loss).astype(dtype)


def aux_loss_backward(
    grad_loss: jax.Array,
    num_rows: int,
    probs_dtype,
    tokens_per_expert: jax.Array,
    total_num_tokens: int | jax.Array,
    num_experts: int,
    topk: int,
    coeff: float,
) -> jax.Array:
    """grad_probs [R, C] in probs_dtype by differentiating aux_loss."""
    zeros = jnp.zeros((num_rows, tokens_per_expert.shape[0]), probs_dtype)
    _, vjp = jax.vjp(
        lambda p: aux_loss(p, tokens_per_expert, total_num_tokens, num_experts, topk, coeff), zeros
    )
    return vjp(grad_loss.astype(_compute_dtype(probs_dtype)))[0]


# Public-API mirrors (what tests differentiate and benchmarks time) ------------------------------------------


def fused_topk_with_score_function(
    logits: jax.Array,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: jax.Array | None = None,
    routing_map_format: str = "bytemap",
    *,
    return_indices: bool = False,
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    routing_indices: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Reference of moetriton.jax.router.fused_topk_with_score_function (differentiable in logits;
    routing_map_format "bytemap" or "bitmap"; `routing_indices` [..., K] replays a selection)."""
    num_experts = logits.shape[-1]
    flat = logits.reshape(-1, num_experts)
    use_pre_softmax = use_pre_softmax and score_function == "softmax"
    scale = 1.0 if scaling_factor is None else scaling_factor
    _, routing_map, indices = topk_forward(
        jax.lax.stop_gradient(flat),
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
    logits: jax.Array, topk: int, score_function: str = "softmax", routing_map_format: str = "bytemap"
) -> tuple[jax.Array, jax.Array]:
    """Reference of moetriton.jax.router.fused_compute_score_for_moe_aux_loss: (routing_map, scores)."""
    num_experts = logits.shape[-1]
    routing_map, _ = aux_scores_forward(
        jax.lax.stop_gradient(logits.reshape(-1, num_experts)), topk, score_function, routing_map_format
    )
    map_shape = (*logits.shape[:-1], routing_map.shape[-1])
    return routing_map.reshape(map_shape), aux_scores(logits, score_function).astype(jnp.float32)


def fused_moe_aux_loss(
    probs: jax.Array,
    tokens_per_expert: jax.Array,
    total_num_tokens: int | jax.Array,
    num_experts: int,
    topk: int,
    coeff: float,
) -> jax.Array:
    """Reference of moetriton.jax.router.fused_moe_aux_loss (0-dim, probs.dtype)."""
    return aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff).astype(probs.dtype)
