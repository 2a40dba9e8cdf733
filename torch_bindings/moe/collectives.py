"""The MoE layer's collectives over torch.distributed: the differentiable row exchange, the loss sum, the
gathered counts (with their host copy started at once), and the host of every rank of a group (gathered once
per group)."""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_groups(**groups: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this rank's place) of the first group (the EP group), after checking every group by name: None
    or a process group this process belongs to (TypeError for anything else; ValueError for a group of
    other ranks, whose collectives this process could never join)."""
    for name, group in groups.items():
        if group is None:
            continue
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"{name}: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
            )
        if dist.get_rank(group) < 0:
            raise ValueError(
                f"{name}: expected a group this process belongs to (rank {dist.get_rank()} is not in it)"
            )
    return group_size_and_rank(next(iter(groups.values())))


#: The environment variable that declares every rank's host, overriding what the launcher says: host labels
#: separated by commas, one per rank of the default group in rank order ("0,0,1,1": ranks 0 and 1 on one host,
#: 2 and 3 on another). The same value on every rank.
HOSTS_VARIABLE = "MOETRITON_HOST_OF_RANK"


def host_label(rank: int, world_size: int, environ: Mapping[str, str]) -> str:
    """The host of the process of global `rank` (of `world_size`) as declared in `environ`: its entry of
    HOSTS_VARIABLE where that is set; otherwise this machine's name, with the node rank torchrun sets
    (GROUP_RANK) where it is set, so that ranks of different nodes never share a host even where their
    machines (containers) have the same name. Raises ValueError for an override without one non-empty label
    per rank.

    Example:
        >>> host_label(2, 4, {"MOETRITON_HOST_OF_RANK": "a,a,b,b"})
        'declared b'
    """
    declared = environ.get(HOSTS_VARIABLE)
    if declared is not None:
        labels = [label.strip() for label in declared.split(",")]
        if len(labels) != world_size or not all(labels):
            raise ValueError(
                f"{HOSTS_VARIABLE}: expected {world_size} non-empty host labels separated by commas (one per"
                f" rank), got {declared!r}"
            )
        return f"declared {labels[rank]}"
    node = environ.get("GROUP_RANK")
    return socket.gethostname() if node is None else f"{socket.gethostname()} node {node}"


# Weak keys: a memo must not keep a process group alive after its owner drops it (a gloo group that outlives
# destroy_process_group is torn down during interpreter shutdown, where its threads can abort the process).
_HOSTS_OF_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_hosts(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The host id of every rank of `group` [group size] (ints from 0, in the order of each host's first
    rank; see `host_label`), the same tuple on every rank. A collective on the first call for a group (every
    rank of it must make that call), cached afterwards: later calls neither communicate nor sync. An
    invalid declaration, or one that differs between ranks, raises the same ValueError on every rank after
    that collective (each rank sends its problem rather than raising alone, so none is left waiting).

    Example (four ranks started with MOETRITON_HOST_OF_RANK=0,0,1,1):
        >>> group_hosts(dist.group.WORLD)  # doctest: +SKIP
        (0, 0, 1, 1)
    """
    group = dist.group.WORLD if group is None else group
    if group in _HOSTS_OF_GROUP:
        return _HOSTS_OF_GROUP[group]
    declared = os.environ.get(HOSTS_VARIABLE)
    try:
        mine = (declared, host_label(dist.get_rank(), dist.get_world_size(), os.environ), None)
    except ValueError as error:
        mine = (declared, None, str(error))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    problems = [problem for _, _, problem in everyone if problem is not None]
    if problems:
        raise ValueError(problems[0])
    values = [value for value, _, _ in everyone]
    if len(set(values)) > 1:
        raise ValueError(f"{HOSTS_VARIABLE}: expected the same value on every rank, got {values}")
    ids: dict[str, int] = {}
    hosts = tuple(ids.setdefault(label, len(ids)) for _, label, _ in everyone)
    _HOSTS_OF_GROUP[group] = hosts
    return hosts


def _all_to_all(
    rows: Tensor,
    send_sizes: list[int] | None,
    recv_sizes: list[int] | None,
    out_rows: int,
    group,
    asynchronous: bool,
) -> tuple[Tensor, dist.Work | None]:
    """([out_rows, H], the collective's work or None): rows [N, H] sent in `send_sizes` row blocks, received
    in `recv_sizes` blocks (None: equal blocks, out_rows = N); rows past the received ones are zero.
    asynchronous: started and not waited for (NCCL: on the process group's own stream); otherwise the
    collective runs in order on the current stream (NCCL since torch 2.7: no stream hand-over, no tensors
    kept for it) and there is no work to wait for."""
    out = rows.new_empty(out_rows, rows.shape[1])
    received = out_rows if recv_sizes is None else sum(recv_sizes)
    if received < out_rows:
        out[received:].zero_()
    sent = rows if send_sizes is None else rows[: sum(send_sizes)]
    work = dist.all_to_all_single(
        out[:received], sent.contiguous(), recv_sizes, send_sizes, group=group, async_op=asynchronous
    )
    return out, work if asynchronous else None


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


class _InFlight:
    """One exchange's collectives: the forward one, then its gradient's reverse one and the rows that one
    fills. Waiting orders the current stream after the collective (NCCL) or blocks until it is done (gloo);
    a synchronous exchange has nothing to wait for."""

    def __init__(self, reverse: tuple, asynchronous: bool) -> None:
        self.reverse = reverse  # the reverse exchange's (send_sizes, recv_sizes, out_rows, group)
        self.asynchronous = asynchronous
        self.forward: dist.Work | None = None
        self.backward: dist.Work | None = None
        self.gradient: Tensor | None = None  # [N, H]: the rows' gradient, once the reverse exchange is done


class _StartExchange(torch.autograd.Function):
    """Starts the exchange of rows [N, H] into [out_rows, H], valid only after `_FinishExchange`. Backward:
    waits for the reverse exchange of the gradient that `_FinishExchange`'s backward started, and returns
    its rows."""

    @staticmethod
    def forward(ctx, rows, send_sizes, recv_sizes, out_rows, group, flight):
        out, flight.forward = _all_to_all(rows, send_sizes, recv_sizes, out_rows, group, flight.asynchronous)
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, _placeholder):
        flight = ctx.flight
        _wait(flight.backward)
        # Dropped once waited for: a collective's work holds its tensors until it is freed.
        gradient, flight.gradient, flight.backward = flight.gradient, None, None
        return gradient, None, None, None, None, None


class _FinishExchange(torch.autograd.Function):
    """Waits for a started exchange. Backward: starts the reverse exchange of the gradient, which
    `_StartExchange`'s backward waits for. Autograd runs the nodes made later in the forward first, so the
    backward of the GEMMs of a chunk whose exchange started later runs while this one moves. Autograd
    checks every gradient against its input's shape, so the reverse exchange's rows ([N, H], not yet valid)
    pass to `_StartExchange` on `flight`, and the gradient itself ([out_rows, H]) goes along as a placeholder
    that nothing reads."""

    @staticmethod
    def forward(ctx, out, flight):
        _wait(flight.forward)
        flight.forward = None  # its tensors are freed with it, not kept for the backward
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.gradient, flight.backward = _all_to_all(grad, *flight.reverse, flight.asynchronous)
        return grad, None


def start_exchange(
    rows: Tensor,
    send_sizes: list[int] | None,
    recv_sizes: list[int] | None,
    out_rows: int,
    group,
    asynchronous: bool = True,
) -> tuple[Tensor, _InFlight]:
    """Starts the differentiable all_to_all_single of rows [N, H] -> [out_rows, H] (as `all_to_all_rows`):
    returns the output rows, not yet valid, and what `finish_exchange` waits for. With NCCL the rows move on
    the collective's own stream while the current stream runs what is queued before `finish_exchange`, and
    the gradient's reverse exchange likewise. asynchronous=False runs both in order on the current stream
    instead, for an exchange with nothing to run beside it (no hand-over between streams, and NCCL keeps no
    tensors for it).

    Example (two ranks; chunk 1's rows move while chunk 0's experts run):
        >>> started = [start_exchange(rows, sent, got, sum(got), group) for rows, sent, got in chunks]
        >>> first = experts(finish_exchange(started[0]))  # doctest: +SKIP
    """
    flight = _InFlight((recv_sizes, send_sizes, rows.shape[0], group), asynchronous)
    return _StartExchange.apply(rows, send_sizes, recv_sizes, out_rows, group, flight), flight


def finish_exchange(started: tuple[Tensor, _InFlight]) -> Tensor:
    """The rows of an exchange `start_exchange` started, once they arrived (the current stream waits for
    them; the host does not, with NCCL)."""
    return _FinishExchange.apply(*started)


def all_to_all_rows(
    rows: Tensor, send_sizes: list[int] | None, recv_sizes: list[int] | None, out_rows: int, group
) -> Tensor:
    """Differentiable all_to_all_single of rows [N, H] -> [out_rows, H]: blocks of `send_sizes` rows go to
    the ranks in order, blocks of `recv_sizes` rows arrive (None: N / EP rows each way, out_rows = N); rows
    past the received ones are zero. The backward is the reverse exchange of the gradient. Both run in
    order on the current stream.

    Example (two ranks; rank 0 sends 1 row to itself and 2 to rank 1):
        >>> out = all_to_all_rows(rows, [1, 2], [1, 3], 4, group)  # doctest: +SKIP
    """
    return finish_exchange(start_exchange(rows, send_sizes, recv_sizes, out_rows, group, asynchronous=False))


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
