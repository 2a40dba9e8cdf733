"""The ops moetriton.jax is made of, each defined by what one token shard computes.

A shard runs the kernels' launch plan (compiled on GPU, interpreted on CPU) or the pure-JAX reference; the
plans come from moetriton.kernels unchanged. `_sharding` turns these one-shard definitions into
unsharded, partitioned and batched execution. All size parameters are per shard.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from moetriton import kernels

from . import reference
from ._sharding import HIDDEN, ShardedOp
from .executor import device_info, dtype_name, run_plan

_op = dataclasses.dataclass(frozen=True, kw_only=True)


def _run(plan: kernels.Plan, inputs: dict[str, jax.Array | None]) -> dict[str, jax.Array]:
    return dict(zip(plan.results, run_plan(plan, inputs), strict=True))


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

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "inp": ("t", HIDDEN),
        "routing": ("t", "e"),
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
        return ("inp", "routing") + ("probs",) * self.has_probs + ("scales",) * self.has_scales

    @property
    def results(self) -> tuple[str, ...]:
        return (
            ("output",)
            + ("permuted_probs",) * self.has_probs
            + ("permuted_scales",) * self.has_scales
            + ("row_id_map",)
            + ("pad_offsets",) * (self.align_size is not None or self.capacity is not None)
            + ("tokens_per_expert",)
        )

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        inp, routing = arrays["inp"], arrays["routing"]
        probs, scales = arrays.get("probs"), arrays.get("scales")
        if use_kernels:
            plan = kernels.dispatch_plan(
                num_tokens=inp.shape[0],
                hidden=inp.shape[1],
                num_slots=routing.shape[1],
                num_experts=self.num_experts,
                is_mask=self.is_mask,
                num_out_tokens=self.num_out_tokens,
                align_size=self.align_size,
                element_bytes=inp.dtype.itemsize,
                has_probs=probs is not None,
                scale_cols=None if scales is None else scales.shape[1],
                capacity=self.capacity,
                device=device_info(),
            )
            out = _run(plan, dict(inp=inp, routing=routing, probs=probs, scales=scales))
        else:
            names = ("output", "permuted_probs", "permuted_scales", "row_id_map", "pad_offsets")
            values = reference.dispatch(
                inp,
                routing,
                probs,
                scales,
                self.num_experts,
                self.is_mask,
                self.num_out_tokens,
                self.align_size,
                self.capacity,
            )
            out = dict(zip((*names, "tokens_per_expert"), values, strict=True))
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
        plan = kernels.combine_plan(
            num_tokens=row_map.shape[0],
            hidden=inp.shape[1],
            num_slots=kernels.row_map_slots(row_map.shape[1]),
            num_rows=inp.shape[0],
            element_bytes=inp.dtype.itemsize,
            has_weights=weights is not None,
            gather_probs=False,
            device=device_info(),
        )
        out = _run(plan, dict(inp=inp, row_id_map=row_map, weights=weights, permuted_probs=None))
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
            plan = kernels.combine_plan(
                num_tokens=row_map.shape[0],
                hidden=grad.shape[1],
                num_slots=kernels.row_map_slots(row_map.shape[1]),
                num_rows=grad.shape[0],
                element_bytes=grad.dtype.itemsize,
                has_weights=False,
                gather_probs=grad_probs is not None,
                probs_dtype="float32" if grad_probs is None else dtype_name(grad_probs.dtype),
                device=device_info(),
            )
            out = _run(plan, dict(inp=grad, row_id_map=row_map, weights=None, permuted_probs=grad_probs))
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
        plan = kernels.scatter_plan(
            num_tokens=row_map.shape[0],
            hidden=grad.shape[1],
            num_slots=kernels.row_map_slots(row_map.shape[1]),
            num_rows=self.num_rows,
            padded=self.padded,
            element_bytes=grad.dtype.itemsize,
            device=device_info(),
        )
        return {"grad_input": _run(plan, dict(grad=grad, row_id_map=row_map))["grad_input"]}


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
            plan = kernels.combine_backward_plan(
                num_tokens=row_map.shape[0],
                hidden=grad.shape[1],
                num_slots=kernels.row_map_slots(row_map.shape[1]),
                num_rows=inp.shape[0],
                padded=self.padded,
                element_bytes=inp.dtype.itemsize,
                device=device_info(),
            )
            out = _run(plan, dict(grad=grad, row_id_map=row_map, inp=inp, weights=partial_weights))
            grad_input, grad_weights = out["grad_input"], out["grad_weights"]
        else:
            grad_input, grad_weights = reference.combine_backward(grad, row_map, inp, partial_weights)
        if self.hidden_axes:
            grad_weights = jax.lax.psum(grad_weights, self.hidden_axes).astype(weights.dtype)
        return {"grad_input": grad_input, "grad_weights": grad_weights}


@_op
class SortChunks(ShardedOp):
    """sort_chunks_by_index: output chunk j is input chunk sorted_indices[j]; `backward` applies the inverse
    permutation (a gather through the same map) and returns no map."""

    has_probs: bool
    backward: bool

    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "inp": ("r", HIDDEN),
        "split_sizes": ("c",),
        "sorted_indices": ("c",),
        "probs": ("r",),
        "output": ("r", HIDDEN),
        "row_id_map": ("r",),
        "permuted_probs": ("r",),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return ("inp", "split_sizes", "sorted_indices") + ("probs",) * self.has_probs

    @property
    def results(self) -> tuple[str, ...]:
        return ("output",) + ("row_id_map",) * (not self.backward) + ("permuted_probs",) * self.has_probs

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        inp, sizes, order, probs = (
            arrays.get(name) for name in ("inp", "split_sizes", "sorted_indices", "probs")
        )
        if use_kernels:
            plan = kernels.sort_chunks_plan(
                num_rows=inp.shape[0],
                hidden=inp.shape[1],
                num_splits=sizes.shape[0],
                element_bytes=inp.dtype.itemsize,
                has_probs=probs is not None,
                backward=self.backward,
                device=device_info(),
            )
            out = _run(plan, dict(inp=inp, split_sizes=sizes, sorted_indices=order, probs=probs))
        else:
            values = reference.sort_chunks(inp, sizes, order, probs, self.backward)
            out = dict(zip(("output", "row_id_map", "permuted_probs"), values, strict=True))
        return {name: out[name] for name in self.results}
