"""TransformerEngine-compatible JAX names, signatures, enums and results, on moetriton's kernels.

TE JAX users switch by changing an import:
    from moetriton.jax.te import token_dispatch, token_combine, ...   # instead of transformer_engine.jax
                                                                      # .permutation / .router

What is TE's here and how (docs/te_migration.md, "JAX" lists every difference):
- row_id_map is TE's [T, 2E + 1] int32: per token the rows (before padding) of its routed experts in
  descending order, then those experts, then their count. It is converted from moetriton's [T, 2E + 2] map
  after dispatch and back inside combine: one pass over a [T, 2E] int32 array each way. A map given to
  token_combine is never trusted: an entry whose expert or (padded) row is out of range is no row.
- Data-parallel semantics: like TE's custom partitioning, every op runs each device's token block as one
  independent problem when the token axis is sharded; the shard count is read from the sharding the
  partitioner gives the tokens (no trace-time guess), so an unsharded call is the global op. A dispatch
  shard gets num_out_tokens // k rows (with padding: TE's worst-case buffer // k rows). Unlike TE, every
  shard's expert blocks are aligned to align_size (TE adds global pad offsets to local rows).
- The router's BITMAP_U8 routing map is the router's own bitmap (routing_map_format="bitmap"): probs, aux
  scores and gradients are bit-identical to BYTEMAP's, the float math being the same kernel for both.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from moetriton.kernels import buffer_rows, row_map_slots
from moetriton.kernels.rules import permutation as rules
from moetriton.kernels.rules import validation
from moetriton.kernels.rules.layout import round_up

from . import chunk_sort, permutation, router
from ._sharding import ShardedOp, axes_size, explicit_mesh, mesh_axes, on_explicit_mesh, run_local
from .executor import compiles_kernels, describe, uses_kernels

__all__ = [
    "RoutingMapFormat",
    "ScoreFunction",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "sort_chunks_by_index",
    "token_combine",
    "token_dispatch",
]


class ScoreFunction(enum.IntEnum):
    """TE JAX's score functions (same members and values)."""

    SIGMOID = 0
    SOFTMAX = 1


class RoutingMapFormat(enum.IntEnum):
    """TE's routing-map layouts: BYTEMAP bool [T, E]; BITMAP_U8 uint8 [T, ceil(E / 8)], bit e % 8 of byte
    e // 8 set when the token routes to expert e (LSB first, unused bits 0)."""

    BYTEMAP = 0
    BITMAP_U8 = 1


# Row maps ------------------------------------------------------------------------------------------------


def _reversed_entries(lists: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's first `count` entries in reverse order ([T, S]), and which positions hold one. TE lists
    a token's rows descending, moetriton ascending: the same entries in opposite orders."""
    num_slots = lists.shape[1]
    position = jnp.arange(num_slots, dtype=jnp.int32)
    listed = position < count
    source = jnp.clip(count - 1 - position, 0, max(num_slots - 1, 0))
    return jnp.take_along_axis(lists, source, axis=1), listed


def _te_row_map(row_map: jax.Array, pad_offsets: jax.Array | None) -> jax.Array:
    """moetriton's [T, 2E + 2] map of a mask dispatch -> TE's [T, 2E + 1]: rows descending with
    pad_offsets[expert] taken off (TE's rows exclude padding), experts beside them, then the count;
    unused entries -1."""
    num_experts = row_map_slots(row_map.shape[1])
    count = row_map[:, 2 * num_experts : 2 * num_experts + 1]
    rows, listed = _reversed_entries(row_map[:, :num_experts], count)
    experts, _ = _reversed_entries(row_map[:, num_experts : 2 * num_experts], count)
    if pad_offsets is not None:
        rows = rows - pad_offsets[jnp.clip(experts, 0, num_experts - 1)]
    return jnp.concatenate(
        [jnp.where(listed, rows, -1), jnp.where(listed, experts, -1), count], axis=1
    ).astype(jnp.int32)


#: A row or pad offset of a TE map beyond this magnitude is no row: within it their sum is exact in int32.
_ROW_BOUND = 2**30 - 1


def _bounded(values: jax.Array) -> jax.Array:
    # Compared on both sides: abs(-2**31) is still negative in int32.
    return (values >= -_ROW_BOUND) & (values <= _ROW_BOUND)


def _native_row_map(te_map: jax.Array, pad_offsets: jax.Array | None, num_rows: int) -> jax.Array:
    """TE's [T, 2E + 1] map -> moetriton's [T, 2E + 2] for a buffer of `num_rows` rows, trusting nothing:
    the count is clamped into [0, E], and an entry is "no row" when its expert is outside [0, E), its row
    or pad offset is beyond +-_ROW_BOUND (so hostile values cannot wrap around int32 into range), or row +
    pad offset is outside [0, num_rows). `end` is the whole buffer: the backward zeroes every row no
    entry names itself (padded=True), so no tail needs marking."""
    num_experts = (te_map.shape[1] - 1) // 2
    te_map = te_map.astype(jnp.int32)
    count = jnp.clip(te_map[:, 2 * num_experts : 2 * num_experts + 1], 0, num_experts)
    rows, listed = _reversed_entries(te_map[:, :num_experts], count)
    experts, _ = _reversed_entries(te_map[:, num_experts : 2 * num_experts], count)
    listed &= (experts >= 0) & (experts < num_experts) & _bounded(rows)
    if pad_offsets is not None:
        offsets = pad_offsets.astype(jnp.int32)[jnp.clip(experts, 0, num_experts - 1)]
        listed &= _bounded(offsets)
        rows = jnp.where(listed, rows, 0) + jnp.where(listed, offsets, 0)
    listed &= (rows >= 0) & (rows < num_rows)
    return jnp.concatenate(
        [
            jnp.where(listed, rows, -1),
            jnp.where(listed, experts, -1),
            count,
            jnp.full_like(count, num_rows),
        ],
        axis=1,
    )


# Per-device ops ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DeviceOp:
    """A moetriton op (num_shards=1) run on each device's token block as one problem, as TE's custom
    partitioning does. `rows` is the global row count of the permuted buffer; a device of k gets rows // k
    (TE's split of num_out_tokens and of its padded worst case). With `te_map`, the row_id_map argument
    is TE's layout (followed by pad_offsets when `padded`) and is converted on the device."""

    native: ShardedOp
    rows: int
    te_map: bool = False
    padded: bool = False

    @property
    def args(self) -> tuple[str, ...]:
        return self.native.args + ("pad_offsets",) * (self.te_map and self.padded)

    @property
    def results(self) -> tuple[str, ...]:
        return tuple(name for name in self.native.results if name not in ("pad_offsets", "tokens_per_expert"))

    def role(self, name: str) -> str | None:
        """The first axis of an array: "t" tokens, "r" buffer rows, None whole (replicated)."""
        return None if name == "pad_offsets" else self.native.layouts[name][0]

    @property
    def key(self) -> str:
        """The argument whose token sharding decides the device count: the tokens, or the row map."""
        return "inp" if isinstance(self.native, permutation.Dispatch) else "row_id_map"

    def run(self, arrays: dict[str, jax.Array], devices: int, use_kernels: bool) -> tuple[jax.Array, ...]:
        rows = self.rows // devices
        native = self.native
        if isinstance(native, permutation.Dispatch):
            native = dataclasses.replace(native, num_out_tokens=_native_budget(native, rows))
        elif isinstance(native, permutation.Scatter):
            native = dataclasses.replace(native, num_rows=rows)
        if self.te_map:
            arrays = dict(arrays)
            arrays["row_id_map"] = _native_row_map(
                arrays["row_id_map"], arrays.pop("pad_offsets", None), rows
            )
        results = dict(
            zip(
                native.results,
                run_local(native, [arrays[name] for name in native.args], use_kernels),
                strict=True,
            )
        )
        # TE's per-device buffer need not be a multiple of align_size; the rows past moetriton's aligned
        # buffer are zero, as in TE.
        return tuple(
            _pad_rows(results[name], rows) if self.role(name) == "r" else results[name]
            for name in self.results
        )


def _native_budget(op: permutation.Dispatch, rows: int) -> int:
    """The largest num_out_tokens whose moetriton buffer fits in `rows` rows (TE's per-device buffer): with
    padding that buffer is `rows` rounded down to align_size, and the budget is the most routed slots such
    a buffer is sized for, never fewer than TE's num_out_tokens when the buffer is TE's worst case."""
    if op.align_size is None:
        return rows
    aligned = rows // op.align_size * op.align_size
    budget = aligned + op.align_size - 1 - op.num_experts * (op.align_size - 1)
    if budget < 0:
        raise ValueError(
            f"num_out_tokens: a token shard's padded buffer of {rows} rows cannot hold the worst-case "
            f"padding of {op.num_experts} experts at align_size {op.align_size}; pass a larger num_out_tokens"
        )
    return budget


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return x if x.shape[0] == rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _token_axes(op: _DeviceOp, mesh, arg_shapes) -> tuple[str, ...]:
    """Mesh axes of the key argument's first axis, () when it is replicated, not a named sharding, or its
    split would not divide every first axis evenly (then every device computes the global op)."""
    shape = dict(zip(op.args, arg_shapes, strict=True))[op.key]
    sharding = shape.sharding
    if not isinstance(sharding, NamedSharding) or not sharding.spec:
        return ()
    axes = mesh_axes(sharding.spec[0])
    devices = axes_size(mesh, axes)
    sizes = [s.shape[0] for name, s in zip(op.args, arg_shapes, strict=True) if op.role(name)] + [op.rows]
    return axes if all(size % devices == 0 for size in sizes) else ()


def _named(op: _DeviceOp, mesh, name: str, ndim: int, axes: tuple[str, ...]) -> NamedSharding:
    first = (axes[0] if len(axes) == 1 else axes) if axes and op.role(name) else None
    return NamedSharding(mesh, PartitionSpec(first, *[None] * (ndim - 1)))


def _lower(op: _DeviceOp, devices: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    return op.run(dict(zip(op.args, arrays, strict=True)), devices, use_kernels=compiles_kernels())


def _partition(op: _DeviceOp, mesh, arg_shapes, result_shape):
    axes = _token_axes(op, mesh, arg_shapes)
    devices = axes_size(mesh, axes)
    results = result_shape if isinstance(result_shape, tuple | list) else (result_shape,)
    return (
        mesh,
        partial(_lower, op, devices),
        tuple(
            _named(op, mesh, name, len(s.shape), axes) for name, s in zip(op.results, results, strict=True)
        ),
        tuple(
            _named(op, mesh, name, len(s.shape), axes) for name, s in zip(op.args, arg_shapes, strict=True)
        ),
    )


def _infer(op: _DeviceOp, mesh, arg_shapes, result_shape):
    axes = _token_axes(op, mesh, arg_shapes)
    results = result_shape if isinstance(result_shape, tuple | list) else (result_shape,)
    return tuple(
        _named(op, mesh, name, len(s.shape), axes) for name, s in zip(op.results, results, strict=True)
    )


def _shardy_rule(op: _DeviceOp, mesh, operand_types, result_types) -> SdyShardingRule:
    """Tokens ("t") and buffer rows ("r") may be sharded, every other axis stays whole. When both first-axis
    sizes are multiples of the mesh's device count M (and larger), each is the compound factor (s, local)
    with s of size M, so the propagation shards the rows wherever it shards the tokens (and back): the
    buffer stays on the devices that made it. Otherwise they are separate factors, as in TE's rules, and
    the partition's shardings are reached by resharding."""
    devices = math.prod(mesh.shape.values())
    names = list(zip(op.args, operand_types, strict=True)) + list(zip(op.results, result_types, strict=True))
    sizes = {op.role(name): t.shape[0] for name, t in names if op.role(name)}
    tied = all(size % devices == 0 and size > devices for size in sizes.values())
    whole: list[str] = []

    def mapping(name: str, ndim: int, label: str) -> tuple:
        factors = []
        for dim in range(ndim):
            if dim == 0 and op.role(name):
                factors.append(CompoundFactor("s", op.role(name)) if tied else op.role(name))
            else:
                factors.append(f"{label}_{name}_{dim}")
                whole.append(factors[-1])
        return tuple(factors)

    operands = tuple(
        mapping(name, len(t.shape), "in") for name, t in zip(op.args, operand_types, strict=True)
    )
    results = tuple(
        mapping(name, len(t.shape), "out") for name, t in zip(op.results, result_types, strict=True)
    )
    local_sizes = {"s": devices} | {role: size // devices for role, size in sizes.items()} if tied else {}
    return SdyShardingRule(operands, results, need_replication_factors=tuple(whole), **local_sizes)


@partial(custom_partitioning, static_argnums=(0,))
def _on_devices(op: _DeviceOp, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    return op.run(dict(zip(op.args, arrays, strict=True)), 1, use_kernels=uses_kernels())


_on_devices.def_partition(
    partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_shardy_rule
)


def _call(op: _DeviceOp, **arrays: jax.Array | None) -> dict[str, jax.Array]:
    results = _on_devices(op, *(arrays[name] for name in op.args))
    return dict(zip(op.results, results, strict=True))


def _on_any_mesh(op: _DeviceOp, function, arrays: tuple, results: tuple[str | int | None, ...]):
    """function(*arrays), which runs `op`; on a mesh of Explicit axes with the axes made Auto inside
    (moetriton.jax._sharding.on_explicit_mesh) and its results sharded as `_partition` places the op's:
    `results` in return order, the name of one of the op's results, the rank of a replicated array, or
    None where it returns None."""
    present = [array for array in arrays if array is not None]
    mesh = explicit_mesh(*present)
    if mesh is None:
        return function(*arrays)
    axes = _token_axes(op, mesh, [jax.typeof(array) for array in present])

    def sharding(result: str | int | None) -> NamedSharding | None:
        if result is None or isinstance(result, int):
            return None if result is None else NamedSharding(mesh, PartitionSpec(*[None] * result))
        return _named(op, mesh, result, len(op.native.layouts[result]), axes)

    shardings = tuple(sharding(result) for result in results)
    return on_explicit_mesh(function, shardings if len(shardings) > 1 else shardings[0])(*arrays)


# Permutation ---------------------------------------------------------------------------------------------


def _tokens(x: jax.Array | None, columns: int) -> jax.Array | None:
    """TE accepts [B, S, ...] for [T, ...]: the leading axes flattened into tokens."""
    return None if x is None else jnp.asarray(x).reshape(-1, columns)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(op: _DeviceOp, inp, routing, probs):
    named = _call(op, inp=inp, routing=routing, probs=probs)
    return named["output"], named.get("permuted_probs"), named["row_id_map"]


def _dispatch_fwd(op, inp, routing, probs):
    results = _dispatch(op, inp, routing, probs)
    return results, results[2]


def _dispatch_bwd(op, row_map, cotangents):
    grad, grad_probs, _ = cotangents
    backward = _DeviceOp(permutation.DispatchBackward(has_probs=op.native.has_probs), rows=op.rows)
    named = _call(backward, grad=grad, row_id_map=row_map, grad_permuted_probs=grad_probs)
    return named["grad_inp"], None, named.get("grad_probs")


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def token_dispatch(
    inp: jax.Array,
    routing_map: jax.Array,
    num_out_tokens: int,
    probs: jax.Array | None = None,
    align_size: int | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None, jax.Array]:
    """TE's token_dispatch: permute tokens into expert-major order.

    Args:
        inp: [T, H] (or [B, S, H]) float32/float64/bfloat16/float16 tokens.
        routing_map: [T, E] (or [B, S, E]) mask, bool or integer (nonzero = routed).
        num_out_tokens: rows of the output before padding, a Python int > 0 (static under jit); with the
            tokens sharded over k devices every device gets num_out_tokens // k rows, as in TE.
        probs: [T, E] routing probabilities, permuted alongside (differentiable).
        align_size: pad every expert's block to a multiple of this; the buffer then has TE's worst case
            floor((num_out_tokens + E * (align_size - 1)) / align_size) * align_size rows.

    Returns:
        (output [N, H], permuted_probs [N] or None, row_id_map [T, 2E + 1] int32, pad_offsets [E] int32 or
        None, tokens_per_expert [E] int32): N = num_out_tokens, or the padded worst case; pad and tail rows
        are zero. tokens_per_expert counts routing_map per expert (over all shards), rounded up to
        align_size with padding; pad_offsets[e] is the padding before expert e's block, also over all
        shards, as TE computes them.

    Example:
        >>> mask = jnp.array([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=jnp.int32)
        >>> out, _, row_id_map, _, counts = token_dispatch(jnp.ones((5, 4)), mask, num_out_tokens=7)
        >>> row_id_map[0].tolist(), counts.tolist()
        ([3, 0, -1, 1, 0, -1, 2], [3, 2, 2])
    """
    num_experts = routing_map.shape[-1]
    inp, routing, probs = (
        _tokens(inp, inp.shape[-1]),
        _tokens(routing_map, num_experts),
        _tokens(probs, num_experts),
    )
    if not isinstance(num_out_tokens, int) or isinstance(num_out_tokens, bool) or num_out_tokens <= 0:
        raise ValueError(f"num_out_tokens: expected a Python int > 0 (as TE), got {num_out_tokens!r}")
    rules.check_dispatch(
        inp=describe(inp),
        routing_map=describe(routing),
        indices=None,
        num_experts=None,
        num_out_tokens=num_out_tokens,
        probs=describe(probs),
        scales=None,
        align_size=align_size,
    )
    native = permutation.Dispatch(
        num_experts=num_experts,
        is_mask=True,
        num_out_tokens=num_out_tokens,
        align_size=align_size,
        has_probs=probs is not None,
        has_scales=False,
    )
    op = _DeviceOp(native, rows=buffer_rows(num_out_tokens, num_experts, align_size))

    def run(inp, routing, probs):
        output, permuted_probs, row_map = _dispatch(op, inp, routing, probs)
        # TE's counts and offsets: from the whole routing map (an all-reduce of [E] under sharding).
        counts = jnp.sum(routing != 0, axis=0, dtype=jnp.int32)
        if align_size is None:
            return output, permuted_probs, _te_row_map(row_map, None), None, counts
        aligned = round_up(counts, align_size)
        pad_offsets = jnp.cumsum(aligned - counts, dtype=jnp.int32) - (aligned - counts)
        return output, permuted_probs, _te_row_map(row_map, pad_offsets), pad_offsets, aligned

    results = ("output", "permuted_probs" if probs is not None else None, "row_id_map")
    return _on_any_mesh(op, run, (inp, routing, probs), (*results, None if align_size is None else 1, 1))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(op: _DeviceOp, inp, row_map, weights, pad_offsets):
    return _call(op, inp=inp, row_id_map=row_map, weights=weights, pad_offsets=pad_offsets)["output"]


def _combine_fwd(op, inp, row_map, weights, pad_offsets):
    return _combine(op, inp, row_map, weights, pad_offsets), (inp, row_map, weights, pad_offsets)


def _combine_bwd(op, residuals, grad):
    inp, row_map, weights, pad_offsets = residuals
    # padded=True: every row no entry names gets an exact zero, whatever map the caller passed (the
    # kernels otherwise zero only the rows past `end`), at the cost of zeroing the gradient buffer first.
    if weights is None:
        scatter = dataclasses.replace(op, native=permutation.Scatter(num_rows=op.rows, padded=True))
        named = _call(scatter, grad=grad, row_id_map=row_map, pad_offsets=pad_offsets)
        return named["grad_input"], None, None, None
    backward = dataclasses.replace(op, native=permutation.CombineBackward(padded=True))
    named = _call(backward, grad=grad, row_id_map=row_map, inp=inp, weights=weights, pad_offsets=pad_offsets)
    return named["grad_input"], None, named["grad_weights"], None


_combine.defvjp(_combine_fwd, _combine_bwd)


def token_combine(
    inp: jax.Array,
    row_id_map: jax.Array,
    merging_probs: jax.Array | None = None,
    pad_offsets: jax.Array | None = None,
) -> jax.Array:
    """TE's token_combine: every token's (weighted) sum of its expert rows, accumulated in fp32.

    Args:
        inp: [N, H] float32/float64/bfloat16/float16 expert outputs in token_dispatch's layout.
        row_id_map: [T, 2E + 1] int32/int64 in TE's layout (token_dispatch's). Never trusted: the count is
            clamped into [0, E], and an entry with an expert outside [0, E) or a row (plus pad offset)
            outside the buffer (a token shard's block of it) adds nothing.
        merging_probs: [T, E] (or [B, S, E]) weights; None sums the rows.
        pad_offsets: [E] int32 from token_dispatch when it padded.

    Returns:
        [T, H] in inp.dtype; tokens with no row are zero. Differentiable in inp and merging_probs; rows no
        entry names get a zero gradient.

    Example:
        >>> mask = jnp.array([[True, True], [True, False]])
        >>> out, _, row_id_map, _, _ = token_dispatch(jnp.ones((2, 4)), mask, num_out_tokens=3)
        >>> token_combine(out, row_id_map)[:, 0].tolist()
        [2.0, 1.0]
    """
    validation.check_array("inp", *describe(inp), ndim=2, dtypes=validation.FLOAT_DTYPES)
    validation.check_array("row_id_map", *describe(row_id_map), ndim=2, dtypes=validation.INDEX_DTYPES)
    num_tokens, columns = row_id_map.shape
    if columns < 3 or columns % 2 == 0:
        raise ValueError(
            f"row_id_map: expected TE's [T, 2E + 1] columns (odd, >= 3), got shape {row_id_map.shape}"
        )
    num_experts = (columns - 1) // 2
    weights = _tokens(merging_probs, num_experts)
    if weights is not None:
        validation.check_array("merging_probs", *describe(weights), ndim=2, dtypes=validation.FLOAT_DTYPES)
        validation.check_dim("merging_probs", weights.shape[0], num_tokens, "tokens (row_id_map.shape[0])")
    if pad_offsets is not None:
        validation.check_array("pad_offsets", *describe(pad_offsets), ndim=1, dtypes=validation.INDEX_DTYPES)
        validation.check_dim("pad_offsets", pad_offsets.shape[0], num_experts, "shape[0] (E of row_id_map)")
    op = _DeviceOp(
        permutation.Combine(has_weights=weights is not None),
        rows=inp.shape[0],
        te_map=True,
        padded=pad_offsets is not None,
    )
    pad_offsets = None if pad_offsets is None else jnp.asarray(pad_offsets)
    arrays = (jnp.asarray(inp), jnp.asarray(row_id_map), weights, pad_offsets)
    return _on_any_mesh(op, partial(_combine, op), arrays, ("output",))


def sort_chunks_by_index(
    inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """TE's sort_chunks_by_index: output chunk j is input chunk sorted_indices[j].

    Args:
        inp: [N, H] rows; split_sizes: [S] int32/int64 chunk sizes; sorted_indices: [S] a permutation of
            [0, S). Global over the rows (as TE's, meaningful unsharded or inside shard_map).

    Returns:
        (output [N, H], row_id_map [N] int32: the destination row of every input row).

    Example:
        >>> out, _ = sort_chunks_by_index(jnp.arange(3.0)[:, None], jnp.array([1, 2]), jnp.array([1, 0]))
        >>> out[:, 0].tolist()
        [1.0, 2.0, 0.0]
    """
    return chunk_sort.sort_chunks_by_index(inp, split_sizes, sorted_indices)


# Router --------------------------------------------------------------------------------------------------


def _score_function(value) -> ScoreFunction:
    if isinstance(value, ScoreFunction):
        return value
    try:
        return ScoreFunction[value.upper()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"score_function: expected 'softmax', 'sigmoid' or a ScoreFunction, got {value!r}"
        ) from None


def _routing_map_format(value) -> RoutingMapFormat:
    if isinstance(value, RoutingMapFormat):
        return value
    try:
        return RoutingMapFormat(value) if isinstance(value, int) else RoutingMapFormat[value.upper()]
    except (KeyError, ValueError, AttributeError):
        raise ValueError(
            "routing_map_format: expected 'bytemap', 'bitmap_u8', a RoutingMapFormat or its int, "
            f"got {value!r}"
        ) from None


def fused_topk_with_score_function(
    logits: jax.Array,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int = -1,
    group_topk: int = -1,
    scaling_factor: float = 1.0,
    score_function: str | ScoreFunction = ScoreFunction.SOFTMAX,
    expert_bias: jax.Array | None = None,
    compute_aux_scores: bool = False,
    routing_map_format: str | RoutingMapFormat | int = RoutingMapFormat.BYTEMAP,
) -> tuple[jax.Array, jax.Array]:
    """TE JAX's fused router: (probs_or_scores [T, E], routing_map).

    Args:
        logits: [T, E] float32/bfloat16/float16.
        topk: experts per token. use_pre_softmax: softmax over all E before the top-k (softmax only).
        num_groups, group_topk: group-limited top-k; a value <= 0 disables grouping (TE's -1 default).
        scaling_factor: a Python float or int (TypeError otherwise, as TE), multiplies the probs.
        score_function: "softmax" / "sigmoid" or a ScoreFunction.
        expert_bias: [E] selection bias, sigmoid only (ValueError otherwise, as TE).
        compute_aux_scores: return the aux-loss scores over all experts instead (bias, pre-softmax, groups
            and scaling ignored): softmax, or the sigmoid normalised over all E.
        routing_map_format: BYTEMAP (bool [T, E]) or BITMAP_U8 (uint8 [T, ceil(E / 8)], LSB first).

    Returns:
        (probs [T, E] in logits.dtype, zero outside the selection, or with compute_aux_scores the dense
        scores in logits.dtype; routing_map). Differentiable in logits. Ties go to the lowest expert index.

    Example:
        >>> probs, bitmap = fused_topk_with_score_function(
        ...     jnp.array([[1.0, 3.0, 2.0, 3.0]]), 2, routing_map_format=RoutingMapFormat.BITMAP_U8)
        >>> bitmap.tolist()
        [[10]]
    """
    if not isinstance(scaling_factor, int | float):
        raise TypeError(
            f"scaling_factor: expected a Python float or int (as TE), got {type(scaling_factor).__name__}"
        )
    score_function = _score_function(score_function)
    map_format = (
        "bitmap" if _routing_map_format(routing_map_format) == RoutingMapFormat.BITMAP_U8 else "bytemap"
    )
    name = score_function.name.lower()
    if compute_aux_scores:
        routing_map, scores = router.fused_compute_score_for_moe_aux_loss(logits, topk, name, map_format)
        probs = scores.astype(logits.dtype)
    else:
        if expert_bias is not None and score_function != ScoreFunction.SIGMOID:
            raise ValueError(f"expert_bias: only with score_function='sigmoid' (as TE), got '{name}'")
        grouped = group_topk > 0
        probs, routing_map = router.fused_topk_with_score_function(
            logits,
            topk,
            use_pre_softmax,
            num_groups if grouped and num_groups > 0 else None,
            group_topk if grouped else None,
            float(scaling_factor),
            name,
            expert_bias,
            map_format,
        )
    return probs, routing_map


def fused_moe_aux_loss(probs: jax.Array, tokens_per_expert: jax.Array, topk: int, coeff: float) -> jax.Array:
    """TE JAX's aux loss: E * coeff / (topk * T^2) * sum_e (sum_t probs[t, e]) * tokens_per_expert[e],
    T = probs.shape[0], E = probs.shape[1]; a scalar in probs.dtype, differentiable in probs. Summed
    deterministically; under token sharding the loss of all tokens (TE's would be a per-shard loss).

    Example:
        >>> float(fused_moe_aux_loss(jnp.full((4, 2), 0.5), jnp.array([4, 4]), topk=1, coeff=1.0))
        2.0
    """
    num_tokens, num_experts = probs.shape
    return router.fused_moe_aux_loss(probs, tokens_per_expert, num_tokens, num_experts, topk, coeff)
