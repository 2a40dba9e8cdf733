"""The experts of one token shard: the grouped MLP on rows in expert-major order (moetriton's grouped GEMMs
and activation), reading and writing the rows through a permutation when they arrive in another order."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moetriton.kernels.rules.expert_parallel import EPLayout

from ..activation import apply_activation, grouped_activation
from ..chunk_sort import sort_chunks_by_index
from ..grouped_gemm import grouped_matmul
from .config import MoEConfig


def expert_mlp(
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
    # Rematerialised: the backward keeps hidden [N, W] and computes the activation output [N, F] again (one
    # elementwise kernel) instead of keeping it; the down GEMM's forward is not rerun (its output is
    # unused in the backward, so it is dead code there).
    down_of_activation = jax.checkpoint(
        partial(_down_of_activation, activation=config.activation),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    return down_of_activation(hidden, down.astype(dtype), group_sizes, order)


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
