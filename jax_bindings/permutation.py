"""The permutation family in JAX: token_dispatch, token_combine, and the sharded ops they run (dispatch,
combine and their backwards), each defined by what one token shard computes.

The public functions have the same names, arguments, results and row_id_map format as moetriton.torch, plus
a keyword-only `num_shards` (static) that gives the op per-shard semantics: with num_shards = n, the token
(row) axis of every argument is n equal blocks, each block is processed as an independent call, and every
result is the concatenation of the n blocks' results along its first axis. Under jax.jit with the token axis
sharded over k devices, k dividing n, every device processes its own blocks and no token crosses devices.
See docs/jax.md.

A shard runs the kernels' launch plan (compiled on GPU, interpreted on CPU) or the pure-JAX reference; the
plans come from moetriton.kernels unchanged. `_sharding` turns the one-shard definitions into unsharded,
partitioned and batched execution. All size parameters of an op are per shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from moetriton import kernels
from moetriton.kernels.rules import permutation as rules

from . import reference
from ._checks import check_shards, check_values
from ._sharding import HIDDEN, ShardedOp, call, explicit_results, on_explicit_mesh
from .executor import described, run_builder

_op = dataclasses.dataclass(frozen=True, kw_only=True)


@_op
class Dispatch(ShardedOp):
    """token_dispatch: permute tokens (and probs, scales) into an expert-major buffer of a padded
    `buffer_rows(num_out_tokens, num_experts, align_size, capacity)` rows."""

    num_experts: int
    is_mask: bool
    num_out_tokens: int | None
    align_size: int | None
    has_probs: bool
    has_scales: bool
    capacity: int | None = None
    routing_map_format: str = "bytemap"

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "inp": ("t", HIDDEN),
        "routing": ("t", "e"),
        # A bit-packed mask: ceil(E / 8) bytes per token, an axis of its own beside the probs' E.
        "bitmap": ("t", "b"),
        "probs": ("t", "e"),
        "scales": ("t", "k"),
        "output": ("r", HIDDEN),
        "permuted_probs": ("r",),
        "permuted_scales": ("r", "k"),
        "row_id_map": ("t", "m"),
        "pad_offsets": ("x",),
        "tokens_per_expert": ("x",),
    }

    @property
    def args(self) -> tuple[str, ...]:
        routing = "bitmap" if self.routing_map_format == "bitmap" else "routing"
        return ("inp", routing) + ("probs",) * self.has_probs + ("scales",) * self.has_scales

    @property
    def config(self) -> rules.DispatchConfig:
        """The static arguments of one shard's dispatch."""
        return rules.DispatchConfig(
            self.num_experts,
            self.is_mask,
            self.num_out_tokens,
            self.align_size,
            self.capacity,
            self.routing_map_format,
        )

    @property
    def results(self) -> tuple[str, ...]:
        # The op's results but the placeholders of absent probs, scales and (unpadded) pad offsets.
        absent = dict(
            permuted_probs=not self.has_probs,
            permuted_scales=not self.has_scales,
            pad_offsets=not self.config.padded,
        )
        return tuple(name for name in rules.DISPATCH_RESULTS if not absent.get(name))

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        inputs = dict(
            inp=arrays["inp"],
            routing=arrays[self.args[1]],
            probs=arrays.get("probs"),
            scales=arrays.get("scales"),
        )
        if use_kernels:
            out = run_builder(kernels.dispatch_plan, inputs, **self.config._asdict())
        else:
            values = reference.dispatch(*inputs.values(), *self.config)
            out = dict(zip(rules.DISPATCH_RESULTS, values, strict=True))
        return {name: out[name] for name in self.results}


@_op
class Combine(ShardedOp):
    """token_combine: per token, the (weighted) fp32 sum of its rows in ascending slot order."""

    has_weights: bool

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "inp": ("r", HIDDEN),
        "row_id_map": ("t", "m"),
        "weights": ("t", "e"),
        "output": ("t", HIDDEN),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return ("inp", "row_id_map") + ("weights",) * self.has_weights

    @property
    def results(self) -> tuple[str, ...]:
        return ("output",)

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        inp, row_map, weights = arrays["inp"], arrays["row_id_map"], arrays.get("weights")
        if not use_kernels:
            return {"output": reference.combine(inp, row_map, weights)}
        out = run_builder(
            kernels.combine_plan, dict(inp=inp, row_id_map=row_map, weights=weights, permuted_probs=None)
        )
        return {"output": out["output"]}


@_op
class DispatchBackward(ShardedOp):
    """Backward of token_dispatch: an unweighted combine of the output's cotangent, plus the probs'
    cotangent gathered back to the routing layout (0 for slots without a row)."""

    has_probs: bool

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "grad": ("r", HIDDEN),
        "row_id_map": ("t", "m"),
        "grad_permuted_probs": ("r",),
        "grad_inp": ("t", HIDDEN),
        "grad_probs": ("t", "e"),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return ("grad", "row_id_map") + ("grad_permuted_probs",) * self.has_probs

    @property
    def results(self) -> tuple[str, ...]:
        return ("grad_inp",) + ("grad_probs",) * self.has_probs

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        grad, row_map, grad_probs = arrays["grad"], arrays["row_id_map"], arrays.get("grad_permuted_probs")
        if use_kernels:
            inputs = dict(inp=grad, row_id_map=row_map, weights=None, permuted_probs=grad_probs)
            out = run_builder(kernels.combine_plan, inputs)
            grad_inp, routing_grad = out["output"], out["probs"]
        else:
            grad_inp, routing_grad = reference.dispatch_backward(grad, grad_probs, row_map)
        return {"grad_inp": grad_inp, "grad_probs": routing_grad}


@_op
class Scatter(ShardedOp):
    """Backward of unweighted token_combine: every token's cotangent copied to the rows of its slots, all
    other rows (padding, tail) exactly zero."""

    num_rows: int
    padded: bool

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "grad": ("t", HIDDEN),
        "row_id_map": ("t", "m"),
        "grad_input": ("r", HIDDEN),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return ("grad", "row_id_map")

    @property
    def results(self) -> tuple[str, ...]:
        return ("grad_input",)

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        grad, row_map = arrays["grad"], arrays["row_id_map"]
        if not use_kernels:
            return {"grad_input": reference.scatter_rows(grad, row_map, self.num_rows)}
        out = run_builder(
            kernels.scatter_plan,
            dict(grad=grad, row_id_map=row_map),
            num_rows=self.num_rows,
            padded=self.padded,
        )
        return {"grad_input": out["grad_input"]}


@_op
class CombineBackward(ShardedOp):
    """Backward of weighted token_combine: grad_input [N, H] (rows no slot owns exactly zero) and the
    merging-probs gradient, per-row dot products in fp32. With the hidden axis sharded, the dot products of
    every hidden shard are summed in fp32 across `hidden_axes`."""

    padded: bool

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "grad": ("t", HIDDEN),
        "row_id_map": ("t", "m"),
        "inp": ("r", HIDDEN),
        "weights": ("t", "e"),
        "grad_input": ("r", HIDDEN),
        "grad_weights": ("t", "e"),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return ("grad", "row_id_map", "inp", "weights")

    @property
    def results(self) -> tuple[str, ...]:
        return ("grad_input", "grad_weights")

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        grad, row_map, inp, weights = (arrays[name] for name in self.args)
        # A hidden shard's dot products are partial sums: keep them in fp32 until all shards are added
        # (weights widened to fp32 exactly, so grad_input is unchanged).
        partial_weights = (
            weights.astype(jnp.promote_types(weights.dtype, jnp.float32)) if self.hidden_axes else weights
        )
        if use_kernels:
            inputs = dict(grad=grad, row_id_map=row_map, inp=inp, weights=partial_weights)
            out = run_builder(kernels.combine_backward_plan, inputs, padded=self.padded)
            grad_input, grad_weights = out["grad_input"], out["grad_weights"]
        else:
            grad_input, grad_weights = reference.combine_backward(grad, row_map, inp, partial_weights)
        if self.hidden_axes:
            grad_weights = jax.lax.psum(grad_weights, self.hidden_axes).astype(weights.dtype)
        return {"grad_input": grad_input, "grad_weights": grad_weights}


# public functions ----------------------------------------------------------------------------------------


_FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _index_rule(num_experts: int) -> Callable[[np.ndarray], None]:
    def rule(ids: np.ndarray) -> None:
        if ids.size:
            rules.check_index_values(int(ids.min()), int(ids.max()), num_experts)

    return rule


def _row_map_rule(num_rows: int) -> Callable[[np.ndarray], None]:
    def rule(row_map: np.ndarray) -> None:
        if not row_map.size:
            return
        parts = rules.row_map_parts(row_map)
        # With no slots the lists are empty: read as -1.
        bounds = {
            name: (int(part.min()), int(part.max())) if part.size else (-1, -1)
            for name, part in parts.items()
        }
        rules.check_row_map_values(**bounds, num_rows=num_rows, num_slots=parts["rows"].shape[1])

    return rule


def _asarray(x):
    return None if x is None else jnp.asarray(x)


# dispatch ------------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(op: Dispatch, inp, routing, probs, scales):
    return call(op, *(x for x in (inp, routing, probs, scales) if x is not None))


def _dispatch_fwd(op, inp, routing, probs, scales):
    results = _dispatch(op, inp, routing, probs, scales)
    return results, results[op.results.index("row_id_map")]


def _dispatch_bwd(op, row_map, cotangents):
    named = dict(zip(op.results, cotangents, strict=True))
    grad = named["output"]
    inp_dtype = grad.dtype
    # FP8 payloads have no FP8 combine: their cotangent is summed in fp32 and rounded once.
    if grad.dtype in _FP8:
        grad = grad.astype(jnp.float32)
    backward = DispatchBackward(num_shards=op.num_shards, has_probs=op.has_probs)
    args = (grad, row_map) + ((named["permuted_probs"],) if op.has_probs else ())
    grads = dict(zip(backward.results, call(backward, *args), strict=True))
    grad_probs = grads.get("grad_probs")
    return grads["grad_inp"].astype(inp_dtype), None, grad_probs, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


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
    num_shards: int = 1,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
) -> tuple:
    """Permute tokens into expert-major order (MoE dispatch).

    Args:
        inp: [T, H] tokens; float32/float64/bfloat16/float16, or float8_e4m3fn/e5m2 payloads (moved as bits).
        routing_map: [T, E] mask (bool or integer, nonzero = routed), or with routing_map_format="bitmap"
            the same mask bit-packed: uint8 [T, ceil(E / 8)], bit e % 8 of byte e // 8 (as the router
            writes it). Pass this or `indices`.
        num_out_tokens: rows of the output before padding, a static Python int (over all shards). Slots whose
            row would fall past the buffer are dropped (no row, weight 0 in combine), so a value below the
            routed count truncates the highest experts first. Defaults to T * K with `indices`.
        probs: [T, E] (mask) or [T, K] (indices) routing probabilities, permuted alongside the tokens.
        align_size: pad every expert's block to a multiple of this (grouped-GEMM tiles). A shard's buffer then
            has the static worst case floor((n_out + E * (A - 1)) / A) * A rows, n_out = num_out_tokens /
            num_shards; pad rows and rows past the last expert are exactly zero in every output.
        indices: [T, K] int32/int64 expert ids, -1 = no expert. Needs `num_experts`. Ids are range-checked
            when their values are free to read (concrete CPU arrays, or every call with MOETRITON_CHECK=1);
            elsewhere (GPU, inside jit) an id outside [0, E) is no expert, like -1 (compared before any
            narrowing: with x64 an int64 id of 2**32 is no expert).
        num_experts: E; required with `indices` and with a bitmap (E cannot be read from its width),
            implied by a [T, E] mask.
        scales: [T, C] row-wise scales of FP8 payloads (any dtype), permuted like the rows (no gradient).
        num_shards: n, a static Python int dividing T and num_out_tokens. Each of the n token blocks is
            dispatched on its own into its own block of every result (see the module docstring).
        capacity: instead of `num_out_tokens` and `align_size`: every expert gets exactly `capacity` rows
            per shard (expert e at rows [e * capacity, (e + 1) * capacity) of a shard's block); slots past
            the first `capacity` of their expert in (token, slot) order are dropped (no row, weight 0 in
            combine) and unused rows are zero. A static layout for fixed-size all-to-all exchanges.
        routing_map_format: "bytemap" (default: routing_map is [T, E], uint8 included) or "bitmap" (or TE's
            "bitmap_u8" / RoutingMapFormat): routing_map is read bit by bit in the kernels (no unpacking
            pass); bits at or past E in a row's last byte are ignored. Results equal the [T, E] mask's.

    Returns:
        (output [N, H], permuted_probs [N] or None, row_id_map [T, 2S + 2] int32, pad_offsets [n * E] int32 or
        None (padding or capacity only), tokens_per_expert [n * E] int32 (rows per expert in the buffer,
        padding included)), plus permuted_scales [N, C] as a sixth element when `scales` is given.
        N = n * (rows of a shard's buffer); S = E for a mask (bitmap included), K for indices. Rows in
        row_id_map are local to their shard's block. Destination rows are expert-major, token order stable
        inside each expert.

    Example:
        >>> x = jnp.ones((4, 8))
        >>> mask = jnp.array([[1, 1, 0], [1, 0, 1], [0, 0, 1], [0, 0, 0]], dtype=bool)
        >>> out, _, row_id_map, _, counts = token_dispatch(x, mask, num_out_tokens=5)
        >>> counts.tolist()
        [2, 1, 2]
    """
    config = rules.check_dispatch(
        **described(inp=inp, routing_map=routing_map, indices=indices, probs=probs, scales=scales),
        num_experts=num_experts,
        num_out_tokens=num_out_tokens,
        align_size=align_size,
        capacity=capacity,
        routing_map_format=routing_map_format,
    )
    check_shards(
        num_shards, ("inp", "shape[0]", inp.shape[0]), ("num_out_tokens", "it", config.num_out_tokens or 0)
    )
    if not config.is_mask:
        check_values(_index_rule(config.num_experts), indices)
    shard_out_tokens = None if capacity is not None else config.num_out_tokens // num_shards
    op = Dispatch(
        num_shards=num_shards,
        has_probs=probs is not None,
        has_scales=scales is not None,
        **config._replace(num_out_tokens=shard_out_tokens)._asdict(),
    )
    routing = routing_map if config.is_mask else indices
    arrays = (jnp.asarray(inp), jnp.asarray(routing), _asarray(probs), _asarray(scales))
    results = on_explicit_mesh(partial(_dispatch, op), explicit_results(op, *arrays))(*arrays)
    named = dict(zip(op.results, results, strict=True))
    return config.results(
        [named.get(name) for name in rules.DISPATCH_RESULTS],
        has_probs=probs is not None,
        has_scales=scales is not None,
    )


# combine -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CombineStatics:
    num_shards: int
    padded: bool


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(statics: _CombineStatics, inp, row_map, weights):
    op = Combine(num_shards=statics.num_shards, has_weights=weights is not None)
    return call(op, *(x for x in (inp, row_map, weights) if x is not None))[0]


def _combine_fwd(statics, inp, row_map, weights):
    return _combine(statics, inp, row_map, weights), (inp, row_map, weights)


def _combine_bwd(statics, residuals, grad):
    inp, row_map, weights = residuals
    if weights is None:
        op = Scatter(
            num_shards=statics.num_shards, num_rows=inp.shape[0] // statics.num_shards, padded=statics.padded
        )
        (grad_inp,) = call(op, grad, row_map)
        return grad_inp, None, None
    op = CombineBackward(num_shards=statics.num_shards, padded=statics.padded)
    grad_inp, grad_weights = call(op, grad, row_map, inp, weights)
    return grad_inp, None, grad_weights


_combine.defvjp(_combine_fwd, _combine_bwd)


def token_combine(
    inp: jax.Array,
    row_id_map: jax.Array,
    merging_probs: jax.Array | None = None,
    pad_offsets: jax.Array | None = None,
    *,
    num_shards: int = 1,
) -> jax.Array:
    """Gather expert outputs back to tokens (MoE combine), optionally weighted.

    Args:
        inp: [N, H] expert outputs in the layout token_dispatch produced; float32/float64/bfloat16/float16.
        row_id_map: [T, 2S + 2] int32 from token_dispatch into this buffer. Checked against inp where its
            values are free to read (concrete CPU arrays, or MOETRITON_CHECK=1); elsewhere entries naming rows
            outside a shard's [0, N / n) are ignored (docs/design.md, "Index data is never trusted").
        merging_probs: [T, S] weights in the routing layout ([T, E] for a mask, [T, K] for indices).
        pad_offsets: pass what token_dispatch returned when it padded (rows in row_id_map already include
            padding; this tells the backward that pad rows exist, so their gradient is written as zeros).
        num_shards: the num_shards token_dispatch was called with (static; divides N and T).

    Returns:
        [T, H] in inp.dtype: out[t] = sum over t's slots, in ascending slot order, of
        w[t, s] * inp[row(t, s)], accumulated in fp32 without atomics (bitwise reproducible).
        Tokens with no row get zeros. Gradients: inp's is exactly zero on rows no slot owns (padding, tail);
        merging_probs' is <inp[row(t, s)], g[t]> in fp32, 0 for slots without a row.

    Example:
        >>> x = jnp.ones((4, 8))
        >>> mask = jnp.array([[1, 1], [1, 0], [0, 1], [0, 0]], dtype=bool)
        >>> out, _, row_id_map, _, _ = token_dispatch(x, mask, num_out_tokens=4)
        >>> token_combine(out, row_id_map)[0, 0].item()
        2.0
    """
    rules.check_combine(
        **described(inp=inp, row_id_map=row_id_map, merging_probs=merging_probs, pad_offsets=pad_offsets)
    )
    check_shards(
        num_shards, ("inp", "shape[0]", inp.shape[0]), ("row_id_map", "shape[0]", row_id_map.shape[0])
    )
    check_values(_row_map_rule(inp.shape[0] // num_shards), row_id_map)
    statics = _CombineStatics(num_shards=num_shards, padded=pad_offsets is not None)
    arrays = (jnp.asarray(inp), jnp.asarray(row_id_map), _asarray(merging_probs))
    results = explicit_results(Combine(num_shards=num_shards, has_weights=merging_probs is not None), *arrays)
    return on_explicit_mesh(partial(_combine, statics), results and results[0])(*arrays)
