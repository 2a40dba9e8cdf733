"""Expert-parallel MoE layer: router -> dispatch -> exchange -> grouped GEMMs -> exchange back -> combine.

`moe(x, gate, gate_up, down, topk=..., mesh=...)` is a pure function (jit- and grad-safe, static shapes, no
host sync). Tokens are sharded over (data axes..., EP axis) on their batch axis, experts over the EP axis
(expert e lives on EP rank e // L, L = E / EP). Every token shard runs, inside one `jax.shard_map`:

1. route (`routing`): logits = x @ gate [T, E] (fp32) -> fused top-k: indices [T, K] and merging weights
   (masked tokens' slots -1: no expert);
2. count (`statistics`): the losses, the dropped count and the loads, global over the token shards (counts
   psum-ed over all token shards, partial losses psum-ed);
3. drop and chunk (`routing`): under a capacity with drop_policy "probs", the slots each expert drops set
   to -1 (`most_probable_slots`); dropless, `pipeline_chunks` static token chunks of the shard, independent
   of each other, so that one chunk's exchange can run beside another's GEMMs;
4. per chunk: dispatch (token_dispatch, aligned or capacity C) -> the exchange (`exchange` and one module
   per exchange: `all_to_all` dropless, `capacity`) moves the rows to their experts' ranks, runs the
   experts there (`experts`: grouped_matmul gate_up -> activation -> grouped_matmul down) and brings the
   outputs back in the send buffer's layout -> combine (token_combine with the merging weights);
5. + the shared experts' FFN of the shard's tokens (optionally gated per token), where shared weights are
   given: computed from the tokens alone, with no dependency on the exchange.

The exchange sizes and static buffer sizes come from moetriton.kernels.rules.expert_parallel (`ep_layout`,
`dropless_exchange`, `dropped_slots`, `kept_slots`); nothing here re-derives them. The dropless exchanges,
"ragged" and "padded" ("auto": `resolve_exchange`), are moetriton.jax.moe.all_to_all's; under a capacity
every (source, expert) pair owns exactly C rows, so one fixed-size all_to_all moves [L, C] slabs
(moetriton.jax.moe.capacity). Gradients are our ops' custom_vjp rules plus JAX's transposes of the
collectives. The grouped GEMMs are moetriton's (`grouped_matmul`: Triton kernels with their VJP; XLA lowers
ragged_dot to E-times-padded dots on GPUs). Never imports torch or flax.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from moetriton.kernels.rules import moe as layer_rules
from moetriton.kernels.rules import validation
from moetriton.kernels.rules.expert_parallel import pipeline_chunk_bounds
from moetriton.kernels.rules.moe import MoEStats

from ..permutation import token_combine, token_dispatch
from .config import MoEConfig
from .exchange import exchanged_experts, resolve_exchange
from .experts import ExpertWeights, shared_mlp
from .routing import apply_drop_policy, route
from .statistics import routing_statistics

#: Row exchanges and expert activations: the shared layer rules' names (moetriton.kernels.rules.moe).
EXCHANGES = layer_rules.JAX_EXCHANGES
ACTIVATIONS = layer_rules.ACTIVATIONS


def _shard(x, router_weights, experts, expert_bias, shared_weights, per_token, *, config: MoEConfig):
    """What one token shard computes: x [B_local, S, H] -> (out [B_local, S, H], aux loss, dropped), and
    MoEStats with config.return_stats. router_weights: (gate [H, E], gate_bias [E] or None); experts: the
    shard's ExpertWeights; shared_weights: (shared_gate_up, shared_down, shared_gate or None),
    or None without shared experts; per_token: (token_mask [B_local, S] bool or None, routing_indices
    [B_local, S, K] or None)."""
    token_mask, routing_indices = per_token
    gate, gate_bias = router_weights
    shape = x.shape
    num_tokens, hidden = shape[0] * shape[1], shape[2]
    num_experts = gate.shape[1]
    layout = config.layout(num_tokens, num_experts)
    x_flat = x.reshape(num_tokens, hidden)
    valid = None if token_mask is None else token_mask.reshape(num_tokens)
    if num_tokens == 0:
        # Every shard is empty (shards hold equal shapes): nothing to route, dispatch or exchange; only the
        # counts' collectives remain. Built without the empty router, dispatch and exchange: nothing would
        # launch, and jaxlib 0.11.2's compiler crashed (SIGSEGV) on that empty program, on GPUs and on
        # CPU devices.
        empty = jnp.zeros((0, num_experts), bool)
        counted = routing_statistics(empty.astype(jnp.float32), empty, valid, layout, config, shape[0])
        return (jnp.zeros(shape, x.dtype), *counted[: 3 if config.return_stats else 2])
    if valid is not None:
        # Padding tokens enter as zeros: whatever they hold (NaN included) reaches no result or gradient.
        x_flat = jnp.where(valid[:, None], x_flat, jnp.zeros((), x_flat.dtype))
    replayed = None if routing_indices is None else routing_indices.reshape(num_tokens, -1)  # [T, K]
    logits, weights, indices, routing_map = route(
        x_flat, gate, gate_bias, expert_bias, valid, config, replayed
    )
    aux_loss, dropped, stats = routing_statistics(logits, routing_map, valid, layout, config, shape[0])
    indices = apply_drop_policy(indices, weights, layout, config.drop_policy)
    tokens = x_flat.astype(config.dtype)
    routed_tokens = tokens
    if (
        config.probs_on_input
    ):  # [T, H] scaled by the top-1 weight (fp32, one rounding); the combine weighs 1 or 0
        routed_tokens = (x_flat.astype(jnp.float32) * weights).astype(config.dtype)
        weights = (indices >= 0).astype(weights.dtype)
    # From the tokens alone: no data dependency on the dispatch or the exchange.
    shared = None if shared_weights is None else shared_mlp(tokens, *shared_weights, config)  # [T, H]
    if layout.dropless:
        # Static, non-empty chunks (every shard holds the same T): each is the dropless layer on its tokens;
        # their exchanges depend on nothing of the other chunks, so XLA may run one beside another's GEMMs.
        bounds = [
            bound
            for bound in pipeline_chunk_bounds(num_tokens, config.pipeline_chunks)
            if bound[1] > bound[0]
        ]
        parts = [
            _routed(
                routed_tokens[start:end],
                indices[start:end],
                weights[start:end],
                experts,
                config.layout(end - start, num_experts),
                config,
            )
            for start, end in bounds
        ]
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    else:
        out = _routed(routed_tokens, indices, weights, experts, layout, config)
    if shared is not None:  # summed in fp32, rounded once to x.dtype below
        shared = shared.astype(jnp.float32)
        if valid is not None:
            shared = jnp.where(valid[:, None], shared, 0.0)
        out = out.astype(jnp.float32) + shared
    out = out.astype(x.dtype).reshape(shape)
    return (out, aux_loss, dropped) if stats is None else (out, aux_loss, dropped, stats)


def _routed(tokens, indices, weights, experts: ExpertWeights, layout, config: MoEConfig):
    """tokens [T, H] routed to their experts by indices [T, K] and merged with weights [T, K]: dispatch,
    exchange (EP > 1), experts and combine -> [T, H] in tokens' dtype (masked tokens' rows zero)."""
    num_experts = layout.num_experts
    if layout.dropless:
        send, _, row_id_map, pad_offsets, counts = token_dispatch(
            tokens, indices=indices, num_experts=num_experts, align_size=layout.align_size
        )
    else:
        send, _, row_id_map, pad_offsets, counts = token_dispatch(
            tokens, indices=indices, num_experts=num_experts, capacity=layout.capacity
        )
    expert_out = exchanged_experts(send, counts, experts, layout, config)
    return token_combine(expert_out, row_id_map, weights, pad_offsets)


#: The array arguments of `moe`, required and optional, as `_array` names them.
ARGUMENTS = ("x", "gate", "gate_up", "down")
OPTIONAL_ARGUMENTS = (
    "expert_bias", "token_mask", "shared_gate_up", "shared_down", "shared_gate", "routing_indices",
    *layer_rules.BIASES,
)  # fmt: skip


def _array(name: str, value) -> jax.Array:
    """`value` as a jax.Array: a JAX array as it is, a numpy array through jnp.asarray (with JAX's dtypes:
    float64 becomes float32 without x64); anything else a TypeError naming the argument."""
    if isinstance(value, np.ndarray):
        return jnp.asarray(value)
    if not isinstance(value, jax.Array):
        validation.require_array(name, validation.not_an_array(value, "a jax.Array"))
    return value


def _dtype_name(value) -> str:
    """The numpy-style name of an array's dtype, or of a dtype (anything jnp.dtype reads; else the value)."""
    try:
        return jnp.dtype(getattr(value, "dtype", value)).name
    except TypeError:
        return repr(value)


def _check_mesh(mesh: Mesh | None, ep_axis: str | None, data_axes: tuple[str, ...]) -> tuple[int, int]:
    """(EP size, token shards) of the mesh arguments."""
    if mesh is None:
        if data_axes:
            raise ValueError(f"data_axes: expected () without a mesh, got {data_axes}")
        return 1, 1
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh or None, got {type(mesh).__name__}")
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
    gate_bias: jax.Array | None = None,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    aux_loss_coeff: float = 0.0,
    align_size: int | None = None,
    capacity_factor: float | None = None,
    activation: str = "swiglu",
    dtype=None,
    mesh: Mesh | None = None,
    ep_axis: str | None = "ep",
    data_axes: tuple[str, ...] = (),
    exchange: str = "auto",
    shared_gate_up: jax.Array | None = None,
    shared_down: jax.Array | None = None,
    shared_gate: jax.Array | None = None,
    seq_aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
    drop_policy: str = "position",
    pipeline_chunks: int = 1,
    token_mask: jax.Array | None = None,
    return_stats: bool = False,
    balance_counts: str = "routed",
    routing_indices: jax.Array | None = None,
    probs_on_input: bool = False,
    fp8: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array, MoEStats]:
    """A mixture-of-experts MLP layer with expert parallelism.

    Args:
        x: [B, S, H] tokens, float32, bfloat16 or float16 (a jax.Array or a numpy array); B must be a
            multiple of the token shards (the product of the sizes of `data_axes` and `ep_axis`). Every
            weight below may be any of those three dtypes: it is cast to `dtype` (docs/moe.md, "dtype
            rules").
        gate: [H, E] router weights. Logits are x @ gate accumulated in fp32 and kept in fp32.
        gate_up: [E, H, 2F] fused gate and up projections for a gated activation ("swiglu", "geglu",
            "clamped_swiglu": the first F columns are the gate, the last F the up projection), or [E, H, F]
            for "gelu" / "relu".
        down: [E, F, H] down projections.
        topk: K experts per token (1 <= K <= E).
        expert_bias: [E] selection bias (sigmoid / sqrtsoftplus, or softmax with use_pre_softmax; no
            gradient). Aux-loss-free balancing
            updates it between steps from the routed counts: `update_expert_bias(expert_bias,
            stats.routed, rate)`.
        gate_bias: [E] or None (replicated): added to the router's logits in fp32 before any score
            (GPT-OSS's router); differentiable.
        gate_up_bias, down_bias: [E, 2F] ([E, F] non-gated) and [E, H], or None, sharded over ep_axis as
            the experts are: each expert's projection biases (GPT-OSS's experts), cast to the compute dtype
            and added to its gate/up and down products; differentiable. A slot an expert drops or a masked
            token adds no bias to any output.
        score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, normalize_topk,
            group_score: the router's options, as in `fused_topk_with_score_function`, so that a model's
            routing recipe (DeepSeek-V3's top-2 group scores and unnormalised weights, Qwen3-MoE's
            norm_topk_prob, ERNIE-4.5's bias on a softmax before the top-k) carries over.
        aux_loss_coeff: weight of the switch / GShard load-balancing loss (0 disables it; the loss is then
            0). Every loss is global over the token shards (the same value and gradients as the unsharded
            layer's) and defined in moetriton.kernels.rules.moe.LOSSES.
        align_size: rows of every expert block rounded up to a multiple of this (grouped-GEMM tiles).
        capacity_factor: None for the dropless policy; c > 0 for the capacity policy: every (token shard,
            expert) pair keeps C = align * max(1, ceil(c * T * K / (E * align))) of its routed slots, which
            ones by `drop_policy`, and drops the rest (a dropped slot adds nothing to its token; the other
            weights are not renormalised). T is the tokens of one shard, padding included.
        activation: "swiglu" (default), "geglu", "clamped_swiglu" (GPT-OSS's), "gelu" or "relu".
        dtype: compute dtype of the dispatched tokens, the expert weights and the grouped GEMMs (default
            x.dtype; float32, bfloat16 or float16). The router runs in fp32; the output is in x.dtype.
        mesh: the device mesh (None: one device, no collectives). Tokens are sharded over
            (*data_axes, ep_axis) on B, the expert axis of gate_up / down over ep_axis, gate and expert_bias
            replicated; inputs in other shardings are resharded by jit (FSDP-sharded weights are
            all-gathered).
        ep_axis: the mesh axis of expert parallelism (None: no EP, experts replicated); E must be a multiple
            of its size.
        data_axes: further mesh axes sharding the tokens (data / FSDP parallelism).
        exchange: "auto", "all_to_all" (`jax.lax.ragged_all_to_all`; also named "ragged") or "padded"
            (fixed-size all_to_all of every pair's rows padded to the step's largest pair, rounded up to one
            of a few sizes). Both move the same rows and give the same results. "auto" is "padded": XLA's
            ragged all-to-all is far slower between the GPUs of one host, and between GPUs of different
            processes jaxlib 0.11 runs it only with
            XLA_FLAGS=--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true (docs/moe.md).
        shared_gate_up, shared_down: the shared experts, an always-on dense FFN every token also goes
            through (DeepSeek-V3, Qwen-MoE), added to the routed output: shared_gate_up [H, 2Fs] ([gate | up]
            for a gated activation; [H, Fs] otherwise) and shared_down [Fs, H], the routed experts' layout
            without the expert axis, cast to the compute dtype; several shared experts are one FFN of their
            summed width Fs. Both or neither (None: no shared experts, the layer as without them). They
            take PartitionSpec() (replicated over the data and EP axes): every token shard runs the FFN on
            its own tokens, with no collective and no dependency on the routed path's exchange.
        shared_gate: [H, 1] or None (PartitionSpec()): the shared FFN's output scaled per token by
            sigmoid(x @ shared_gate) (fp32 logits and sigmoid), as Qwen-MoE does.
        seq_aux_loss_coeff: weight of DeepSeek-V3's sequence-wise balancing loss: per sequence of x (a row
            of B), averaged over the sequences holding an unmasked token (0 disables it).
        z_loss_coeff: weight of the ST-MoE router z-loss, the mean over unmasked tokens of
            logsumexp(logits)^2 (0 disables it).
        drop_policy: which routed slots a full expert keeps under capacity_factor (ignored when dropless):
            "position" (default) its first C in (token, slot) order, "probs" its C of highest merging weight,
            ties to the earlier slot. Both keep min(routed, C) per expert, so `dropped` is the same.
        pipeline_chunks: dropless only (1 with capacity_factor): every token shard's routed path (dispatch,
            exchange, experts, combine) runs on this many consecutive chunks of its tokens, sizes differing
            by one at most (moetriton.kernels.rules.expert_parallel.pipeline_chunk_bounds; more chunks than
            tokens: one per token). The chunks share no data, so XLA's scheduler may run one chunk's
            exchange beside another's GEMMs. The results equal the unchunked layer's up to rounding (the
            same bits for the same chunking); docs/moe.md ("Pipelined chunks") says what it measured.
        token_mask: [B, S] bool or None (every token counts), sharded like x: False marks padding, routed to
            no expert and counted in no loss, load, capacity or token count, with an output row of exactly
            zero (shared experts' included) and a zero gradient. No host sync: the counts stay on device.
        return_stats: also return a `moetriton.kernels.rules.moe.MoEStats` (every field global over the
            token shards). False: the outputs and the compiled program are those without it.
        routing_indices: [B, S, K] int32/int64 or None, sharded like x: router replay, the expert ids the
            router takes instead of choosing (e.g. recorded at inference), with this call's weights from
            this call's logits; ids outside [0, E) and repeats within a token select nothing
            (docs/router.md, "Router replay"). Losses and statistics follow the replayed selection.
        balance_counts: the counts the two load-balancing losses weigh the scores by
            (moetriton.kernels.rules.moe.BALANCE_COUNTS): "routed" (default: the slots the router routed,
            expert bias and group limits included) or "scores" (the top-K of the aux-loss scores without
            bias or groups, Megatron-Core's counts). They differ only where a bias or groups steer the
            selection; MoEStats.routed is the routed slots either way.
        probs_on_input: the merging weight scales the token before its expert (Llama 4: expert(w x)) instead
            of the expert's output (w expert(x)); topk 1 only. The shared experts see the unscaled tokens.
        fp8: None (default: the expert GEMMs in `dtype`) or an FP8 recipe, "tensorwise" (TE's current
            scaling) or "blockwise" (DeepSeek-V3's 1x128 / 128x128 scales): both projections of the routed
            experts as `moetriton.jax.fp8_grouped_linear`, forward and VJP, the weights quantized on each
            call; router, combine and shared experts unchanged (docs/fp8.md, "The MoE layer in FP8").

    Returns:
        (out [B, S, H] in x.dtype, aux_loss fp32 scalar: the sum of the three weighted losses, dropped
        int32 scalar: routed slots the capacity policy dropped over all token shards, 0 for dropless), and
        with `return_stats` a fourth element, MoEStats: load_balancing_loss, seq_load_balancing_loss,
        z_loss (fp32 scalars, each times its coefficient), routed [E] int32 (slots routed per expert,
        padding excluded), kept [E] int32 (per shard min(routed, C), summed; routed when dropless), dropped
        (the third output), max_load int32 = max(kept) and mean_load fp32 = mean(kept).

    Example:
        >>> mesh = jax.make_mesh((4,), ("ep",))
        >>> out, aux_loss, dropped = moe(x, gate, gate_up, down, topk=2, mesh=mesh, aux_loss_coeff=1e-2)
        >>> out, aux_loss, dropped, stats = moe(
        ...     x, gate, gate_up, down, topk=2, mesh=mesh, z_loss_coeff=1e-3, token_mask=mask,
        ...     capacity_factor=1.25, drop_policy="probs", return_stats=True,
        ... )
        >>> stats.max_load / stats.mean_load  # the load imbalance of this step
    """
    layer_rules.check_options(
        activation=activation,
        score_function=score_function,
        aux_loss_coeff=aux_loss_coeff,
        seq_aux_loss_coeff=seq_aux_loss_coeff,
        z_loss_coeff=z_loss_coeff,
        exchange=exchange,
        exchanges=EXCHANGES,
        drop_policy=drop_policy,
        pipeline_chunks=pipeline_chunks,
        capacity_factor=capacity_factor,
        return_stats=return_stats,
        balance_counts=balance_counts,
        probs_on_input=probs_on_input,
        topk=topk,
        fp8=fp8,
    )
    x, gate, gate_up, down = (
        _array(name, value) for name, value in zip(ARGUMENTS, (x, gate, gate_up, down), strict=True)
    )
    optional = (expert_bias, token_mask, shared_gate_up, shared_down, shared_gate, routing_indices)
    optional += (gate_bias, gate_up_bias, down_bias)
    expert_bias, token_mask, shared_gate_up, shared_down, shared_gate, routing_indices, *biases = (
        None if value is None else _array(name, value)
        for name, value in zip(OPTIONAL_ARGUMENTS, optional, strict=True)
    )
    biases = dict(zip(layer_rules.BIASES, biases, strict=True))
    if x.ndim != 3:
        raise ValueError(f"x: expected rank 3 [B, S, H], got shape {tuple(x.shape)}")
    mask_type = None if token_mask is None else (tuple(token_mask.shape), jnp.dtype(token_mask.dtype).name)
    layer_rules.check_tokens(
        x_shape=tuple(x.shape),
        token_mask=mask_type,
        seq_aux_loss_coeff=seq_aux_loss_coeff,
        routing_indices=None
        if routing_indices is None
        else (tuple(routing_indices.shape), jnp.dtype(routing_indices.dtype).name),
        topk=topk,
    )
    if gate.ndim != 2:
        raise ValueError(f"gate: expected [H, E], got shape {list(gate.shape)}")
    hidden, num_experts = gate.shape
    shape = layer_rules.check_weights(
        x_shape=tuple(x.shape),
        gate=("gate", "[H, E]", num_experts, hidden),
        gate_up=tuple(gate_up.shape),
        down=tuple(down.shape),
        expert_bias=None if expert_bias is None else tuple(expert_bias.shape),
        experts_held=None,
        activation=activation,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
    )
    layer_rules.check_biases(
        shape=shape,
        experts_held=None,
        activation=activation,
        **{name: None if array is None else tuple(array.shape) for name, array in biases.items()},
    )
    shared = dict(shared_gate_up=shared_gate_up, shared_down=shared_down, shared_gate=shared_gate)
    layer_rules.check_shared_weights(
        hidden=hidden,
        activation=activation,
        **{name: None if array is None else tuple(array.shape) for name, array in shared.items()},
    )
    weights = dict(gate=gate, gate_up=gate_up, down=down, **biases, **shared)
    layer_rules.check_layer_dtypes(
        x=_dtype_name(x),
        weights={name: None if array is None else _dtype_name(array) for name, array in weights.items()},
        same_as_x=False,
        compute=None if dtype is None else _dtype_name(dtype),
    )
    batch = x.shape[0]
    data_axes = tuple(data_axes)
    ep_size, num_shards = _check_mesh(mesh, ep_axis if mesh is not None else None, data_axes)
    if batch % num_shards:
        raise ValueError(
            f"x: expected a batch size B that is a multiple of the token shards {num_shards}, got {batch}"
        )
    router = dict(topk=topk, score_function=score_function, use_pre_softmax=use_pre_softmax)
    router.update(num_groups=num_groups, group_topk=group_topk, scaling_factor=scaling_factor)
    router.update(normalize_topk=normalize_topk, group_score=group_score)
    losses = dict(aux_loss_coeff=float(aux_loss_coeff), seq_aux_loss_coeff=float(seq_aux_loss_coeff))
    losses.update(z_loss_coeff=float(z_loss_coeff))
    config = MoEConfig(
        **router,
        **losses,
        align_size=align_size,
        capacity_factor=capacity_factor,
        activation=activation,
        drop_policy=drop_policy,
        pipeline_chunks=pipeline_chunks,
        balance_counts=balance_counts,
        probs_on_input=probs_on_input,
        fp8=fp8,
        dtype=jnp.dtype(dtype or x.dtype).name,
        mesh=mesh,
        ep_axis=ep_axis if mesh is not None else None,
        data_axes=data_axes,
        exchange=resolve_exchange(exchange),
        num_shards=num_shards,
        ep_size=ep_size,
        return_stats=return_stats,
    )
    config.layout(batch // num_shards * x.shape[1], num_experts)  # validates the layout's arguments
    layer_rules.check_router(
        num_tokens=batch * x.shape[1],
        num_experts=num_experts,
        logits_dtype="float32",
        expert_bias=None if expert_bias is None else (tuple(expert_bias.shape), _dtype_name(expert_bias)),
        **router,
    )
    if capacity_factor is not None:  # a float in the jit key: 1 and 1.0 compile once
        config = dataclasses.replace(config, capacity_factor=float(capacity_factor))
    shared_weights = None if shared_gate_up is None else (shared_gate_up, shared_down, shared_gate)
    per_token = (token_mask, routing_indices)
    router_weights = (gate, biases["gate_bias"])
    experts = ExpertWeights(gate_up, down, biases["gate_up_bias"], biases["down_bias"])
    return _jitted(config)(x, router_weights, experts, expert_bias, shared_weights, per_token, config)


@cache
def _jitted(config: MoEConfig):
    """The jitted layer for `config`. On a mesh of Auto and Explicit axes the output's type names only its
    Explicit axes, and JAX 0.11 then places it replicated over the Auto ones: jit is told the tokens'
    sharding of the output (the other results are the compiler's to place)."""
    mesh = config.mesh
    kinds = set(mesh.axis_types) if mesh is not None else set()
    if {AxisType.Auto, AxisType.Explicit} <= kinds:
        tokens = NamedSharding(mesh, PartitionSpec(config.token_axes or None))
        results = 4 if config.return_stats else 3
        return jax.jit(_moe, static_argnums=(6,), out_shardings=(tokens, *(None,) * (results - 1)))
    return _moe_jit


def _moe(x, router_weights, experts, expert_bias, shared_weights, per_token, config: MoEConfig):
    if config.mesh is None:
        return _shard(x, router_weights, experts, expert_bias, shared_weights, per_token, config=config)
    tokens = PartitionSpec(config.token_axes or None)
    # One spec for every leaf of a tuple (None leaves are no arrays): the router's weight and bias and the
    # shared experts' weights replicated, every expert array sharded over the EP axis on its expert axis,
    # the token mask [B, S] and the replayed ids [B, S, K] like x, on its batch axis.
    specs = (tokens, PartitionSpec(), PartitionSpec(config.ep_axis), PartitionSpec(), PartitionSpec(), tokens)

    def body(x, router_weights, experts, expert_bias, shared_weights, per_token):
        return _shard(x, router_weights, experts, expert_bias, shared_weights, per_token, config=config)

    arrays = (x, router_weights, experts, expert_bias, shared_weights, per_token)
    if AxisType.Explicit in tuple(config.mesh.axis_types):
        # Explicit axes: shard_map's in_specs must be the shardings the arrays' types carry, so each array
        # is resharded to its spec (what jit does by itself on Auto axes).
        arrays = tuple(
            _resharded(array, config.mesh, spec) for array, spec in zip(arrays, specs, strict=True)
        )

    # Every result but the output is global (replicated): the scalars and every MoEStats field.
    out_specs = (tokens, *(PartitionSpec(),) * (3 if config.return_stats else 2))
    # check_vma=False: our ops' custom_vjp rules and host callbacks do not carry varying-axis types; every
    # collective here is explicit, and JAX still psums the gradients of replicated inputs.
    sharded = jax.shard_map(body, mesh=config.mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    return sharded(*arrays)


_moe_jit = jax.jit(_moe, static_argnums=(6,))


def _resharded(arrays, mesh: Mesh, spec: PartitionSpec):
    """`arrays` (an array, None, or a pytree of them: the experts, the shared weights) resharded to `spec` on
    `mesh` over its Explicit axes (a type names no other: Auto axes are jit's to place)."""
    explicit = {
        axis for axis, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind == AxisType.Explicit
    }
    entries = []
    for entry in spec:
        axes = tuple(axis for axis in (entry if isinstance(entry, tuple) else (entry,)) if axis in explicit)
        entries.append(axes or None)
    sharding = NamedSharding(mesh, PartitionSpec(*entries))
    return jax.tree.map(lambda array: jax.sharding.reshard(array, sharding), arrays)
