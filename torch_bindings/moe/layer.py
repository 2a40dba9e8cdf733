"""Expert-parallel MoE layer: `MoELayer` (nn.Module) and its functional form `moe`.

One call on one rank of the expert-parallel (EP) group, T tokens, E experts of which L = E / EP are local
(expert e lives on rank e // L), top-K routing; sizes and exchange formulas come from
moetriton.kernels.rules.expert_parallel. The steps, the JAX layer's too (moetriton.jax.moe.layer):

1. route (`routing`): logits = x @ gate_weight^T [T, E] (x.dtype, fp32 accumulation) -> fused top-k:
   routing_map [T, E], indices [T, K], merging weights = probs at indices; padding tokens routed nowhere;
2. count (`statistics`): the losses, the dropped count and the loads, global over the token group;
3. drop and chunk (`routing`): under a capacity with drop_policy "probs", the slots each expert drops set
   to -1; dropless, `pipeline_chunks` consecutive token chunks;
4. per chunk: dispatch (token_dispatch into the send buffer, expert-major and so rank-major) -> the
   exchange (`exchange` and one module per exchange) moves the rows to their experts' ranks, runs the
   experts there (`experts`: grouped GEMM gate_up -> activation -> grouped GEMM down) and brings the
   outputs back in the send buffer's layout -> combine (token_combine with the merging weights);
5. + the shared experts' FFN of the tokens (optionally gated per token), where shared weights are given.

The exchanges (`exchange_for` says which one a group gets): EP = 1, none (`Local`: the experts read the send
buffer in place). Dropless with EP > 1, `all_to_all` (all_to_all_single, the receive buffer chunk-sorted
to expert-major and back; with `pipeline_chunks=n` every exchange started without waiting, so that a
chunk's rows move while another chunk's GEMMs run; one count exchange and host sync for all chunks) or, on
GPUs of one host (exchange="auto" or "peer"), `peer`: the dispatch writes into a symmetric staging buffer,
every rank copies its rows from the others' buffers straight into expert-major order, the expert outputs
are copied back into their sources' buffers and the combine reads them there (no chunk sort, no NCCL row
exchange). An EP group whose ranks span hosts (as the launcher declares them, or MOETRITON_HOST_OF_RANK)
exchanges every row through all_to_all_single with exchange="auto". Capacity with EP > 1: fixed slabs,
through `peer` on GPUs of one host, else `capacity`.

Capacity policies (the same as the JAX layer):

* dropless (`capacity_factor=None`): every routed slot is computed. With EP > 1 the variable split sizes of
  all_to_all_single must be on the host: the layer copies the gathered counts [EP, E] to the host once per
  call (its only host sync) and sizes the receive buffer exactly. The counts come from the router (routed
  slots per expert rounded up to align_size, as token_dispatch pads them), so they are exchanged and their
  copy started before the dispatch kernels, and the host waits for that copy alone (not for the dispatch),
  so it launches the row exchange while the dispatch still runs. With EP = 1 there is no exchange: the
  experts read the send buffer in place, with group sizes from token_dispatch's counts on the device, and
  nothing syncs.
* capacity (`capacity_factor=c`): every (source rank, expert) pair keeps its first C = layout.capacity slots
  in token order (earlier tokens win) and drops the rest (a dropped slot adds nothing to its token's output;
  the remaining weights are not renormalised; drop_policy="probs" keeps the likeliest C instead). The
  exchange moves fixed [L, C] slabs (through peer memory on GPUs of one host, straight into the experts'
  [L, EP * C] order; else all_to_all_single and chunk sorts) and the experts run a batched GEMM over
  [L, EP * C] rows: no size depends on data and nothing syncs (EP = 1 and EP = 2 through peer memory are
  tested in a CUDA graph).
  `dropped` counts the dropped slots over the token group exactly.

Grouped GEMMs: dropless rows go through `torch._grouped_mm` (offsets = int32 cumulative group ends) on CUDA
GPUs of compute capability 9.0 or later, with bf16 tensors whose hidden and FFN sizes are multiples of 8
(16-byte strides); anywhere else a per-expert loop that masks each expert's rows (every expert multiplies
every row: E / EP times the FLOPs, a correctness fallback, CUDA-graph and compile safe). The capacity path
uses torch.bmm on every device.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moetriton.kernels.rules import moe as layer_rules
from moetriton.kernels.rules.expert_parallel import EPLayout, ep_layout, gate_up_width
from moetriton.kernels.rules.moe import MoEStats

from .._checks import Signature, describe, memoised, same_device, signature
from .._stages import stage
from .all_to_all import AllToAllExchange
from .balancing import update_expert_bias
from .capacity import CapacityExchange, gather_tokens
from .collectives import check_groups
from .exchange import Exchange, Local, dispatch, exchange_for
from .experts import Experts, add_shared, shared_mlp
from .peer import PeerExchange
from .routing import apply_drop_policy, route, token_chunks
from .statistics import routing_statistics

#: Expert activations and row exchanges (the dropless layer with EP > 1: "all_to_all" is all_to_all_single
#: then chunk sorts to expert-major and back, "peer" moetriton.torch.moe.peer's copies through peer
#: memory straight into expert-major order, "auto" peer where `peer_exchange_available`: GPUs of one host;
#: `exchange_for` says which a group gets): the shared layer rules' names (moetriton.kernels.rules.moe).
ACTIVATIONS = layer_rules.ACTIVATIONS
EXCHANGES = layer_rules.TORCH_EXCHANGES


@memoised
def _check_moe(
    *,
    x: Signature,
    gate_weight: Signature,
    gate_up: Signature,
    down: Signature,
    expert_bias: Signature | None,
    gate_bias: Signature | None,
    gate_up_bias: Signature | None,
    down_bias: Signature | None,
    shared_gate_up: Signature | None,
    shared_down: Signature | None,
    shared_gate: Signature | None,
    token_mask: Signature | None,
    routing_indices: Signature | None,
    ep_size: int,
    activation,
    score_function,
    exchange,
    drop_policy,
    pipeline_chunks,
    capacity_factor,
    return_stats,
    balance_counts,
    probs_on_input,
    fp8,
    router: tuple,
    align_size,
    **coefficients,
) -> layer_rules.LayerShape:
    """(hidden H, experts E, ffn F) of valid layer arguments: the shared layer rules (the same errors as
    the JAX layer's, the router's and the layout's included: every argument is checked before the call's
    first collective), then PyTorch's own: one dtype for x and the weights, one device. router: the values
    of layer_rules.ROUTER_OPTIONS, in order."""
    layer_rules.check_options(
        activation=activation,
        score_function=score_function,
        exchange=exchange,
        exchanges=EXCHANGES,
        drop_policy=drop_policy,
        pipeline_chunks=pipeline_chunks,
        capacity_factor=capacity_factor,
        return_stats=return_stats,
        balance_counts=balance_counts,
        probs_on_input=probs_on_input,
        topk=router[0],
        fp8=fp8,
        **coefficients,
    )
    shared = dict(shared_gate_up=shared_gate_up, shared_down=shared_down, shared_gate=shared_gate)
    biases = dict(gate_bias=gate_bias, gate_up_bias=gate_up_bias, down_bias=down_bias)
    arrays = dict(gate_weight=gate_weight, gate_up=gate_up, down=down, expert_bias=expert_bias, **shared)
    arrays.update(biases)
    same_device(x=x, token_mask=token_mask, routing_indices=routing_indices, **arrays)
    layer_rules.check_tokens(
        x_shape=tuple(x[0]),
        token_mask=None if token_mask is None else (tuple(token_mask[0]), str(token_mask[1]).split(".")[-1]),
        seq_aux_loss_coeff=coefficients["seq_aux_loss_coeff"],
        routing_indices=describe(routing_indices),
        topk=router[0],
    )
    if len(gate_weight[0]) != 2:
        raise ValueError(f"gate_weight: expected [E, H], got shape {list(gate_weight[0])}")
    num_experts, hidden = gate_weight[0]
    if num_experts % ep_size:
        raise ValueError(f"num_experts: expected a multiple of the EP size {ep_size}, got {num_experts}")
    router = dict(zip(layer_rules.ROUTER_OPTIONS, router, strict=True))
    shape = layer_rules.check_weights(
        x_shape=tuple(x[0]),
        gate=("gate_weight", "[E, H]", num_experts, hidden),
        gate_up=tuple(gate_up[0]),
        down=tuple(down[0]),
        expert_bias=None if expert_bias is None else tuple(expert_bias[0]),
        experts_held=num_experts // ep_size,
        activation=activation,
        score_function=score_function,
        use_pre_softmax=router["use_pre_softmax"],
    )
    layer_rules.check_biases(
        shape=shape,
        experts_held=num_experts // ep_size,
        activation=activation,
        **{name: None if sig is None else tuple(sig[0]) for name, sig in biases.items()},
    )
    layer_rules.check_shared_weights(
        hidden=hidden,
        activation=activation,
        **{name: None if sig is None else tuple(sig[0]) for name, sig in shared.items()},
    )
    num_tokens = math.prod(x[0][:-1])
    ep_layout(
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=router["topk"],
        ep_size=ep_size,
        align_size=align_size,
        capacity_factor=capacity_factor,
    )
    weights = dict(gate_weight=gate_weight, gate_up=gate_up, down=down, **biases, **shared)
    layer_rules.check_layer_dtypes(
        x=describe(x)[1],
        weights={name: describe(sig)[1] if sig else None for name, sig in weights.items()},
        same_as_x=True,
    )
    layer_rules.check_router(
        num_tokens=num_tokens,
        num_experts=num_experts,
        logits_dtype=describe(x)[1],
        expert_bias=describe(expert_bias),
        **router,
    )
    return shape


def moe(
    x: Tensor,
    gate_weight: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    topk: int,
    expert_bias: Tensor | None = None,
    gate_bias: Tensor | None = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    aux_loss_coeff: float = 0.0,
    align_size: int | None = None,
    activation: str = "swiglu",
    capacity_factor: float | None = None,
    ep_group: dist.ProcessGroup | None = None,
    token_group: dist.ProcessGroup | None = None,
    exchange: str = "auto",
    shared_gate_up: Tensor | None = None,
    shared_down: Tensor | None = None,
    shared_gate: Tensor | None = None,
    seq_aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
    drop_policy: str = "position",
    pipeline_chunks: int = 1,
    token_mask: Tensor | None = None,
    return_stats: bool = False,
    balance_counts: str = "routed",
    routing_indices: Tensor | None = None,
    probs_on_input: bool = False,
    fp8: str | None = None,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, MoEStats]:
    """One MoE layer on this rank's tokens, experts sharded over `ep_group` (see the module docstring).

    Every argument is checked before the call's first collective (the shared rules of
    moetriton.kernels.rules: a bad one raises on every rank alike, none of them left waiting).

    Args:
        x: [..., H] float32/bfloat16/float16 tokens of this rank; every weight has x's dtype exactly.
        gate_weight: [E, H] router weight (nn.Linear convention), x.dtype; logits are x.dtype.
        gate_up: [L, H, 2F] fused gate+up weights of this rank's L = E / EP experts (experts
            rank * L ... rank * L + L - 1), first F columns the gate; [L, H, F] for non-gated activations.
        down: [L, F, H] down-projection weights of the local experts.
        topk, expert_bias, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
            normalize_topk, group_score: the router's (moetriton.torch.fused_topk_with_score_function), so
            a model's routing recipe (DeepSeek-V3's top-2 group scores and unnormalised weights, Qwen3-MoE's
            norm_topk_prob, ERNIE-4.5's bias on a softmax before the top-k) carries over; expert_bias [E]
            steers selection only.
        gate_bias: [E] x.dtype or None: added to the router's logits (x @ gate_weight^T + gate_bias) before
            any score (GPT-OSS's router); differentiable.
        gate_up_bias, down_bias: [L, 2F] ([L, F] non-gated) and [L, H] x.dtype, or None: each local expert's
            projection biases (GPT-OSS's experts), added to its gate/up and down products; differentiable.
            A slot an expert drops or a padding token adds no bias to any output.
        aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff: weights of the switch load-balancing loss, the
            sequence-wise one of DeepSeek-V3 (needs x [B, S, H]) and the router z-loss, each global over
            token_group as moetriton.kernels.rules.moe.LOSSES defines it (0: that loss is off); aux_loss is
            their sum.
        balance_counts: the counts the two load-balancing losses weigh the scores by
            (moetriton.kernels.rules.moe.BALANCE_COUNTS): "routed" (default: the slots the router routed,
            expert bias and group limits included) or "scores" (the top-K of the aux-loss scores without
            bias or groups, Megatron-Core's counts). They differ only where a bias or groups steer the
            selection; MoEStats.routed is the routed slots either way.
        align_size: rows per expert block padded to a multiple of this (dropless; the capacity is rounded
            up to it).
        activation: "swiglu" (default), "geglu", "clamped_swiglu" (gated; GPT-OSS's), "gelu" or "relu"
            (non-gated): ACTIVATIONS.
        capacity_factor: None for dropless; c > 0 for C = c x the balanced load per (rank, expert).
        drop_policy: which slots a full expert keeps under capacity_factor: "position" (its first C, in
            token order) or "probs" (its C of highest merging weight, ties to the earlier slot).
        pipeline_chunks: dropless only (1 with capacity_factor): the routed path (dispatch, exchange,
            experts, combine) runs on this many consecutive chunks of the T tokens, sizes differing by one
            at most (moetriton.kernels.rules.expert_parallel.pipeline_chunk_bounds). With the all_to_all
            exchange the chunks form a pipeline, forward and backward: one chunk's rows move on NCCL's
            stream while another chunk's GEMMs run; the peer exchange's copies are kernels on the layer's
            stream, so there chunks run in turn. The results equal the unchunked layer's up to rounding
            (the same bits for the same chunking); still one host sync per call. Whether it pays is a
            measurement per shape and GPU: docs/moe.md ("Pipelined chunks").
        ep_group: the expert-parallel process group (None: one rank, every expert local). Every rank calls
            with the same T, E, K and options.
        token_group: the group over which the aux loss and the dropped count are global: every rank whose
            tokens share the loss (EP and data parallel ranks; None: ep_group).
        exchange: the row exchange with EP > 1, one of EXCHANGES: "all_to_all", "peer" (GPUs of
            one host; where ep_group spans hosts or `peer_exchange_available` is False, the same ValueError
            on every rank) or "auto" (peer where available; all_to_all for a group that spans hosts).
            `moetriton.torch.moe.exchange_for(ep_group, x.device, exchange)` says which one runs. Both give
            the same outputs and gradients up to rounding; the capacity path takes the same choice
            (peer: fixed slabs, no count exchange). The host of every rank is what the launcher
            declares: the environment variable MOETRITON_HOST_OF_RANK where set (host labels separated by
            commas, one per global rank, the same on every rank: "0,0,1,1" poses four ranks as two hosts
            of two), else the machine's name and torchrun's node rank (GROUP_RANK); it is gathered over
            ep_group once, on the group's first call with exchange="peer" or with peer memory possible
            (moetriton.torch.moe.collectives.group_hosts).
        shared_gate_up, shared_down: the shared experts, an always-on dense FFN every token also goes
            through (DeepSeek-V3, Qwen-MoE), added to the routed output: shared_gate_up [H, 2Fs] ([gate | up]
            for a gated activation; [H, Fs] otherwise) and shared_down [Fs, H], x.dtype, the routed experts'
            layout without the expert axis; several shared experts are one FFN of their summed width Fs.
            Both or neither (None: no shared experts, the layer as without them). The FFN runs on this
            rank's tokens with no collective (replicate the weights over ep_group) and reads nothing of the
            routed path's exchange.
        shared_gate: [H, 1] x.dtype or None: the shared FFN's output scaled per token by
            sigmoid(x @ shared_gate) (fp32), as Qwen-MoE does.
        token_mask: bool [...] (x's leading shape) or None: False marks padding, which takes no expert
            slot, counts in no loss, load or capacity, and gets a zero output row and zero gradient.
        return_stats: also return the call's MoEStats (losses by name, per-expert routed and kept slots,
            loads), device tensors global over token_group.
        routing_indices: int32/int64 [..., K] (x's leading shape) or None: router replay, the expert ids
            the router takes instead of choosing (e.g. recorded at inference, from the router's returned
            indices), with this call's weights from this call's logits; ids outside [0, E) and repeats
            within a token select nothing (docs/router.md, "Router replay"). Losses and statistics follow
            the replayed selection.
        probs_on_input: the merging weight scales the token before its expert (Llama 4: expert(w x)) instead
            of the expert's output (w expert(x)); topk 1 only. The shared experts see the unscaled tokens.
        fp8: None (default: the expert GEMMs in x.dtype) or an FP8 recipe, "tensorwise" (TE's current
            scaling) or "blockwise" (DeepSeek-V3's 1x128 / 128x128 scales): both projections of the routed
            experts as `moetriton.torch.fp8_grouped_linear`, forward and backward, the master weights kept
            in their dtype and quantized on each call; router, combine and shared experts unchanged
            (docs/fp8.md, "The MoE layer in FP8").

    Returns:
        (out [..., H] in x.dtype, aux_loss fp32 scalar, dropped int32 scalar), and the MoEStats with
        return_stats: aux_loss has the same value on every rank and its backward gives each rank the
        gradient of its own tokens, so parameter gradients summed over token_group equal the unsharded
        layer's. Differentiable in x, gate_weight,
        gate_up, down and the shared weights (replicated: sum their gradients over token_group as for
        gate_weight). Host syncs: one per call for dropless with EP > 1, none otherwise.

    Example:
        >>> x = torch.randn(6, 8)
        >>> gate, gate_up, down = torch.randn(4, 8), torch.randn(4, 8, 8), torch.randn(4, 4, 8)
        >>> out, aux_loss, dropped = moe(x, gate, gate_up, down, topk=2, capacity_factor=1.0)
        >>> out.shape, aux_loss.dtype, dropped.dtype
        (torch.Size([6, 8]), torch.float32, torch.int32)
    """
    ep_size, ep_rank = check_groups(ep_group=ep_group, token_group=token_group)
    router = (topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function)
    router += (normalize_topk, group_score)  # ROUTER_OPTIONS, in order
    shape = _check_moe(
        x=signature(x),
        gate_weight=signature(gate_weight),
        gate_up=signature(gate_up),
        down=signature(down),
        expert_bias=signature(expert_bias),
        gate_bias=signature(gate_bias),
        gate_up_bias=signature(gate_up_bias),
        down_bias=signature(down_bias),
        shared_gate_up=signature(shared_gate_up),
        shared_down=signature(shared_down),
        shared_gate=signature(shared_gate),
        token_mask=signature(token_mask),
        routing_indices=signature(routing_indices),
        ep_size=ep_size,
        activation=activation,
        score_function=score_function,
        exchange=exchange,
        drop_policy=drop_policy,
        pipeline_chunks=pipeline_chunks,
        capacity_factor=capacity_factor,
        return_stats=return_stats,
        balance_counts=balance_counts,
        probs_on_input=probs_on_input,
        fp8=fp8,
        router=router,
        align_size=align_size,
        aux_loss_coeff=aux_loss_coeff,
        seq_aux_loss_coeff=seq_aux_loss_coeff,
        z_loss_coeff=z_loss_coeff,
    )
    tokens = x.reshape(-1, shape.hidden)  # [T, H]
    valid = None if token_mask is None else token_mask.reshape(-1)  # [T]
    if valid is not None:  # padding enters as zeros: whatever it holds (NaN included) reaches nothing
        tokens = torch.where(valid[:, None], tokens, 0)
    layout = ep_layout(
        num_tokens=tokens.shape[0],
        num_experts=shape.num_experts,
        topk=topk,
        ep_size=ep_size,
        align_size=align_size,
        capacity_factor=capacity_factor,
    )
    row_exchange = _exchange(layout, ep_group, ep_rank, tokens.device, exchange)
    with stage("router"):
        replayed = None if routing_indices is None else routing_indices.reshape(-1, topk)  # [T, K]
        routing = route(
            tokens,
            gate_weight,
            gate_bias,
            valid,
            expert_bias,
            replayed,
            **dict(zip(layer_rules.ROUTER_OPTIONS, router, strict=True)),
        )
        aux_loss, dropped, stats = routing_statistics(
            routing,
            valid,
            layout,
            score_function=score_function,
            coefficients=(aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff),
            batch_shape=tuple(x.shape[:2]) if x.dim() == 3 else None,
            group=token_group if token_group is not None else ep_group,
            want_stats=return_stats,
            balance_counts=balance_counts,
        )
        routing = apply_drop_policy(routing, layout, drop_policy)
    routed_tokens = tokens
    if probs_on_input:  # [T, H] scaled by the top-1 weight (fp32, one rounding); the combine weighs 1 or 0
        routed_tokens = (tokens.float() * routing.merging).to(tokens.dtype)
        routing = replace(routing, merging=(routing.indices >= 0).to(routing.merging.dtype))
    chunks = token_chunks(routed_tokens, routing, layout, pipeline_chunks)
    row_exchange.start(chunks)
    sends = (dispatch(chunk, row_exchange) for chunk in chunks)
    if not row_exchange.in_turn:  # every chunk dispatched before the shared experts and the first row moves
        sends = list(sends)
    # From the tokens alone: no data dependency on the routed path. On the layer's stream: a side stream hid a
    # little of the exchange but lengthened the step by more (docs/performance.md), since the peer copies and
    # the GEMMs each fill every SM.
    shared = None
    if shared_gate_up is not None:
        shared = shared_mlp(tokens, shared_gate_up, shared_down, shared_gate, activation)
    experts = Experts(gate_up, down, activation, gate_up_bias, down_bias, fp8)
    parts = [row_exchange.combine(rows, send) for send, rows in row_exchange(sends, experts)]
    out = add_shared(parts[0] if len(parts) == 1 else torch.cat(parts), shared, valid)
    return (out.reshape(x.shape), aux_loss, dropped, *((stats,) if return_stats else ()))


def _exchange(layout: EPLayout, group, rank: int, device: torch.device, requested: str) -> Exchange:
    """The call's row exchange (moetriton.torch.moe.exchange), decided before any collective of the call (the
    hosts are gathered once per group, on its first call): every rank takes the same one, and a bad choice
    fails on every rank at once."""
    if layout.ep_size == 1:
        return Local(layout, group, rank)
    peer = exchange_for(group, device, requested) == "peer"
    same_tokens = gather_tokens(layout, group, device)
    if peer:
        return PeerExchange(layout, group, rank, same_tokens)
    if layout.dropless:
        return AllToAllExchange(layout, group, rank)
    return CapacityExchange(layout, group, rank, same_tokens)


class MoELayer(nn.Module):
    """Expert-parallel MoE layer: router, dispatch, all-to-all, grouped GEMMs, combine (see `moe`).

    Parameters: gate_weight [E, H]; gate_up [L, H, 2F] (SwiGLU; [L, H, F] non-gated) and down [L, F, H] for
    this rank's L = E / EP experts (rank r holds experts r * L ... r * L + L - 1); with `expert_bias=True`
    an fp32 buffer expert_bias [E] (sigmoid / sqrtsoftplus, or softmax with use_pre_softmax), which
    aux-loss-free balancing moves after each optimizer step: `layer.update_expert_bias(stats.routed,
    update_rate)` with the stats of `layer(x, return_stats=True)`. With `num_shared_experts=n > 0`
    (DeepSeek-V3: 1) the shared experts, one always-on FFN of width Fs = n * F: shared_gate_up [H, 2Fs]
    ([H, Fs] non-gated) and shared_down [Fs, H], replicated on every rank; with `shared_expert_gate=True`
    (Qwen-MoE) also shared_gate [H, 1], scaling their output per token by sigmoid(x @ shared_gate) (see
    `moe`). With `gate_bias=True` a router bias gate_bias [E], and with `projection_biases=True` the
    experts' biases gate_up_bias [L, 2F] ([L, F] non-gated) and down_bias [L, H] (GPT-OSS), zero at reset.

    forward(x [..., H], token_mask=None, return_stats=False, routing_indices=None) -> (out [..., H],
    aux_loss fp32 scalar, dropped int32 scalar[, MoEStats]); the loss coefficients, drop_policy and
    balance_counts are `moe`'s options.

    The dropless row exchange with EP > 1 is `exchange` ("auto": peer memory on GPUs of one host,
    all_to_all_single otherwise, an EP group that spans hosts included); every rank's host comes from the
    launcher (machine name and torchrun's GROUP_RANK) or from MOETRITON_HOST_OF_RANK (one host label per
    global rank, e.g. "0,0,1,1"), gathered once per group: see `moe`'s `exchange` argument, and
    `moetriton.torch.moe.exchange_for(layer.ep_group, device, exchange)` for the exchange a group gets.

    Example:
        >>> layer = MoELayer(16, 32, num_experts=4, topk=2, aux_loss_coeff=1e-2)
        >>> out, aux_loss, dropped = layer(torch.randn(2, 3, 16))
        >>> out.shape
        torch.Size([2, 3, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        topk: int,
        *,
        score_function: str = "softmax",
        use_pre_softmax: bool = False,
        num_groups: int | None = None,
        group_topk: int | None = None,
        scaling_factor: float | None = None,
        normalize_topk: bool | None = None,
        group_score: str = "topk_sum",
        expert_bias: bool = False,
        gate_bias: bool = False,
        projection_biases: bool = False,
        aux_loss_coeff: float = 0.0,
        align_size: int | None = None,
        activation: str = "swiglu",
        capacity_factor: float | None = None,
        ep_group: dist.ProcessGroup | None = None,
        token_group: dist.ProcessGroup | None = None,
        exchange: str = "auto",
        num_shared_experts: int = 0,
        shared_expert_gate: bool = False,
        seq_aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        drop_policy: str = "position",
        pipeline_chunks: int = 1,
        balance_counts: str = "routed",
        probs_on_input: bool = False,
        fp8: str | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        layer_rules.check_options(  # now rather than at the first call
            activation=activation,
            score_function=score_function,
            exchange=exchange,
            exchanges=EXCHANGES,
            drop_policy=drop_policy,
            pipeline_chunks=pipeline_chunks,
            capacity_factor=capacity_factor,
            balance_counts=balance_counts,
            probs_on_input=probs_on_input,
            topk=topk,
            fp8=fp8,
            aux_loss_coeff=aux_loss_coeff,
            seq_aux_loss_coeff=seq_aux_loss_coeff,
            z_loss_coeff=z_loss_coeff,
        )
        ep_size, _ = check_groups(ep_group=ep_group, token_group=token_group)
        ep_layout(  # validates E, K, EP, align_size and capacity_factor now rather than at the first call
            num_tokens=0,
            num_experts=num_experts,
            topk=topk,
            ep_size=ep_size,
            align_size=align_size,
            capacity_factor=capacity_factor,
        )
        local = num_experts // ep_size
        width = gate_up_width(activation, ffn_hidden_size)
        factory = dict(dtype=dtype, device=device)
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        self.gate_up = nn.Parameter(torch.empty(local, hidden_size, width, **factory))
        self.down = nn.Parameter(torch.empty(local, ffn_hidden_size, hidden_size, **factory))
        optional_shapes = layer_rules.shared_weight_shapes(
            hidden=hidden_size,
            ffn=ffn_hidden_size,
            num_shared_experts=num_shared_experts,
            shared_expert_gate=shared_expert_gate,
            activation=activation,
        )
        optional_shapes |= layer_rules.bias_shapes(
            hidden=hidden_size,
            ffn=ffn_hidden_size,
            num_experts=num_experts,
            experts_held=local,
            activation=activation,
            gate_bias=gate_bias,
            projection_biases=projection_biases,
        )
        for name in (*layer_rules.SHARED_WEIGHTS, *layer_rules.BIASES):  # absent ones are None attributes
            shape = optional_shapes.get(name)
            weight = None if shape is None else nn.Parameter(torch.empty(shape, **factory))
            self.register_parameter(name, weight)
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if expert_bias else None
        self.register_buffer("expert_bias", bias)
        self.ep_group = ep_group
        self.token_group = token_group
        self.options = dict(
            topk=topk,
            score_function=score_function,
            use_pre_softmax=use_pre_softmax,
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=scaling_factor,
            normalize_topk=normalize_topk,
            group_score=group_score,
            aux_loss_coeff=aux_loss_coeff,
            align_size=align_size,
            activation=activation,
            capacity_factor=capacity_factor,
            exchange=exchange,
            seq_aux_loss_coeff=seq_aux_loss_coeff,
            z_loss_coeff=z_loss_coeff,
            drop_policy=drop_policy,
            pipeline_chunks=pipeline_chunks,
            balance_counts=balance_counts,
            probs_on_input=probs_on_input,
            fp8=fp8,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal weights with standard deviation fan_in ** -0.5 (fan_in: H, H and F; the shared experts'
        H, Fs and the shared gate's H, as the routed experts')."""
        for weight in (self.gate_weight, self.gate_up, self.down):
            nn.init.normal_(weight, std=weight.shape[1] ** -0.5)
        for weight in (self.shared_gate_up, self.shared_down, self.shared_gate):
            if weight is not None:  # [fan_in, fan_out]: the routed experts' layout without the expert axis
                nn.init.normal_(weight, std=weight.shape[0] ** -0.5)
        for bias in (self.gate_bias, self.gate_up_bias, self.down_bias):
            if bias is not None:  # zero: the layer starts as the one without biases
                nn.init.zeros_(bias)

    def forward(
        self,
        x: Tensor,
        token_mask: Tensor | None = None,
        return_stats: bool = False,
        routing_indices: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, MoEStats]:
        """`moe` with this layer's parameters and options: (out, aux_loss, dropped[, stats]);
        routing_indices [..., K] replays a recorded selection (`moe`)."""
        return moe(
            x,
            self.gate_weight,
            self.gate_up,
            self.down,
            expert_bias=self.expert_bias,
            gate_bias=self.gate_bias,
            gate_up_bias=self.gate_up_bias,
            down_bias=self.down_bias,
            ep_group=self.ep_group,
            token_group=self.token_group,
            shared_gate_up=self.shared_gate_up,
            shared_down=self.shared_down,
            shared_gate=self.shared_gate,
            token_mask=token_mask,
            return_stats=return_stats,
            routing_indices=routing_indices,
            **self.options,
        )

    @torch.no_grad()
    def update_expert_bias(self, routed: Tensor, update_rate: float) -> None:
        """Aux-loss-free balancing: the expert_bias buffer moved in place by `update_expert_bias` from a
        step's routed counts [E] (`MoEStats.routed`, global over token_group, so every rank applies the same
        update); call it once per optimizer step. Needs `expert_bias=True`."""
        if self.expert_bias is None:
            raise ValueError("expert_bias: update_expert_bias needs a layer built with expert_bias=True")
        self.expert_bias.copy_(update_expert_bias(self.expert_bias, routed, update_rate))

    def extra_repr(self) -> str:
        experts, hidden = self.gate_weight.shape
        ffn = self.down.shape[1]
        options = ", ".join(f"{name}={value}" for name, value in self.options.items())
        shared = "" if self.shared_down is None else f", shared_ffn={self.shared_down.shape[0]}"
        shared += ", shared_expert_gate=True" if self.shared_gate is not None else ""
        shared += ", gate_bias=True" if self.gate_bias is not None else ""
        shared += ", projection_biases=True" if self.down_bias is not None else ""
        return (
            f"hidden={hidden}, ffn={ffn}, experts={experts}, local_experts={self.down.shape[0]}{shared},"
            f" {options}"
        )
