"""PyTorch router: fused top-k with score functions, aux-loss scores and the aux loss.

Each op is a moetriton::router_* torch.library custom op whose fake implementation comes from the same
launch plan as the real one, with autograd registered on the forward ops (the backward ops are custom ops
too), so torch.compile(fullgraph=True) traces through them. Nothing reads device values: the ops are
CUDA-graph safe, and `total_num_tokens` may be a 0-dim device tensor. Tensors of any memory layout are
accepted: the plan executor (moetriton.torch._launch) makes them contiguous where the kernels need it. On
CUDA the Triton kernels run compiled; on CPU they run under the Triton interpreter when TRITON_INTERPRET=1
was set before import, and otherwise `moetriton.torch.reference_router` runs instead. Semantics:
moetriton.kernels.router and docs/router.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton.kernels import Plan
from moetriton.kernels import router as plans
from moetriton.kernels import router_validation as rules

from . import reference_router as reference
from ._launch import allocate, describe, device_info, dtype_name, run_plan, uses_kernels


def _fake(outputs: dict, inputs: dict[str, Tensor | None], device: torch.device) -> tuple[Tensor, ...]:
    """Fake (meta) results from a plan's output buffers, which allow symbolic sizes (dynamic shapes)."""
    buffers = allocate(Plan(outputs, (), tuple(outputs)), inputs, device, fake=True)
    return tuple(buffers.values())


def _check_devices(**tensors: Tensor | None) -> None:
    present = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = present[0]
    for name, tensor in present[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} (as {first_name}), got {tensor.device}")


# top-k -----------------------------------------------------------------------------------------------------
# Op bodies collect their non-tensor arguments as `options`, in the order the plan builders and the
# reference functions take them. Fake implementations allocate the plans' output buffers only, which
# accept symbolic sizes (torch.compile with dynamic shapes).


def _topk_plan(
    logits,
    expert_bias,
    topk,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    score_function,
    return_indices,
):
    return plans.topk_plan(
        num_tokens=logits.shape[0],
        num_experts=logits.shape[1],
        topk=topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        has_bias=expert_bias is not None,
        return_indices=return_indices,
        device=device_info(logits.device),
    )


@torch.library.custom_op("moetriton::router_topk", mutates_args=())
def router_topk(
    logits: Tensor,
    expert_bias: Tensor | None,
    topk: int,
    use_pre_softmax: bool,
    num_groups: int,
    group_topk: int,
    scaling_factor: float,
    score_function: str,
    return_indices: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(probs [T, E], routing_map [T, E] bool, indices [T, K] int32 or [T, 0]) of [T, E] logits;
    num_groups = group_topk = 0: no groups."""
    options = (topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, return_indices)
    if not uses_kernels(logits.device):
        return reference.topk_forward(logits, expert_bias, *options)
    plan = _topk_plan(logits, expert_bias, *options)
    return run_plan(plan, dict(logits=logits, bias=expert_bias), logits.device)


@router_topk.register_fake
def _(logits, expert_bias, topk, *options):
    outputs = plans.topk_outputs(*logits.shape, topk, return_indices=options[-1])
    return _fake(outputs, dict(logits=logits), logits.device)


def _topk_setup(ctx, inputs, output):
    logits, _, topk, use_pre_softmax, _, _, scaling_factor, score_function, _ = inputs
    ctx.options = (topk, use_pre_softmax, scaling_factor, score_function)
    ctx.save_for_backward(logits, output[1])


def _topk_backward(ctx, grad_probs, grad_map, grad_indices):
    logits, routing_map = ctx.saved_tensors
    grad_logits = router_topk_backward(grad_probs, logits, routing_map, *ctx.options)
    return grad_logits, None, None, None, None, None, None, None, None


router_topk.register_autograd(_topk_backward, setup_context=_topk_setup)


def _topk_backward_plan(logits, topk, use_pre_softmax, scaling_factor, score_function):
    return plans.topk_backward_plan(
        num_tokens=logits.shape[0],
        num_experts=logits.shape[1],
        topk=topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        scaling_factor=scaling_factor,
        device=device_info(logits.device),
    )


@torch.library.custom_op("moetriton::router_topk_backward", mutates_args=())
def router_topk_backward(
    grad_probs: Tensor,
    logits: Tensor,
    routing_map: Tensor,
    topk: int,
    use_pre_softmax: bool,
    scaling_factor: float,
    score_function: str,
) -> Tensor:
    """grad_logits [T, E] (logits dtype), recomputing the scores from logits and the routing map."""
    options = (topk, use_pre_softmax, scaling_factor, score_function)
    if not uses_kernels(logits.device):
        return reference.topk_backward(grad_probs, logits, routing_map, *options)
    inputs = dict(grad_probs=grad_probs, logits=logits, routing_map=routing_map)
    return run_plan(_topk_backward_plan(logits, *options), inputs, logits.device)[0]


@router_topk_backward.register_fake
def _(grad_probs, logits, routing_map, *options):
    return _fake(plans.grad_logits_outputs(*logits.shape), dict(logits=logits), logits.device)[0]


# aux-loss scores -------------------------------------------------------------------------------------------


def _scores_plan(logits, topk, score_function):
    return plans.aux_scores_plan(
        num_tokens=logits.shape[0],
        num_experts=logits.shape[1],
        topk=topk,
        score_function=score_function,
        device=device_info(logits.device),
    )


@torch.library.custom_op("moetriton::router_aux_scores", mutates_args=())
def router_aux_scores(logits: Tensor, topk: int, score_function: str) -> tuple[Tensor, Tensor]:
    """(routing_map [T, E] bool, scores [T, E] fp32) of [T, E] logits."""
    if not uses_kernels(logits.device):
        return reference.aux_scores_forward(logits, topk, score_function)
    return run_plan(_scores_plan(logits, topk, score_function), dict(logits=logits), logits.device)


@router_aux_scores.register_fake
def _(logits, topk, score_function):
    return _fake(plans.aux_scores_outputs(*logits.shape), {}, logits.device)


def _scores_setup(ctx, inputs, output):
    logits, _, score_function = inputs
    ctx.score_function = score_function
    ctx.save_for_backward(logits)


def _scores_backward(ctx, grad_map, grad_scores):
    (logits,) = ctx.saved_tensors
    return router_aux_scores_backward(grad_scores, logits, ctx.score_function), None, None


router_aux_scores.register_autograd(_scores_backward, setup_context=_scores_setup)


def _scores_backward_plan(logits, score_function):
    return plans.aux_scores_backward_plan(
        num_tokens=logits.shape[0],
        num_experts=logits.shape[1],
        score_function=score_function,
        device=device_info(logits.device),
    )


@torch.library.custom_op("moetriton::router_aux_scores_backward", mutates_args=())
def router_aux_scores_backward(grad_scores: Tensor, logits: Tensor, score_function: str) -> Tensor:
    """grad_logits [T, E] (logits dtype) of the aux-loss scores."""
    if not uses_kernels(logits.device):
        return reference.aux_scores_backward(grad_scores, logits, score_function)
    plan = _scores_backward_plan(logits, score_function)
    return run_plan(plan, dict(grad_scores=grad_scores, logits=logits), logits.device)[0]


@router_aux_scores_backward.register_fake
def _(grad_scores, logits, score_function):
    return _fake(plans.grad_logits_outputs(*logits.shape), dict(logits=logits), logits.device)[0]


# aux loss --------------------------------------------------------------------------------------------------


def _loss_plan(probs, total, total_int, num_experts, topk, coeff):
    return plans.aux_loss_plan(
        num_rows=probs.shape[0],
        num_cols=probs.shape[1],
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
        total=None if total is not None else total_int,
    )


@torch.library.custom_op("moetriton::router_aux_loss", mutates_args=())
def router_aux_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total: Tensor | None,
    total_int: int,
    num_experts: int,
    topk: int,
    coeff: float,
) -> Tensor:
    """0-dim aux loss in probs.dtype. The token total is the 0-dim `total` tensor, or `total_int` when
    `total` is None."""
    options = (num_experts, topk, coeff)
    if not uses_kernels(probs.device):
        return reference.aux_loss(probs, tokens_per_expert, total_int if total is None else total, *options)
    inputs = dict(probs=probs, counts=tokens_per_expert, total=total)
    return run_plan(_loss_plan(probs, total, total_int, *options), inputs, probs.device)[0]


@router_aux_loss.register_fake
def _(probs, tokens_per_expert, total, total_int, *options):
    return _fake(plans.aux_loss_outputs(), dict(probs=probs), probs.device)[0]


def _loss_setup(ctx, inputs, output):
    probs, tokens_per_expert, total, total_int, num_experts, topk, coeff = inputs
    ctx.options = (probs.shape[0], probs.shape[1], probs.dtype, total_int, num_experts, topk, coeff)
    ctx.save_for_backward(tokens_per_expert, total)


def _loss_backward(ctx, grad_loss):
    tokens_per_expert, total = ctx.saved_tensors
    grad_probs = router_aux_loss_backward(grad_loss, tokens_per_expert, total, *ctx.options)
    return grad_probs, None, None, None, None, None, None


router_aux_loss.register_autograd(_loss_backward, setup_context=_loss_setup)


def _loss_backward_plan(total, num_rows, num_cols, probs_dtype, total_int, num_experts, topk, coeff):
    return plans.aux_loss_backward_plan(
        num_rows=num_rows,
        num_cols=num_cols,
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
        total=None if total is not None else total_int,
        probs_dtype=dtype_name(probs_dtype),
    )


@torch.library.custom_op("moetriton::router_aux_loss_backward", mutates_args=())
def router_aux_loss_backward(
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
    if not uses_kernels(grad_loss.device):
        return reference.aux_loss_backward(grad_loss, tokens_per_expert, total, *options)
    inputs = dict(grad_loss=grad_loss, counts=tokens_per_expert, total=total)
    return run_plan(_loss_backward_plan(total, *options), inputs, grad_loss.device)[0]


@router_aux_loss_backward.register_fake
def _(grad_loss, tokens_per_expert, total, num_rows, num_cols, probs_dtype, *options):
    outputs = plans.aux_loss_backward_outputs(num_rows, num_cols, dtype_name(probs_dtype))
    return _fake(outputs, {}, grad_loss.device)[0]


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
    *,
    return_indices: bool = False,
) -> tuple[Tensor, ...]:
    """Route every token to its top-k experts (fused score function, group limit, bias, scaling).

    Args:
        logits: [..., E] router logits, float32/bfloat16/float16; 1 <= E <= 8192. Leading dims are tokens.
        topk: K experts per token, 1 <= K <= E.
        use_pre_softmax: softmax only: softmax over all E before the top-k (probs are those softmax values),
            instead of a softmax over the K selected logits. Ignored for sigmoid / sqrtsoftplus (as TE).
        num_groups, group_topk: group-limited top-k (DeepSeek-V3): experts form num_groups equal groups; a
            group's score is the sum of its top K / group_topk selection scores; experts are chosen only in
            the group_topk best groups. Both or neither.
        scaling_factor: multiplies the probs (None = 1.0).
        score_function: "softmax", "sigmoid" or "sqrtsoftplus" (sqrt(softplus(x))). Sigmoid and
            sqrtsoftplus weights are renormalised over the K selected experts when K > 1.
        expert_bias: [E] float bias added to the sigmoid / sqrtsoftplus scores for selection only (the
            weights use the unbiased score; no gradient). Not allowed with softmax.
        return_indices: also return the selected expert ids [..., K] int32 in rank order (best first),
            ready for `token_dispatch(..., indices=indices, num_experts=E)`.

    Returns:
        (probs [..., E] in logits.dtype, zero outside the selection; routing_map [..., E] bool) and, with
        `return_indices`, indices [..., K] int32. Ties go to the lowest expert index; NaN scores rank below
        every number. Math is fp32. Differentiable in logits.

    Example:
        >>> logits = torch.tensor([[1.0, 3.0, 2.0, 3.0]])
        >>> probs, routing_map, indices = fused_topk_with_score_function(logits, 2, return_indices=True)
        >>> routing_map.tolist(), indices.tolist()
        ([[False, True, False, True]], [[1, 3]])
    """
    config = rules.check_topk(
        logits=describe(logits),
        topk=topk,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        expert_bias=describe(expert_bias),
    )
    if not isinstance(return_indices, bool):
        raise ValueError(f"return_indices: expected a bool, got {type(return_indices).__name__}")
    _check_devices(logits=logits, expert_bias=expert_bias)
    shape = logits.shape
    probs, routing_map, indices = router_topk(
        logits.reshape(-1, config.num_experts),
        expert_bias,
        config.topk,
        config.use_pre_softmax,
        config.num_groups,
        config.group_topk,
        config.scaling_factor,
        config.score_function,
        return_indices,
    )
    result = (probs.reshape(shape), routing_map.reshape(shape))
    return (*result, indices.reshape(*shape[:-1], config.topk)) if return_indices else result


def fused_compute_score_for_moe_aux_loss(
    logits: Tensor, topk: int, score_function: str = "softmax"
) -> tuple[Tensor, Tensor]:
    """Scores for the load-balancing loss and their top-k mask (no bias, groups or scaling).

    Args:
        logits: [..., E] float32/bfloat16/float16, 1 <= E <= 8192.
        topk: K, 1 <= K <= E.
        score_function: "softmax" (softmax over E), or "sigmoid" / "sqrtsoftplus", whose activations are
            always normalised over all E experts: a / (sum a + 1e-20).

    Returns:
        (routing_map [..., E] bool: the top-K of the scores, ties to the lowest index; scores [..., E]
        float32). Differentiable in logits (through scores).

    Example:
        >>> routing_map, scores = fused_compute_score_for_moe_aux_loss(torch.zeros(1, 4), 2, "softmax")
        >>> routing_map.tolist(), scores.tolist()
        ([[True, True, False, False]], [[0.25, 0.25, 0.25, 0.25]])
    """
    _, num_experts, topk, score_function = rules.check_aux_scores(
        logits=describe(logits), topk=topk, score_function=score_function
    )
    routing_map, scores = router_aux_scores(logits.reshape(-1, num_experts), topk, score_function)
    return routing_map.reshape(logits.shape), scores.reshape(logits.shape)


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
            (CUDA-graph safe: the coefficient is then computed on the device).
        num_experts, topk: E and K (coefficient only); coeff: the loss weight (a Python float).

    Returns:
        0-dim tensor in probs.dtype, bitwise reproducible run to run. Differentiable in probs.

    Example:
        >>> probs = torch.full((4, 2), 0.5)
        >>> fused_moe_aux_loss(probs, torch.tensor([4, 4]), 4, num_experts=2, topk=1, coeff=1.0).item()
        2.0
    """
    total_is_tensor = isinstance(total_num_tokens, Tensor)
    config = rules.check_aux_loss(
        probs=describe(probs),
        tokens_per_expert=describe(tokens_per_expert),
        total_num_tokens=describe(total_num_tokens) if total_is_tensor else total_num_tokens,
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
    )
    _check_devices(
        probs=probs,
        tokens_per_expert=tokens_per_expert,
        total_num_tokens=total_num_tokens if total_is_tensor else None,
    )
    return router_aux_loss(
        probs,
        tokens_per_expert,
        total_num_tokens if total_is_tensor else None,
        config.total or 0,
        config.num_experts,
        config.topk,
        config.coeff,
    )
