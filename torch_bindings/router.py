"""PyTorch router: fused top-k with score functions, aux-loss scores and the aux loss.

Each op is a moetriton::router_* torch.library custom op whose fake implementation comes from the same
launch plan as the real one, with autograd registered on the forward ops (the backward ops are custom ops
too), so torch.compile(fullgraph=True) traces through them. Nothing reads device values: the ops are
CUDA-graph safe, and `total_num_tokens` may be a 0-dim device tensor. Tensors of any memory layout are
accepted: the plan executor (moetriton.torch.executor) makes them contiguous where the kernels need it. On
CUDA the Triton kernels run compiled; on CPU they run under the Triton interpreter when TRITON_INTERPRET=1
was set before import, and otherwise `moetriton.torch.reference_router` runs instead. Semantics:
moetriton.kernels.router and docs/router.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules import router as rules

from . import reference_router as reference
from ._checks import Signature, describe, memoised, same_device, signature
from ._op import Op, PlanBinding, trailing
from .executor import dtype_name


@memoised
def _check_topk(
    *,
    logits: Signature,
    expert_bias: Signature | None,
    routing_indices: Signature | None,
    return_indices,
    **options,
) -> rules.TopkConfig:
    config = rules.check_topk(
        logits=describe(logits),
        expert_bias=describe(expert_bias),
        routing_indices=describe(routing_indices),
        **options,
    )
    if not isinstance(return_indices, bool):
        raise TypeError(f"return_indices: expected a bool, got {type(return_indices).__name__}")
    same_device(logits=logits, expert_bias=expert_bias, routing_indices=routing_indices)
    return config


@memoised
def _check_aux_scores(
    *, logits: Signature, topk, score_function, routing_map_format
) -> tuple[int, int, int, str, str]:
    return rules.check_aux_scores(
        logits=describe(logits),
        topk=topk,
        score_function=score_function,
        routing_map_format=routing_map_format,
    )


@memoised
def _check_aux_loss(
    *, probs: Signature, tokens_per_expert: Signature, total_num_tokens, num_experts, topk, coeff
) -> rules.AuxLossConfig:
    total_is_tensor = isinstance(total_num_tokens, tuple)
    config = rules.check_aux_loss(
        probs=describe(probs),
        tokens_per_expert=describe(tokens_per_expert),
        total_num_tokens=describe(total_num_tokens) if total_is_tensor else total_num_tokens,
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
    )
    same_device(
        probs=probs,
        tokens_per_expert=tokens_per_expert,
        total_num_tokens=total_num_tokens if total_is_tensor else None,
    )
    return config


# top-k -----------------------------------------------------------------------------------------------------
# Op bodies collect their non-tensor arguments as `options`, in the order the plan builders and the
# reference functions take them. Fakes allocate the plans' output buffers only (`outputs`), which accept
# symbolic sizes (torch.compile with dynamic shapes).


_TOPK = PlanBinding(
    kernels.topk_plan,
    lambda logits, expert_bias, routing_indices, *options: dict(
        logits=logits, bias=expert_bias, routing_indices=routing_indices
    ),
    trailing(*rules.TOPK_OPTIONS),
    lambda logits, expert_bias, routing_indices, *options: reference.topk_forward(
        logits, expert_bias, *options, routing_indices=routing_indices
    ),
    outputs=lambda sizes: kernels.topk_outputs(
        sizes["num_tokens"],
        sizes["num_experts"],
        sizes["topk"],
        sizes["return_indices"],
        sizes["routing_map_format"],
    ),
)


def _router_topk(
    logits: Tensor,
    expert_bias: Tensor | None,
    routing_indices: Tensor | None,
    topk: int,
    use_pre_softmax: bool,
    num_groups: int,
    group_topk: int,
    scaling_factor: float,
    score_function: str,
    return_indices: bool,
    routing_map_format: str,
    normalize_topk: bool | None,
    group_score: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(probs [T, E], routing_map (bool [T, E], or uint8 [T, ceil(E / 8)] for "bitmap"), indices [T, K]
    int32 or [T, 0]) of [T, E] logits; num_groups = group_topk = 0: no groups; normalize_topk None: TE's
    rule (moetriton.kernels.rules.router.normalizes_topk); routing_indices [T, K] int32/int64 or None: the
    selection to replay (ids outside [0, E) and repeats select nothing)."""
    options = (topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, return_indices)
    return _TOPK.run(
        logits, expert_bias, routing_indices, *options, routing_map_format, normalize_topk, group_score
    )


def _topk_setup(ctx, inputs, output):
    logits, _, _, topk, use_pre_softmax, _, _, scaling_factor, score_function, _, map_format, normalize, _ = (
        inputs
    )
    ctx.options = (topk, use_pre_softmax, scaling_factor, score_function, map_format, normalize)
    ctx.save_for_backward(logits, output[1])


def _topk_backward(ctx, grad_probs, grad_map, grad_indices):
    if grad_probs is None:
        return (None,) * 13
    logits, routing_map = ctx.saved_tensors
    grad_logits = ROUTER_TOPK_BACKWARD(grad_probs, logits, routing_map, *ctx.options)
    return grad_logits, *(None,) * 12


ROUTER_TOPK = Op("router_topk", _router_topk, _TOPK.fake, setup=_topk_setup, backward=_topk_backward)


def _grad_logits_outputs(sizes: dict) -> dict:
    return kernels.grad_logits_outputs(sizes["num_tokens"], sizes["num_experts"])


_TOPK_BACKWARD = PlanBinding(
    kernels.topk_backward_plan,
    lambda grad_probs, logits, routing_map, *options: dict(
        grad_probs=grad_probs, logits=logits, routing_map=routing_map
    ),
    trailing(*rules.TOPK_BACKWARD_OPTIONS),
    reference.topk_backward,
    outputs=_grad_logits_outputs,
    first=True,
)


def _router_topk_backward(
    grad_probs: Tensor,
    logits: Tensor,
    routing_map: Tensor,
    topk: int,
    use_pre_softmax: bool,
    scaling_factor: float,
    score_function: str,
    routing_map_format: str,
    normalize_topk: bool | None,
) -> Tensor:
    """grad_logits [T, E] (logits dtype), recomputing the scores from logits and the routing map (the
    forward's, bit-packed for "bitmap": unpacked into a bool scratch map first)."""
    return _TOPK_BACKWARD.run(
        grad_probs,
        logits,
        routing_map,
        topk,
        use_pre_softmax,
        scaling_factor,
        score_function,
        routing_map_format,
        normalize_topk,
    )


ROUTER_TOPK_BACKWARD = Op("router_topk_backward", _router_topk_backward, _TOPK_BACKWARD.fake)

# aux-loss scores -------------------------------------------------------------------------------------------

_AUX_SCORES = PlanBinding(
    kernels.aux_scores_plan,
    lambda logits, *options: dict(logits=logits),
    trailing(*rules.AUX_SCORES_OPTIONS),
    reference.aux_scores_forward,
    outputs=lambda sizes: kernels.aux_scores_outputs(
        sizes["num_tokens"], sizes["num_experts"], sizes["routing_map_format"]
    ),
)


def _router_aux_scores(
    logits: Tensor, topk: int, score_function: str, routing_map_format: str
) -> tuple[Tensor, Tensor]:
    """(routing_map (bool [T, E], or uint8 [T, ceil(E / 8)] for "bitmap"), scores [T, E] fp32) of [T, E]
    logits."""
    return _AUX_SCORES.run(logits, topk, score_function, routing_map_format)


def _scores_setup(ctx, inputs, output):
    logits, _, score_function, _ = inputs
    ctx.score_function = score_function
    ctx.save_for_backward(logits)


def _scores_backward(ctx, grad_map, grad_scores):
    if grad_scores is None:
        return None, None, None, None
    (logits,) = ctx.saved_tensors
    return ROUTER_AUX_SCORES_BACKWARD(grad_scores, logits, ctx.score_function), None, None, None


ROUTER_AUX_SCORES = Op(
    "router_aux_scores", _router_aux_scores, _AUX_SCORES.fake, setup=_scores_setup, backward=_scores_backward
)

_AUX_SCORES_BACKWARD = PlanBinding(
    kernels.aux_scores_backward_plan,
    lambda grad_scores, logits, score_function: dict(grad_scores=grad_scores, logits=logits),
    trailing("score_function"),
    reference.aux_scores_backward,
    outputs=_grad_logits_outputs,
    first=True,
)


def _router_aux_scores_backward(grad_scores: Tensor, logits: Tensor, score_function: str) -> Tensor:
    """grad_logits [T, E] (logits dtype) of the aux-loss scores."""
    return _AUX_SCORES_BACKWARD.run(grad_scores, logits, score_function)


ROUTER_AUX_SCORES_BACKWARD = Op(
    "router_aux_scores_backward", _router_aux_scores_backward, _AUX_SCORES_BACKWARD.fake
)

# aux loss --------------------------------------------------------------------------------------------------
# The token total is a 0-dim tensor `total`, or the int `total_int` when `total` is None (the plan then
# bakes it in).

_AUX_LOSS = PlanBinding(
    kernels.aux_loss_plan,
    lambda probs, tokens_per_expert, total, *options: dict(
        probs=probs, counts=tokens_per_expert, total=total
    ),
    lambda probs, tokens_per_expert, total, total_int, num_experts, topk, coeff: dict(
        num_experts=num_experts, topk=topk, coeff=coeff, total=None if total is not None else total_int
    ),
    lambda probs, tokens_per_expert, total, total_int, *options: reference.aux_loss(
        probs, tokens_per_expert, total_int if total is None else total, *options
    ),
    outputs=lambda sizes: kernels.aux_loss_outputs(),
    first=True,
)


def _router_aux_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total: Tensor | None,
    total_int: int,
    num_experts: int,
    topk: int,
    coeff: float,
) -> Tensor:
    """0-dim aux loss in probs.dtype."""
    return _AUX_LOSS.run(probs, tokens_per_expert, total, total_int, num_experts, topk, coeff)


def _loss_setup(ctx, inputs, output):
    probs, tokens_per_expert, total, total_int, num_experts, topk, coeff = inputs
    ctx.options = (probs.shape[0], probs.shape[1], probs.dtype, total_int, num_experts, topk, coeff)
    ctx.save_for_backward(tokens_per_expert, total)


def _loss_backward(ctx, grad_loss):
    if grad_loss is None:
        return (None,) * 7
    tokens_per_expert, total = ctx.saved_tensors
    grad_probs = ROUTER_AUX_LOSS_BACKWARD(grad_loss, tokens_per_expert, total, *ctx.options)
    return grad_probs, None, None, None, None, None, None


ROUTER_AUX_LOSS = Op(
    "router_aux_loss", _router_aux_loss, _AUX_LOSS.fake, setup=_loss_setup, backward=_loss_backward
)


_AUX_LOSS_BACKWARD = PlanBinding(
    kernels.aux_loss_backward_plan,
    lambda grad_loss, tokens_per_expert, total, *options: dict(
        grad_loss=grad_loss, counts=tokens_per_expert, total=total
    ),
    lambda grad_loss, tokens_per_expert, total, num_rows, num_cols, probs_dtype, total_int, *options: dict(
        trailing("num_experts", "topk", "coeff")(*options),
        num_rows=num_rows,
        num_cols=num_cols,
        total=None if total is not None else total_int,
        probs_dtype=dtype_name(probs_dtype),
    ),
    reference.aux_loss_backward,
    outputs=lambda sizes: kernels.aux_loss_backward_outputs(
        sizes["num_rows"], sizes["num_cols"], sizes["probs_dtype"]
    ),
    first=True,
)


def _router_aux_loss_backward(
    grad_loss: Tensor,
    tokens_per_expert: Tensor,
    total: Tensor | None,
    num_rows: int,
    num_cols: int,
    probs_dtype: torch.dtype,
    total_int: int,
    num_experts: int,
    topk: int,
    coeff: float,
) -> Tensor:
    """grad_probs [R, C] = C * tokens_per_expert[c] * grad_loss, in probs_dtype."""
    options = (num_rows, num_cols, probs_dtype, total_int, num_experts, topk, coeff)
    return _AUX_LOSS_BACKWARD.run(grad_loss, tokens_per_expert, total, *options)


ROUTER_AUX_LOSS_BACKWARD = Op("router_aux_loss_backward", _router_aux_loss_backward, _AUX_LOSS_BACKWARD.fake)

# Public API ------------------------------------------------------------------------------------------------


def fused_topk_with_score_function(
    logits: Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: Tensor | None = None,
    routing_map_format: str = "bytemap",
    *,
    return_indices: bool = False,
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    routing_indices: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Route every token to its top-k experts (fused score function, group limit, bias, scaling).

    Args:
        logits: [..., E] router logits, float32/bfloat16/float16; 1 <= E <= 8192. Leading dims are tokens.
        topk: K experts per token, 1 <= K <= E.
        use_pre_softmax: softmax only: softmax over all E before the top-k (probs are those softmax values),
            instead of a softmax over the K selected logits. Ignored for sigmoid / sqrtsoftplus (as TE).
        num_groups, group_topk: group-limited top-k (DeepSeek-V3): experts form num_groups equal groups,
            scored by `group_score`; experts are chosen only in the group_topk best groups. Both or neither.
        scaling_factor: multiplies the probs (None = 1.0), after any renormalisation.
        score_function: "softmax", "sigmoid" or "sqrtsoftplus" (sqrt(softplus(x))).
        expert_bias: [E] float bias added to the scores for selection only (the weights use the unbiased
            score; no gradient): with sigmoid / sqrtsoftplus, or softmax with use_pre_softmax=True (the
            softmax over all E is what it shifts; ERNIE-4.5). Not allowed with a softmax after the top-k.
        routing_map_format: "bytemap" (bool [..., E]) or "bitmap" (uint8 [..., ceil(E / 8)]: bit e % 8 of
            byte e // 8 set when the token routes to expert e, LSB first, unused high bits 0); TE's
            "bitmap_u8" and RoutingMapFormat members are accepted too. The bitmap is packed from the bool
            map after the float kernel and unpacked before the backward's, so probs and gradients are the
            bytemap's bit for bit. `token_dispatch(..., routing_map_format="bitmap", num_experts=E)` takes
            the bitmap directly.
        return_indices: also return the selected expert ids [..., K] int32 in rank order (best first),
            ready for `token_dispatch(..., indices=indices, num_experts=E)`.
        normalize_topk: renormalise the K selected weights, w / (sum w + 1e-20). None (TE's rule):
            sigmoid / sqrtsoftplus when K > 1, not the softmax over all E. True / False force it for
            sigmoid / sqrtsoftplus at any K and for use_pre_softmax=True (Qwen3-MoE's and DeepSeek-V3's
            norm_topk_prob). A softmax after the top-k sums to 1 already: False is refused there.
        group_score: how a group is scored: "topk_sum" (the sum of its top K / group_topk selection
            scores, TE), "top2_sum" (the sum of its top 2, DeepSeek-V3) or "max" (its best score,
            DeepSeek-V2's group_limited_greedy). Needs groups; the count must fit in a group.
        routing_indices: replay a selection: [..., K] int32/int64 expert ids (logits' leading dims, K =
            topk, the device of logits), e.g. the `indices` of an earlier call. The selection is these ids
            (groups and expert_bias do not change it); the weights are this call's, computed from `logits`
            as for any selection (score function, use_pre_softmax, normalize_topk, scaling_factor), with
            their gradient. An id outside [0, E), or one repeated in its row after its first slot, selects
            nothing (weight 0, not in the map; -1 in the returned indices). Ids are not read on the host.

    Returns:
        (probs [..., E] in logits.dtype, zero outside the selection; routing_map [..., E] bool, or
        [..., ceil(E / 8)] uint8) and, with `return_indices`, indices [..., K] int32 (with
        `routing_indices`: those ids, -1 where a slot selects nothing). Ties go to the lowest expert index;
        NaN scores rank below every number. Math is fp32. Differentiable in logits.

    Example:
        >>> logits = torch.tensor([[1.0, 3.0, 2.0, 3.0]])
        >>> probs, routing_map, indices = fused_topk_with_score_function(logits, 2, return_indices=True)
        >>> routing_map.tolist(), indices.tolist()
        ([[False, True, False, True]], [[1, 3]])
        >>> fused_topk_with_score_function(logits, 2, routing_map_format="bitmap")[1].tolist()
        [[10]]
        >>> replayed = fused_topk_with_score_function(logits, 2, routing_indices=indices, return_indices=True)
        >>> all(torch.equal(a, b) for a, b in zip(replayed, (probs, routing_map, indices)))
        True
        >>> fused_topk_with_score_function(logits, 2, routing_indices=torch.tensor([[0, 9]]))[1].tolist()
        [[True, False, False, False]]
    """
    config = _check_topk(
        logits=signature(logits),
        expert_bias=signature(expert_bias),
        routing_indices=signature(routing_indices),
        return_indices=return_indices,
        topk=topk,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        routing_map_format=routing_map_format,
        normalize_topk=normalize_topk,
        group_score=group_score,
    )
    shape = logits.shape
    if routing_indices is not None and routing_indices.dim() != 2:
        routing_indices = routing_indices.reshape(-1, config.topk)
    probs, routing_map, indices = ROUTER_TOPK(
        logits if logits.dim() == 2 else logits.reshape(-1, config.num_experts),
        expert_bias,
        routing_indices,
        config.topk,
        config.use_pre_softmax,
        config.num_groups,
        config.group_topk,
        config.scaling_factor,
        config.score_function,
        return_indices,
        config.routing_map_format,
        config.normalize_topk,
        config.group_score,
    )
    if len(shape) == 2:  # the common case needs no reshape back
        return (probs, routing_map, indices) if return_indices else (probs, routing_map)
    result = (probs.reshape(shape), routing_map.reshape(*shape[:-1], routing_map.shape[-1]))
    return (*result, indices.reshape(*shape[:-1], config.topk)) if return_indices else result


def fused_compute_score_for_moe_aux_loss(
    logits: Tensor, topk: int, score_function: str = "softmax", routing_map_format: str = "bytemap"
) -> tuple[Tensor, Tensor]:
    """Scores for the load-balancing loss and their top-k mask (no bias, groups or scaling).

    Args:
        logits: [..., E] float32/bfloat16/float16, 1 <= E <= 8192.
        topk: K, 1 <= K <= E.
        score_function: "softmax" (softmax over E), or "sigmoid" / "sqrtsoftplus", whose activations are
            always normalised over all E experts: a / (sum a + 1e-20).
        routing_map_format: "bytemap" (bool) or "bitmap" (uint8 [..., ceil(E / 8)], LSB first), as in
            fused_topk_with_score_function.

    Returns:
        (routing_map [..., E] bool, or [..., ceil(E / 8)] uint8: the top-K of the scores, ties to the lowest
        index; scores [..., E] float32). Differentiable in logits (through scores).

    Example:
        >>> routing_map, scores = fused_compute_score_for_moe_aux_loss(torch.zeros(1, 4), 2, "softmax")
        >>> routing_map.tolist(), scores.tolist()
        ([[True, True, False, False]], [[0.25, 0.25, 0.25, 0.25]])
    """
    _, num_experts, topk, score_function, routing_map_format = _check_aux_scores(
        logits=signature(logits),
        topk=topk,
        score_function=score_function,
        routing_map_format=routing_map_format,
    )
    flat = logits.reshape(-1, num_experts)
    routing_map, scores = ROUTER_AUX_SCORES(flat, topk, score_function, routing_map_format)
    return routing_map.reshape(*logits.shape[:-1], routing_map.shape[-1]), scores.reshape(logits.shape)


def fused_moe_aux_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: int | Tensor,
    num_experts: int,
    topk: int,
    coeff: float,
) -> Tensor:
    """Switch-style load-balancing loss, reduced deterministically (no atomics).

    loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c], C = num_experts * coeff /
    (topk * total_num_tokens^2).

    Args:
        probs: [R, C] float32/bfloat16/float16 scores (C a multiple of num_experts, e.g. [seq, batch * E]
            for a sequence-level loss).
        tokens_per_expert: [C] int32/int64/float counts.
        total_num_tokens: a Python int >= 1, or a 0-dim int32/int64/float32 tensor on probs' device
            (CUDA-graph safe: the coefficient is then computed on the device, and never read on the host).
            A tensor total below 1 means no tokens: the loss is exactly 0 and so is its gradient, on every
            device (a NaN total gives NaN).
        num_experts, topk: E and K (coefficient only); coeff: the loss weight (a Python float).

    Returns:
        0-dim tensor in probs.dtype, bitwise reproducible run to run. Differentiable in probs.

    Example:
        >>> probs = torch.full((4, 2), 0.5)
        >>> fused_moe_aux_loss(probs, torch.tensor([4, 4]), 4, num_experts=2, topk=1, coeff=1.0).item()
        2.0
    """
    total_is_tensor = isinstance(total_num_tokens, Tensor)
    config = _check_aux_loss(
        probs=signature(probs),
        tokens_per_expert=signature(tokens_per_expert),
        total_num_tokens=signature(total_num_tokens) if total_is_tensor else total_num_tokens,
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
    )
    return ROUTER_AUX_LOSS(
        probs,
        tokens_per_expert,
        total_num_tokens if total_is_tensor else None,
        config.total or 0,
        config.num_experts,
        config.topk,
        config.coeff,
    )
