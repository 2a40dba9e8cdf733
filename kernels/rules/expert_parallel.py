"""Expert-parallel (EP) layout arithmetic, written once for the JAX and PyTorch MoE layers.

Symbols: EP ranks (the EP group), E experts in all, L = E / EP local experts (expert e lives on rank e // L),
T tokens per rank, K experts per token, A alignment (rows per expert block are a multiple of A).

Dataflow of one rank (docs/moe.md): its T tokens are dispatched into a send buffer
that is expert-major, so rank-major too (rank r's experts are contiguous). Each rank sends rank r the blocks
of r's experts; the receive buffer holds, for every source rank p in order, p's blocks of the local experts
("source-major"); a chunk sort makes it expert-major for the grouped GEMMs and its inverse restores the
source-major order (the PyTorch layer), or the GEMMs read and write the rows through that chunk sort's row
permutation (the JAX layer); the reverse exchange returns every row to the rank and row it came from.

Two capacity policies fix the static buffer sizes:

* dropless: the send buffer is token_dispatch's padded worst case for T * K slots; the receive buffer holds
  what every source rank could send one rank at most: each source's slots for the local experts (at most
  T * min(K, L), one slot per token and expert) with each expert block padded to A.
* capacity_factor c: every (source rank, local expert) pair gets C = A * max(1, ceil(c * T * K / (E * A)))
  rows, i.e. c times the balanced load, rounded up to A. The send buffer is token_dispatch's capacity
  layout ([E, C]: each expert keeps its first C slots in token order, the rest are dropped and counted), the
  exchange moves fixed [L, C] slabs, and the receive buffer is EP * L * C = c x the balanced load of the
  local experts. No sizes depend on data: nothing syncs with the host and the step captures in a CUDA graph.

The exchange formulas below take arrays and use only operations that numpy, JAX and PyTorch share
(reshape, sum / cumsum over a positional axis, integer indexing, clip), so every framework runs the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .activation import GATED_ACTIVATIONS
from .layout import buffer_rows, round_up

POLICIES = ("dropless", "capacity")


def gate_up_width(activation: str, ffn: int) -> int:
    """Columns of the fused gate+up expert weight for `activation` and FFN width F: 2F if gated, else F."""
    return 2 * ffn if GATED_ACTIVATIONS[activation] else ffn


@dataclass(frozen=True)
class EPLayout:
    """Static sizes of one rank's EP exchange. Construct with `ep_layout` (validates)."""

    num_tokens: int  # T, tokens of one rank
    num_experts: int  # E
    topk: int  # K
    ep_size: int  # EP
    align: int  # A (1: no alignment)
    capacity_factor: float | None  # None: dropless

    @property
    def local_experts(self) -> int:
        """L = E / EP, the experts of one rank."""
        return self.num_experts // self.ep_size

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    @property
    def capacity(self) -> int | None:
        """C, rows of one (source rank, local expert) pair under capacity_factor (None when dropless)."""
        if self.capacity_factor is None:
            return None
        balanced = self.capacity_factor * self.num_tokens * self.topk / (self.num_experts * self.align)
        return self.align * max(1, math.ceil(balanced))

    @property
    def align_size(self) -> int | None:
        """token_dispatch's align_size argument for the send buffer (dropless), or None."""
        return self.align if self.align > 1 else None

    @property
    def send_rows(self) -> int:
        """Rows of the send buffer (token_dispatch's output)."""
        if self.dropless:
            return buffer_rows(self.num_tokens * self.topk, self.num_experts, self.align_size)
        return self.num_experts * self.capacity

    @property
    def recv_rows(self) -> int:
        """Rows of the receive buffer: the most all source ranks together can send one rank."""
        local = self.local_experts
        if self.dropless:
            per_source = buffer_rows(self.num_tokens * min(self.topk, local), local, self.align_size)
            return self.ep_size * per_source
        return self.ep_size * local * self.capacity

    @property
    def pair_rows(self) -> int:
        """Rows of one (source, destination) block of the padded dropless exchange: a pair's worst case."""
        return self.recv_rows // self.ep_size

    @property
    def exchange_block_rows(self) -> tuple[int, ...]:
        """Block sizes, ascending, that the padded dropless exchange chooses from: each step every (source,
        destination) block is padded to the smallest of them that holds the step's largest pair
        (`exchange_block_index`), not to the worst case `pair_rows`, which the last one is.

        A source's pairs average T * K / EP rows (more with alignment), so the largest pair is never below
        that: the sizes start there and step by 1/64 of it up to 1.125 times it (balanced routing moves at
        most 1/64 more than its largest pair), by 1/16 up to 1.5 times, then grow by a quarter each up to
        the worst case (skewed routing): 17 sizes at EP = 2, 20-23 at EP = 8."""
        worst = self.pair_rows
        mean = min(worst, -(-self.num_tokens * self.topk // self.ep_size))
        if mean == 0:
            return (worst,)
        sizes = [-(-mean * (64 + step) // 64) for step in range(9)]
        sizes += [-(-mean * (16 + step) // 16) for step in range(3, 9)]
        while sizes[-1] < worst:
            sizes.append(-(-sizes[-1] * 5 // 4))
        return tuple(sorted({min(size, worst) for size in sizes}))

    def expert_major_order(self, gaps: bool = False) -> list[int]:
        """sorted_indices of the chunk sort from source-major chunks (p, j) = p * L + j to expert-major order
        (j, p): position j * EP + p holds chunk p * L + j. Its inverse sorts back. gaps: every source's
        chunks end in one more, (p, L), its block's unused rows (the padded exchange's receive layout); the
        gaps go last, after every expert's rows."""
        chunks = self.local_experts + gaps
        return [p * chunks + j for j in range(chunks) for p in range(self.ep_size)]

    def source_major_order(self, gaps: bool = False) -> list[int]:
        """sorted_indices of the inverse sort: expert-major chunks (j, p) = j * EP + p back to (p, j)."""
        chunks = self.local_experts + gaps
        return [j * self.ep_size + p for p in range(self.ep_size) for j in range(chunks)]


def ep_layout(
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    ep_size: int,
    align_size: int | None = None,
    capacity_factor: float | None = None,
) -> EPLayout:
    """Validated EPLayout; every error names the argument and the expected value."""
    for name, value, low in (
        ("num_tokens", num_tokens, 0),
        ("num_experts", num_experts, 1),
        ("topk", topk, 1),
        ("ep_size", ep_size, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts: expected a multiple of the EP size {ep_size}, got {num_experts}")
    if topk > num_experts:
        raise ValueError(f"topk: expected <= num_experts = {num_experts}, got {topk}")
    if align_size is not None and (
        not isinstance(align_size, int) or isinstance(align_size, bool) or align_size < 1
    ):
        raise ValueError(f"align_size: expected None or an int >= 1, got {align_size!r}")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float):
            raise ValueError(
                f"capacity_factor: expected None (dropless) or a number > 0, got {capacity_factor!r}"
            )
        if not capacity_factor > 0 or not math.isfinite(capacity_factor):
            raise ValueError(f"capacity_factor: expected a finite number > 0, got {capacity_factor}")
    return EPLayout(num_tokens, num_experts, topk, ep_size, align_size or 1, capacity_factor)


def pipeline_chunk_bounds(num_tokens: int, num_chunks: int) -> tuple[tuple[int, int], ...]:
    """(start, end) token ranges of the dropless pipeline's `num_chunks` chunks of a rank's T tokens:
    consecutive, covering [0, T), sizes differing by one at most (the first T % n one row larger; empty
    ranges where T < n, so that every rank of a group runs the same number of chunks whatever its T).

    Example:
        >>> pipeline_chunk_bounds(7, 3)
        ((0, 3), (3, 5), (5, 7))
    """
    base, larger = divmod(num_tokens, num_chunks)
    ends = [(chunk + 1) * base + min(chunk + 1, larger) for chunk in range(num_chunks)]
    return tuple(zip([0, *ends[:-1]], ends, strict=True))


def shard_capacity(
    num_tokens: int,
    num_shards: int,
    num_experts: int,
    topk: int,
    align_size: int | None,
    capacity_factor: float | None,
) -> int | None:
    """C of the capacity policy for each of `num_shards` equal token shards of `num_tokens` tokens (None:
    dropless): what every rank of a token group of num_shards ranks keeps per expert, as the single-device
    references emulate it. Validated as `ep_layout`."""
    layout = ep_layout(
        num_tokens=num_tokens // num_shards,
        num_experts=num_experts,
        topk=topk,
        ep_size=1,
        align_size=align_size,
        capacity_factor=capacity_factor,
    )
    return layout.capacity


def _exclusive_cumsum(values: Any, axis: int) -> Any:
    return values.cumsum(axis) - values


def padded_counts(routed_per_expert: Any, layout: EPLayout) -> Any:
    """token_dispatch's tokens_per_expert for a dropless send buffer [E], from a rank's routed slots per
    expert [E]: each count rounded up to the alignment A (zero stays zero). Known right after the router,
    so the count exchange need not wait for the dispatch kernels."""
    return round_up(routed_per_expert, layout.align)


def dropless_exchange(counts_all: Any, rank: Any, layout: EPLayout) -> dict[str, Any]:
    """Sizes and offsets of a dropless exchange, from `counts_all` [EP, E]: the rows per expert of every
    rank's send buffer (token_dispatch's tokens_per_expert, gathered over the EP group; padding included),
    and this rank's index (an int, or a traced scalar). All results are integer arrays:

    * send_sizes [EP], input_offsets [EP]: rows this rank sends each rank, and where they start in its send
      buffer; output_offsets [EP]: where they land in each receiving rank's buffer (the rows that lower
      ranks send that rank come first);
    * recv_sizes [EP], recv_offsets [EP]: rows this rank receives from each rank, and where they start in its
      receive buffer (source-major);
    * chunk_sizes [EP * L]: the (source rank, local expert) chunks of the receive buffer, source-major (the
      split sizes of the chunk sort); group_sizes [L]: rows per local expert over all sources;
    * return_offsets [EP]: for the reverse exchange (same sizes, swapped), where this rank's rows land in
      each source rank's send buffer.
    """
    ep, local = layout.ep_size, layout.local_experts
    per_dest = counts_all.reshape(ep, ep, local).sum(2)  # [source, destination]
    send_sizes = per_dest[rank]
    recv_sizes = per_dest[:, rank]
    mine = counts_all.reshape(ep, ep, local)[:, rank]  # [source, local expert]
    return dict(
        send_sizes=send_sizes,
        input_offsets=_exclusive_cumsum(send_sizes, 0),
        output_offsets=_exclusive_cumsum(per_dest, 0)[rank],
        recv_sizes=recv_sizes,
        recv_offsets=_exclusive_cumsum(recv_sizes, 0),
        chunk_sizes=mine.reshape(ep * local),
        group_sizes=mine.sum(0),
        return_offsets=_exclusive_cumsum(per_dest, 1)[:, rank],
    )


def peer_chunks(counts_all: Any, rank: Any, layout: EPLayout) -> dict[str, Any]:
    """The receiving layout of the peer exchange (moetriton.kernels.peer_copy) of this rank, from
    `counts_all` [EP, E] as in `dropless_exchange`: expert-major chunks, chunk j * EP + p holding what
    source rank p's send buffer holds for local expert j.

    * chunk_sizes [L * EP]: rows of each chunk (sum: the rows this rank receives);
    * source_offsets [L * EP]: the row of source p's send buffer where the chunk starts.
    """
    ep, local = layout.ep_size, layout.local_experts
    mine = counts_all.reshape(ep, ep, local)[:, rank]  # [source, local expert]
    starts = _exclusive_cumsum(counts_all, 1).reshape(ep, ep, local)[:, rank]
    return dict(chunk_sizes=mine.T.reshape(local * ep), source_offsets=starts.T.reshape(local * ep))


def exchange_block_index(counts_all: Any, layout: EPLayout) -> Any:
    """The padded exchange's block size for `counts_all` [EP, E] (as in `dropless_exchange`): the index into
    `layout.exchange_block_rows` of the smallest block that holds the largest (source, destination) pair.
    Every rank computes the same value from the same gathered counts, so every rank takes the same branch.
    A sum of comparisons with the sizes below the worst case, so that numpy, JAX and PyTorch all run it."""
    ep = layout.ep_size
    largest_pair = counts_all.reshape(ep, ep, layout.local_experts).sum(2).max()
    return sum(((largest_pair > size) * 1 for size in layout.exchange_block_rows[:-1]), largest_pair * 0)


def kept_slots(routed_per_expert: Any, layout: EPLayout) -> Any:
    """Routed slots per expert [E] a rank keeps under its capacity policy: min(routed, C) (either drop
    policy keeps that many), all of them for dropless."""
    if layout.dropless:
        return routed_per_expert
    return routed_per_expert.clip(max=layout.capacity)


def dropped_slots(routed_per_expert: Any, layout: EPLayout) -> Any:
    """Routed slots a rank drops under capacity_factor: sum over experts of max(0, routed - C), from its
    routed (unpadded) slots per expert [E]. 0 for dropless (nothing is dropped there)."""
    if layout.dropless:
        return routed_per_expert.sum() * 0
    return (routed_per_expert - layout.capacity).clip(min=0).sum()


def ranks_by_host(hosts: Sequence[int]) -> list[list[int]]:
    """The ranks of a group that share each host, from `hosts`: hosts[r] is the host id (an int) of rank r.
    Hosts come in the order of their first rank, ranks ascending; a group whose ranks all share one host
    gives one list. Every rank that holds the same `hosts` gets the same answer.

    Example:
        >>> ranks_by_host([0, 0, 1, 1])
        [[0, 1], [2, 3]]
        >>> ranks_by_host([7, 3, 7])
        [[0, 2], [1]]
    """
    if any(not isinstance(host, int) or isinstance(host, bool) for host in hosts):
        raise ValueError(f"hosts: expected an int host id per rank, got {list(hosts)!r}")
    ranks: dict[int, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)
    return list(ranks.values())
