"""The fused top-k router (fused_topk_with_score_function): forward and backward kernels and plans."""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ..rules.router import group_score_count, normalizes_topk
from ..runtime.plan import (
    DEFAULT_DEVICE,
    Buffer,
    DeviceInfo,
    Plan,
    SearchSpace,
    Sizes,
    cached,
    next_pow2,
    sized_by,
)
from .bitmap import routing_map_buffer
from .scores import (
    _INT64_MAX,
    _INT64_MIN,
    _TILE_PARAMS,
    _activation,
    _activation_grad,
    _key_score,
    _kth_key,
    _logits_tile,
    _order_keys,
    _rows_plan,
    _softmax_rows,
    grad_logits_outputs,
)


@triton.jit
def _ranked_columns(keys, K: tl.constexpr, K_POW2: tl.constexpr, WIDTH: tl.constexpr):
    """(K-th largest key, [BLOCK_T, K_POW2] columns of the K largest keys in rank order)."""
    kth = tl.full([keys.shape[0]], _INT64_MAX, tl.int64)
    ranks = tl.arange(0, K_POW2)
    columns = tl.zeros([keys.shape[0], K_POW2], tl.int32)
    for k in range(K):
        kth = tl.max(tl.where(keys < kth[:, None], keys, _INT64_MIN), axis=1)
        column = WIDTH - kth.to(tl.int32)  # the low word: int64 -> int32 keeps it
        columns = tl.where(ranks[None, :] == k, column[:, None], columns)
    return kth, columns


@triton.jit
def _keep_best_groups(
    keys,
    BLOCK_T: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    PER_GROUP: tl.constexpr,
    GROUP_TOPK: tl.constexpr,
):
    """Group-limited selection: keys of experts outside the GROUP_TOPK best groups become the minimum.

    A group's score is the sum of its PER_GROUP largest scores, added in descending order.
    """
    keys3 = tl.reshape(keys, [BLOCK_T, GROUPS_POW2, GROUP_POW2])
    group_score = tl.zeros([BLOCK_T, GROUPS_POW2], tl.float32)
    kth = tl.full([BLOCK_T, GROUPS_POW2], _INT64_MAX, tl.int64)
    for _ in range(PER_GROUP):
        kth = tl.max(tl.where(keys3 < kth[:, :, None], keys3, _INT64_MIN), axis=2)
        group_score += _key_score(kth)
    groups = tl.arange(0, GROUPS_POW2)
    group_keys = _order_keys(group_score, groups[None, :], GROUPS_POW2)
    group_keys = tl.where(groups[None, :] < NUM_GROUPS, group_keys, _INT64_MIN)
    chosen = group_keys >= _kth_key(group_keys, GROUP_TOPK)[:, None]
    kept = tl.where(chosen[:, :, None], keys3, _INT64_MIN)
    return tl.reshape(kept, [BLOCK_T, GROUPS_POW2 * GROUP_POW2])


@triton.jit
def _replayed_selection(
    ids_ptr,
    indices_ptr,
    rows,
    row_ok,
    experts,
    valid,
    NUM_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    RETURN_INDICES: tl.constexpr,
):
    """The selection, a bool tile shaped like `valid` [BLOCK_T, WIDTH] whose columns hold `experts`, of the
    given expert ids [T, K] of tokens `rows`; with RETURN_INDICES the kept ids are stored as indices [T, K]
    int32.

    Slot k of a token keeps its id when the id lies in [0, E) and no earlier slot of the token holds it;
    otherwise the slot selects nothing (and lists -1 among the stored indices). Ids are checked in their own
    dtype, before the narrowing to int32, and only compared with columns, never used as addresses.
    """
    ranks = tl.arange(0, TOPK_POW2)
    slot_ok = row_ok[:, None] & (ranks[None, :] < TOPK)
    slot_offsets = rows.to(tl.int64)[:, None] * TOPK + ranks[None, :]
    ids = tl.load(ids_ptr + slot_offsets, mask=slot_ok, other=-1)
    kept = tl.full([rows.shape[0], TOPK_POW2], -1, tl.int32)
    selected = tl.zeros(valid.shape, tl.int1)
    for k in range(TOPK):
        at_k = ranks[None, :] == k
        # Column k of the ids: one nonzero term per row, so the sum is exact in the ids' dtype.
        id_k = tl.sum(tl.where(at_k, ids, 0), axis=1)
        copies = tl.sum(tl.where((ranks[None, :] < k) & (ids == id_k[:, None]), 1, 0), axis=1)
        keep = (id_k >= 0) & (id_k < NUM_EXPERTS) & (copies == 0)
        kept = tl.where(at_k & keep[:, None], id_k.to(tl.int32)[:, None], kept)
        selected = selected | (keep[:, None] & (experts[None, :] == id_k[:, None]))
    if RETURN_INDICES:
        tl.store(indices_ptr + slot_offsets, kept, mask=slot_ok)
    return valid & selected


@triton.jit
def _topk_forward_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] (HAS_BIAS)
    routing_indices_ptr,  # [T, K] int32 or int64 (REPLAY)
    num_tokens,
    probs_ptr,  # [T, E] logits dtype
    routing_map_ptr,  # [T, E] bool
    indices_ptr,  # [T, K] int32 (RETURN_INDICES)
    NUM_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    SCORE_FUNCTION: tl.constexpr,
    USE_PRE_SOFTMAX: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP_TOPK: tl.constexpr,
    SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RETURN_INDICES: tl.constexpr,
    NORMALIZE: tl.constexpr,
    PER_GROUP: tl.constexpr,
    REPLAY: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Fused top-k with score function. Grid (cdiv(T, BLOCK_T),): program b routes tokens
    [b*BLOCK_T, (b+1)*BLOCK_T): one coalesced [BLOCK_T, WIDTH] load of logits, scores and keys in
    registers, optional group pruning, K max-reductions for the top-k, then probs, routing map and
    (optionally) the ranked expert ids are stored. Ungrouped calls pass NUM_GROUPS = 1, GROUP_SIZE = E;
    WIDTH = GROUPS_POW2 * GROUP_POW2. A group scores the sum of its PER_GROUP best selection scores; NORMALIZE
    renormalises the K selected weights of every path but the softmax after the top-k (normalised anyway).
    REPLAY takes the selection from routing_indices instead (`_replayed_selection`; groups only lay the tile
    out, the bias is not read) and computes the weights of that selection as above.
    """
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, WIDTH)
    if GROUPS_POW2 == 1:
        # One group: column == expert, so loads and stores are plainly contiguous.
        experts = cols
        col_ok = cols < NUM_EXPERTS
    else:
        experts = (cols // GROUP_POW2) * GROUP_SIZE + cols % GROUP_POW2
        col_ok = (cols // GROUP_POW2 < NUM_GROUPS) & (cols % GROUP_POW2 < GROUP_SIZE)
    valid = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * NUM_EXPERTS + experts[None, :]
    x = tl.load(logits_ptr + offsets, mask=valid, other=0.0).to(tl.float32)

    if REPLAY:
        selected = _replayed_selection(
            routing_indices_ptr,
            indices_ptr,
            rows,
            row_ok,
            experts,
            valid,
            NUM_EXPERTS,
            TOPK,
            TOPK_POW2,
            RETURN_INDICES,
        )
        if SCORE_FUNCTION == 0:
            if USE_PRE_SOFTMAX:
                score = _softmax_rows(x, valid)
        else:
            score = _activation(x, SCORE_FUNCTION)
    else:
        if SCORE_FUNCTION == 0:
            if USE_PRE_SOFTMAX:
                score = _softmax_rows(x, valid)
                select = score
            else:
                select = x
        else:
            score = _activation(x, SCORE_FUNCTION)
            select = score
        if HAS_BIAS:
            bias = tl.load(bias_ptr + experts, mask=col_ok, other=0.0).to(tl.float32)
            select = score + bias[None, :]

        keys = tl.where(valid, _order_keys(select, cols[None, :], WIDTH), _INT64_MIN)
        if GROUP_TOPK > 0:
            keys = _keep_best_groups(
                keys, BLOCK_T, NUM_GROUPS, GROUPS_POW2, GROUP_POW2, PER_GROUP, GROUP_TOPK
            )
        if RETURN_INDICES:
            kth, ranked = _ranked_columns(keys, TOPK, TOPK_POW2, WIDTH)
            ranks = tl.arange(0, TOPK_POW2)
            if GROUPS_POW2 == 1:
                ranked_experts = ranked
            else:
                ranked_experts = (ranked // GROUP_POW2) * GROUP_SIZE + ranked % GROUP_POW2
            tl.store(
                indices_ptr + rows.to(tl.int64)[:, None] * TOPK + ranks[None, :],
                ranked_experts,
                mask=row_ok[:, None] & (ranks[None, :] < TOPK),
            )
        else:
            kth = _kth_key(keys, TOPK)
        selected = valid & (keys >= kth[:, None])

    if SCORE_FUNCTION == 0 and not USE_PRE_SOFTMAX:
        weights = tl.where(selected, _softmax_rows(x, selected), 0.0)
    else:
        weights = tl.where(selected, score, 0.0)
        if NORMALIZE:
            # The outer where keeps unselected probs exactly 0 when a selected score is NaN.
            weights = tl.where(selected, weights / (tl.sum(weights, axis=1)[:, None] + 1e-20), 0.0)
    probs = weights * SCALE
    tl.store(probs_ptr + offsets, probs.to(probs_ptr.dtype.element_ty), mask=valid)
    tl.store(routing_map_ptr + offsets, selected, mask=valid)


@triton.jit
def _topk_backward_kernel(
    grad_probs_ptr,  # [T, E]
    logits_ptr,  # [T, E]
    routing_map_ptr,  # [T, E] bool
    num_tokens,
    grad_logits_ptr,  # [T, E] logits dtype
    NUM_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    SCORE_FUNCTION: tl.constexpr,
    USE_PRE_SOFTMAX: tl.constexpr,
    SCALE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
):
    """Backward of the fused top-k. Grid (cdiv(T, BLOCK_T),): program b recomputes the scores of tokens
    [b*BLOCK_T, (b+1)*BLOCK_T) from their logits and routing map and writes grad_logits. With
    g = grad_probs * scaling_factor and r the routing map:
      softmax post: y = softmax(x[r]); dx = r * y * (g - sum_r g y)
      otherwise a is the score (softmax over all E, or the elementwise sigmoid / sqrtsoftplus) and
      ga = r * (g / S - sum_r(g a) / S^2), S = sum_r a + 1e-20, with NORMALIZE, else ga = r * g; then
      dx = a * (ga - sum ga a) for the softmax, dx = ga * da/dx elementwise otherwise. The expert bias
      only moves the selection, so it gets no gradient.
    """
    _, valid, offsets, x = _logits_tile(logits_ptr, num_tokens, NUM_EXPERTS, BLOCK_T, EXPERTS_POW2)
    grad = tl.load(grad_probs_ptr + offsets, mask=valid, other=0.0).to(tl.float32) * SCALE
    routed = valid & (tl.load(routing_map_ptr + offsets, mask=valid, other=0) != 0)

    if SCORE_FUNCTION == 0 and not USE_PRE_SOFTMAX:
        y = _softmax_rows(x, routed)
        dot = tl.sum(tl.where(routed, grad * y, 0.0), axis=1)
        dx = tl.where(routed, y * (grad - dot[:, None]), 0.0)
    else:
        score = _softmax_rows(x, valid) if SCORE_FUNCTION == 0 else _activation(x, SCORE_FUNCTION)
        if NORMALIZE:
            total = tl.sum(tl.where(routed, score, 0.0), axis=1)[:, None] + 1e-20
            dot = tl.sum(tl.where(routed, grad * score, 0.0), axis=1)[:, None]
            grad_score = tl.where(routed, grad / total - dot / (total * total), 0.0)
        else:
            grad_score = tl.where(routed, grad, 0.0)
        if SCORE_FUNCTION == 0:
            dot = tl.sum(tl.where(valid, grad_score * score, 0.0), axis=1)
            dx = tl.where(valid, score * (grad_score - dot[:, None]), 0.0)
        else:
            dx = tl.where(routed, grad_score * _activation_grad(x, score, SCORE_FUNCTION), 0.0)
    tl.store(grad_logits_ptr + offsets, dx.to(grad_logits_ptr.dtype.element_ty), mask=valid)


TOPK_SPACE = SearchSpace("router_topk", _TILE_PARAMS)


TOPK_BACKWARD_SPACE = SearchSpace("router_topk_backward", _TILE_PARAMS)


def _group_layout(num_experts: int, num_groups: int) -> tuple[int, int, int, int]:
    """(groups, group size, groups_pow2, group size pow2); one group of E experts when ungrouped."""
    groups = num_groups or 1
    size = num_experts // groups
    return groups, size, next_pow2(groups), next_pow2(size)


# Output buffers: shape arithmetic only, so that fake (meta) implementations can call these with symbolic
# sizes; the plans below add their launches (and internal buffers) on top.


def topk_outputs(
    num_tokens, num_experts, topk, return_indices: bool, routing_map_format: str = "bytemap"
) -> dict[str, Buffer]:
    """probs [T, E] (logits dtype), routing_map (`routing_map_buffer`), indices [T, K] int32 ([T, 0] if not
    asked)."""
    return {
        "probs": Buffer((num_tokens, num_experts), "like:logits"),
        "routing_map": routing_map_buffer(num_tokens, num_experts, routing_map_format),
        "indices": (
            Buffer((num_tokens, topk), "int32") if return_indices else Buffer.absent("int32", (num_tokens, 0))
        ),
    }


@sized_by(
    Sizes(
        axes=dict(num_tokens=("logits", 0), num_experts=("logits", 1)),
        present=dict(has_bias="bias", replay="routing_indices"),
    )
)
@cached
def topk_plan(
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int,
    group_topk: int,
    scaling_factor: float,
    has_bias: bool,
    return_indices: bool,
    routing_map_format: str = "bytemap",
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    replay: bool = False,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """fused_topk_with_score_function forward. num_groups = group_topk = 0: no groups. `normalize_topk` and
    `group_score`: as moetriton.kernels.rules.router.normalizes_topk and group_score_count read them.
    `replay`: the selection is the "routing_indices" input's. Groups and bias then change no result: the
    launch keeps the groups' tile layout and the call's grid and warps; compiled, the REPLAY variant is a
    kernel of its own, whose fp32 sums of the weights Triton may order otherwise (docs/router.md).

    Inputs: "logits" [T, E], "bias" [E] or None, "routing_indices" [T, K] int32 or int64 (expert ids; an id
    outside [0, E), or a repeat of an earlier slot's id, selects nothing) or None. Results: probs [T, E]
    (logits dtype), routing_map (bool [T, E], or with routing_map_format "bitmap" uint8 [T, ceil(E / 8)],
    packed from a bool scratch map by a second launch), indices [T, K] int32 ([T, 0] unless
    `return_indices`): the selected experts by rank, or with `replay` the given ids, -1 in the slots that
    select nothing.
    """
    if replay:
        group_topk, has_bias = 0, False
    groups, size, groups_pow2, size_pow2 = _group_layout(num_experts, num_groups)
    return _rows_plan(
        _topk_forward_kernel,
        TOPK_SPACE,
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        width=groups_pow2 * size_pow2,
        inputs=("logits", "bias", "routing_indices"),
        buffers=topk_outputs(num_tokens, num_experts, topk, return_indices, routing_map_format),
        constexprs=dict(
            TOPK_POW2=next_pow2(topk),
            USE_PRE_SOFTMAX=use_pre_softmax,
            NUM_GROUPS=groups,
            GROUP_SIZE=size,
            GROUPS_POW2=groups_pow2,
            GROUP_POW2=size_pow2,
            WIDTH=groups_pow2 * size_pow2,
            GROUP_TOPK=group_topk,
            SCALE=scaling_factor,
            HAS_BIAS=has_bias,
            RETURN_INDICES=return_indices,
            NORMALIZE=normalizes_topk(score_function, use_pre_softmax, topk, normalize_topk),
            PER_GROUP=group_score_count(group_score, topk, group_topk) if group_topk else 0,
            REPLAY=replay,
        ),
        routing_map_format=routing_map_format,
        device=device,
        config=config,
    )


@sized_by(Sizes(axes=dict(num_tokens=("logits", 0), num_experts=("logits", 1))))
@cached
def topk_backward_plan(
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    scaling_factor: float,
    routing_map_format: str = "bytemap",
    normalize_topk: bool | None = None,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Backward of the fused top-k. Inputs: "grad_probs" [T, E], "logits" [T, E], "routing_map" (the
    forward's: bool [T, E], or with routing_map_format "bitmap" uint8 [T, ceil(E / 8)], unpacked into a bool
    scratch map by a first launch). Result: grad_logits [T, E] in the logits dtype. `normalize_topk`: as in
    `topk_plan`."""
    return _rows_plan(
        _topk_backward_kernel,
        TOPK_BACKWARD_SPACE,
        inputs=("grad_probs", "logits", "routing_map"),
        buffers=grad_logits_outputs(num_tokens, num_experts),
        constexprs=dict(
            USE_PRE_SOFTMAX=use_pre_softmax,
            SCALE=scaling_factor,
            NORMALIZE=normalizes_topk(score_function, use_pre_softmax, topk, normalize_topk),
        ),
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        routing_map_format=routing_map_format,
        device=device,
        config=config,
    )
