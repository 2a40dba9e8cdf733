"""The permutation family in PyTorch: token_dispatch, token_combine, and the moetriton::* ops they run
(dispatch, combine and their backwards; see _op.py for how an op is defined once for eager mode and
torch.compile).

Every function takes tensors in any memory layout and returns what it returns for their contiguous copies.
Token tensors ([T, H] inputs and [N, H] expert rows, and the gradients autograd hands to the backward ops)
are read in place when their columns are unit stride (row slices, offset views, expanded rows); other layouts
of them, and every other tensor argument (routing, probs, indices), are copied to contiguous memory first.
Results are dense. The ops run their launch plans on CUDA (compiled) or CPU (interpreted), the reference
otherwise; no op reads device values, so they are CUDA-graph safe, and every fake comes from the same plan as
the op, so torch.compile(fullgraph=True) traces through them. Backward functions accept None for the
gradient of an output that was not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules import permutation as rules

from . import reference
from ._checks import Signature, described, extremes, memoised, same_device, signature, values_checked
from ._op import Op, PlanBinding, trailing, zeros_like_meta

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# dispatch ------------------------------------------------------------------------------------------------


def _dispatch_outputs(sizes: dict) -> dict:
    # Shapes only, for the fake: the expert count may be a data-dependent size here (TE's index map without
    # E), which building the whole plan would guard on.
    del sizes["element_bytes"], sizes["is_mask"]
    return kernels.dispatch_outputs(**sizes)


_DISPATCH = PlanBinding(
    kernels.dispatch_plan,
    lambda inp, routing, probs, scales, *config: dict(inp=inp, routing=routing, probs=probs, scales=scales),
    # The op's arguments after its four tensors: a DispatchConfig's, dispatch_plan's options.
    trailing(*rules.DispatchConfig._fields),
    reference.dispatch,
    outputs=_dispatch_outputs,
)


def dispatch_sizes(inputs: dict, config: rules.DispatchConfig) -> dict:
    """dispatch_plan's arguments for a dispatch of `inputs` (inp, routing, probs, scales, in order) under
    `config`, for a caller that binds the plan itself (the peer exchange writes into its staging buffer)."""
    return _DISPATCH.sizes(inputs, (*inputs.values(), *config))


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
    routing_map_format: str = "bytemap",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(output, permuted_probs, permuted_scales, row_id_map, pad_offsets, tokens_per_expert); align_size None
    = no padding, capacity None = none (else num_out_tokens is unused); absent probs/scales give empty
    tensors; a mask may come bit-packed (routing_map_format "bitmap")."""
    config = (num_experts, is_mask, num_out_tokens, align_size, capacity, routing_map_format)
    return _DISPATCH.run(inp, routing, probs, scales, *config)


def _dispatch_fake(inp, routing, probs, scales, *config):
    # A custom op's fake gets the arguments as given: the routing-map format may be left to its default.
    return _DISPATCH.fake(inp, routing, probs, scales, *rules.DispatchConfig(*config))


def _dispatch_setup(ctx, inputs, output):
    ctx.has_probs = inputs[2] is not None
    ctx.rows = (output[0].shape, output[0].dtype, output[0].device)
    ctx.save_for_backward(output[3])


def _dispatch_backward(ctx, grad_output, grad_probs, grad_scales, grad_map, grad_pad, grad_counts):
    (row_map,) = ctx.saved_tensors
    grad_probs = grad_probs if ctx.has_probs else None
    if grad_output is None and grad_probs is None:
        return (None,) * 10
    if grad_output is None:  # only permuted_probs was used
        grad_output = zeros_like_meta(ctx.rows)
    inp_dtype = grad_output.dtype
    # FP8 payloads have no FP8 combine: their cotangent is summed in fp32 and rounded once (as in JAX).
    if inp_dtype in _FP8:
        grad_output = grad_output.float()
    grad_inp, grad_routing_probs = DISPATCH_BACKWARD(grad_output, grad_probs, row_map)
    grad_inp = grad_inp.to(inp_dtype)
    # Without a gradient for permuted_probs the op returns an empty placeholder: no gradient for probs.
    return (grad_inp, None, grad_routing_probs if grad_probs is not None else None, *(None,) * 7)


# Dispatch's gradient is a combine of its cotangent (and a gather of the permuted probs' gradient).
_DISPATCH_BACKWARD = PlanBinding(
    kernels.combine_plan,
    lambda grad_output, grad_permuted_probs, row_id_map: dict(
        inp=grad_output, row_id_map=row_id_map, weights=None, permuted_probs=grad_permuted_probs
    ),
    trailing(),
    reference.dispatch_backward,
)


def _dispatch_backward_op(
    grad_output: Tensor, grad_permuted_probs: Tensor | None, row_id_map: Tensor
) -> tuple[Tensor, Tensor]:
    """(grad_inp [T, H], grad_probs [T, S] or empty)."""
    return _DISPATCH_BACKWARD.run(grad_output, grad_permuted_probs, row_id_map)


DISPATCH_BACKWARD = Op("dispatch_backward", _dispatch_backward_op, _DISPATCH_BACKWARD.fake)
DISPATCH = Op("dispatch", _dispatch, _dispatch_fake, setup=_dispatch_setup, backward=_dispatch_backward)


# combine -------------------------------------------------------------------------------------------------


_COMBINE = PlanBinding(
    kernels.combine_plan,
    lambda inp, row_id_map, merging_probs, padded: dict(
        inp=inp, row_id_map=row_id_map, weights=merging_probs, permuted_probs=None
    ),
    trailing(),
    lambda inp, row_id_map, merging_probs, padded: reference.combine(inp, row_id_map, merging_probs),
    first=True,
)


def _combine(inp: Tensor, row_id_map: Tensor, merging_probs: Tensor | None, padded: bool) -> Tensor:
    """[T, H]: per token, the fp32 sum over its slots (ascending) of merging_probs[t, s] * inp[row(t, s)]."""
    return _COMBINE.run(inp, row_id_map, merging_probs, padded)


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


_SCATTER_ROWS = PlanBinding(
    kernels.scatter_plan,
    lambda grad, row_id_map, num_rows, padded: dict(grad=grad, row_id_map=row_id_map),
    trailing("num_rows", "padded"),
    lambda grad, row_id_map, num_rows, padded: reference.scatter_rows(grad, row_id_map, num_rows),
    first=True,
)


def _scatter_rows(grad: Tensor, row_id_map: Tensor, num_rows: int, padded: bool) -> Tensor:
    """[N, H]: every token's row copied to the rows of its slots, all other rows zero (unweighted combine
    backward)."""
    return _SCATTER_ROWS.run(grad, row_id_map, num_rows, padded)


_COMBINE_BACKWARD = PlanBinding(
    kernels.combine_backward_plan,
    lambda grad, row_id_map, inp, merging_probs, padded: dict(
        grad=grad, row_id_map=row_id_map, inp=inp, weights=merging_probs
    ),
    trailing("padded"),
    lambda grad, row_id_map, inp, merging_probs, padded: reference.combine_backward(
        grad, row_id_map, inp, merging_probs, inp.shape[0]
    ),
)


def _combine_backward_op(
    grad: Tensor, row_id_map: Tensor, inp: Tensor, merging_probs: Tensor, padded: bool
) -> tuple[Tensor, Tensor]:
    """(grad_inp [N, H], grad_merging_probs [T, S]) of weighted combine, in one pass over the rows."""
    return _COMBINE_BACKWARD.run(grad, row_id_map, inp, merging_probs, padded)


SCATTER_ROWS = Op("scatter_rows", _scatter_rows, _SCATTER_ROWS.fake)
COMBINE_BACKWARD = Op("combine_backward", _combine_backward_op, _COMBINE_BACKWARD.fake)
COMBINE = Op("combine", _combine, _COMBINE.fake, setup=_combine_setup, backward=_combine_backward)


# public functions ----------------------------------------------------------------------------------------


def _check_index_values(indices: torch.Tensor, num_experts: int) -> None:
    if indices.numel() and values_checked(indices):
        ((low, high),) = extremes(indices)
        rules.check_index_values(low, high, num_experts)


def _check_row_map_values(row_id_map: torch.Tensor, num_rows: int) -> None:
    if not row_id_map.numel() or not values_checked(row_id_map):
        return
    parts = rules.row_map_parts(row_id_map)
    # Every part's extremes in one device read; with no slots the lists are empty (read as -1).
    found = iter(extremes(*(part for part in parts.values() if part.numel())))
    bounds = {name: next(found) if part.numel() else (-1, -1) for name, part in parts.items()}
    rules.check_row_map_values(**bounds, num_rows=num_rows, num_slots=parts["rows"].shape[1])


def _symbolic_experts(num_experts) -> bool:
    """True while torch.compile traces, where the expert count may be symbolic (read from the data; dynamo
    presents it as an int): its rule is then `torch._check`, a deferred run-time assertion for a symbolic
    value, since guarding on a data-dependent size fails the trace. (Dynamo accepts only a message function
    without free variables.)"""
    if not torch.compiler.is_compiling() or not isinstance(num_experts, int):
        return False
    torch._check(num_experts >= 1, lambda: "num_experts: expected > 0")
    return True


@memoised
def _check_dispatch(
    *,
    inp: Signature,
    routing_map: Signature | None,
    indices: Signature | None,
    probs: Signature | None,
    scales: Signature | None,
    num_experts,
    **options,
) -> rules.DispatchConfig:
    """rules.check_dispatch of token_dispatch's arguments, tensors given by their signatures (which
    must share one device). The expert count may be symbolic only while torch.compile traces, where this
    runs on every call."""
    tensors = dict(inp=inp, routing_map=routing_map, indices=indices, probs=probs, scales=scales)
    symbolic_experts = _symbolic_experts(num_experts)
    config = rules.check_dispatch(
        **described(**tensors), num_experts=num_experts, symbolic_experts=symbolic_experts, **options
    )
    same_device(**tensors)
    return config


@memoised
def _check_combine(**tensors: Signature | None) -> None:
    rules.check_combine(**described(**tensors))
    same_device(**tensors)


def token_dispatch(
    inp: torch.Tensor,
    routing_map: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    probs: torch.Tensor | None = None,
    align_size: int | None = None,
    *,
    indices: torch.Tensor | None = None,
    num_experts: int | None = None,
    scales: torch.Tensor | None = None,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
) -> tuple:
    """Permute tokens into expert-major order (MoE dispatch).

    Args:
        inp: [T, H] tokens; float32/float64/bfloat16/float16, or float8_e4m3fn/e5m2 payloads. Any layout;
            read in place when its columns are unit stride, else copied (see the module docstring).
        routing_map: [T, E] mask (bool or integer, nonzero = routed), or with routing_map_format="bitmap"
            the same mask bit-packed: uint8 [T, ceil(E / 8)], bit e % 8 of byte e // 8 (as the router
            writes it). Pass this or `indices`.
        num_out_tokens: rows of the output before padding (a Python int). Slots whose row would fall past
            the buffer are dropped (no row, weight 0 in combine), so `num_out_tokens` smaller than the routed
            count truncates the highest experts first, like TE's index map. Defaults to T * K with `indices`.
        probs: [T, E] (mask) or [T, K] (indices) routing probabilities, permuted alongside the tokens.
        align_size: pad every expert's block to a multiple of this (grouped-GEMM tiles). The buffer then has
            the static worst-case size floor((num_out_tokens + E * (A - 1)) / A) * A rows; pad rows and rows
            past the last expert are exactly zero in every output.
        indices: [T, K] int32/int64 expert ids, -1 = no expert. Needs `num_experts`. Ids are range-checked
            where their values are free to read (CPU tensors, or every call with MOETRITON_CHECK=1); elsewhere
            (GPU, torch.compile) an id outside [0, E) is no expert, like -1.
        num_experts: E; required with `indices` and with a bitmap (E cannot be read from its width),
            implied by a [T, E] mask.
        scales: [T, C] row-wise scales of FP8 payloads (any dtype), permuted like the rows.
        capacity: instead of `num_out_tokens` and `align_size`: every expert gets exactly `capacity` rows
            (N = E * capacity, expert e at rows [e * capacity, (e + 1) * capacity)); slots past the first
            `capacity` of their expert in (token, slot) order are dropped (no row, weight 0 in combine) and
            unused rows are zero. A static layout for fixed-size all-to-all exchanges.
        routing_map_format: "bytemap" (default: routing_map is [T, E], uint8 included) or "bitmap" (or TE's
            "bitmap_u8" / RoutingMapFormat): routing_map is read bit by bit in the kernels (no unpacking
            pass); bits at or past E in a row's last byte are ignored. Results equal the [T, E] mask's.

    Returns:
        (output [N, H], permuted_probs [N] or None, row_id_map [T, 2S + 2] int32, pad_offsets [E] int32 or
        None (padding or capacity only), tokens_per_expert [E] int32 (rows per expert in the buffer,
        padding included)),
        plus permuted_scales [N, C] as a sixth element when `scales` is given. S = E for a mask (bitmap
        included), K for indices. Destination rows are expert-major, token order stable inside each
        expert. No host sync.

    Example:
        >>> x = torch.randn(4, 8)
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
        >>> out, _, row_id_map, _, counts = token_dispatch(x, mask, num_out_tokens=5)
        >>> counts.tolist()
        [2, 1, 2]
    """
    config = _check_dispatch(
        inp=signature(inp),
        routing_map=signature(routing_map),
        indices=signature(indices),
        num_experts=num_experts,
        num_out_tokens=num_out_tokens,
        probs=signature(probs),
        scales=signature(scales),
        align_size=align_size,
        capacity=capacity,
        routing_map_format=routing_map_format,
    )
    if not config.is_mask:
        _check_index_values(indices, config.num_experts)
    results = DISPATCH(inp, routing_map if config.is_mask else indices, probs, scales, *config)
    return config.results(results, has_probs=probs is not None, has_scales=scales is not None)


def token_combine(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather expert outputs back to tokens (MoE combine), optionally weighted.

    Args:
        inp: [N, H] expert outputs in the layout token_dispatch produced; float32/float64/bfloat16/float16.
        row_id_map: [T, 2S + 2] int32 from token_dispatch into a buffer of N = inp.shape[0] rows. Checked
            against inp where its values are free to read (CPU, or MOETRITON_CHECK=1); elsewhere entries
            naming rows outside [0, N) are ignored (docs/design.md, "Index data is never trusted").
        merging_probs: [T, S] weights in the routing layout ([T, E] for a mask, [T, K] for indices).
        pad_offsets: pass what token_dispatch returned when it padded (rows in row_id_map already include
            padding; this tells the backward that pad rows exist).

    Returns:
        [T, H] in inp.dtype: out[t] = sum over t's slots, in ascending slot order, of
        w[t, s] * inp[row(t, s)], accumulated in fp32 without atomics (bitwise reproducible).
        Tokens with no row get zeros.

    Example:
        >>> x = torch.randn(4, 8)
        >>> mask = torch.tensor([[1, 1], [1, 0], [0, 1], [0, 0]], dtype=torch.bool)
        >>> out, _, row_id_map, _, _ = token_dispatch(x, mask, num_out_tokens=4)
        >>> torch.equal(token_combine(out, row_id_map)[0], 2 * x[0])
        True
    """
    _check_combine(
        inp=signature(inp),
        row_id_map=signature(row_id_map),
        merging_probs=signature(merging_probs),
        pad_offsets=signature(pad_offsets),
    )
    _check_row_map_values(row_id_map, inp.shape[0])
    return COMBINE(inp, row_id_map, merging_probs, pad_offsets is not None)
