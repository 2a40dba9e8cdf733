"""Shard-major ops: one definition gives unsharded execution, token-dimension partitioning and vmap.

Every moetriton.jax op is defined by what ONE token shard computes (`ShardedOp.one_shard`). An op with
`num_shards = n` splits each array argument into n equal blocks along its first axis, runs one shard per block
and concatenates each result along its first axis. Every argument and result of every op is shard-major in
this sense (tokens, buffer rows, per-expert counts, chunk sizes), so the same rule explains:

* unsharded execution: n shards run one after the other on one device;
* partitioning under jax.jit: when the first axis is sharded k ways over mesh axes and k divides n, each
  device runs its n / k shards locally and no token moves between devices (custom_partitioning, with a
  Shardy rule that ties the first axes of all arrays to one "shard" factor of size n, and GSPMD callbacks for
  when Shardy is off). Otherwise the op asks for replicated operands and every device runs all n shards.
  The hidden axis may stay sharded too: rows move column by column, and reductions over it are all-reduced;
* jax.vmap: a batch of B problems of n shards is one problem of B * n shards (custom_vmap folds the batch
  into the first axis), run like any other: shard by shard, or partitioned when the batch axis is sharded.

Two kinds of arrays are not shard-major: a WHOLE argument (an expert bias, per-expert counts, a 0-dim
total) is the same for every shard and stays replicated, and a SUM result (the aux loss) is a sum over the
shards: each shard computes a partial, added in shard order (psum-ed over the token mesh axes when
partitioned). A `token_parallel` op (the router) treats every token as its own shard: it partitions along
any split of the token axis over whole mesh axes, whatever num_shards, and vmap folds the batch into its
tokens.

Inside a partitioned computation the shard runs the kernels only compiled (on GPU): JAX cannot keep a host
callback alive inside custom_partitioning (https://github.com/jax-ml/jax/issues/23620), so CPU runs the
reference there, interpreter or not.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import NamedSharding, PartitionSpec

from .executor import compiles_kernels, uses_kernels

#: Layout role of the hidden axis: the only non-leading axis that may stay sharded.
HIDDEN = "h"
#: First entry of the layout of an argument that is not shard-major: replicated, given whole to every shard
#: (the entries after it name its axes).
WHOLE = "whole"
#: Layout of a result that is the sum of the shards' partial results (a 0-dim array).
SUM = "sum"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedOp(abc.ABC):
    """Static description of an op; subclasses add their parameters (all per shard).

    `layouts[name]` names the role of every axis of an argument or result: the first is the shard-major axis
    (e.g. "t" tokens, "r" buffer rows), HIDDEN marks the hidden axis, anything else must stay whole.
    `hidden_axes` is set while partitioning: the mesh axes the hidden axis is split over, for ops that
    reduce over it.
    """

    num_shards: int = 1
    hidden_axes: tuple[str, ...] = ()

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Every token is independent (module docstring): any split of the first axis partitions the op.
    token_parallel: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def args(self) -> tuple[str, ...]:
        """Names of the array arguments, in call order (absent optional inputs are left out)."""

    @property
    @abc.abstractmethod
    def results(self) -> tuple[str, ...]:
        """Names of the results, in return order."""

    @abc.abstractmethod
    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        """What one shard computes: the launch plan's results (use_kernels) or the reference's."""


def _split(x: jax.Array, parts: int) -> list[jax.Array]:
    return [x] if parts == 1 else jnp.split(x, parts)


def _whole(op: ShardedOp, name: str) -> bool:
    return op.layouts[name][:1] in ((WHOLE,), (SUM,))


def run_local(op: ShardedOp, arrays: Sequence[jax.Array], use_kernels: bool) -> tuple[jax.Array, ...]:
    """Runs op.num_shards shards on local arrays, one after the other: each shard-major result is the
    concatenation of the shards' blocks, a SUM result the sum of their partials (in shard order)."""
    blocks = [
        [x] * op.num_shards if _whole(op, name) else _split(x, op.num_shards)
        for name, x in zip(op.args, arrays, strict=True)
    ]
    outs = [
        op.one_shard(dict(zip(op.args, [b[i] for b in blocks], strict=True)), use_kernels)
        for i in range(op.num_shards)
    ]
    if op.num_shards == 1:
        return tuple(outs[0][name] for name in op.results)
    return tuple(
        sum(out[name] for out in outs) if _whole(op, name) else jnp.concatenate([out[name] for out in outs])
        for name in op.results
    )


# Partitioning -------------------------------------------------------------------------------------------


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def axes_size(mesh, axes: tuple[str, ...]) -> int:
    """How many devices `axes` of `mesh` span together."""
    return math.prod(mesh.shape[axis] for axis in axes)


def _axis_orders(mesh, size: int, exclude: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every ordered choice of mesh axes (outside `exclude`) whose sizes multiply to `size`."""
    names = [axis for axis in mesh.axis_names if axis not in exclude]
    return [
        axes
        for count in range(len(names) + 1)
        for axes in itertools.permutations(names, count)
        if axes_size(mesh, axes) == size
    ]


def _decode(mesh, first) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(mesh axes of the leading axis, mesh axes of the hidden axis) of the first argument's sharding, or None
    when it is not a split over whole mesh axes (Shardy may split one axis into sub-axes)."""
    shape, sharding = first.shape, first.sharding
    if 0 in shape:
        return (), ()
    try:
        local_shape = sharding.shard_shape(shape)
    except ValueError:  # uneven tiles: not a split over whole mesh axes either
        return None
    tiles = [size // local for size, local in zip(shape, local_shape, strict=True)]
    for token_axes in _axis_orders(mesh, tiles[0]):
        for hidden_axes in _axis_orders(mesh, tiles[1], exclude=token_axes):
            candidate = NamedSharding(mesh, PartitionSpec(token_axes or None, hidden_axes or None))
            if candidate.is_equivalent_to(sharding, len(shape)):
                return token_axes, hidden_axes
    return None


def _choose_axes(op: ShardedOp, mesh, arg_shapes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mesh axes of the shard-major axis, mesh axes of the hidden axis) the op runs with, read from its
    first argument (the payload, [rows, hidden]): kept where the shard count divides num_shards and the
    hidden size, replicated otherwise."""
    decoded = _decode(mesh, arg_shapes[0])
    if decoded is None:
        return (), ()
    token_axes, hidden_axes = decoded
    if not op.token_parallel and op.num_shards % axes_size(mesh, token_axes):
        token_axes = ()
    return token_axes, hidden_axes


def _named(mesh, layout: tuple[str, ...], token_axes, hidden_axes) -> NamedSharding:
    if layout[:1] in ((WHOLE,), (SUM,)):  # replicated: every axis whole
        return NamedSharding(mesh, PartitionSpec(*[None] * (len(layout) - 1)))
    entries = []
    for dim, role in enumerate(layout):
        axes = token_axes if dim == 0 else hidden_axes if role == HIDDEN else ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, PartitionSpec(*entries))


def _shardings(op: ShardedOp, mesh, names, token_axes, hidden_axes) -> tuple[NamedSharding, ...]:
    return tuple(_named(mesh, op.layouts[name], token_axes, hidden_axes) for name in names)


def _lower(op: ShardedOp, token_axes: tuple[str, ...], *arrays: jax.Array) -> tuple[jax.Array, ...]:
    results = run_local(op, arrays, use_kernels=compiles_kernels())
    return tuple(
        jax.lax.psum(x, token_axes) if token_axes and op.layouts[name][:1] == (SUM,) else x
        for name, x in zip(op.results, results, strict=True)
    )


def _partition(op: ShardedOp, mesh, arg_shapes, result_shape):
    token_axes, hidden_axes = _choose_axes(op, mesh, arg_shapes)
    shards = op.num_shards if op.token_parallel else op.num_shards // axes_size(mesh, token_axes)
    local = dataclasses.replace(op, num_shards=shards, hidden_axes=hidden_axes)
    return (
        mesh,
        partial(_lower, local, token_axes),
        _shardings(op, mesh, op.results, token_axes, hidden_axes),
        _shardings(op, mesh, op.args, token_axes, hidden_axes),
    )


def _infer(op: ShardedOp, mesh, arg_shapes, result_shape):
    token_axes, hidden_axes = _choose_axes(op, mesh, arg_shapes)
    return _shardings(op, mesh, op.results, token_axes, hidden_axes)


def _shardy_rule(op: ShardedOp, mesh, operand_types, result_types) -> SdyShardingRule:
    """Shardy rule: the first axis of every shard-major array is the compound factor (s, <role>) with s the
    shard factor of size num_shards (of a token-parallel op: the factor <role> itself, free to shard);
    WHOLE and SUM arrays name their axes after the marker; factors other than s, the token-parallel ones and
    the hidden axis need replication, and a SUM result makes the token factor a reduction factor."""
    n = op.num_shards
    seen: list[str] = []  # factors in order of first use: Shardy wants special factors listed in that order
    whole: set[str] = set()
    free: set[str] = {"s", HIDDEN}
    local_sizes: dict[str, int] = {}

    def use(*factors: str) -> None:
        seen.extend(factor for factor in factors if factor not in seen)

    def mapping(name: str, shape: Sequence[int]) -> ArrayMapping:
        layout = op.layouts[name]
        if layout[:1] in ((WHOLE,), (SUM,)):
            use(*layout[1:])
            whole.update(layout[1:])
            return ArrayMapping(*layout[1:])
        factors = []
        for dim, (role, size) in enumerate(zip(layout, shape, strict=True)):
            if dim == 0 and op.token_parallel:
                free.add(role)
                factors.append(role)
                use(role)
            elif dim == 0 and n > 1 and size == n:
                factors.append("s")
                whole.add("s")
                use("s")
            elif dim == 0 and n > 1 and size > 0:
                factors.append(CompoundFactor("s", role))
                local_sizes[role] = size // n
                use("s", role)
            else:
                factors.append(role)
                whole.add(role)
                use(role)
        return ArrayMapping(*factors)

    operands = tuple(mapping(name, t.shape) for name, t in zip(op.args, operand_types, strict=True))
    results = tuple(mapping(name, t.shape) for name, t in zip(op.results, result_types, strict=True))
    sizes = dict(local_sizes)
    if "s" in seen and "s" not in whole:
        sizes["s"] = n
    summed = any(op.layouts[name][:1] == (SUM,) for name in op.results)
    token_factors = tuple(factor for factor in seen if factor in free and factor not in ("s", HIDDEN))
    return SdyShardingRule(
        operands,
        results,
        reduction_factors=token_factors if summed else (),
        need_replication_factors=tuple(factor for factor in seen if factor not in free),
        **sizes,
    )


@partial(custom_partitioning, static_argnums=(0,))
def _partitioned(op: ShardedOp, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    return run_local(op, arrays, use_kernels=uses_kernels())


# decode_shardings=False: Shardy may hand over shardings on sub-axes, which have no PartitionSpec; `_decode`
# matches shardings against whole-axis candidates itself and replicates otherwise.
_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule=_shardy_rule,
    decode_shardings=False,
)


# Batching -----------------------------------------------------------------------------------------------


def _batched(op: ShardedOp, axis_size: int, in_batched: list[bool], *arrays: jax.Array):
    """vmap: the batch folds into the shard-major axis of every shard-major argument (num_shards times the
    batch, or for a token-parallel op more tokens). WHOLE arguments must be unbatched, and SUM results,
    which would add up the problems, are not supported."""
    if any(op.layouts[name][:1] == (SUM,) for name in op.results):
        raise NotImplementedError(f"moetriton.jax: {type(op).__name__} (a sum over tokens) under jax.vmap")
    flat = []
    for name, x, batched in zip(op.args, arrays, in_batched, strict=True):
        if op.layouts[name][:1] == (WHOLE,):
            if batched:
                raise NotImplementedError(f"moetriton.jax: a batched {name} under jax.vmap")
            flat.append(x)
            continue
        x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        flat.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
    shards = op.num_shards if op.token_parallel else op.num_shards * axis_size
    outs = call(dataclasses.replace(op, num_shards=shards), *flat)
    unfolded = tuple(y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]) for y in outs)
    return unfolded, (True,) * len(unfolded)


def call(op: ShardedOp, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Runs `op` on its shard-major arguments (in op.args order); returns its results (op.results order)."""

    @jax.custom_batching.custom_vmap
    def run(*arrays):
        return _partitioned(op, *arrays)

    run.def_vmap(partial(_batched, op))
    return tuple(run(*arrays))


# Meshes of Explicit axes --------------------------------------------------------------------------------


def explicit_mesh(*arrays) -> jax.sharding.AbstractMesh | None:
    """The mesh of the first array whose type names a mesh with Explicit axes (what `jax.make_mesh` makes
    by default on JAX >= 0.7), or None: no such array, or meshes of Auto axes only."""
    for x in arrays:
        sharding = None if x is None else getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
            return mesh
    return None


def spec_axes(array: jax.Array, dim: int) -> tuple[str, ...]:
    """The mesh axes that dimension `dim` of `array` is split over, as its type states (Explicit axes)."""
    spec = jax.typeof(array).sharding.spec
    return mesh_axes(spec[dim]) if dim < len(spec) else ()


def explicit_results(op: ShardedOp, *arrays: jax.Array | None) -> tuple[NamedSharding, ...] | None:
    """The shardings of `op`'s results (op.results order) on a mesh of Explicit axes: the partitioner's
    choice (`_choose_axes`) from its first argument's sharding as the type states it; None on other
    meshes. `arrays`: the op's arguments, absent ones None."""
    mesh = explicit_mesh(*arrays)
    if mesh is None:
        return None
    first = next(x for x in arrays if x is not None)
    token_axes = spec_axes(first, 0)
    hidden_axes = spec_axes(first, 1) if first.ndim > 1 else ()
    if not op.token_parallel and op.num_shards % axes_size(mesh, token_axes):
        token_axes = ()
    return _shardings(op, mesh, op.results, token_axes, hidden_axes)


def row_sharding(like: jax.Array, ndim: int) -> NamedSharding | None:
    """On a mesh of Explicit axes (else None): a [rows, ...] result of `ndim` dimensions whose rows are
    split as `like`'s first dimension is, and whose other dimensions are whole."""
    mesh = explicit_mesh(like)
    if mesh is None:
        return None
    axes = spec_axes(like, 0)
    return NamedSharding(mesh, PartitionSpec(axes or None, *[None] * (ndim - 1)))


def on_explicit_mesh(function: Callable, out_sharding) -> Callable:
    """`function` as it runs on any mesh. With `out_sharding` (on a mesh of Explicit axes: the shardings of
    its results, a pytree like them) the mesh's axes are made Auto inside (`jax.sharding.auto_axes`):
    custom_partitioning's trace of one shard and the custom VJPs cannot follow shardings carried in types,
    so the op partitions as on a mesh of Auto axes; its results get `out_sharding`, and its gradients the
    shardings of its arguments (the transpose of auto_axes' resharding). Without it, `function` itself."""
    if out_sharding is None:
        return function
    return jax.sharding.auto_axes(function, out_sharding=out_sharding)
