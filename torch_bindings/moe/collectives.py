"""The MoE layer's collectives over torch.distributed: the differentiable row exchange, the loss sum, the
gathered counts (with their host copy started at once)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all(
    rows: Tensor, send_sizes: list[int] | None, recv_sizes: list[int] | None, out_rows: int, group
) -> Tensor:
    """[out_rows, H]: rows [N, H] sent in `send_sizes` row blocks, received in `recv_sizes` blocks (None:
    equal blocks, out_rows = N); rows past the received ones are zero."""
    out = rows.new_empty(out_rows, rows.shape[1])
    if send_sizes is None:
        dist.all_to_all_single(out, rows.contiguous(), group=group)
        return out
    received = sum(recv_sizes)
    out[received:].zero_()
    dist.all_to_all_single(
        out[:received], rows[: sum(send_sizes)].contiguous(), recv_sizes, send_sizes, group=group
    )
    return out


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows whose backward is the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, rows, send_sizes, recv_sizes, out_rows, group):
        ctx.reverse = (recv_sizes, send_sizes, rows.shape[0], group)
        return _all_to_all(rows, send_sizes, recv_sizes, out_rows, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.reverse), None, None, None, None


def all_to_all_rows(
    rows: Tensor, send_sizes: list[int] | None, recv_sizes: list[int] | None, out_rows: int, group
) -> Tensor:
    """Differentiable all_to_all_single of rows [N, H] -> [out_rows, H]: blocks of `send_sizes` rows go to
    the ranks in order, blocks of `recv_sizes` rows arrive (None: N / EP rows each way, out_rows = N); rows
    past the received ones are zero. The backward is the reverse exchange of the gradient.

    Example (two ranks; rank 0 sends 1 row to itself and 2 to rank 1):
        >>> out = all_to_all_rows(rows, [1, 2], [1, 3], 4, group)  # doctest: +SKIP
    """
    return _Exchange.apply(rows, send_sizes, recv_sizes, out_rows, group)


class _GlobalSum(torch.autograd.Function):
    """all_reduce(SUM) of a rank's partial loss; the backward passes the gradient through, so each rank
    differentiates its own partial: the gradient of its tokens in the global loss."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_counts(counts: Tensor, ep_size: int, group) -> tuple[Tensor, Callable[[], np.ndarray]]:
    """([EP, E] rows per expert of every rank's send buffer, a function that returns them on the host).
    dropless_exchange needs all of them (both directions' sizes and offsets), so each rank sends its row to
    every rank: an all_to_all_single of the row repeated EP times. The host copy starts now, and the function
    waits for it alone (an event, not the whole device), so work queued after it runs meanwhile."""
    gathered = counts.new_empty(ep_size, counts.shape[0])
    dist.all_to_all_single(gathered, counts.expand(ep_size, -1).contiguous(), group=group)
    if not gathered.is_cuda:
        return gathered, gathered.numpy
    on_host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    on_host.copy_(gathered, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> np.ndarray:
        copied.synchronize()
        return on_host.numpy()

    return gathered, wait


def global_sum(partial: Tensor, group) -> Tensor:
    """all_reduce(SUM) of a rank's partial loss over `group`; its backward gives each rank the gradient of
    its own partial (see `_GlobalSum`)."""
    return _GlobalSum.apply(partial, group)
