"""Pure-JAX reference of every moetriton op: vectorised, differentiable, independent of the kernels.

Used as the test oracle, as the fallback when no kernel can run (no GPU and TRITON_INTERPRET unset, or
inside a partitioned computation on CPU), and as a benchmark baseline. Row maps come from a stable argsort of
expert ids (the kernels count and scan instead); rows move by scatter and gather, so data movement matches the
kernels bit for bit. Combine accumulates in fp32 in ascending slot order like the kernels; XLA may contract a
multiply and an add into one fused multiply-add, so weighted sums can differ from the kernels in the last bit.

The op-level functions (`dispatch`, `combine`, ...) return what one shard of a moetriton.jax op computes, with
None for absent optional results; the public-API mirrors (`token_dispatch`, `token_combine`,
`sort_chunks_by_index`) take the arguments of moetriton.jax's functions (without `num_shards`) and are what
tests differentiate. `argsort_dispatch` / `argsort_combine` are a MaxText-style gather-based baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetriton.kernels import buffer_rows, row_map_slots
from moetriton.kernels.rules import permutation as rules
from moetriton.kernels.rules.layout import bitmap_columns, round_up

_BIT_DTYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _asarray(x: jax.Array | None) -> jax.Array | None:
    return None if x is None else jnp.asarray(x)


def _acc_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _move_rows(values: jax.Array, dst: jax.Array, src: jax.Array, num_rows: int) -> jax.Array:
    """out[dst[i]] = values[src[i]] (entries with dst[i] == num_rows are dropped); every other row zero.

    Float payloads wider than a byte move as floats (differentiable); everything else moves as raw bits.
    """
    shape = (num_rows, *values.shape[1:])
    if num_rows == 0 or values.shape[0] == 0 or src.shape[0] == 0:
        return jnp.zeros(shape, values.dtype)
    if jnp.issubdtype(values.dtype, jnp.floating) and values.dtype.itemsize > 1:
        return jnp.zeros(shape, values.dtype).at[dst].set(values[src], mode="drop")
    bits = jax.lax.bitcast_convert_type(values, _BIT_DTYPES[values.dtype.itemsize])
    moved = jnp.zeros(shape, bits.dtype).at[dst].set(bits[src], mode="drop")
    return jax.lax.bitcast_convert_type(moved, values.dtype)


def pack_bitmap(mask: jax.Array) -> jax.Array:
    """bool [T, E] -> uint8 [T, ceil(E / 8)]: bit e % 8 of byte e // 8 is mask[:, e] (LSB first), unused high
    bits 0."""
    num_tokens, num_experts = mask.shape
    columns = bitmap_columns(num_experts)
    padded = jnp.pad(mask.astype(jnp.int32), [(0, 0), (0, columns * 8 - num_experts)])
    weights = jnp.left_shift(1, jnp.arange(8, dtype=jnp.int32))
    return (padded.reshape(num_tokens, columns, 8) * weights).sum(-1).astype(jnp.uint8)


def unpack_bitmap(bitmap: jax.Array, num_experts: int) -> jax.Array:
    """uint8 [T, ceil(E / 8)] -> bool [T, E]: the first E bits of each row, LSB first (later bits ignored)."""
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    return ((bitmap[:, experts // 8].astype(jnp.int32) >> (experts % 8)) & 1) != 0


def row_map(
    routing: jax.Array,
    num_experts: int,
    is_mask: bool,
    num_rows: int,
    align: int,
    capacity: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row map [T, 2S + 2], rows per expert in the buffer [E] and pad offsets [E] (all int32).

    A slot's row is its expert's (padded) block start plus its rank among that expert's slots in
    (token, slot) order; slots past the buffer, with no expert, or with an id outside [0, E) get -1. With a
    capacity every block has `capacity` rows, and slots ranked past it in their expert get -1.
    """
    num_tokens, num_slots = routing.shape
    if is_mask:
        valid = routing != 0
        experts = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), routing.shape)
    else:
        # Compared in the ids' own dtype, narrowed after: with x64 an int64 id of 2**32 has no expert.
        valid = (routing >= 0) & (routing < num_experts)
        experts = jnp.where(valid, routing, num_experts).astype(jnp.int32)
    flat = jnp.where(valid, experts, num_experts).reshape(-1)
    counts = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    aligned = jnp.full_like(counts, capacity) if capacity else round_up(counts, align)
    start = jnp.cumsum(aligned, dtype=jnp.int32) - aligned
    plain_start = jnp.cumsum(counts, dtype=jnp.int32) - counts
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    pad = jnp.zeros(1, jnp.int32)
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - jnp.concatenate([plain_start, pad])[sorted_experts]
    sorted_rows = jnp.concatenate([start, pad])[sorted_experts] + rank
    rows = jnp.zeros_like(flat).at[order].set(sorted_rows)
    keep = valid.reshape(-1) & (rows < num_rows)
    if capacity:
        keep &= jnp.zeros_like(flat).at[order].set(rank) < capacity
    rows = jnp.where(keep, rows, -1)
    end = jnp.minimum(aligned.sum(), num_rows)
    kept = jnp.minimum(jnp.maximum(num_rows - start, 0), aligned)
    rows = rows.reshape(num_tokens, num_slots)
    has_row = rows >= 0
    # The lists: slots with a row first (ascending), then -1, and their rows in the same order.
    slot_ids = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), rows.shape)
    listed = jnp.sort(jnp.where(has_row, slot_ids, num_slots + slot_ids), axis=1)
    is_listed = listed < num_slots
    listed_rows = jnp.where(is_listed, jnp.take_along_axis(rows, listed % max(num_slots, 1), axis=1), -1)
    full_map = jnp.concatenate(
        [
            listed_rows,
            jnp.where(is_listed, listed, -1),
            has_row.sum(axis=1, keepdims=True, dtype=jnp.int32),
            jnp.full((num_tokens, 1), end, jnp.int32),
        ],
        axis=1,
    )
    return full_map.astype(jnp.int32), kept.astype(jnp.int32), (start - plain_start).astype(jnp.int32)


def _lists(row_id_map: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """A row map's two lists, [T, S] each: the rows of each token's slots that have one and those slots,
    in ascending slot order, then -1. Read by the index rule of the kernels (docs/design.md): only the
    first `count` entries (clamped into [0, S]) are listed, a row outside [0, num_rows) makes its entry
    unlisted, and a slot outside [0, S) reads as -1 (weight 0)."""
    num_slots = row_map_slots(row_id_map.shape[1])
    listed_rows = row_id_map[:, :num_slots]
    listed = row_id_map[:, num_slots : 2 * num_slots]
    count = jnp.clip(row_id_map[:, 2 * num_slots : 2 * num_slots + 1], 0, num_slots)
    positions = jnp.arange(num_slots, dtype=jnp.int32)
    live = (positions < count) & (listed_rows >= 0) & (listed_rows < num_rows)
    listed = jnp.where((listed >= 0) & (listed < num_slots), listed, -1)
    return jnp.where(live, listed_rows, -1), jnp.where(live, listed, -1)


def _rows(row_id_map: jax.Array, num_rows: int) -> jax.Array:
    """[T, S] destination rows of a row map's slots (-1: none)."""
    listed_rows, listed = _lists(row_id_map, num_rows)
    num_slots = listed.shape[1]
    tokens = jnp.broadcast_to(jnp.arange(row_id_map.shape[0], dtype=jnp.int32)[:, None], listed.shape)
    # Padding entries (-1) point past the last slot, where the scatter drops them.
    rows = jnp.full(listed.shape, -1, jnp.int32)
    return rows.at[tokens, jnp.where(listed >= 0, listed, num_slots)].set(listed_rows, mode="drop")


def _entries(row_id_map: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token, slot, destination row) of every list entry, flattened in (token, position) order: the
    (token, slot) order for a map from token_dispatch. Unlisted entries point at `num_rows`, which scatters
    drop; slots out of range are -1."""
    listed_rows, listed = _lists(row_id_map, num_rows)
    tokens = jnp.broadcast_to(jnp.arange(listed.shape[0], dtype=jnp.int32)[:, None], listed.shape)
    dst = jnp.where(listed_rows >= 0, listed_rows, num_rows)
    return tokens.reshape(-1), listed.reshape(-1), dst.reshape(-1)


def dispatch(
    inp: jax.Array,
    routing: jax.Array,
    probs: jax.Array | None,
    scales: jax.Array | None,
    num_experts: int,
    is_mask: bool,
    num_out_tokens: int | None,
    align_size: int | None,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array, jax.Array, jax.Array]:
    """One shard of token_dispatch: (output [N, H], permuted_probs [N] | None, permuted_scales [N, C] | None,
    row_id_map [T, 2S + 2], pad_offsets [E], tokens_per_expert [E]). A mask may come as a "bitmap" (uint8
    [T, ceil(E / 8)]): its unpacked [T, E] bits route."""
    if routing_map_format == "bitmap":
        routing = unpack_bitmap(routing, num_experts)
    num_rows = buffer_rows(num_out_tokens, num_experts, align_size, capacity)
    full_map, kept, pad_offsets = row_map(routing, num_experts, is_mask, num_rows, align_size or 1, capacity)
    tokens, slots, dst = _entries(full_map, num_rows)
    output = _move_rows(inp, dst, tokens, num_rows)
    flat_slots = tokens * routing.shape[1] + jnp.maximum(slots, 0)
    permuted_probs = None if probs is None else _move_rows(probs.reshape(-1), dst, flat_slots, num_rows)
    permuted_scales = None if scales is None else _move_rows(scales, dst, tokens, num_rows)
    return output, permuted_probs, permuted_scales, full_map, pad_offsets, kept


def combine(inp: jax.Array, row_id_map: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """One shard of token_combine: per token, the sum over its slots in ascending order of w * inp[row]
    (w = 1 without weights), in fp32 (fp64 for fp64 input), cast to inp.dtype."""
    acc_dtype = _acc_dtype(inp.dtype)
    listed_rows, listed = _lists(row_id_map, inp.shape[0])
    num_tokens = listed.shape[0]
    acc = jnp.zeros((num_tokens, inp.shape[1]), acc_dtype)
    if inp.shape[0] == 0 or num_tokens == 0:
        return acc.astype(inp.dtype)
    # The weight of every listed slot (0 past the list and for a slot out of range), so the scan walks
    # positions of the lists: the slots in ascending order.
    listed_weights = None
    if weights is not None:
        listed_weights = jnp.take_along_axis(weights, jnp.maximum(listed, 0), axis=1)
        listed_weights = jnp.where(listed >= 0, listed_weights, 0)

    def add_slot(acc, position):
        position_rows, position_weights = position
        term = inp[jnp.maximum(position_rows, 0)].astype(acc_dtype)
        if position_weights is not None:
            term = term * position_weights.astype(acc_dtype)[:, None]
        return jnp.where((position_rows >= 0)[:, None], acc + term, acc), None

    scanned = (listed_rows.T, None if listed_weights is None else listed_weights.T)
    acc, _ = jax.lax.scan(add_slot, acc, scanned)
    return acc.astype(inp.dtype)


def dispatch_backward(
    grad_output: jax.Array, grad_permuted_probs: jax.Array | None, row_id_map: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """Backward of one dispatch shard: (grad_inp [T, H], the combined cotangent; grad_probs [T, S] / None)."""
    grad_inp = combine(grad_output, row_id_map)
    if grad_permuted_probs is None:
        return grad_inp, None
    rows = _rows(row_id_map, grad_output.shape[0])
    if grad_permuted_probs.shape[0] == 0:
        return grad_inp, jnp.zeros(rows.shape, grad_permuted_probs.dtype)
    gathered = grad_permuted_probs[jnp.maximum(rows, 0)]
    return grad_inp, jnp.where(rows >= 0, gathered, jnp.zeros_like(gathered))


def scatter_rows(grad: jax.Array, row_id_map: jax.Array, num_rows: int) -> jax.Array:
    """Backward of one unweighted combine shard: grad [T, H] copied to the rows of its slots, others zero."""
    tokens, _, dst = _entries(row_id_map, num_rows)
    return _move_rows(grad, dst, tokens, num_rows)


def combine_backward(
    grad: jax.Array, row_id_map: jax.Array, inp: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Backward of one weighted combine shard: grad_inp[row(t, s)] = g[t] * w[t, s] (fp32, cast to inp.dtype;
    rows no slot owns are zero) and grad_weights[t, s] = <inp[row(t, s)], g[t]> in fp32 (0 without a row)."""
    acc_dtype = _acc_dtype(inp.dtype)
    num_rows = inp.shape[0]
    if num_rows == 0 or row_id_map.shape[0] == 0:
        return jnp.zeros_like(inp), jnp.zeros(weights.shape, weights.dtype)
    tokens, slots, dst = _entries(row_id_map, num_rows)
    has_slot = slots >= 0
    entry_weights = jnp.where(has_slot, weights[tokens, jnp.maximum(slots, 0)], 0).astype(acc_dtype)
    # Every row takes the gradient of the entry that names it (a map from token_dispatch names each row once).
    owned = jnp.zeros(num_rows, bool).at[dst].set(True, mode="drop")
    owner = jnp.zeros(num_rows, jnp.int32).at[dst].set(jnp.arange(dst.shape[0], dtype=jnp.int32), mode="drop")
    grad_rows = grad[tokens[owner]].astype(acc_dtype)
    scaled = (grad_rows * entry_weights[owner][:, None]).astype(inp.dtype)
    grad_inp = jnp.where(owned[:, None], scaled, 0)
    live = dst < num_rows
    dots = jnp.sum(inp[jnp.where(live, dst, 0)].astype(acc_dtype) * grad[tokens].astype(acc_dtype), axis=1)
    dots = jnp.where(live & has_slot, dots, 0)
    grad_weights = jnp.zeros(weights.shape, acc_dtype).at[tokens, jnp.maximum(slots, 0)].add(dots)
    return grad_inp, grad_weights.astype(weights.dtype)


def is_partition(split_sizes: jax.Array, sorted_indices: jax.Array, num_rows: int) -> jax.Array:
    """Whether chunk sort's sizes and order describe a partition of at most `num_rows` rows: sizes in
    [0, N] summing to at most N, the order a permutation of [0, S) (a bool array; jit-safe)."""
    num_splits = split_sizes.shape[0]
    if num_splits == 0:
        return jnp.array(True)
    sizes_ok = jnp.all((split_sizes >= 0) & (split_sizes <= num_rows))
    sizes = jnp.where(sizes_ok, split_sizes, 0).astype(jnp.int32)
    # A running sum that saturates past N, so that no int32 sum of many large sizes can wrap.
    total = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, num_rows + 1), sizes)[-1]
    in_range = (sorted_indices >= 0) & (sorted_indices < num_splits)
    bins = jnp.where(in_range, sorted_indices, num_splits).astype(jnp.int32)
    seen = jnp.bincount(bins, length=num_splits + 1)
    return sizes_ok & (total <= num_rows) & jnp.all(in_range) & jnp.all(seen[:num_splits] == 1)


def chunk_sort_map(split_sizes: jax.Array, sorted_indices: jax.Array, num_rows: int) -> jax.Array:
    """Destination row [N] (int32) of every input row for chunk sort; rows past the chunks stay put.
    Sizes and order that are not a partition (`is_partition`) give -1 for every row."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    if split_sizes.shape[0] == 0:
        return rows
    valid = is_partition(split_sizes, sorted_indices, num_rows)
    # Invalid: sizes 0 and the identity order (every index computed below stays in range), map -1.
    sizes = jnp.where(valid, split_sizes, 0).astype(jnp.int32)
    order = jnp.where(valid, sorted_indices, jnp.arange(split_sizes.shape[0])).astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    src_start = ends - sizes
    sorted_sizes = sizes[order]
    dst_start = jnp.zeros_like(sizes).at[order].set(jnp.cumsum(sorted_sizes) - sorted_sizes)
    chunk = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), sizes.shape[0] - 1)
    dst = jnp.where(rows < ends[-1], dst_start[chunk] + rows - src_start[chunk], rows)
    return jnp.where(valid, dst, -1).astype(jnp.int32)


def sort_chunks(
    inp: jax.Array,
    split_sizes: jax.Array,
    sorted_indices: jax.Array,
    probs: jax.Array | None,
    backward: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """One shard of chunk sort: (output, row_id_map | None (backward), permuted_probs | None). The forward
    scatters row i to map[i]; the backward gathers row i from map[i]. Sizes and an order that are not a
    partition move nothing: zero rows and probs, map -1 (the kernels' rule)."""
    num_rows = inp.shape[0]
    dst = chunk_sort_map(split_sizes, sorted_indices, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # -1 (not a partition) becomes num_rows: the scatter drops it, the gather's row is replaced below.
    moved = jnp.where(dst >= 0, dst, num_rows)
    dst_rows, src_rows = (rows, jnp.minimum(moved, num_rows - 1)) if backward else (moved, rows)
    output = _move_rows(inp, dst_rows, src_rows, num_rows)
    permuted = None if probs is None else _move_rows(probs, dst_rows, src_rows, num_rows)
    if backward:
        keep = dst >= 0
        output = jnp.where(keep.reshape(-1, *(1,) * (inp.ndim - 1)), output, jnp.zeros_like(output))
        permuted = None if permuted is None else jnp.where(keep, permuted, jnp.zeros_like(permuted))
    return output, None if backward else dst, permuted


# Public-API mirrors -------------------------------------------------------------------------------------


def token_dispatch(
    inp: jax.Array,
    routing_map: jax.Array | None = None,
    num_out_tokens: int | None = None,
    probs: jax.Array | None = None,
    align_size: int | None = None,
    *,
    indices: jax.Array | None = None,
    num_experts: int | None = None,
    scales: jax.Array | None = None,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
) -> tuple:
    """Reference of moetriton.jax.token_dispatch with num_shards=1 (same arguments and results).

    Example:
        >>> mask = jnp.array([[True, False], [True, True]])
        >>> out, _, row_id_map, _, counts = token_dispatch(jnp.ones((2, 4)), mask, num_out_tokens=3)
        >>> counts.tolist()
        [2, 1]
    """
    is_mask = routing_map is not None
    routing = jnp.asarray(routing_map if is_mask else indices)
    config = rules.DispatchConfig(
        num_experts, is_mask, num_out_tokens, align_size, capacity, routing_map_format
    ).with_reference_defaults(tuple(routing.shape))
    results = dispatch(jnp.asarray(inp), routing, _asarray(probs), _asarray(scales), *config)
    return config.results(results, has_probs=probs is not None, has_scales=scales is not None)


def token_combine(
    inp: jax.Array,
    row_id_map: jax.Array,
    merging_probs: jax.Array | None = None,
    pad_offsets: jax.Array | None = None,
) -> jax.Array:
    """Reference of moetriton.jax.token_combine with num_shards=1: [T, H] in inp.dtype."""
    return combine(jnp.asarray(inp), jnp.asarray(row_id_map), _asarray(merging_probs))


def sort_chunks_by_index(
    inp: jax.Array,
    split_sizes: jax.Array,
    sorted_indices: jax.Array,
    probs: jax.Array | None = None,
) -> tuple:
    """Reference of moetriton.jax.sort_chunks_by_index with num_shards=1: (output, row_id_map[, probs])."""
    output, dst, permuted = sort_chunks(
        jnp.asarray(inp),
        jnp.asarray(split_sizes),
        jnp.asarray(sorted_indices),
        _asarray(probs),
        backward=False,
    )
    return (output, dst) if probs is None else (output, dst, permuted)


# MaxText-style baseline -----------------------------------------------------------------------------------


@jax.custom_vjp
def _permute_rows(x: jax.Array, order: jax.Array) -> jax.Array:
    return x[order]


def _permute_rows_fwd(x, order):
    return x[order], order


def _permute_rows_bwd(order, grad):
    # The inverse permutation is a gather too, so the backward never lowers to a scatter-add.
    return grad[jnp.argsort(order)], None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def argsort_dispatch(
    inp: jax.Array, indices: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gather-based dispatch as MaxText does it: repeat every token K times, then gather the copies in the
    order of a stable argsort of the flat expert ids.

    Args:
        inp: [T, H] tokens.
        indices: [T, K] expert ids, all in [0, E) (no -1: they would sort first).
        num_experts: E.

    Returns:
        (output [T * K, H], the same rows as token_dispatch(inp, indices=indices, num_experts=E)[0];
        order [T * K] int32, the argsort to pass to argsort_combine; group_sizes [E] int32).

    Example:
        >>> out, order, sizes = argsort_dispatch(jnp.ones((3, 2)), jnp.array([[1], [0], [1]]), 2)
        >>> sizes.tolist()
        [1, 2]
    """
    topk = indices.shape[1]
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    output = _permute_rows(jnp.repeat(inp, topk, axis=0), order)
    return output, order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def argsort_combine(expert_out: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Inverse of argsort_dispatch, weighted: out[t] = sum_k weights[t, k] * row of (t, k), summed in fp32.

    Args:
        expert_out: [T * K, H] rows in argsort_dispatch's order.
        order: [T * K] from argsort_dispatch.
        weights: [T, K].

    Returns:
        [T, H] in expert_out.dtype.

    Example:
        >>> out, order, _ = argsort_dispatch(jnp.ones((3, 2)), jnp.array([[1], [0], [1]]), 2)
        >>> argsort_combine(out, order, jnp.full((3, 1), 0.5)).tolist()[0]
        [0.5, 0.5]
    """
    num_tokens, topk = weights.shape
    rows = _permute_rows(expert_out, jnp.argsort(order)).reshape(num_tokens, topk, -1)
    summed = jnp.einsum("tkh,tk->th", rows.astype(jnp.float32), weights.astype(jnp.float32))
    return summed.astype(expert_out.dtype)
