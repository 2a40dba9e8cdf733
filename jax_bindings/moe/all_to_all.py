"""The dropless EP row exchange of one token shard: ragged (`jax.lax.ragged_all_to_all`) or padded (blocks of
one of a few sizes through a fixed-size all_to_all, placed in expert-major order by the block kernels), each
direction the transpose of the other, around the experts.

The received rows arrive grouped by source rank. The padded exchange places them straight in expert-major
order (and takes the results back out of it) by the chunk sort's row map
(moetriton.jax.moe.experts.expert_major_rows: the chunk-sort kernel's map of zero columns); after the
ragged (or capacity) exchange the grouped GEMMs read and write them through that permutation instead.
Either way no chunk sort copies them before and after the GEMMs (nor back in the backward pass).

Two exchanges move the same rows:

* "ragged": `jax.lax.ragged_all_to_all` into the static receive buffer (GPU meshes only);
* "padded": every (source, destination) pair's rows padded to one block size and moved with a fixed-size
  `jax.lax.all_to_all`: the smallest of `EPLayout.exchange_block_rows` that holds the step's largest pair
  (one `lax.switch` branch per size; every rank picks the same one from the all-gathered counts). The
  receiver places the rows each source sent into the static worst-case layout, in expert-major order
  (moetriton.kernels.block_copy: those rows copied, nothing else written; each block's unused rows a last
  chunk, ordered after the experts' rows), takes the results back out the same way, and the sending side
  compacts what comes back. Each direction's transpose is the other direction. "auto" picks this:
  XLA:CPU has no ragged all-to-all, XLA's GPU one is slower than this between the GPUs of one host, and
  jaxlib 0.11 runs it between processes only when XLA_FLAGS allows its NCCL fallback
  (moetriton.jax.moe.exchange.resolve_exchange).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import EPLayout, dropless_exchange, exchange_block_index

from ..executor import run_plan, uses_kernels
from .config import MoEConfig
from .experts import ExpertWeights, expert_major_rows, expert_mlp


def _block_rows(buffer: jax.Array, offsets: jax.Array, sizes: jax.Array, rows: int) -> jax.Array:
    """[P, rows, H]: block p holds buffer[offsets[p] : offsets[p] + sizes[p]], zero-padded to `rows`."""
    position = jnp.arange(rows, dtype=offsets.dtype)
    index = jnp.clip(offsets[:, None] + position[None, :], 0, buffer.shape[0] - 1)
    valid = position[None, :] < sizes[:, None]
    return jnp.where(valid[..., None], buffer[index], jnp.zeros((), buffer.dtype))


def _compact_blocks(blocks: jax.Array, offsets: jax.Array, sizes: jax.Array, rows: int) -> jax.Array:
    """Inverse of `_block_rows`: [rows, H] with blocks[p, :sizes[p]] at offsets[p] (ascending), zeros
    elsewhere."""
    row = jnp.arange(rows, dtype=offsets.dtype)
    block = jnp.clip(jnp.searchsorted(offsets, row, side="right") - 1, 0, blocks.shape[0] - 1)
    within = row - offsets[block]
    valid = (within >= 0) & (within < sizes[block])
    picked = blocks[block, jnp.clip(within, 0, blocks.shape[1] - 1)]
    return jnp.where(valid[:, None], picked, jnp.zeros((), blocks.dtype))


def _choose_block(block_rows: tuple[int, ...], block_index, branch: Callable[[int], Callable]):
    """Run `branch(rows)` for the block size block_rows[block_index] (a traced index, the same on every
    rank): one lax.switch branch per size, each with its own static shapes."""
    if len(block_rows) == 1:
        return branch(block_rows[0])
    return lambda *operands: jax.lax.switch(block_index, [branch(rows) for rows in block_rows], *operands)


def _block_kernel(take: bool, source: jax.Array, sizes: jax.Array, rows: int, out_rows: int, **where):
    """The block kernels (moetriton.kernels.block_copy): take (`take`) blocks of `rows` rows out of the layout
    `source` [N, H], or place the blocks `source` [P, rows, H] into it, with out_rows as the plans read it;
    `where`: dest_rows (a permutation of the layout's rows) or offsets (each block's first row), or
    neither. Only the blocks' first sizes[p] rows are written."""
    hidden = source.shape[-1]
    builder = kernels.take_blocks_plan if take else kernels.place_blocks_plan
    plan = builder(
        num_blocks=sizes.shape[0],
        rows=rows,
        out_rows=out_rows,
        width=hidden,
        element_bytes=source.dtype.itemsize,
        permuted=where.get("dest_rows") is not None,
        offsets=where.get("offsets") is not None,
    )
    inputs = dict(dest_rows=None, offsets=None) | where | dict(sizes=sizes.astype(jnp.int32))
    inputs["layout" if take else "blocks"] = source.reshape(-1, hidden)
    (out,) = run_plan(plan, inputs)
    return out.reshape(sizes.shape[0], rows, hidden) if take else out


def _place_blocks(blocks: jax.Array, recv_sizes: jax.Array, out_rows: int, dest_rows) -> jax.Array:
    """[EP, rows, H] arriving blocks -> [EP * out_rows, H]: block p's first recv_sizes[p] rows at p *
    out_rows + j, or at dest_rows[p * out_rows + j] ([EP * out_rows] permutation, or None). The kernel
    writes those rows only (the rest unspecified: nothing reads them); XLA's pad and scatter, where the
    kernels do not run, write zeros."""
    rows, hidden = blocks.shape[1:]
    if not uses_kernels():
        out = jnp.pad(blocks, ((0, 0), (0, out_rows - rows), (0, 0))).reshape(-1, hidden)
        return out if dest_rows is None else jnp.zeros_like(out).at[dest_rows].set(out, unique_indices=True)
    return _block_kernel(False, blocks, recv_sizes, rows, out_rows, dest_rows=dest_rows)


def _take_blocks(layout: jax.Array, recv_sizes: jax.Array, rows: int, dest_rows) -> jax.Array:
    """The inverse of `_place_blocks`: [EP * out_rows, H] -> departing blocks [EP, rows, H], block p's first
    recv_sizes[p] rows from p * out_rows + j (or dest_rows of it); its other rows unspecified (the
    receiving side keeps only the rows it sent)."""
    ep = recv_sizes.shape[0]
    if not uses_kernels():
        ordered = layout if dest_rows is None else layout[dest_rows]
        return ordered.reshape(ep, -1, layout.shape[1])[:, :rows]
    return _block_kernel(True, layout, recv_sizes, rows, layout.shape[0] // ep, dest_rows=dest_rows)


def _departing_blocks(buffer: jax.Array, offsets: jax.Array, sizes: jax.Array, rows: int) -> jax.Array:
    """[P, rows, H]: block p's first sizes[p] rows are buffer[offsets[p] + j]. The kernel writes those rows
    only (the rest unspecified: the receiver places sizes[p] rows); `_block_rows` where the kernels do not
    run."""
    if not uses_kernels():
        return _block_rows(buffer, offsets, sizes, rows)
    return _block_kernel(True, buffer, sizes, rows, buffer.shape[0], offsets=offsets)


def _arrived_rows(blocks: jax.Array, offsets: jax.Array, sizes: jax.Array, num_rows: int) -> jax.Array:
    """The inverse of `_departing_blocks`: [num_rows, H] with blocks[p, :sizes[p]] at offsets[p]. The kernel
    writes those rows only (the rest unspecified: the combine reads the rows it dispatched);
    `_compact_blocks` (zeros elsewhere) where the kernels do not run."""
    if not uses_kernels():
        return _compact_blocks(blocks, offsets, sizes, num_rows)
    return _block_kernel(False, blocks, sizes, blocks.shape[1], num_rows, offsets=offsets)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _send_blocks(shape, buffer, offsets, sizes, recv_sizes, block_index, dest_rows):
    """Padded exchange out of a send buffer [N, H] of which rank p gets rows [offsets[p], +sizes[p]):
    [EP * pair_rows, H], block p holding the recv_sizes[p] rows rank p sent this rank, each block's row j at
    p * pair_rows + j, or at dest_rows of that ([EP * pair_rows] permutation: the layer's expert-major
    order); every other row unspecified where the kernels run, zeros otherwise. shape = (N, block_rows,
    EP axis name, zeros): the all_to_all moves blocks of block_rows[block_index] rows (at least every pair's
    rows), which the receiver places into blocks of the worst case, the last size; `zeros` is
    `_return_blocks`' (this exchange's transpose)."""
    _, block_rows, axis, _ = shape

    def branch(rows):
        def send(buffer, offsets, sizes, recv_sizes, dest_rows):
            blocks = jax.lax.all_to_all(_departing_blocks(buffer, offsets, sizes, rows), axis, 0, 0)
            return _place_blocks(blocks, recv_sizes, block_rows[-1], dest_rows)

        return send

    return _choose_block(block_rows, block_index, branch)(buffer, offsets, sizes, recv_sizes, dest_rows)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _return_blocks(shape, layout, offsets, sizes, recv_sizes, block_index, dest_rows):
    """Inverse of `_send_blocks`: the rows of [EP * pair_rows, H] that `_send_blocks` placed (the same
    recv_sizes, block index and dest_rows) go back to their ranks, which place the first sizes[p] rows of
    the block they get from rank p at offsets[p]: [N, H], zeros elsewhere where shape's `zeros` is True or
    the kernels do not run, every other row unspecified otherwise."""
    num_rows, block_rows, axis, zeros = shape

    def branch(rows):
        def send_back(layout, offsets, sizes, recv_sizes, dest_rows):
            received = jax.lax.all_to_all(_take_blocks(layout, recv_sizes, rows, dest_rows), axis, 0, 0)
            if zeros:
                return _compact_blocks(received, offsets, sizes, num_rows)
            return _arrived_rows(received, offsets, sizes, num_rows)

        return send_back

    return _choose_block(block_rows, block_index, branch)(layout, offsets, sizes, recv_sizes, dest_rows)


# Each exchange moves every row to at most one place (nothing elsewhere that any reader uses: zeros, or
# the placed blocks' unspecified rows), so the transpose of one is the other. JAX's own transposes would
# turn the gathers into scatter-adds, several times slower on GPUs.
_send_blocks.defvjp(
    lambda shape, buffer, *sizes: (_send_blocks(shape, buffer, *sizes), sizes),
    lambda shape, saved, cotangent: (_return_blocks(shape, cotangent, *saved), *(None,) * len(saved)),
)
_return_blocks.defvjp(
    lambda shape, layout, *sizes: (_return_blocks(shape, layout, *sizes), sizes),
    lambda shape, saved, cotangent: (_send_blocks(shape, cotangent, *saved), *(None,) * len(saved)),
)


def exchange_sizes(counts_all: jax.Array, rank, layout: EPLayout) -> dict:
    """`dropless_exchange`'s sizes and offsets of this rank's dropless exchange, with "block_index" (the
    padded exchange's block size, `exchange_block_index`): what `dropless_forward` / `dropless_reverse`
    take. counts_all [EP, E]: token_dispatch's counts all-gathered over the EP axis."""
    return dropless_exchange(counts_all, rank, layout) | dict(
        block_index=exchange_block_index(counts_all, layout)
    )


def _padded_exchange_args(sizes: dict) -> tuple:
    """(offsets, sizes of this rank's send buffer, rows it receives from every rank, block index) for
    _send_blocks / _return_blocks."""
    return sizes["input_offsets"], sizes["send_sizes"], sizes["recv_sizes"], sizes["block_index"]


def _ragged(buffer, rows: int, offsets, sizes, remote_offsets, recv_sizes, config: MoEConfig) -> jax.Array:
    """[rows, H] through jax.lax.ragged_all_to_all: rank p gets buffer[offsets[p], +sizes[p]) at its
    remote_offsets[p]; recv_sizes[p] rows arrive from rank p; zeros elsewhere."""
    result = jnp.zeros((rows, buffer.shape[1]), buffer.dtype)
    return jax.lax.ragged_all_to_all(
        buffer, result, offsets, sizes, remote_offsets, recv_sizes, axis_name=config.ep_axis
    )


def dropless_forward(send, sizes: dict, layout: EPLayout, config: MoEConfig):
    """Send buffer [send_rows, H] -> source-major receive buffer [recv_rows, H] (rows from rank p at
    recv_offsets[p], zeros after the received rows); `sizes` from exchange_sizes. The layer runs the padded
    exchange without this compaction of the blocks (`exchanged_experts`)."""
    if config.exchange == "ragged":
        keys = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
        return _ragged(send, layout.recv_rows, *(sizes[key] for key in keys), config)
    shape = (send.shape[0], layout.exchange_block_rows, config.ep_axis, True)
    blocks = _send_blocks(shape, send, *_padded_exchange_args(sizes), None)
    blocks = blocks.reshape(layout.ep_size, layout.pair_rows, -1)
    return _compact_blocks(blocks, sizes["recv_offsets"], sizes["recv_sizes"], layout.recv_rows)


def dropless_reverse(recv, sizes: dict, layout: EPLayout, config: MoEConfig):
    """Receive buffer [recv_rows, H] -> every row back to its place in the send buffer [send_rows, H]."""
    if config.exchange == "ragged":
        keys = ("recv_offsets", "recv_sizes", "return_offsets", "send_sizes")
        return _ragged(recv, layout.send_rows, *(sizes[key] for key in keys), config)
    blocks = _block_rows(recv, sizes["recv_offsets"], sizes["recv_sizes"], layout.pair_rows)
    blocks = blocks.reshape(-1, recv.shape[1])
    shape = (layout.send_rows, layout.exchange_block_rows, config.ep_axis, True)
    return _return_blocks(shape, blocks, *_padded_exchange_args(sizes), None)


def dropless_experts(send, counts, experts: ExpertWeights, layout: EPLayout, config: MoEConfig):
    """Dropless, EP > 1: send buffer [send_rows, H] and its counts per expert [E] -> expert outputs in the
    same rows, through the EP group's experts. The grouped GEMMs read the received rows in expert-major
    order and write the results back in the received order. With the padded exchange the receiver places
    the arriving blocks straight in expert-major order (block p: source p's chunks, then its unused rows as
    one more chunk, ordered after every expert's rows) and takes the departing blocks out of it, so the
    GEMMs read and write their rows in order and nothing else copies them."""
    ep, local = layout.ep_size, layout.local_experts
    counts_all = jax.lax.all_gather(counts, config.ep_axis)  # [EP, E]
    sizes = exchange_sizes(counts_all, jax.lax.axis_index(config.ep_axis), layout)
    group_sizes = sizes["group_sizes"]
    if config.exchange == "padded":
        unused = layout.pair_rows - sizes["recv_sizes"]
        chunk_sizes = jnp.concatenate([sizes["chunk_sizes"].reshape(ep, local), unused[:, None]], axis=1)
        chunk_sizes = chunk_sizes.reshape(-1)  # [EP * (L + 1)]
        rows = ep * layout.pair_rows
        destinations = expert_major_rows(chunk_sizes, layout, True, rows, destinations=True)
        # The combine reads only the rows it dispatched: the returning rows need no zeros around them.
        block = (send.shape[0], layout.exchange_block_rows, config.ep_axis, False)
        sent = (*_padded_exchange_args(sizes), destinations)
        expert_major = _send_blocks(block, send, *sent)
        return _return_blocks(block, expert_mlp(expert_major, group_sizes, experts, config), *sent)
    recv = dropless_forward(send, sizes, layout, config)
    order = expert_major_rows(sizes["chunk_sizes"], layout, False, recv.shape[0])
    return dropless_reverse(expert_mlp(recv, group_sizes, experts, config, order), sizes, layout, config)
