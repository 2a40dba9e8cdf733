"""The MoE layer's row exchange: the contract every exchange honours, the layer's dispatch into the buffer an
exchange gives, the dropless count exchange, and which exchange a call runs.

The contract, for one layer call on one rank (T tokens in chunks, E experts of which L = E / EP are local):

1. `start(chunks)`, after the router, before any row moves: what the exchange needs to know early (dropless
   with EP > 1: every rank's counts per expert and T of every chunk, gathered in one collective whose host
   copy starts at once; capacity with EP > 1: the check that every rank holds the same T).
2. `send_buffer(chunk, hidden, dtype)`: where the layer's dispatch writes the chunk's send buffer (rows
   [S, H] expert-major, so rank-major: rank r's experts are contiguous, and with `carries_probs` the
   merging weights [S] beside them), or None for a buffer of the dispatch's own.
3. `__call__(sends, experts)`: the chunks' send buffers with their counts per expert [E] (`Send`, from the
   layer's dispatch, taken from `sends` as the exchange is ready for them) -> for each chunk in order, the
   pair (its Send, the expert outputs [S, H] in the send buffer's layout): every row moved to the rank of
   its expert, through `experts` (moetriton.torch.moe.experts.Experts), and back to its place.
4. `combine(rows, send)`: the layer's weighted combine of those rows into the chunk's [T_c, H]
   (token_combine).

An exchange may keep chunks apart or overlap them: each chunk's results are taken, and combined, before the
exchange asks for the next chunk's send buffer or waits for the next chunk's rows to return. The exchanges:
`Local` (EP = 1: the send buffer is the receive buffer), moetriton.torch.moe.all_to_all (dropless, through
all_to_all_single and chunk sorts, chunks pipelined), moetriton.torch.moe.peer (GPUs of one host, through peer
memory: the send buffer is the rank's staging buffer) and moetriton.torch.moe.capacity (fixed [L, C] slabs
through all_to_all_single).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import EPLayout, padded_counts, ranks_by_host
from moetriton.kernels.rules.permutation import DispatchConfig

from .._stages import stage
from ..executor import bound
from ..permutation import DISPATCH_BACKWARD, dispatch_sizes, token_combine, token_dispatch
from .collectives import gather_counts, group_hosts
from .experts import Experts
from .routing import Chunk


@dataclass
class Send:
    """One chunk's send buffer, as the layer's dispatch wrote it: rows [S, H] expert-major, probs [S] (the
    merging weights beside the rows, for an exchange that `carries_probs`; else None), the row map
    [T_c, 2K + 2], pad_offsets [E] (None unpadded) and counts [E] int32 (rows per expert, padding
    included)."""

    chunk: Chunk
    rows: Tensor
    probs: Tensor | None
    row_id_map: Tensor
    pad_offsets: Tensor | None
    counts: Tensor


class SendBuffer(Protocol):
    """Memory an exchange lends the dispatch: views of its first rows [rows, H] and of their probs [rows]."""

    def rows_view(self, rows: int, hidden: int, dtype: torch.dtype) -> Tensor: ...

    def probs_view(self, rows: int, dtype: torch.dtype) -> Tensor: ...


class Exchange:
    """The contract (module docstring). This base holds the parts most exchanges share: nothing to start, no
    buffer of its own, token_combine."""

    #: Whether the send buffer carries the merging weights beside the rows.
    carries_probs = False
    #: Whether the chunks take the exchange in turn (they share its send buffer): each is dispatched when the
    #: exchange asks for it. Otherwise the layer dispatches every chunk before anything else runs.
    in_turn = False

    def __init__(self, layout: EPLayout, group: dist.ProcessGroup | None, rank: int) -> None:
        self.layout, self.group, self.rank = layout, group, rank

    def start(self, chunks: Sequence[Chunk]) -> None:
        """Step 1: before the first dispatch."""

    def send_buffer(self, chunk: Chunk, hidden: int, dtype: torch.dtype) -> SendBuffer | None:
        """Step 2: where the chunk's dispatch writes (None: a new buffer)."""
        return None

    def __call__(self, sends: Iterable[Send], experts: Experts) -> Iterator[tuple[Send, Tensor]]:
        """Step 3: every chunk's (send, expert outputs in its send buffer's layout)."""
        raise NotImplementedError

    def combine(self, rows: Tensor, send: Send) -> Tensor:
        """Step 4: rows [S, H] in the send buffer's layout -> [T_c, H], weighted by the chunk's merging
        weights."""
        with stage("combine"):
            return token_combine(
                rows, send.row_id_map, merging_probs=send.chunk.merging, pad_offsets=send.pad_offsets
            )


class Local(Exchange):
    """EP = 1: every expert is local, so the send buffer is the receive buffer, already expert-major; the
    experts read it in place, with group sizes from the dispatch's counts on the device (nothing syncs)."""

    def __call__(self, sends: Iterable[Send], experts: Experts) -> Iterator[tuple[Send, Tensor]]:
        for send in sends:
            yield send, experts(send.rows, send.counts if self.layout.dropless else None)


def dispatch(chunk: Chunk, exchange: Exchange) -> Send:
    """The layer's dispatch of a chunk: its tokens into the send buffer, aligned (dropless) or in [E, C]
    capacity slabs (each expert's first C slots; the layer applied its drop policy to the indices), with
    the merging weights beside the rows where the exchange carries them, into the exchange's buffer where it
    gives one (zero-copy: no row is copied between the dispatch and the exchange)."""
    layout = chunk.layout
    into = exchange.send_buffer(chunk, chunk.tokens.shape[1], chunk.tokens.dtype)
    probs = chunk.merging if exchange.carries_probs else None
    with stage("dispatch"):
        if into is not None:
            return Send(chunk, *_DispatchInto.apply(chunk.tokens, probs, chunk.indices, layout, into))
        # aligned rows dropless, [E, C] slabs under a capacity
        sizing = dict(align_size=layout.align_size) if layout.dropless else dict(capacity=layout.capacity)
        results = token_dispatch(
            chunk.tokens, indices=chunk.indices, probs=probs, num_experts=layout.num_experts, **sizing
        )
    return Send(chunk, *results)


def dispatch_into(
    tokens: Tensor, indices: Tensor, probs: Tensor | None, layout: EPLayout, into: SendBuffer
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor]:
    """token_dispatch of tokens [T, H] (and probs [T, K]) by `layout` (aligned when dropless; else [E, C]
    slabs, each expert's first C slots) written into the rows [S, H] and probs [S] of `into`, by the same
    plan: (rows, probs or None, row_id_map, pad_offsets or None, counts). Not differentiable."""
    inputs = dict(inp=tokens, routing=indices, probs=probs, scales=None)
    if layout.dropless:
        slots = layout.num_tokens * layout.topk
        config = DispatchConfig(layout.num_experts, False, slots, layout.align_size, None)
    else:
        config = DispatchConfig(layout.num_experts, False, None, None, layout.capacity)
    executable = bound(kernels.dispatch_plan, tokens.device, **dispatch_sizes(inputs, config))
    rows = layout.send_rows
    inputs.update(
        output=into.rows_view(rows, tokens.shape[1], tokens.dtype),
        permuted_probs=None if probs is None else into.probs_view(rows, probs.dtype),
    )
    out, permuted, _, row_id_map, pad_offsets, counts = executable.into(inputs)
    return out, permuted, row_id_map, pad_offsets, counts


class _DispatchInto(torch.autograd.Function):
    """`dispatch_into`, differentiable in tokens and probs: the backward is dispatch's (a combine of the rows'
    gradient, a gather of the probs')."""

    @staticmethod
    def forward(
        ctx, tokens: Tensor, probs: Tensor | None, indices: Tensor, layout: EPLayout, into: SendBuffer
    ):
        ctx.set_materialize_grads(False)
        results = dispatch_into(tokens, indices, probs, layout, into)
        ctx.mark_non_differentiable(*(value for value in results[2:] if value is not None))
        ctx.save_for_backward(results[2])
        ctx.rows = (results[0].shape, results[0].dtype, results[0].device)
        return results

    @staticmethod
    def backward(ctx, grad_rows, grad_probs, *_):
        (row_id_map,) = ctx.saved_tensors
        if grad_rows is None and grad_probs is None:
            return (None,) * 5
        if grad_rows is None:  # only the probs were used
            shape, dtype, device = ctx.rows
            grad_rows = torch.zeros(shape, dtype=dtype, device=device)
        with stage("dispatch"):
            grad_tokens, grad_merging = DISPATCH_BACKWARD(grad_rows, grad_probs, row_id_map)
        return grad_tokens, grad_merging if grad_probs is not None else None, None, None, None


@dataclass
class GatheredCounts:
    """One chunk's counts per expert of every rank's send buffer [EP, E] on the device, and functions that
    wait for their host copy (the call's one host sync): those counts [EP, E] and every rank's T [EP]."""

    on_device: Tensor
    on_host: Callable[[], np.ndarray]
    tokens_on_host: Callable[[], np.ndarray]


def gather_chunk_counts(chunks: Sequence[Chunk], group) -> list[GatheredCounts]:
    """The dropless count exchange: every rank's counts per expert and T of every chunk, gathered in one
    collective before the dispatch (the counts come from the router: routed slots per expert rounded up to
    the alignment, as token_dispatch pads them) with their host copy started, so that the host waits for that
    copy alone, not for the dispatch."""
    layout = chunks[0].layout
    with stage("exchange_sizes"):
        mine = torch.cat(
            [
                torch.cat(
                    [padded_counts(routed, chunk.layout), routed.new_full((1,), chunk.layout.num_tokens)]
                )
                for chunk in chunks
                for routed in (chunk.routed,)
            ]
        )
        everyone, on_host = gather_counts(mine, layout.ep_size, group)
    width = layout.num_experts + 1  # per chunk: its counts per expert, then its T
    gathered = []
    for chunk in range(len(chunks)):
        columns = slice(chunk * width, chunk * width + layout.num_experts)
        gathered.append(
            GatheredCounts(
                everyone[:, columns],
                lambda columns=columns: on_host()[:, columns],
                lambda column=columns.stop: on_host()[:, column],
            )
        )
    return gathered


# Which exchange ------------------------------------------------------------------------------------------


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
    """The row exchange of an EP group of two or more ranks, "peer" or "all_to_all", from the requested
    `exchange` (one of EXCHANGES), the host id of every rank of the group (`group_hosts`; None where they
    cannot be asked: no group, or while torch.compile traces) and whether its devices could map each other's
    memory on one host (CUDA GPUs, an NCCL group, symmetric memory, eager).

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
    """The row exchange the layer runs with EP > 1 on `group` with tensors on `device`, for the requested
    `exchange`: "peer" or "all_to_all" (`choose_exchange` on the group's hosts; under a capacity, "all_to_all"
    is moetriton.torch.moe.capacity's slabs). The same answer on every rank. Where the answer depends on the
    hosts (peer memory possible, or exchange="peer") the group's first call gathers them, a collective every
    rank of the group reaches since all call the layer with the same options; later calls neither
    communicate nor sync. exchange="peer" where it cannot run raises the same ValueError on every rank.

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
