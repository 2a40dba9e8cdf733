"""moetriton::* custom ops: launch plans run on CUDA (compiled) or CPU (interpreted), the reference otherwise.

Every op has a fake implementation built from the same launch plan, so torch.compile(fullgraph=True) traces
through them, and none reads device values, so they are CUDA-graph safe. Autograd is registered on the
forward ops; their backward ops are ops too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton import kernels

from . import reference
from ._launch import allocate, device_info, run_plan, uses_kernels


def _run(plan: kernels.Plan, inputs: dict[str, Tensor | None], device: torch.device) -> tuple[Tensor, ...]:
    return run_plan(plan, inputs, device)


def _fake(plan: kernels.Plan, inputs: dict[str, Tensor | None], device: torch.device) -> tuple[Tensor, ...]:
    buffers = allocate(plan, inputs, device, fake=True)
    return tuple(buffers[name] for name in plan.results)


# dispatch ------------------------------------------------------------------------------------------------


def _dispatch_sizes(inp, routing, probs, scales, num_experts, num_out_tokens, align_size, capacity) -> dict:
    return dict(
        num_tokens=inp.shape[0],
        hidden=inp.shape[1],
        num_slots=routing.shape[1],
        num_experts=num_experts,
        num_out_tokens=None if capacity else num_out_tokens,
        align_size=align_size or None,
        capacity=capacity or None,
        has_probs=probs is not None,
        scale_cols=None if scales is None else scales.shape[1],
    )


@torch.library.custom_op("moetriton::dispatch", mutates_args=())
def dispatch(
    inp: Tensor,
    routing: Tensor,
    probs: Tensor | None,
    scales: Tensor | None,
    num_experts: int,
    is_mask: bool,
    num_out_tokens: int,
    align_size: int,
    capacity: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(output, permuted_probs, permuted_scales, row_id_map, pad_offsets, tokens_per_expert); align_size 0 =
    no padding, capacity 0 = none (else num_out_tokens is unused); absent probs/scales give empty tensors."""
    if not uses_kernels(inp.device):
        return reference.dispatch(
            inp, routing, probs, scales, num_experts, is_mask, num_out_tokens, align_size, capacity
        )
    sizes = _dispatch_sizes(inp, routing, probs, scales, num_experts, num_out_tokens, align_size, capacity)
    plan = kernels.dispatch_plan(
        **sizes, is_mask=is_mask, element_bytes=inp.element_size(), device=device_info(inp.device)
    )
    output, permuted_probs, permuted_scales, row_map, pad_offsets, tokens_per_expert = _run(
        plan, dict(inp=inp, routing=routing, probs=probs, scales=scales), inp.device
    )
    return output, permuted_probs, permuted_scales, row_map, pad_offsets, tokens_per_expert


@dispatch.register_fake
def _(inp, routing, probs, scales, num_experts, is_mask, num_out_tokens, align_size, capacity):
    # Shapes only: the expert count may be a data-dependent size here (TE's index map without E).
    outputs = kernels.dispatch_outputs(
        **_dispatch_sizes(inp, routing, probs, scales, num_experts, num_out_tokens, align_size, capacity)
    )
    return _fake(
        kernels.Plan(outputs, (), tuple(outputs)), dict(inp=inp, probs=probs, scales=scales), inp.device
    )


def _dispatch_setup(ctx, inputs, output):
    probs = inputs[2]
    ctx.has_probs = probs is not None
    ctx.save_for_backward(output[3])


def _dispatch_backward(ctx, grad_output, grad_probs, grad_scales, grad_map, grad_pad, grad_counts):
    (row_map,) = ctx.saved_tensors
    grad_inp, grad_routing_probs = dispatch_backward(
        grad_output, grad_probs if ctx.has_probs else None, row_map
    )
    return grad_inp, None, grad_routing_probs if ctx.has_probs else None, None, None, None, None, None, None


dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


def _combine_plan(inp, row_map, weights, permuted_probs):
    return kernels.combine_plan(
        num_tokens=row_map.shape[0],
        hidden=inp.shape[1],
        num_slots=row_map.shape[1] - 1,
        element_bytes=inp.element_size(),
        has_weights=weights is not None,
        gather_probs=permuted_probs is not None,
        probs_dtype="float32" if permuted_probs is None else str(permuted_probs.dtype).removeprefix("torch."),
        device=device_info(inp.device),
    )


@torch.library.custom_op("moetriton::dispatch_backward", mutates_args=())
def dispatch_backward(
    grad_output: Tensor, grad_permuted_probs: Tensor | None, row_id_map: Tensor
) -> tuple[Tensor, Tensor]:
    """(grad_inp [T, H], grad_probs [T, S] or empty): dispatch's gradient is a combine of its cotangent."""
    if not uses_kernels(grad_output.device):
        return reference.dispatch_backward(grad_output, grad_permuted_probs, row_id_map)
    plan = _combine_plan(grad_output, row_id_map, None, grad_permuted_probs)
    return _run(
        plan,
        dict(inp=grad_output, row_id_map=row_id_map, weights=None, permuted_probs=grad_permuted_probs),
        grad_output.device,
    )


@dispatch_backward.register_fake
def _(grad_output, grad_permuted_probs, row_id_map):
    plan = _combine_plan(grad_output, row_id_map, None, grad_permuted_probs)
    return _fake(
        plan,
        dict(inp=grad_output, row_id_map=row_id_map, weights=None, permuted_probs=grad_permuted_probs),
        grad_output.device,
    )


# combine -------------------------------------------------------------------------------------------------


@torch.library.custom_op("moetriton::combine", mutates_args=())
def combine(inp: Tensor, row_id_map: Tensor, merging_probs: Tensor | None, padded: bool) -> Tensor:
    """[T, H]: per token, the fp32 sum over its slots (ascending) of merging_probs[t, s] * inp[row(t, s)]."""
    if not uses_kernels(inp.device):
        return reference.combine(inp, row_id_map, merging_probs)
    plan = _combine_plan(inp, row_id_map, merging_probs, None)
    return _run(
        plan, dict(inp=inp, row_id_map=row_id_map, weights=merging_probs, permuted_probs=None), inp.device
    )[0]


@combine.register_fake
def _(inp, row_id_map, merging_probs, padded):
    plan = _combine_plan(inp, row_id_map, merging_probs, None)
    return _fake(
        plan, dict(inp=inp, row_id_map=row_id_map, weights=merging_probs, permuted_probs=None), inp.device
    )[0]


def _combine_setup(ctx, inputs, output):
    inp, row_map, merging_probs, padded = inputs
    ctx.padded = padded
    ctx.num_rows = inp.shape[0]
    ctx.has_weights = merging_probs is not None
    ctx.save_for_backward(row_map, inp if ctx.has_weights else None, merging_probs)


def _combine_backward(ctx, grad):
    row_map, inp, merging_probs = ctx.saved_tensors
    if ctx.has_weights:
        grad_inp, grad_weights = combine_backward(grad, row_map, inp, merging_probs, ctx.padded)
        return grad_inp, None, grad_weights, None
    return scatter_rows(grad, row_map, ctx.num_rows, ctx.padded), None, None, None


combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def _scatter_plan(grad, row_map, num_rows, padded):
    return kernels.scatter_plan(
        num_tokens=row_map.shape[0],
        hidden=grad.shape[1],
        num_slots=row_map.shape[1] - 1,
        num_rows=num_rows,
        padded=padded,
        element_bytes=grad.element_size(),
        device=device_info(grad.device),
    )


@torch.library.custom_op("moetriton::scatter_rows", mutates_args=())
def scatter_rows(grad: Tensor, row_id_map: Tensor, num_rows: int, padded: bool) -> Tensor:
    """[N, H]: every token's row copied to the rows of its slots, all other rows zero (unweighted combine
    backward)."""
    if not uses_kernels(grad.device):
        return reference.scatter_rows(grad, row_id_map, num_rows)
    return _run(
        _scatter_plan(grad, row_id_map, num_rows, padded), dict(grad=grad, row_id_map=row_id_map), grad.device
    )[0]


@scatter_rows.register_fake
def _(grad, row_id_map, num_rows, padded):
    return _fake(
        _scatter_plan(grad, row_id_map, num_rows, padded), dict(grad=grad, row_id_map=row_id_map), grad.device
    )[0]


def _combine_backward_plan(grad, row_map, inp, padded):
    return kernels.combine_backward_plan(
        num_tokens=row_map.shape[0],
        hidden=grad.shape[1],
        num_slots=row_map.shape[1] - 1,
        num_rows=inp.shape[0],
        padded=padded,
        element_bytes=inp.element_size(),
        device=device_info(grad.device),
    )


@torch.library.custom_op("moetriton::combine_backward", mutates_args=())
def combine_backward(
    grad: Tensor, row_id_map: Tensor, inp: Tensor, merging_probs: Tensor, padded: bool
) -> tuple[Tensor, Tensor]:
    """(grad_inp [N, H], grad_merging_probs [T, S]) of weighted combine, in one pass over the rows."""
    if not uses_kernels(grad.device):
        return reference.combine_backward(grad, row_id_map, inp, merging_probs, inp.shape[0])
    inputs = dict(grad=grad, row_id_map=row_id_map, inp=inp, weights=merging_probs)
    return _run(_combine_backward_plan(grad, row_id_map, inp, padded), inputs, grad.device)


@combine_backward.register_fake
def _(grad, row_id_map, inp, merging_probs, padded):
    inputs = dict(grad=grad, row_id_map=row_id_map, inp=inp, weights=merging_probs)
    return _fake(_combine_backward_plan(grad, row_id_map, inp, padded), inputs, grad.device)


# chunk sort ----------------------------------------------------------------------------------------------


def _sort_plan(inp, split_sizes, probs, backward):
    return kernels.sort_chunks_plan(
        num_rows=inp.shape[0],
        hidden=inp.shape[1],
        num_splits=split_sizes.shape[0],
        element_bytes=inp.element_size(),
        has_probs=probs is not None,
        backward=backward,
        device=device_info(inp.device),
    )


@torch.library.custom_op("moetriton::sort_chunks", mutates_args=())
def sort_chunks(
    inp: Tensor, split_sizes: Tensor, sorted_indices: Tensor, probs: Tensor | None, backward: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(output, row_id_map, permuted_probs): chunk j of the output is chunk sorted_indices[j] of inp;
    `backward` applies the inverse permutation (and returns an empty map)."""
    if not uses_kernels(inp.device):
        return reference.sort_chunks(inp, split_sizes, sorted_indices, probs, backward)
    inputs = dict(inp=inp, split_sizes=split_sizes, sorted_indices=sorted_indices, probs=probs)
    return _run(_sort_plan(inp, split_sizes, probs, backward), inputs, inp.device)


@sort_chunks.register_fake
def _(inp, split_sizes, sorted_indices, probs, backward):
    inputs = dict(inp=inp, split_sizes=split_sizes, sorted_indices=sorted_indices, probs=probs)
    return _fake(_sort_plan(inp, split_sizes, probs, backward), inputs, inp.device)


def _sort_setup(ctx, inputs, output):
    _, split_sizes, sorted_indices, probs, backward = inputs
    ctx.backward = backward
    ctx.has_probs = probs is not None
    ctx.save_for_backward(split_sizes, sorted_indices)


def _sort_backward(ctx, grad_output, grad_map, grad_probs):
    split_sizes, sorted_indices = ctx.saved_tensors
    grad_inp, _, grad_in_probs = sort_chunks(
        grad_output, split_sizes, sorted_indices, grad_probs if ctx.has_probs else None, not ctx.backward
    )
    return grad_inp, None, None, grad_in_probs if ctx.has_probs else None, None


sort_chunks.register_autograd(_sort_backward, setup_context=_sort_setup)
