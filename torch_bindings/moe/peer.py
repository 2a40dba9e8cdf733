"""The dropless EP exchange through peer memory (moetriton.kernels.peer_exchange), for the PyTorch MoE layer.

Every rank of the EP group owns one symmetric allocation (torch.distributed._symmetric_memory, the same size
on every rank, mapped into every other rank's address space): its "staging" buffer, which holds the rank's
send layout (token_dispatch's rows [S, H] and their probs [S]). The four exchanges of a layer step each run
as barrier, one copy kernel, barrier, all on the current stream, with nothing on the host between them:

* dispatch (forward): token_dispatch writes straight into the own staging buffer; every rank then pulls
  its rows from all staging buffers into its expert-major receive buffer (rows and merging weights);
* combine (forward): every rank pushes its expert outputs back into their sources' staging buffers, and
  each source runs the weighted token_combine over its own staging buffer;
* combine backward: token_dispatch of the output gradient into the own staging buffer; every rank pulls
  it, scaled by the merging weights, and takes the weights' gradient as dot products with the expert
  outputs it kept (the source does not keep the rows it combined: the staging buffer is reused);
* dispatch backward: every rank pushes the rows' and weights' gradients back into the sources' staging
  buffers, and each source runs dispatch's backward over its own.

The barrier before a copy orders it after the peers' writes of the buffers it reads (or after their last
reads of the buffers it writes); the one after it keeps any rank from reusing its staging buffer while a
peer still copies. So one staging buffer per (group, device) serves every layer and both directions.

Needs CUDA GPUs of one host with peer access and an NCCL group; the layer picks it with exchange="auto"
where `peer_exchange_available` says so, and `exchange_for` says which exchange a group gets: an EP group
whose ranks span hosts (moetriton.torch.moe.collectives.group_hosts) exchanges through all_to_all.
Dropless, the receive buffer is sized exactly, from the counts on the host: the same one host sync per call
as the all-to-all path. Under a capacity (`peer_capacity`) every chunk is C rows at a fixed place, so
nothing is counted or synced, and a step captures in a CUDA graph (free the graph before the process group:
NCCL's teardown waited forever on two H100s while a graph that holds the group's work was alive). Not for
torch.compile (the layer takes the all-to-all path while compiling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import EPLayout, peer_chunks, ranks_by_host
from moetriton.kernels.rules.permutation import DispatchConfig

from .._stages import stage
from ..executor import bound, dtype_name
from ..permutation import DISPATCH_BACKWARD, dispatch_sizes, token_combine
from .collectives import group_hosts
from .experts import batched_mlp, expert_mlp


def _peer_memory(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether the ranks of `group` could map each other's memory were they on one host: an NCCL group of
    more than one rank, CUDA `device`s, outside torch.compile, with this torch's symmetric memory."""
    if group is None or device.type != "cuda" or torch.compiler.is_compiling():
        return False
    # "nccl", or a device-mapped backend string such as "cuda:nccl,cpu:gloo".
    if dist.get_world_size(group) < 2 or "nccl" not in str(dist.get_backend(group)):
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def peer_exchange_available(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True where the layer can exchange through peer memory: an NCCL `group` of more than one rank, all on
    one host (moetriton.torch.moe.collectives.group_hosts: a collective on the group's first call), on CUDA
    `device`s, outside torch.compile, with this torch's symmetric memory.

    Example:
        >>> peer_exchange_available(None, torch.device("cpu"))
        False
    """
    return exchange_for(group, device) == "peer"


def choose_exchange(exchange: str, hosts: Sequence[int] | None, peer_memory: bool) -> str:
    """The row exchange of a dropless EP group of two or more ranks, "peer" or "all_to_all", from the
    requested `exchange` (one of EXCHANGES), the host id of every rank of the group (`group_hosts`; None
    where they cannot be asked: no group, or while torch.compile traces) and whether its devices could map
    each other's memory on one host (CUDA GPUs, an NCCL group, symmetric memory, eager).

    "auto" takes peer for a group of one host with peer memory and all_to_all otherwise: a group that spans
    hosts moves every row through all_to_all, those between the GPUs of one host too (peer memory within
    each host with the collective between hosts is not built: NCCL already sends those pairs over NVLink
    beside the slower network; docs/moe.md, "Running on many hosts"). "peer" where it cannot
    run raises ValueError; every rank holds the same arguments, so every rank raises the same one.

    Example:
        >>> choose_exchange("auto", [0, 0, 1, 1], peer_memory=True)
        'all_to_all'
        >>> choose_exchange("auto", [0, 0], peer_memory=True)
        'peer'
    """
    if exchange == "all_to_all":
        return "all_to_all"
    on_hosts = None if hosts is None else ranks_by_host(hosts)
    if exchange == "peer" and on_hosts is not None and len(on_hosts) > 1:
        listing = ", ".join(str(ranks) for ranks in on_hosts)
        raise ValueError(
            f"exchange='peer' needs every rank of ep_group on one host, got ranks on {len(on_hosts)} hosts:"
            f" {listing}; use exchange='auto' or 'all_to_all'"
        )
    usable = peer_memory and on_hosts is not None and len(on_hosts) == 1
    if exchange == "peer" and not usable:
        raise ValueError(
            "exchange='peer' needs CUDA GPUs of one host in an NCCL group, outside torch.compile"
        )
    return "peer" if usable else "all_to_all"


def exchange_for(group: dist.ProcessGroup | None, device: torch.device, exchange: str = "auto") -> str:
    """The row exchange the dropless layer runs with EP > 1 on `group` with tensors on `device`, for the
    requested `exchange`: "peer" or "all_to_all" (`choose_exchange` on the group's hosts). The same answer
    on every rank. Where the answer depends on the hosts (peer memory possible, or exchange="peer") the
    group's first call gathers them, a collective every rank of the group reaches since all call the layer
    with the same options; later calls neither communicate nor sync. exchange="peer" where it cannot run
    raises the same ValueError on every rank.

    Example (every rank; on CPU tensors and gloo, or across hosts, "auto" gives "all_to_all"):
        >>> exchange_for(None, torch.device("cpu"))
        'all_to_all'
    """
    peer_memory = _peer_memory(group, device)
    asks_hosts = (
        exchange != "all_to_all"
        and (peer_memory or exchange == "peer")
        and group is not None
        and not torch.compiler.is_compiling()
    )
    return choose_exchange(exchange, group_hosts(group) if asks_hosts else None, peer_memory)


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
    """One layer call's exchange: the staging allocation, the receiving layout (expert-major chunk sizes and
    their source offsets [EP * L], on the device), the routing and sizes."""

    staging: _Staging
    chunk_sizes: Tensor
    source_offsets: Tensor
    indices: Tensor  # [T, K] the router's expert ids (the combine backward re-dispatches the gradient)
    layout: EPLayout
    received_rows: Callable[[], int]  # rows this rank receives (waits for the counts' host copy)
    largest_rows: Callable[[], int]  # the largest send buffer of the group (waits likewise)
    group: dist.ProcessGroup
    row_bytes: int

    def fits(self) -> bool:
        """Whether this rank's send buffer fits the staging buffer (a local answer: peers may not fit)."""
        return self.layout.send_rows <= self.staging.rows

    def grow(self) -> bool:
        """After the counts arrived: whether some rank's send buffer does not fit, in which case every
        rank (all see the same counts) replaces the staging buffer by one that holds the largest."""
        rows = self.largest_rows()
        if rows <= self.staging.rows:
            return False
        self.staging = _staging(self.group, self.indices.device, rows, self.row_bytes)
        return True


def peer_plan(
    group: dist.ProcessGroup,
    chunks: dict[str, Tensor],
    indices: Tensor,
    layout: EPLayout,
    hidden: int,
    dtype: torch.dtype,
    received_rows: Callable[[], int],
    largest_rows: Callable[[], int],
) -> PeerPlan:
    """The exchange plan of one layer call: chunks from moetriton.kernels.rules.expert_parallel.peer_chunks
    (chunk_sizes, source_offsets [EP * L] on the device), the router's indices [T, K], the layer's layout,
    the rows' width and dtype, and functions returning the rows this rank receives and the largest send
    buffer of the group (both wait for the counts' host copy; ranks may hold different T). The group's
    staging buffer is kept while the rows fit; it is (re)allocated, a collective, on the first call, for
    wider rows (the same on every rank) and, after the counts arrived, when some rank's rows do not fit
    (`PeerPlan.grow`): decisions every rank takes alike, so none is left in the collective alone.

    Example (every rank of a two-GPU NCCL group; moetriton.torch.moe builds it this way):
        >>> plan = peer_plan(group, chunks, ids, layout, 4096, dtype, rows, largest)  # doctest: +SKIP
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
        indices,
        layout,
        received_rows,
        largest_rows,
        group,
        row_bytes,
    )


def _dispatch_into(plan: PeerPlan, inp: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """token_dispatch of inp [T, H] (and probs [T, K]) into the staging buffer, aligned (dropless) or in
    capacity slabs: (row_id_map, pad_offsets, tokens_per_expert)."""
    layout, staging = plan.layout, plan.staging
    rows = layout.send_rows
    slots = layout.num_tokens * layout.topk
    inputs = dict(inp=inp, routing=plan.indices, probs=probs, scales=None)
    if layout.dropless:
        config = DispatchConfig(layout.num_experts, False, slots, layout.align_size, None)
    else:  # [E, C] slabs, each expert's first C slots (the layer applied its drop policy to the indices)
        config = DispatchConfig(layout.num_experts, False, None, None, layout.capacity)
    executable = bound(kernels.dispatch_plan, inp.device, **dispatch_sizes(inputs, config))
    inputs.update(
        output=staging.rows_view(rows, inp.shape[1], inp.dtype),
        permuted_probs=None if probs is None else staging.probs_view(rows, probs.dtype),
    )
    _, _, _, row_id_map, pad_offsets, counts = executable.into(inputs)
    return row_id_map, pad_offsets, counts


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


class _PeerDispatch(torch.autograd.Function):
    """tokens [T, H], merging [T, K] -> (received [R, H], weights [R] in merging's dtype, row_id_map,
    pad_offsets): token_dispatch into the staging buffer, then every rank pulls its expert-major rows and
    their merging weights. Backward: the rows' and weights' gradients pushed back, then dispatch's backward
    over the staging buffer."""

    @staticmethod
    def forward(ctx, tokens: Tensor, merging: Tensor, plan: PeerPlan):
        ctx.set_materialize_grads(False)
        # Dispatch before the host waits for the counts when this rank's rows fit; again into a new
        # staging buffer in the rare call where some rank's do not (the same decision on every rank).
        fits = plan.fits()
        if fits:
            with stage("dispatch"):
                row_id_map, pad_offsets, _ = _dispatch_into(plan, tokens, merging)
        with stage("exchange_sizes"):  # the call's one host sync
            num_rows = plan.received_rows()
            grown = plan.grow()
        if grown or not fits:
            with stage("dispatch"):
                row_id_map, pad_offsets, _ = _dispatch_into(plan, tokens, merging)
        with stage("all_to_all"):
            received, weights = _pull(plan, num_rows, tokens.shape[1], tokens.dtype, merging.dtype)
        ctx.plan = plan
        ctx.meta = (received.shape, received.dtype, weights.dtype)
        ctx.save_for_backward(row_id_map)
        return received, weights, row_id_map, pad_offsets

    @staticmethod
    def backward(ctx, grad_received, grad_weights, _grad_map, _grad_offsets):
        (row_id_map,) = ctx.saved_tensors
        plan, (shape, dtype, weights_dtype) = ctx.plan, ctx.meta
        device = row_id_map.device
        if grad_received is None:
            grad_received = torch.zeros(shape, dtype=dtype, device=device)
        if grad_weights is None:
            grad_weights = torch.zeros(shape[0], dtype=weights_dtype, device=device)
        with stage("all_to_all"):
            _push(plan, grad_received.contiguous(), grad_weights.to(weights_dtype).contiguous())
        rows = plan.layout.send_rows
        with stage("dispatch"):
            grad_tokens, grad_merging = DISPATCH_BACKWARD(
                plan.staging.rows_view(rows, shape[1], dtype),
                plan.staging.probs_view(rows, weights_dtype),
                row_id_map,
            )
        return grad_tokens, grad_merging, None


class _PeerCombine(torch.autograd.Function):
    """expert outputs [R, H] -> [T, H]: pushed back into the sources' staging buffers, then the weighted
    token_combine over the own one with `merging` [T, K].

    `weights` [R] must be `merging` as `_PeerDispatch` delivered it (the same values, expert-major): the
    merging weights' gradient (dot products of the output gradient with the expert outputs, taken where
    the outputs are) leaves through `weights` and none through `merging`, whose total gradient is then
    dispatch's backward of it."""

    @staticmethod
    def forward(ctx, out: Tensor, weights: Tensor, merging: Tensor, row_id_map: Tensor, pad_offsets, plan):
        ctx.set_materialize_grads(False)
        out = out.contiguous()
        with stage("all_to_all"):
            _push(plan, out)
        rows = plan.staging.rows_view(plan.layout.send_rows, out.shape[1], out.dtype)
        with stage("combine"):
            combined = token_combine(rows, row_id_map, merging_probs=merging, pad_offsets=pad_offsets)
        ctx.plan = plan
        ctx.save_for_backward(out, weights)
        return combined

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 6
        out, weights = ctx.saved_tensors
        plan = ctx.plan
        with stage("combine"):
            _dispatch_into(plan, grad, None)
        with stage("all_to_all"):
            grad_out, dots = _pull(plan, out.shape[0], out.shape[1], out.dtype, saved=out, weights=weights)
        return grad_out, dots.to(weights.dtype), None, None, None, None


def peer_experts(
    tokens: Tensor,
    merging: Tensor,
    plan: PeerPlan,
    group_sizes: Tensor | None,
    experts: Callable[[Tensor, Tensor | None], Tensor],
) -> Tensor:
    """tokens [T, H] (float32 / bfloat16 / float16) through dispatch, the peer exchange,
    `experts(rows [R, H], group_sizes [L]) -> [R, H]` and the exchange back and weighted combine with merging
    [T, K] -> [T, H] in tokens' dtype; differentiable in tokens, merging and whatever `experts` uses.

    Example (every rank; group_sizes [L] rows per local expert, from plan.chunk_sizes):
        >>> out = peer_experts(tokens, merging, plan, group_sizes, experts)  # doctest: +SKIP
    """
    received, weights, row_id_map, pad_offsets = _PeerDispatch.apply(tokens, merging, plan)
    out = experts(received, group_sizes)
    return _PeerCombine.apply(out, weights, merging, row_id_map, pad_offsets, plan)


def peer_dropless(
    tokens, indices, merging, gathered, tokens_on_host, layout, ep_rank, group, gate_up, down, activation
) -> Tensor:
    """Dropless EP through the peer exchange: tokens [T, H] -> combined [T, H] (dispatch, exchanges,
    experts and combine; see moetriton.torch.moe.peer). tokens_on_host: every rank's T (ranks may
    hold different T), read with the counts when the staging buffer's size must be decided."""
    counts_all, counts_on_host = gathered
    chunks = peer_chunks(counts_all, ep_rank, layout)
    group_sizes = chunks["chunk_sizes"].view(layout.local_experts, layout.ep_size).sum(1)  # [L]

    def received_rows() -> int:
        return int(peer_chunks(counts_on_host(), ep_rank, layout)["chunk_sizes"].sum())

    def largest_rows() -> int:
        return max(replace(layout, num_tokens=int(count)).send_rows for count in tokens_on_host())

    plan = peer_plan(
        group, chunks, indices, layout, tokens.shape[1], tokens.dtype, received_rows, largest_rows
    )
    return peer_experts(
        tokens,
        merging,
        plan,
        group_sizes,
        lambda rows, sizes: expert_mlp(rows, sizes, gate_up, down, activation),
    )


def peer_capacity(tokens, indices, merging, layout, ep_rank, group, gate_up, down, activation) -> Tensor:
    """The capacity policy through the peer exchange: tokens [T, H] -> combined [T, H]. Every (source,
    expert) chunk is C rows at row e * C of the source's [E, C] slabs, so the receiving layout is fixed: no
    count exchange, no host sync, and each rank pulls its [L, EP, C] rows straight into the batched
    experts' expert-major order (no chunk sort). Every rank must hold the same T (the layer checks it)."""
    ep, local, capacity = layout.ep_size, layout.local_experts, layout.capacity
    counts_all = torch.full((ep, layout.num_experts), capacity, dtype=torch.int64, device=tokens.device)
    chunks = peer_chunks(counts_all, ep_rank, layout)
    received = ep * local * capacity
    plan = peer_plan(
        group,
        chunks,
        indices,
        layout,
        tokens.shape[1],
        tokens.dtype,
        lambda: received,
        lambda: layout.send_rows,
    )
    return peer_experts(
        tokens, merging, plan, None, lambda rows, _: batched_mlp(rows, gate_up, down, activation)
    )
