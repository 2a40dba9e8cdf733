"""moetriton::* ops: launch plans run on CUDA (compiled) or CPU (interpreted), the reference otherwise.

Each op is an `_op.Op`: one implementation, reached directly in eager mode and through its torch.library
custom op under torch.compile (see _op.py). Every fake is built from the same plan (or its output shapes),
so torch.compile(fullgraph=True) traces through the ops, and no op reads device values, so they are
CUDA-graph safe. Autograd is registered on the forward ops; their backward ops are ops too. Backward
functions accept None for the gradient of an output that was not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton import kernels

from . import reference
from ._op import Op
from .executor import allocate, bound, device_info, uses_kernels

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _zeros_like_meta(meta: tuple) -> Tensor:
    """Zeros of a tensor known by (shape, dtype, device): the gradient of an unused output, when another
    output's gradient needs a partner. (Tensors themselves are not kept on ctx: an output kept there would
    form a reference cycle with its grad_fn.)"""
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _fake(plan: kernels.Plan, inputs: dict[str, Tensor | None], device: torch.device) -> tuple[Tensor, ...]:
    buffers = allocate(plan, inputs, device, fake=True)
    return tuple(buffers[name] for name in plan.results)


# dispatch ------------------------------------------------------------------------------------------------


def dispatch_sizes(inp, routing, probs, scales, num_experts, num_out_tokens, align_size, capacity) -> dict:
    """dispatch_plan's size arguments for a dispatch of inp through routing (None: no alignment, no
    capacity; with a capacity num_out_tokens is unused)."""
    return dict(
        num_tokens=inp.shape[0],
        hidden=inp.shape[1],
        num_slots=routing.shape[1],
        num_experts=num_experts,
        num_out_tokens=None if capacity is not None else num_out_tokens,
        align_size=align_size,
        capacity=capacity,
        has_probs=probs is not None,
        scale_cols=None if scales is None else scales.shape[1],
    )


def _dispatch(
    inp: Tensor,
    routing: Tensor,
    probs: Tensor | None,
    scales: Tensor | None,
    num_experts: int,
    is_mask: bool,
    num_out_tokens: int | None,
    align_size: int | None,
    capacity: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(output, permuted_probs, permuted_scales, row_id_map, pad_offsets, tokens_per_expert); align_size None
    = no padding, capacity None = none (else num_out_tokens is unused); absent probs/scales give empty
    tensors."""
    if not uses_kernels(inp.device):
        return reference.dispatch(
            inp, routing, probs, scales, num_experts, is_mask, num_out_tokens, align_size, capacity
        )
    sizes = dispatch_sizes(inp, routing, probs, scales, num_experts, num_out_tokens, align_size, capacity)
    executable = bound(
        kernels.dispatch_plan, inp.device, **sizes, is_mask=is_mask, element_bytes=inp.element_size()
    )
    return executable(dict(inp=inp, routing=routing, probs=probs, scales=scales))


def _dispatch_fake(inp, routing, probs, scales, num_experts, is_mask, num_out_tokens, align_size, capacity):
    # Shapes only: the expert count may be a data-dependent size here (TE's index map without E).
    outputs = kernels.dispatch_outputs(
        **dispatch_sizes(inp, routing, probs, scales, num_experts, num_out_tokens, align_size, capacity)
    )
    return _fake(
        kernels.Plan(outputs, (), tuple(outputs)), dict(inp=inp, probs=probs, scales=scales), inp.device
    )


def _dispatch_setup(ctx, inputs, output):
    ctx.has_probs = inputs[2] is not None
    ctx.rows = (output[0].shape, output[0].dtype, output[0].device)
    ctx.save_for_backward(output[3])


def _dispatch_backward(ctx, grad_output, grad_probs, grad_scales, grad_map, grad_pad, grad_counts):
    (row_map,) = ctx.saved_tensors
    grad_probs = grad_probs if ctx.has_probs else None
    if grad_output is None and grad_probs is None:
        return (None,) * 9
    if grad_output is None:  # only permuted_probs was used
        grad_output = _zeros_like_meta(ctx.rows)
    inp_dtype = grad_output.dtype
    # FP8 payloads have no FP8 combine: their cotangent is summed in fp32 and rounded once (as in JAX).
    if inp_dtype in _FP8:
        grad_output = grad_output.float()
    grad_inp, grad_routing_probs = DISPATCH_BACKWARD(grad_output, grad_probs, row_map)
    grad_inp = grad_inp.to(inp_dtype)
    # Without a gradient for permuted_probs the op returns an empty placeholder: no gradient for probs.
    return (
        grad_inp,
        None,
        grad_routing_probs if grad_probs is not None else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


def _combine_sizes(inp, row_map, weights, permuted_probs) -> dict:
    return dict(
        num_tokens=row_map.shape[0],
        hidden=inp.shape[1],
        num_slots=kernels.row_map_slots(row_map.shape[1]),
        num_rows=inp.shape[0],
        element_bytes=inp.element_size(),
        has_weights=weights is not None,
        gather_probs=permuted_probs is not None,
        probs_dtype="float32" if permuted_probs is None else str(permuted_probs.dtype).removeprefix("torch."),
    )


def _dispatch_backward_op(
    grad_output: Tensor, grad_permuted_probs: Tensor | None, row_id_map: Tensor
) -> tuple[Tensor, Tensor]:
    """(grad_inp [T, H], grad_probs [T, S] or empty): dispatch's gradient is a combine of its cotangent."""
    if not uses_kernels(grad_output.device):
        return reference.dispatch_backward(grad_output, grad_permuted_probs, row_id_map)
    sizes = _combine_sizes(grad_output, row_id_map, None, grad_permuted_probs)
    inputs = dict(inp=grad_output, row_id_map=row_id_map, weights=None, permuted_probs=grad_permuted_probs)
    return bound(kernels.combine_plan, grad_output.device, **sizes)(inputs)


def _dispatch_backward_fake(grad_output, grad_permuted_probs, row_id_map):
    sizes = _combine_sizes(grad_output, row_id_map, None, grad_permuted_probs)
    plan = kernels.combine_plan(**sizes, device=device_info(grad_output.device))
    inputs = dict(inp=grad_output, row_id_map=row_id_map, weights=None, permuted_probs=grad_permuted_probs)
    return _fake(plan, inputs, grad_output.device)


DISPATCH_BACKWARD = Op("dispatch_backward", _dispatch_backward_op, _dispatch_backward_fake)
DISPATCH = Op("dispatch", _dispatch, _dispatch_fake, setup=_dispatch_setup, backward=_dispatch_backward)


# combine -------------------------------------------------------------------------------------------------


def _combine(inp: Tensor, row_id_map: Tensor, merging_probs: Tensor | None, padded: bool) -> Tensor:
    """[T, H]: per token, the fp32 sum over its slots (ascending) of merging_probs[t, s] * inp[row(t, s)]."""
    if not uses_kernels(inp.device):
        return reference.combine(inp, row_id_map, merging_probs)
    sizes = _combine_sizes(inp, row_id_map, merging_probs, None)
    inputs = dict(inp=inp, row_id_map=row_id_map, weights=merging_probs, permuted_probs=None)
    return bound(kernels.combine_plan, inp.device, **sizes)(inputs)[0]


def _combine_fake(inp, row_id_map, merging_probs, padded):
    plan = kernels.combine_plan(
        **_combine_sizes(inp, row_id_map, merging_probs, None), device=device_info(inp.device)
    )
    inputs = dict(inp=inp, row_id_map=row_id_map, weights=merging_probs, permuted_probs=None)
    return _fake(plan, inputs, inp.device)[0]


def _combine_setup(ctx, inputs, output):
    inp, row_map, merging_probs, padded = inputs
    ctx.padded = padded
    ctx.num_rows = inp.shape[0]
    ctx.has_weights = merging_probs is not None
    ctx.save_for_backward(row_map, inp if ctx.has_weights else None, merging_probs)


def _combine_backward(ctx, grad):
    if grad is None:
        return None, None, None, None
    row_map, inp, merging_probs = ctx.saved_tensors
    if ctx.has_weights:
        grad_inp, grad_weights = COMBINE_BACKWARD(grad, row_map, inp, merging_probs, ctx.padded)
        return grad_inp, None, grad_weights, None
    return SCATTER_ROWS(grad, row_map, ctx.num_rows, ctx.padded), None, None, None


def _scatter_sizes(grad, row_map, num_rows, padded) -> dict:
    return dict(
        num_tokens=row_map.shape[0],
        hidden=grad.shape[1],
        num_slots=kernels.row_map_slots(row_map.shape[1]),
        num_rows=num_rows,
        padded=padded,
        element_bytes=grad.element_size(),
    )


def _scatter_rows(grad: Tensor, row_id_map: Tensor, num_rows: int, padded: bool) -> Tensor:
    """[N, H]: every token's row copied to the rows of its slots, all other rows zero (unweighted combine
    backward)."""
    if not uses_kernels(grad.device):
        return reference.scatter_rows(grad, row_id_map, num_rows)
    executable = bound(
        kernels.scatter_plan, grad.device, **_scatter_sizes(grad, row_id_map, num_rows, padded)
    )
    return executable(dict(grad=grad, row_id_map=row_id_map))[0]


def _scatter_rows_fake(grad, row_id_map, num_rows, padded):
    sizes = _scatter_sizes(grad, row_id_map, num_rows, padded)
    plan = kernels.scatter_plan(**sizes, device=device_info(grad.device))
    return _fake(plan, dict(grad=grad, row_id_map=row_id_map), grad.device)[0]


def _combine_backward_sizes(grad, row_map, inp, padded) -> dict:
    return dict(
        num_tokens=row_map.shape[0],
        hidden=grad.shape[1],
        num_slots=kernels.row_map_slots(row_map.shape[1]),
        num_rows=inp.shape[0],
        padded=padded,
        element_bytes=inp.element_size(),
    )


def _combine_backward_op(
    grad: Tensor, row_id_map: Tensor, inp: Tensor, merging_probs: Tensor, padded: bool
) -> tuple[Tensor, Tensor]:
    """(grad_inp [N, H], grad_merging_probs [T, S]) of weighted combine, in one pass over the rows."""
    if not uses_kernels(grad.device):
        return reference.combine_backward(grad, row_id_map, inp, merging_probs, inp.shape[0])
    sizes = _combine_backward_sizes(grad, row_id_map, inp, padded)
    inputs = dict(grad=grad, row_id_map=row_id_map, inp=inp, weights=merging_probs)
    return bound(kernels.combine_backward_plan, grad.device, **sizes)(inputs)


def _combine_backward_fake(grad, row_id_map, inp, merging_probs, padded):
    sizes = _combine_backward_sizes(grad, row_id_map, inp, padded)
    plan = kernels.combine_backward_plan(**sizes, device=device_info(grad.device))
    inputs = dict(grad=grad, row_id_map=row_id_map, inp=inp, weights=merging_probs)
    return _fake(plan, inputs, grad.device)


SCATTER_ROWS = Op("scatter_rows", _scatter_rows, _scatter_rows_fake)
COMBINE_BACKWARD = Op("combine_backward", _combine_backward_op, _combine_backward_fake)
COMBINE = Op("combine", _combine, _combine_fake, setup=_combine_setup, backward=_combine_backward)


# chunk sort ----------------------------------------------------------------------------------------------


def _sort_sizes(inp, split_sizes, probs, backward) -> dict:
    return dict(
        num_rows=inp.shape[0],
        hidden=inp.shape[1],
        num_splits=split_sizes.shape[0],
        element_bytes=inp.element_size(),
        has_probs=probs is not None,
        backward=backward,
    )


def _sort_chunks(
    inp: Tensor, split_sizes: Tensor, sorted_indices: Tensor, probs: Tensor | None, backward: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(output, row_id_map, permuted_probs): chunk j of the output is chunk sorted_indices[j] of inp;
    `backward` applies the inverse permutation (and returns an empty map)."""
    if not uses_kernels(inp.device):
        return reference.sort_chunks(inp, split_sizes, sorted_indices, probs, backward)
    inputs = dict(inp=inp, split_sizes=split_sizes, sorted_indices=sorted_indices, probs=probs)
    return bound(kernels.sort_chunks_plan, inp.device, **_sort_sizes(inp, split_sizes, probs, backward))(
        inputs
    )


def _sort_chunks_fake(inp, split_sizes, sorted_indices, probs, backward):
    plan = kernels.sort_chunks_plan(
        **_sort_sizes(inp, split_sizes, probs, backward), device=device_info(inp.device)
    )
    inputs = dict(inp=inp, split_sizes=split_sizes, sorted_indices=sorted_indices, probs=probs)
    return _fake(plan, inputs, inp.device)


def _sort_setup(ctx, inputs, output):
    inp, split_sizes, sorted_indices, probs, backward = inputs
    ctx.backward = backward
    ctx.has_probs = probs is not None
    ctx.rows = (inp.shape, inp.dtype, inp.device)
    ctx.save_for_backward(split_sizes, sorted_indices)


def _sort_backward(ctx, grad_output, grad_map, grad_probs):
    grad_probs = grad_probs if ctx.has_probs else None
    if grad_output is None and grad_probs is None:
        return None, None, None, None, None
    if grad_output is None:  # only the permuted probs were used
        grad_output = _zeros_like_meta(ctx.rows)
    split_sizes, sorted_indices = ctx.saved_tensors
    grad_inp, _, grad_in_probs = SORT_CHUNKS(
        grad_output, split_sizes, sorted_indices, grad_probs, not ctx.backward
    )
    return grad_inp, None, None, grad_in_probs if ctx.has_probs else None, None


SORT_CHUNKS = Op("sort_chunks", _sort_chunks, _sort_chunks_fake, setup=_sort_setup, backward=_sort_backward)


# expert activation ---------------------------------------------------------------------------------------


def _activation_sizes(hidden: Tensor, activation: str) -> dict:
    return dict(
        activation=activation,
        num_rows=hidden.shape[0],
        width=hidden.shape[1],
        num_groups=None,
        element_bytes=hidden.element_size(),
    )


def _activate(hidden: Tensor, activation: str) -> Tensor:
    """[M, F]: the expert activation of every row of hidden [M, 2F] (gated) or [M, F], in one kernel."""
    if not uses_kernels(hidden.device):
        return reference.activate(hidden, activation)
    executable = bound(kernels.activation_plan, hidden.device, **_activation_sizes(hidden, activation))
    return executable(dict(hidden=hidden, group_sizes=None))[0]


def _activate_fake(hidden, activation):
    plan = kernels.activation_plan(**_activation_sizes(hidden, activation), device=device_info(hidden.device))
    return _fake(plan, dict(hidden=hidden, group_sizes=None), hidden.device)[0]


def _activate_setup(ctx, inputs, output):
    hidden, ctx.activation = inputs
    ctx.save_for_backward(hidden)


def _activate_backward(ctx, grad):
    if grad is None:
        return None, None
    (hidden,) = ctx.saved_tensors
    return ACTIVATE_BACKWARD(grad, hidden, ctx.activation), None


def _activate_backward_op(grad: Tensor, hidden: Tensor, activation: str) -> Tensor:
    """[M, W]: the gradient of `_activate` with respect to hidden, in one kernel."""
    if not uses_kernels(hidden.device):
        return reference.activate_backward(grad, hidden, activation)
    executable = bound(
        kernels.activation_backward_plan, hidden.device, **_activation_sizes(hidden, activation)
    )
    return executable(dict(hidden=hidden, grad=grad.to(hidden.dtype), group_sizes=None))[0]


def _activate_backward_fake(grad, hidden, activation):
    sizes = _activation_sizes(hidden, activation)
    plan = kernels.activation_backward_plan(**sizes, device=device_info(hidden.device))
    return _fake(plan, dict(hidden=hidden, grad=grad, group_sizes=None), hidden.device)[0]


ACTIVATE_BACKWARD = Op("activate_backward", _activate_backward_op, _activate_backward_fake)
ACTIVATE = Op("activate", _activate, _activate_fake, setup=_activate_setup, backward=_activate_backward)
