"""Expert-parallel MoE layer: router -> dispatch -> all-to-all -> grouped GEMMs -> all-to-all -> combine.

`moe(x, gate, gate_up, down, topk=..., mesh=...)` is a pure function (jit- and grad-safe, static shapes, no
host sync). Tokens are sharded over (data axes..., EP axis) on their batch axis, experts over the EP axis
(expert e lives on EP rank e // L, L = E / EP). Every token shard runs, inside one `jax.shard_map`:

    logits = x @ gate (fp32) -> fused top-k (indices) -> aux loss (global: counts psum-ed over all token
    shards, partial losses psum-ed) -> token_dispatch (aligned, or capacity C) -> exchange ->
    grouped_matmul(x, gate_up) reading the received rows in expert-major order -> activation ->
    grouped_matmul(., down) writing them back in the received order -> reverse exchange -> token_combine
    with the merging probs.

The received rows arrive grouped by source rank. The padded exchange places them straight in expert-major
order (and takes the results back out of it) by the chunk sort's row map (`_expert_major_rows`: the
chunk-sort kernel's map of zero columns); after the ragged or capacity exchange the grouped GEMMs read and
write them through that permutation instead. Either way no chunk sort copies them before and after the
GEMMs (nor back in the backward pass).

The exchange sizes and static buffer sizes come from moetriton.kernels.rules.expert_parallel (`ep_layout`,
`dropless_exchange`, `dropped_slots`); nothing here re-derives them. Two exchanges move the same rows:

* "ragged": `jax.lax.ragged_all_to_all` into the static receive buffer (GPU meshes spanning processes);
* "padded": every (source, destination) pair's rows padded to one block size and moved with a fixed-size
  `jax.lax.all_to_all`: the smallest of `EPLayout.exchange_block_rows` that holds the step's largest pair
  (one `lax.switch` branch per size; every rank picks the same one from the all-gathered counts). The
  receiver places the rows each source sent into the static worst-case layout, in expert-major order
  (moetriton.kernels.exchange: those rows copied, nothing else written; each block's unused rows a last
  chunk, ordered after the experts' rows), takes the results back out the same way, and the sending side
  compacts what comes back.
  Each direction's transpose is the other direction. "auto" picks this on one host: XLA:CPU has no
  ragged all-to-all, and XLA's GPU one is slower than this between the GPUs of one host
  (`_resolve_exchange`).

The capacity policy needs neither: every (source, expert) pair owns exactly C rows, so one fixed-size
all_to_all moves [L, C] slabs. Gradients are our ops' custom_vjp rules plus JAX's transposes of the
collectives. The grouped GEMMs are moetriton's (`grouped_matmul`: Triton kernels with their VJP; XLA lowers
ragged_dot to E-times-padded dots on GPUs). Never imports torch or flax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from moetriton import kernels
from moetriton.kernels.rules import moe as layer_rules
from moetriton.kernels.rules.expert_parallel import (
    EPLayout,
    dropless_exchange,
    dropped_slots,
    ep_layout,
    exchange_block_index,
)

from .activation import grouped_activation
from .api import sort_chunks_by_index, token_combine, token_dispatch
from .executor import run_plan, uses_kernels
from .grouped_gemm import grouped_matmul
from .router import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss, fused_topk_with_score_function

#: Row exchanges and expert activations: the shared layer rules' names (moetriton.kernels.rules.moe).
EXCHANGES = layer_rules.JAX_EXCHANGES
ACTIVATIONS = layer_rules.ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static configuration of one layer call (hashable: the jit cache key)."""

    topk: int
    score_function: str
    use_pre_softmax: bool
    num_groups: int | None
    group_topk: int | None
    scaling_factor: float | None
    aux_loss_coeff: float
    align_size: int | None
    capacity_factor: float | None
    activation: str
    dtype: str
    mesh: Mesh | None
    ep_axis: str | None
    data_axes: tuple[str, ...]
    exchange: str  # "ragged" or "padded" (resolved)
    num_shards: int  # token shards: the product of the data axes' and the EP axis' sizes
    ep_size: int

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.data_axes + ((self.ep_axis,) if self.ep_axis else ())


# Exchanges ------------------------------------------------------------------------------------------------


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


def _place_blocks(blocks: jax.Array, recv_sizes: jax.Array, out_rows: int, dest_rows) -> jax.Array:
    """[EP, rows, H] arriving blocks -> [EP * out_rows, H]: block p's first recv_sizes[p] rows at p *
    out_rows + j, or at dest_rows[p * out_rows + j] ([EP * out_rows] permutation, or None). The kernel
    writes those rows only (the rest unspecified: nothing reads them); XLA's pad and scatter, where the
    kernels do not run, write zeros."""
    ep, rows, hidden = blocks.shape
    if not uses_kernels():
        out = jnp.pad(blocks, ((0, 0), (0, out_rows - rows), (0, 0))).reshape(-1, hidden)
        return out if dest_rows is None else jnp.zeros_like(out).at[dest_rows].set(out, unique_indices=True)
    plan = kernels.place_blocks_plan(
        num_blocks=ep,
        rows=rows,
        out_rows=out_rows,
        width=hidden,
        element_bytes=blocks.dtype.itemsize,
        permuted=dest_rows is not None,
    )
    inputs = dict(blocks=blocks.reshape(-1, hidden), sizes=recv_sizes.astype(jnp.int32), dest_rows=dest_rows)
    (out,) = run_plan(plan, inputs)
    return out


def _take_blocks(layout: jax.Array, recv_sizes: jax.Array, rows: int, dest_rows) -> jax.Array:
    """The inverse of `_place_blocks`: [EP * out_rows, H] -> departing blocks [EP, rows, H], block p's first
    recv_sizes[p] rows from p * out_rows + j (or dest_rows of it); its other rows unspecified (the
    receiving side keeps only the rows it sent)."""
    hidden = layout.shape[1]
    ep = recv_sizes.shape[0]
    if not uses_kernels():
        ordered = layout if dest_rows is None else layout[dest_rows]
        return ordered.reshape(ep, -1, hidden)[:, :rows]
    plan = kernels.take_blocks_plan(
        num_blocks=ep,
        rows=rows,
        out_rows=layout.shape[0] // ep,
        width=hidden,
        element_bytes=layout.dtype.itemsize,
        permuted=dest_rows is not None,
    )
    (blocks,) = run_plan(plan, dict(layout=layout, sizes=recv_sizes.astype(jnp.int32), dest_rows=dest_rows))
    return blocks.reshape(ep, rows, hidden)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _send_blocks(shape, buffer, offsets, sizes, recv_sizes, block_index, dest_rows):
    """Padded exchange out of a send buffer [N, H] of which rank p gets rows [offsets[p], +sizes[p]):
    [EP * pair_rows, H], block p holding the recv_sizes[p] rows rank p sent this rank, each block's row j at
    p * pair_rows + j, or at dest_rows of that ([EP * pair_rows] permutation: the layer's expert-major
    order); every other row unspecified where the kernels run, zeros otherwise. shape = (N, block_rows,
    EP axis name): the all_to_all moves blocks of block_rows[block_index] rows (at least every pair's rows),
    which the receiver places into blocks of the worst case, the last size."""
    _, block_rows, axis = shape

    def branch(rows):
        def send(buffer, offsets, sizes, recv_sizes, dest_rows):
            blocks = jax.lax.all_to_all(_block_rows(buffer, offsets, sizes, rows), axis, 0, 0)
            return _place_blocks(blocks, recv_sizes, block_rows[-1], dest_rows)

        return send

    return _choose_block(block_rows, block_index, branch)(buffer, offsets, sizes, recv_sizes, dest_rows)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _return_blocks(shape, layout, offsets, sizes, recv_sizes, block_index, dest_rows):
    """Inverse of `_send_blocks`: the rows of [EP * pair_rows, H] that `_send_blocks` placed (the same
    recv_sizes, block index and dest_rows) go back to their ranks, which place the first sizes[p] rows of
    the block they get from rank p at offsets[p]: [N, H], zeros elsewhere."""
    num_rows, block_rows, axis = shape

    def branch(rows):
        def send_back(layout, offsets, sizes, recv_sizes, dest_rows):
            received = jax.lax.all_to_all(_take_blocks(layout, recv_sizes, rows, dest_rows), axis, 0, 0)
            return _compact_blocks(received, offsets, sizes, num_rows)

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
    exchange without this compaction of the blocks (`_exchanged_experts`)."""
    if config.exchange == "ragged":
        keys = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
        return _ragged(send, layout.recv_rows, *(sizes[key] for key in keys), config)
    shape = (send.shape[0], layout.exchange_block_rows, config.ep_axis)
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
    shape = (layout.send_rows, layout.exchange_block_rows, config.ep_axis)
    return _return_blocks(shape, blocks, *_padded_exchange_args(sizes), None)


def _capacity_exchange(buffer: jax.Array, layout: EPLayout, config: MoEConfig) -> jax.Array:
    """Capacity policy, either direction: [EP * L * C, H] -> [EP * L * C, H], the [L, C] slab for rank r
    swapped with rank r's slab for this rank (the exchange is its own inverse)."""
    if layout.ep_size == 1:
        return buffer
    slabs = buffer.reshape(layout.ep_size, -1, buffer.shape[1])
    return jax.lax.all_to_all(slabs, config.ep_axis, 0, 0).reshape(buffer.shape)


# One token shard --------------------------------------------------------------------------------------------


def _experts(
    rows: jax.Array, group_sizes: jax.Array, gate_up, down, config: MoEConfig, order: jax.Array | None = None
) -> jax.Array:
    """Grouped expert MLP on rows [N, H] with group_sizes [L]: expert-major rows, or rows[order] expert-major
    (order [N]: a row permutation), the result in the rows' order. Rows past the groups are left
    unspecified, forward and backward: every caller's buffer is sized for a worst case (up to EP times the
    routed rows) and reads back only the groups' rows, so no kernel streams the tail."""
    dtype = jnp.dtype(config.dtype)
    hidden = grouped_matmul(
        rows.astype(dtype), gate_up.astype(dtype), group_sizes, lhs_rows=order, zero_tail=False
    )
    act = grouped_activation(hidden, group_sizes, config.activation)
    return grouped_matmul(act, down.astype(dtype), group_sizes, out_rows=order, zero_tail=False)


def _expert_major_rows(
    chunk_sizes: jax.Array, layout: EPLayout, gaps: bool, rows: int, destinations: bool = False
) -> jax.Array:
    """[rows] int32 row permutation of the chunk sort to expert-major order (`EPLayout.expert_major_order`
    of source-major chunks of chunk_sizes): row i of the sorted buffer is row result[i] of the unsorted one
    (the row map of the inverse sort), or with `destinations` source-major row r goes to row result[r]
    (the sort's own row map); rows past the chunks stay in place. The chunk-sort kernel writes the map;
    sorting zero columns moves nothing else."""
    to_expert_major = jnp.asarray(layout.expert_major_order(gaps=gaps), jnp.int32)
    no_columns = jnp.zeros((rows, 0), jnp.float32)
    if destinations:
        return sort_chunks_by_index(no_columns, chunk_sizes, to_expert_major)[1]
    to_source_major = jnp.asarray(layout.source_major_order(gaps=gaps), jnp.int32)
    return sort_chunks_by_index(no_columns, chunk_sizes[to_expert_major], to_source_major)[1]


def _router(x_flat, gate, expert_bias, config: MoEConfig, num_tokens_global: int):
    """(merging weights [T, K] fp32, indices [T, K] int32, routed slots per expert [E] int32, partial aux
    loss of this shard (fp32 scalar; the psum over token shards is the global loss))."""
    logits = jnp.dot(x_flat, gate.astype(x_flat.dtype), preferred_element_type=jnp.float32)  # [T, E]
    probs, routing_map, indices = fused_topk_with_score_function(
        logits,
        config.topk,
        config.use_pre_softmax,
        config.num_groups,
        config.group_topk,
        config.scaling_factor,
        config.score_function,
        None if expert_bias is None else jax.lax.stop_gradient(expert_bias.astype(jnp.float32)),
        return_indices=True,
    )
    weights = jnp.take_along_axis(probs, indices, axis=1)
    routed = routing_map.sum(0, dtype=jnp.int32)
    if config.aux_loss_coeff == 0 or num_tokens_global == 0:  # no tokens anywhere: no loss
        return weights, indices, routed, jnp.zeros((), jnp.float32)
    _, scores = fused_compute_score_for_moe_aux_loss(logits, config.topk, config.score_function)
    routed_global = jax.lax.psum(routed, config.token_axes) if config.token_axes else routed
    num_experts = gate.shape[1]
    loss = fused_moe_aux_loss(
        scores, routed_global, num_tokens_global, num_experts, config.topk, config.aux_loss_coeff
    )
    return weights, indices, routed, loss.astype(jnp.float32)


def _shard(x, gate, gate_up, down, expert_bias, *, config: MoEConfig):
    """What one token shard computes: x [B_local, S, H] -> (out [B_local, S, H], aux loss, dropped)."""
    shape = x.shape
    num_tokens, hidden = shape[0] * shape[1], shape[2]
    num_experts = gate.shape[1]
    layout = ep_layout(
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=config.topk,
        ep_size=config.ep_size,
        align_size=config.align_size,
        capacity_factor=config.capacity_factor,
    )
    x_flat = x.reshape(num_tokens, hidden)
    weights, indices, routed, aux_loss = _router(
        x_flat, gate, expert_bias, config, num_tokens * config.num_shards
    )
    tokens = x_flat.astype(config.dtype)
    if layout.dropless:
        send, _, row_id_map, pad_offsets, counts = token_dispatch(
            tokens, indices=indices, num_experts=num_experts, align_size=layout.align_size
        )
    else:
        send, _, row_id_map, pad_offsets, counts = token_dispatch(
            tokens, indices=indices, num_experts=num_experts, capacity=layout.capacity
        )
    if layout.ep_size == 1:
        # One EP rank: the send buffer is the receive buffer, already expert-major.
        expert_out = _experts(send, counts, gate_up, down, config)
    else:
        expert_out = _exchanged_experts(send, counts, gate_up, down, layout, config)
    out = token_combine(expert_out, row_id_map, weights, pad_offsets)
    dropped = dropped_slots(routed, layout).astype(jnp.int32)
    if config.token_axes:
        aux_loss = jax.lax.psum(aux_loss, config.token_axes)
        dropped = jax.lax.psum(dropped, config.token_axes)
    return out.astype(x.dtype).reshape(shape), aux_loss, dropped


def _exchanged_experts(send, counts, gate_up, down, layout: EPLayout, config: MoEConfig):
    """Send buffer [send_rows, H] -> expert outputs in the same rows, through the EP group's experts.
    The grouped GEMMs read the received rows in expert-major order and write the results back in the
    received order. With the padded dropless exchange the receiver places the arriving blocks straight in
    expert-major order (block p: source p's chunks, then its unused rows as one more chunk, ordered after
    every expert's rows) and takes the departing blocks out of it, so the GEMMs read and write their rows
    in order and nothing else copies them."""
    ep, local = layout.ep_size, layout.local_experts
    if layout.dropless:
        counts_all = jax.lax.all_gather(counts, config.ep_axis)  # [EP, E]
        sizes = exchange_sizes(counts_all, jax.lax.axis_index(config.ep_axis), layout)
        group_sizes = sizes["group_sizes"]
        if config.exchange == "padded":
            unused = layout.pair_rows - sizes["recv_sizes"]
            chunk_sizes = jnp.concatenate([sizes["chunk_sizes"].reshape(ep, local), unused[:, None]], axis=1)
            chunk_sizes = chunk_sizes.reshape(-1)  # [EP * (L + 1)]
            rows = ep * layout.pair_rows
            destinations = _expert_major_rows(chunk_sizes, layout, True, rows, destinations=True)
            block = (send.shape[0], layout.exchange_block_rows, config.ep_axis)
            sent = (*_padded_exchange_args(sizes), destinations)
            expert_major = _send_blocks(block, send, *sent)
            return _return_blocks(block, _experts(expert_major, group_sizes, gate_up, down, config), *sent)
        chunk_sizes = sizes["chunk_sizes"]
        recv = dropless_forward(send, sizes, layout, config)

        def back(rows):
            return dropless_reverse(rows, sizes, layout, config)

    else:
        chunk_sizes = jnp.full((ep * local,), layout.capacity, jnp.int32)
        group_sizes = jnp.full((local,), ep * layout.capacity, jnp.int32)
        recv = _capacity_exchange(send, layout, config)

        def back(rows):
            return _capacity_exchange(rows, layout, config)

    order = _expert_major_rows(chunk_sizes, layout, False, recv.shape[0])
    return back(_experts(recv, group_sizes, gate_up, down, config, order))


# Public API ------------------------------------------------------------------------------------------------


def _resolve_exchange(exchange: str, mesh: Mesh | None) -> str:
    """ "ragged" or "padded": the exchange the call runs ("all_to_all" is "ragged")."""
    if exchange != "auto":
        return "ragged" if exchange == "all_to_all" else exchange
    # XLA:CPU has no ragged-all-to-all. Between the GPUs of one host XLA's ragged-all-to-all was far slower
    # than the padded exchange (docs/moe.md, "Row exchange"; https://github.com/openxla/xla/issues/33386
    # reports the same on B200s): only EP groups spanning several processes (hosts) use it.
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    on_gpus = all(device.platform == "gpu" for device in devices)
    several_processes = len({device.process_index for device in devices}) > 1
    return "ragged" if on_gpus and several_processes else "padded"


def _check_mesh(mesh: Mesh | None, ep_axis: str | None, data_axes: tuple[str, ...]) -> tuple[int, int]:
    """(EP size, token shards) of the mesh arguments."""
    if mesh is None:
        if data_axes:
            raise ValueError(f"data_axes: expected () without a mesh, got {data_axes}")
        return 1, 1
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    for name, axis in [("ep_axis", ep_axis)] * (ep_axis is not None) + [("data_axes", a) for a in data_axes]:
        if axis not in mesh.shape:
            raise ValueError(
                f"{name}: expected a mesh axis name, one of {tuple(mesh.axis_names)}, got {axis!r}"
            )
    if ep_axis in data_axes or len(set(data_axes)) != len(data_axes):
        raise ValueError(f"data_axes: expected distinct axes other than ep_axis {ep_axis!r}, got {data_axes}")
    ep_size = mesh.shape[ep_axis] if ep_axis is not None else 1
    return ep_size, ep_size * math.prod(mesh.shape[axis] for axis in data_axes)


def moe(
    x: jax.Array,
    gate: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    topk: int,
    expert_bias: jax.Array | None = None,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    aux_loss_coeff: float = 0.0,
    align_size: int | None = None,
    capacity_factor: float | None = None,
    activation: str = "swiglu",
    dtype=None,
    mesh: Mesh | None = None,
    ep_axis: str | None = "ep",
    data_axes: tuple[str, ...] = (),
    exchange: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A mixture-of-experts MLP layer with expert parallelism.

    Args:
        x: [B, S, H] tokens, any float dtype; B must be a multiple of the token shards (the product of the
            sizes of `data_axes` and `ep_axis`).
        gate: [H, E] router weights. Logits are x @ gate accumulated in fp32 and kept in fp32.
        gate_up: [E, H, 2F] fused gate and up projections for a gated activation ("swiglu", "geglu": the first
            F columns are the gate, the last F the up projection), or [E, H, F] for "gelu" / "relu".
        down: [E, F, H] down projections.
        topk: K experts per token (1 <= K <= E).
        expert_bias: [E] selection bias (sigmoid / sqrtsoftplus only; no gradient).
        score_function, use_pre_softmax, num_groups, group_topk, scaling_factor: the router's options, as in
            `fused_topk_with_score_function`.
        aux_loss_coeff: weight of the load-balancing loss (0 disables it; the loss is then 0). The loss is
            global: the same value and gradients as the unsharded layer's.
        align_size: rows of every expert block rounded up to a multiple of this (grouped-GEMM tiles).
        capacity_factor: None for the dropless policy; c > 0 for the capacity policy: every (token shard,
            expert) pair keeps its first C = align * max(1, ceil(c * T * K / (E * align))) routed slots in
            token order (earlier tokens win) and drops the rest (a dropped slot adds nothing to its token; the
            other weights are not renormalised). T is the tokens of one shard.
        activation: "swiglu" (default), "geglu", "gelu" or "relu".
        dtype: compute dtype of the dispatched tokens, the expert weights and the grouped GEMMs (default
            x.dtype). The router runs in fp32; the output is in x.dtype.
        mesh: the device mesh (None: one device, no collectives). Tokens are sharded over
            (*data_axes, ep_axis) on B, the expert axis of gate_up / down over ep_axis, gate and expert_bias
            replicated; inputs in other shardings are resharded by jit (FSDP-sharded weights are
            all-gathered).
        ep_axis: the mesh axis of expert parallelism (None: no EP, experts replicated); E must be a multiple
            of its size.
        data_axes: further mesh axes sharding the tokens (data / FSDP parallelism).
        exchange: "auto", "all_to_all" (`jax.lax.ragged_all_to_all`; also named "ragged") or "padded"
            (fixed-size all_to_all of every pair's rows padded to the step's largest pair, rounded up to one
            of a few sizes). Both move the same rows and give the same results. "auto" picks the ragged one
            when the mesh's GPUs span several processes and "padded" otherwise: XLA's ragged all-to-all is
            far slower than the padded exchange between the GPUs of one host (docs/moe.md).

    Returns:
        (out [B, S, H] in x.dtype, aux_loss fp32 scalar, dropped int32 scalar: routed slots the capacity
        policy dropped over all token shards, 0 for dropless).

    Example:
        >>> mesh = jax.make_mesh((4,), ("ep",))
        >>> out, aux_loss, dropped = moe(x, gate, gate_up, down, topk=2, mesh=mesh, aux_loss_coeff=1e-2)
    """
    layer_rules.check_options(
        activation=activation,
        score_function=score_function,
        aux_loss_coeff=aux_loss_coeff,
        exchange=exchange,
        exchanges=EXCHANGES,
    )
    if x.ndim != 3:
        raise ValueError(f"x: expected rank 3 [B, S, H], got shape {tuple(x.shape)}")
    if gate.ndim != 2:
        raise ValueError(f"gate: expected [H, E], got shape {list(gate.shape)}")
    hidden, num_experts = gate.shape
    layer_rules.check_weights(
        x_shape=tuple(x.shape),
        gate=("gate", "[H, E]", num_experts, hidden),
        gate_up=tuple(gate_up.shape),
        down=tuple(down.shape),
        expert_bias=None if expert_bias is None else tuple(expert_bias.shape),
        experts_held=None,
        activation=activation,
        score_function=score_function,
    )
    for name, array in (("x", x), ("gate", gate), ("gate_up", gate_up), ("down", down)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {array.dtype}")
    batch = x.shape[0]
    data_axes = tuple(data_axes)
    ep_size, num_shards = _check_mesh(mesh, ep_axis if mesh is not None else None, data_axes)
    if batch % num_shards:
        raise ValueError(
            f"x: expected a batch size B that is a multiple of the token shards {num_shards}, got {batch}"
        )
    # Validates topk, E against the EP size, align_size and capacity_factor with the layout's messages.
    ep_layout(
        num_tokens=batch // num_shards * x.shape[1],
        num_experts=num_experts,
        topk=topk,
        ep_size=ep_size,
        align_size=align_size,
        capacity_factor=capacity_factor,
    )
    config = MoEConfig(
        topk=topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        aux_loss_coeff=float(aux_loss_coeff),
        align_size=align_size,
        capacity_factor=None if capacity_factor is None else float(capacity_factor),
        activation=activation,
        dtype=jnp.dtype(dtype or x.dtype).name,
        mesh=mesh,
        ep_axis=ep_axis if mesh is not None else None,
        data_axes=data_axes,
        exchange=_resolve_exchange(exchange, mesh),
        num_shards=num_shards,
        ep_size=ep_size,
    )
    return _moe(x, gate, gate_up, down, expert_bias, config)


@partial(jax.jit, static_argnums=(5,))
def _moe(x, gate, gate_up, down, expert_bias, config: MoEConfig):
    if config.mesh is None:
        return _shard(x, gate, gate_up, down, expert_bias, config=config)
    tokens = PartitionSpec(config.token_axes or None)
    experts = PartitionSpec(config.ep_axis)
    arrays = (x, gate, gate_up, down) + ((expert_bias,) if expert_bias is not None else ())
    specs = (tokens, PartitionSpec(), experts, experts, PartitionSpec())[: len(arrays)]

    def body(x, gate, gate_up, down, expert_bias=None):
        return _shard(x, gate, gate_up, down, expert_bias, config=config)

    # check_vma=False: our ops' custom_vjp rules and host callbacks do not carry varying-axis types; every
    # collective here is explicit, and JAX still psums the gradients of replicated inputs.
    sharded = jax.shard_map(
        body,
        mesh=config.mesh,
        in_specs=specs,
        out_specs=(tokens, PartitionSpec(), PartitionSpec()),
        check_vma=False,
    )
    return sharded(*arrays)
