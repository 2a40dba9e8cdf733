"""The experts of one token shard: the grouped MLP on rows in expert-major order (moetriton's grouped GEMMs
and activation), reading and writing the rows through a permutation when they arrive in another order."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import EPLayout

from ..activation import apply_activation, grouped_activation
from ..chunk_sort import sort_chunks_by_index
from ..fp8 import fp8_grouped_linear
from ..grouped_gemm import grouped_matmul
from .config import MoEConfig


class ExpertWeights(NamedTuple):
    """The experts' arrays as one pytree, sharded alike over the EP axis (one spec for every leaf):
    gate_up [L, H, W], down [L, F, H], and the projection biases gate_up_bias [L, W] and down_bias [L, H]
    or None."""

    gate_up: jax.Array
    down: jax.Array
    gate_up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def _group_bias(bias: jax.Array, group_sizes: jax.Array, num_rows: int, dtype) -> jax.Array:
    """[N, M] in dtype: bias [L, M] row j on each row of group j, zero on the rows past the groups (whose
    gradients are unspecified: `take`'s fill drops them from the bias gradient)."""
    ends = jnp.cumsum(group_sizes)  # [L]
    expert_of_row = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")  # L: tail
    return jnp.take(bias.astype(dtype), expert_of_row, axis=0, mode="fill", fill_value=0)


def expert_mlp(
    rows: jax.Array,
    group_sizes: jax.Array,
    experts: ExpertWeights,
    config: MoEConfig,
    order: jax.Array | None = None,
) -> jax.Array:
    """Grouped expert MLP on rows [N, H] with group_sizes [L]: expert-major rows, or rows[order] expert-major
    (order [N]: a row permutation), the result in the rows' order; each expert's biases added to its
    projections where given. Rows past the groups are left unspecified, forward and backward: every
    caller's buffer is sized for a worst case (up to EP times the routed rows) and reads back only the
    groups' rows, so no kernel streams the tail."""
    dtype = jnp.dtype(config.dtype)
    gate_up, down, gate_up_bias, down_bias = experts
    num_rows = rows.shape[0]
    if config.fp8 is not None:
        return _fp8_mlp(rows, group_sizes, experts, config, order)
    hidden = grouped_matmul(
        rows.astype(dtype), gate_up.astype(dtype), group_sizes, lhs_rows=order, zero_tail=False
    )  # [N, W], expert-major
    if gate_up_bias is not None:
        hidden = hidden + _group_bias(gate_up_bias, group_sizes, num_rows, hidden.dtype)
    # Rematerialised: the backward keeps hidden [N, W] and computes the activation output [N, F] again (one
    # elementwise kernel) instead of keeping it; the down GEMM's forward is not rerun (its output is
    # unused in the backward, so it is dead code there).
    down_of_activation = jax.checkpoint(
        partial(_down_of_activation, activation=config.activation),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    out = down_of_activation(hidden, down.astype(dtype), group_sizes, order)  # [N, H], the rows' order
    if down_bias is None:
        return out
    bias = _group_bias(down_bias, group_sizes, num_rows, out.dtype)  # [N, H], expert-major
    return out + bias if order is None else out.at[order].add(bias, unique_indices=True)


def _fp8_mlp(rows, group_sizes, experts: ExpertWeights, config: MoEConfig, order) -> jax.Array:
    """expert_mlp with both projections in FP8 (`fp8_grouped_linear` by config.fp8's recipe, forward and
    VJP; the weights quantized on each call). Rows in another order are gathered to expert-major first and
    the results scattered back: the FP8 GEMM reads its rows in order."""
    dtype = jnp.dtype(config.dtype)
    gate_up, down, gate_up_bias, down_bias = experts
    num_rows = rows.shape[0]
    rows = rows.astype(dtype) if order is None else rows.astype(dtype)[order]  # [N, H] expert-major
    hidden = fp8_grouped_linear(rows, group_sizes, gate_up.astype(dtype), config.fp8)
    if gate_up_bias is not None:
        hidden = hidden + _group_bias(gate_up_bias, group_sizes, num_rows, hidden.dtype)
    act = grouped_activation(hidden, group_sizes, config.activation)
    out = fp8_grouped_linear(act, group_sizes, down.astype(dtype), config.fp8)
    if down_bias is not None:
        out = out + _group_bias(down_bias, group_sizes, num_rows, out.dtype)
    return out if order is None else jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def _down_of_activation(hidden, down, group_sizes, order, activation: str) -> jax.Array:
    act = grouped_activation(hidden, group_sizes, activation)
    return grouped_matmul(act, down, group_sizes, out_rows=order, zero_tail=False)


def dense_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with fp32 accumulation and full-precision inputs: for float32 operands XLA's default on GPUs
    rounds them to TF32, which the layer's other GEMMs (moetriton's) and PyTorch's do not (bf16 and fp16
    operands are exact either way)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def shared_mlp(tokens: jax.Array, shared_gate_up, shared_down, shared_gate, config: MoEConfig) -> jax.Array:
    """The shared experts on every token of the shard: tokens [T, H] -> [T, H] in the compute dtype.

    shared_gate_up [H, 2Fs] (gated activation; [H, Fs] otherwise) and shared_down [Fs, H]: one dense FFN
    with the routed experts' activation (math in fp32), GEMMs in the compute dtype with fp32 accumulation.
    shared_gate [H, 1] or None: the output scaled per token by sigmoid(tokens @ shared_gate), in fp32. Reads
    nothing the routed path computes, so XLA may schedule it beside the row exchange."""
    dtype = jnp.dtype(config.dtype)
    tokens = tokens.astype(dtype)

    def matmul(a, b):
        # Output in the compute dtype (XLA accumulates in fp32 and rounds once, as an fp32 result cast would),
        # so the backward's cotangents stay in it too: an fp32 result would make every backward GEMM of a
        # bf16 layer an fp32 one (measured on two H200s, dsv3: TF32 kernels, the shared experts +7.5 ms).
        precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        return jnp.dot(a, b.astype(dtype), precision=precision)

    out = matmul(apply_activation(matmul(tokens, shared_gate_up), config.activation), shared_down)
    if shared_gate is None:
        return out
    logits = dense_dot(tokens, shared_gate.astype(dtype))  # [T, 1]
    return (jax.nn.sigmoid(logits) * out.astype(jnp.float32)).astype(dtype)


def expert_major_rows(
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
