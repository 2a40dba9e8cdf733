"""The peer exchange: rows moved through peer memory (moetriton.kernels.peer_copy) on one host's GPUs.

Every rank of the EP group owns one symmetric allocation (torch.distributed._symmetric_memory, the same size
on every rank, mapped into every other rank's address space): its "staging" buffer, which holds the rank's
send buffer (the layer's dispatch writes its rows [S, H] and their merging weights [S] there). Four copies
move a layer step's rows, each as barrier, one copy kernel, barrier, all on the current stream, with nothing
on the host between them:

* forward, out: every rank pulls its rows from all staging buffers into its expert-major receive buffer
  (rows and merging weights), so no chunk sort runs;
* forward, back: every rank pushes its expert outputs back into their sources' staging buffers, where the
  layer's combine reads them (each source over its own);
* combine backward: the output gradient dispatched into the own staging buffer; every rank pulls it,
  scaled by the merging weights, and takes the weights' gradient as dot products with the expert outputs
  it kept (the source does not keep the rows it combined: the staging buffer is reused);
* dispatch backward: every rank pushes the rows' and weights' gradients back into the sources' staging
  buffers, where the dispatch's backward reads them.

The barrier before a copy orders it after the peers' writes of the buffers it reads (or after their last
reads of the buffers it writes); the one after it keeps any rank from reusing its staging buffer while a
peer still copies. So one staging buffer per (group, device) serves every layer and both directions, and a
layer's token chunks run in turn.

Needs CUDA GPUs of one host with peer access and an NCCL group; the layer picks it with exchange="auto"
where `peer_exchange_available` says so (moetriton.torch.moe.exchange). Dropless, the receive buffer is
sized exactly, from the counts on the host: the same one host sync per call as the all-to-all path. Under a
capacity every chunk is C rows at a fixed place, so nothing is counted or synced, and a step captures in a
CUDA graph (free the graph before the process group: NCCL's teardown waited forever on two H100s while a
graph that holds the group's work was alive). Not for torch.compile (the layer takes the all-to-all path
while compiling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import EPLayout, peer_chunks

from .._stages import stage
from ..executor import bound, dtype_name
from ..permutation import token_combine
from .capacity import check_same_tokens
from .exchange import Exchange, Send, dispatch_into, gather_chunk_counts
from .experts import Experts
from .routing import Chunk


class _Staging:
    """A rank's symmetric staging allocation: rows [S, H] at offset 0, probs [S] (4 bytes a row) after them,
    and [EP] int64 tables of every rank's rows and probs addresses on the device."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, rows: int, row_bytes: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.rows, self.row_bytes = rows, row_bytes
        self.probs_offset = -(-rows * row_bytes // 256) * 256
        self.buffer = symm_mem.empty(self.probs_offset + 4 * rows, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        bases = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64)
        self.rows_table = bases.to(device)
        self.probs_table = (bases + self.probs_offset).to(device)

    def holds(self, rows: int, row_bytes: int) -> bool:
        return rows <= self.rows and rows * row_bytes <= self.rows * self.row_bytes

    def rows_view(self, rows: int, hidden: int, dtype: torch.dtype) -> Tensor:
        return self.buffer[: rows * hidden * dtype.itemsize].view(dtype).view(rows, hidden)

    def probs_view(self, rows: int, dtype: torch.dtype) -> Tensor:
        start = self.probs_offset
        return self.buffer[start : start + rows * dtype.itemsize].view(dtype)

    def barrier(self) -> None:
        self.handle.barrier(channel=0)


_STAGING: dict[tuple[str, torch.device], _Staging] = {}


def staging_bytes(device: torch.device) -> int:
    """Bytes of the staging allocations this process holds on `device` (symmetric memory, outside the
    caching allocator's statistics): per EP group, the group's largest send buffer of rows x (H x element
    bytes + 4)."""
    return sum(staging.buffer.numel() for (_, where), staging in _STAGING.items() if where == device)


def _staging(group: dist.ProcessGroup, device: torch.device, rows: int, row_bytes: int) -> _Staging:
    """The group's staging allocation on `device`, (re)made when it is too small: a collective, reached by
    every rank at once since all call with the same sizes (the group's largest send buffer). The old
    allocation goes only after the device and the group are idle, since queued copies and peers may still
    use it."""
    key = (group.group_name, device)
    staging = _STAGING.get(key)
    if staging is not None and staging.holds(rows, row_bytes):
        return staging
    if staging is not None:
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        del _STAGING[key], staging  # freed before the new one is allocated
    _STAGING[key] = _Staging(group, device, rows, row_bytes)
    return _STAGING[key]


@dataclass
class PeerPlan:
    """One chunk's exchange: the staging allocation, the receiving layout (expert-major chunk sizes and their
    source offsets [EP * L], on the device), the routing and sizes."""

    staging: _Staging
    chunk_sizes: Tensor
    source_offsets: Tensor
    group_sizes: Tensor | None  # [L] rows per local expert (dropless), None for equal groups (capacity)
    indices: Tensor  # [T, K] the router's expert ids (the combine backward re-dispatches the gradient)
    layout: EPLayout
    received_rows: Callable[[], int]  # rows this rank receives (waits for the counts' host copy)
    largest_rows: Callable[[], int]  # the largest send buffer of the group (waits likewise)
    group: dist.ProcessGroup
    row_bytes: int

    def fits(self) -> bool:
        """Whether this rank's send buffer fits the staging buffer (a local answer: peers may not fit)."""
        return self.layout.send_rows <= self.staging.rows

    def grow(self, rows: Tensor, probs: Tensor) -> None:
        """After the counts arrived: where some rank's send buffer does not fit, every rank (all see the same
        counts) replaces the staging buffer by one that holds the largest, and moves its send rows [S, H] and
        probs [S] (from the old buffer, or from the dispatch's own where they did not fit it) into it."""
        largest = self.largest_rows()
        if largest <= self.staging.rows:
            return
        kept = rows.clone(), probs.clone()  # the old buffer goes before the new one is made
        self.staging = _staging(self.group, self.indices.device, largest, self.row_bytes)
        self.staging.rows_view(*rows.shape, rows.dtype).copy_(kept[0])
        self.staging.probs_view(probs.shape[0], probs.dtype).copy_(kept[1])


def peer_plan(
    group: dist.ProcessGroup,
    chunks: dict[str, Tensor],
    group_sizes: Tensor | None,
    indices: Tensor,
    layout: EPLayout,
    hidden: int,
    dtype: torch.dtype,
    received_rows: Callable[[], int],
    largest_rows: Callable[[], int],
) -> PeerPlan:
    """The exchange plan of one chunk: chunks from moetriton.kernels.rules.expert_parallel.peer_chunks
    (chunk_sizes, source_offsets [EP * L] on the device), the experts' group sizes, the router's indices
    [T, K], the chunk's layout, the rows' width and dtype, and functions returning the rows this rank
    receives and the largest send buffer of the group (both wait for the counts' host copy; ranks may hold
    different T). The group's staging buffer is kept while the rows fit; it is (re)allocated, a collective,
    on the first call, for wider rows (the same on every rank) and, after the counts arrived, when some
    rank's rows do not fit (`PeerPlan.grow`): decisions every rank takes alike, so none is left in the
    collective alone.

    Example (every rank of a two-GPU NCCL group; `PeerExchange` builds it this way):
        >>> plan = peer_plan(group, chunks, sizes, ids, layout, 4096, dtype, rows, largest)  # doctest: +SKIP
    """
    row_bytes = hidden * dtype.itemsize
    key = (group.group_name, indices.device)
    staging = _STAGING.get(key)
    if staging is None or staging.row_bytes < row_bytes:
        staging = _staging(group, indices.device, largest_rows(), row_bytes)
    return PeerPlan(
        staging,
        chunks["chunk_sizes"],
        chunks["source_offsets"],
        group_sizes,
        indices,
        layout,
        received_rows,
        largest_rows,
        group,
        row_bytes,
    )


class PeerExchange(Exchange):
    """Dropless or capacity with EP > 1 through peer memory (moetriton.torch.moe.exchange's contract): the
    send buffer is the staging buffer, each rank pulls its rows from every rank's straight into expert-major
    order and pushes the expert outputs back into their sources', where the layer's combine reads them; the
    merging weights travel with the rows, so that their gradient is taken where the expert outputs are.
    Chunks run in turn (one staging buffer). Under a capacity every (source, expert) chunk is C rows at row
    e * C of the source's [E, C] slabs: the receiving layout is fixed, nothing is counted or synced, and
    each rank pulls its [L, EP, C] rows straight into the batched experts' order."""

    carries_probs = True
    in_turn = True

    def __init__(
        self, layout: EPLayout, group, rank: int, same_tokens: Callable[[], np.ndarray] | None
    ) -> None:
        super().__init__(layout, group, rank)
        self.same_tokens = same_tokens
        self.plans: dict[int, PeerPlan] = {}  # by chunk, from its dispatch to its combine

    def start(self, chunks: Sequence[Chunk]) -> None:
        if self.layout.dropless:
            self.gathered = gather_chunk_counts(chunks, self.group)
        elif self.same_tokens is not None:  # before the staging buffer is sized: a bad T fails on every rank
            check_same_tokens(self.same_tokens())

    def send_buffer(self, chunk: Chunk, hidden: int, dtype: torch.dtype) -> _Staging | None:
        # Dispatched before the host waits for the counts where this rank's rows fit; into a buffer of its
        # own in the rare call where they do not (the rows move in once the staging buffer has grown).
        plan = self.plans[chunk.index] = self._plan(chunk, hidden, dtype)
        return plan.staging if plan.fits() else None

    def _plan(self, chunk: Chunk, hidden: int, dtype: torch.dtype) -> PeerPlan:
        layout, rank = chunk.layout, self.rank
        if layout.dropless:
            counts = self.gathered[chunk.index]
            chunks = peer_chunks(counts.on_device, rank, layout)
            group_sizes = chunks["chunk_sizes"].view(layout.local_experts, layout.ep_size).sum(1)  # [L]

            def received_rows() -> int:
                return int(peer_chunks(counts.on_host(), rank, layout)["chunk_sizes"].sum())

            def largest_rows() -> int:
                return max(
                    replace(layout, num_tokens=int(count)).send_rows for count in counts.tokens_on_host()
                )

        else:  # every rank holds the same T (`start` checked it where it could)
            ep, capacity = layout.ep_size, layout.capacity
            counts_all = torch.full(
                (ep, layout.num_experts), capacity, dtype=torch.int64, device=chunk.tokens.device
            )
            chunks = peer_chunks(counts_all, rank, layout)
            group_sizes, received = None, ep * layout.local_experts * capacity

            def received_rows() -> int:
                return received

            def largest_rows() -> int:
                return layout.send_rows

        return peer_plan(
            self.group, chunks, group_sizes, chunk.indices, layout, hidden, dtype, received_rows, largest_rows
        )

    def __call__(self, sends: Iterable[Send], experts: Experts) -> Iterator[tuple[Send, Tensor]]:
        for send in sends:  # each chunk's rows go out and return before the next chunk is dispatched
            plan = self.plans[send.chunk.index]
            received, weights = _Pull.apply(send.rows, send.probs, plan)
            yield send, _Push.apply(experts(received, plan.group_sizes), weights, plan)

    def combine(self, rows: Tensor, send: Send) -> Tensor:
        plan = self.plans.pop(send.chunk.index)
        return _Combine.apply(rows, send.chunk.merging, send.row_id_map, send.pad_offsets, plan)


def _pull(
    plan: PeerPlan,
    num_rows: int,
    hidden: int,
    dtype: torch.dtype,
    probs_dtype: torch.dtype | None = None,
    saved: Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, ...]:
    staging = plan.staging
    executable = bound(
        kernels.pull_rows_plan,
        plan.chunk_sizes.device,
        num_rows=num_rows,
        num_chunks=plan.chunk_sizes.shape[0],
        num_sources=plan.layout.ep_size,
        source_rows=staging.rows,
        hidden=hidden,
        dtype=dtype_name(dtype),
        element_bytes=dtype.itemsize,
        probs_dtype=None if probs_dtype is None else dtype_name(probs_dtype),
        scale_dot=saved is not None,
    )
    inputs = dict(
        peer_rows=staging.rows_table,
        peer_probs=staging.probs_table if probs_dtype is not None else None,
        chunk_sizes=plan.chunk_sizes,
        source_offsets=plan.source_offsets,
        saved=saved,
        weights=weights,
    )
    staging.barrier()
    results = executable(inputs)
    staging.barrier()
    return results


def _push(plan: PeerPlan, rows: Tensor, probs: Tensor | None = None) -> None:
    staging = plan.staging
    executable = bound(
        kernels.push_rows_plan,
        rows.device,
        num_rows=rows.shape[0],
        num_chunks=plan.chunk_sizes.shape[0],
        num_sources=plan.layout.ep_size,
        source_rows=staging.rows,
        hidden=rows.shape[1],
        element_bytes=rows.element_size(),
        has_probs=probs is not None,
    )
    inputs = dict(
        rows=rows,
        probs=probs,
        chunk_sizes=plan.chunk_sizes,
        source_offsets=plan.source_offsets,
        peer_rows=staging.rows_table,
        peer_probs=staging.probs_table if probs is not None else None,
    )
    staging.barrier()
    executable(inputs)
    staging.barrier()


class _Pull(torch.autograd.Function):
    """The send rows [S, H] and merging weights [S] in the staging buffer -> (received [R, H], weights [R] in
    the probs' dtype): every rank pulls its expert-major rows and their weights from all staging buffers
    (after the counts arrived: the call's one host sync, dropless). Backward: the rows' and weights'
    gradients pushed back into their sources' staging buffers, which then hold the gradients of the send
    rows and probs (read there by the dispatch's backward)."""

    @staticmethod
    def forward(ctx, rows: Tensor, probs: Tensor, plan: PeerPlan):
        ctx.set_materialize_grads(False)
        with stage("exchange_sizes"):
            num_rows = plan.received_rows()
            plan.grow(rows, probs)
        with stage("all_to_all"):
            received, weights = _pull(plan, num_rows, rows.shape[1], rows.dtype, probs.dtype)
        ctx.plan = plan
        ctx.meta = (received.shape, received.dtype, weights.dtype)
        return received, weights

    @staticmethod
    def backward(ctx, grad_received, grad_weights):
        plan, (shape, dtype, weights_dtype) = ctx.plan, ctx.meta
        device = plan.chunk_sizes.device
        if grad_received is None:
            grad_received = torch.zeros(shape, dtype=dtype, device=device)
        if grad_weights is None:
            grad_weights = torch.zeros(shape[0], dtype=weights_dtype, device=device)
        with stage("all_to_all"):
            _push(plan, grad_received.contiguous(), grad_weights.to(weights_dtype).contiguous())
        rows = plan.layout.send_rows
        return (
            plan.staging.rows_view(rows, shape[1], dtype),
            plan.staging.probs_view(rows, weights_dtype),
            None,
        )


class _Push(torch.autograd.Function):
    """Expert outputs [R, H] -> the rows [S, H] in the send buffer's layout: pushed back into their sources'
    staging buffers, so that the own holds this rank's rows (what `_Combine` reads).

    `weights` [R] must be the merging weights as `_Pull` delivered them: the merging weights' gradient (dot
    products of the output gradient with the expert outputs, taken where the outputs are) leaves through
    them. Backward: the gradient `_Combine` hands over is the combine output's gradient dispatched,
    unweighted, into the staging buffers (not the rows' own gradient, which would be weighted); every rank
    pulls it, scaled by the merging weights, with the dot products beside it."""

    @staticmethod
    def forward(ctx, out: Tensor, weights: Tensor, plan: PeerPlan):
        ctx.set_materialize_grads(False)
        out = out.contiguous()
        with stage("all_to_all"):
            _push(plan, out)
        ctx.plan = plan
        ctx.save_for_backward(out, weights)
        return plan.staging.rows_view(plan.layout.send_rows, out.shape[1], out.dtype)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        out, weights = ctx.saved_tensors
        with stage("all_to_all"):
            grad_out, dots = _pull(
                ctx.plan, out.shape[0], out.shape[1], out.dtype, saved=out, weights=weights
            )
        return grad_out, dots.to(weights.dtype), None


class _Combine(torch.autograd.Function):
    """`_Push`'s rows [S, H] in the own staging buffer -> token_combine with merging [T, K] -> [T, H].
    Backward: the gradient [T, H] dispatched, unweighted, into the staging buffer and handed to `_Push` as
    the rows' gradient; none for merging, whose gradient leaves through `_Push`'s weights (and is then
    dispatch's backward of them)."""

    @staticmethod
    def forward(ctx, rows: Tensor, merging: Tensor, row_id_map: Tensor, pad_offsets, plan: PeerPlan):
        ctx.set_materialize_grads(False)
        with stage("combine"):
            combined = token_combine(rows, row_id_map, merging_probs=merging, pad_offsets=pad_offsets)
        ctx.plan = plan
        ctx.meta = (rows.shape, rows.dtype)
        return combined

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 5
        plan, (shape, dtype) = ctx.plan, ctx.meta
        with stage("combine"):
            dispatch_into(grad, plan.indices, None, plan.layout, plan.staging)
        return plan.staging.rows_view(shape[0], shape[1], dtype), None, None, None, None
