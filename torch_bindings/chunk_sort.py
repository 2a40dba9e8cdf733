"""The chunk sort in PyTorch: sort_chunks_by_index and the moetriton::sort_chunks op it runs (forward and
its inverse, which is its backward; see _op.py for how an op is defined once for eager mode and
torch.compile).

The input rows are read in place when their columns are unit stride; other layouts of them, and the split
sizes and the order, are copied to contiguous memory first. Results are dense. The op runs its launch plan on
CUDA (compiled) or CPU (interpreted), the reference otherwise; it reads no device values, so it is CUDA-graph
safe, and its fake comes from the same plan, so torch.compile(fullgraph=True) traces through it. The backward
accepts None for the gradient of an output that was not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules import chunk_sort as rules

from . import reference
from ._checks import Signature, described, memoised, same_device, signature, values_checked
from ._op import Op, PlanBinding, trailing, zeros_like_meta

_SORT_CHUNKS = PlanBinding(
    kernels.sort_chunks_plan,
    lambda inp, split_sizes, sorted_indices, probs, backward: dict(
        inp=inp, split_sizes=split_sizes, sorted_indices=sorted_indices, probs=probs
    ),
    trailing("backward"),
    reference.sort_chunks,
)


def _sort_chunks(
    inp: Tensor, split_sizes: Tensor, sorted_indices: Tensor, probs: Tensor | None, backward: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(output, row_id_map, permuted_probs): chunk j of the output is chunk sorted_indices[j] of inp;
    `backward` applies the inverse permutation (and returns an empty map)."""
    return _SORT_CHUNKS.run(inp, split_sizes, sorted_indices, probs, backward)


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
        grad_output = zeros_like_meta(ctx.rows)
    split_sizes, sorted_indices = ctx.saved_tensors
    grad_inp, _, grad_in_probs = SORT_CHUNKS(
        grad_output, split_sizes, sorted_indices, grad_probs, not ctx.backward
    )
    return grad_inp, None, None, grad_in_probs if ctx.has_probs else None, None


SORT_CHUNKS = Op("sort_chunks", _sort_chunks, _SORT_CHUNKS.fake, setup=_sort_setup, backward=_sort_backward)


# public functions ----------------------------------------------------------------------------------------


@memoised
def _check_sort_chunks(**tensors: Signature | None) -> None:
    rules.check_sort_chunks(**described(**tensors))
    # The sizes and the order may stay on the host (an all-to-all's splits).
    same_device(inp=tensors["inp"], probs=tensors["probs"])


def sort_chunks_by_index(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> tuple:
    """Reorder row chunks: output chunk j is input chunk sorted_indices[j] (e.g. rank-major -> expert-major
    after an expert-parallel all-to-all).

    Args:
        inp: [N, H] rows; any float or FP8 dtype (moved bit for bit).
        split_sizes: [S] int32/int64 chunk sizes; rows past their sum stay in place. Host tensors are fine.
        sorted_indices: [S] int32/int64 permutation of [0, S). Sizes and order are checked where their
            values are free to read (CPU, or MOETRITON_CHECK=1); elsewhere sizes outside [0, N], a sum past
            N or an order that is not a permutation move nothing: zero output and probs, row_id_map -1.
        probs: optional [N] per-row values permuted alongside.

    Returns:
        (output [N, H], row_id_map [N] int32 destination of each input row[, permuted_probs [N]]).

    Example:
        >>> x = torch.arange(6.0).reshape(6, 1)
        >>> out, _ = sort_chunks_by_index(x, torch.tensor([2, 3, 1]), torch.tensor([2, 0, 1]))
        >>> out[:, 0].tolist()
        [5.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    """
    _check_sort_chunks(
        inp=signature(inp),
        split_sizes=signature(split_sizes),
        sorted_indices=signature(sorted_indices),
        probs=signature(probs),
    )
    # Sizes may come from the host (e.g. an all-to-all's splits): checked there for free.
    if values_checked(split_sizes) and values_checked(sorted_indices):
        rules.check_split_values(split_sizes.tolist(), sorted_indices.tolist(), inp.shape[0])
    if split_sizes.device != inp.device:
        split_sizes = split_sizes.to(inp.device, non_blocking=True)
    if sorted_indices.device != inp.device:
        sorted_indices = sorted_indices.to(inp.device, non_blocking=True)
    output, row_id_map, permuted_probs = SORT_CHUNKS(inp, split_sizes, sorted_indices, probs, False)
    return (output, row_id_map) if probs is None else (output, row_id_map, permuted_probs)
