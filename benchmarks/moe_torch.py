"""Layer-step benchmark of the PyTorch expert-parallel MoE layer beside a Megatron-style baseline.

    python -m benchmarks.moe_torch                                # one GPU (EP = 1), mixtral and dsv3
    torchrun --nproc-per-node 2 -m benchmarks.moe_torch           # EP = 2 over NCCL
    python -m benchmarks.moe_torch --tiny                         # CPU smoke run: tiny shapes, one step

(--tiny runs on CPU: our kernels interpreted when TRITON_INTERPRET=1 is in the environment, as in the test
suite, otherwise moetriton's reference ops.)

One step = forward + backward of one layer (bf16 on GPU) on MOE_LAYER_SHAPES (T tokens per GPU), aux loss
on (coefficient 1e-2); `--layers N`: of N such layers, each feeding the next, as in a model (the host then
runs ahead of the GPU during a layer's GEMMs and queues the next layer's work, which one layer alone cannot
show; sums below are over the layers). Implementations:

* moetriton: `moetriton.torch.moe` (our router, dispatch, chunk sort and combine kernels), exchange="auto":
  with EP > 1 on GPUs of one host the peer exchange (moetriton.torch.moe.peer: no chunk sorts, no NCCL
  row exchange);
* moetriton_a2a: the same with exchange="all_to_all" (all_to_all_single and chunk sorts);
* megatron: the same layer without our kernels, the way Megatron-Core's unfused path builds it: torch
  softmax / sigmoid / group-limited top-k router, torch.argsort permutation (index_select) and index_add
  unpermutation, all_to_all_single with host split sizes, chunk sort by torch.split + torch.cat; the same
  grouped GEMMs (`moetriton.torch.moe.expert_mlp`: torch._grouped_mm where supported) and SwiGLU.

`--variants plain,shared,recipe,...` (benchmarks.common.LAYER_VARIANTS) runs the moetriton impls once per
variant: a shared expert of the routed FFN size (its FFN alone, forward + backward, is timed beside the step
as shared_ffn_ms: step(shared) - step(plain) below it is the part other work hid), each training-recipe
option alone, or all of them; the step time against "plain" is what an option costs. Tokens are [B, S, H]
with S = benchmarks.common.SEQUENCE_LENGTH.

Each row (impl x variant x shape x EP) reports: step_ms (median wall time of `--steps` synchronised steps,
slowest rank); the stage breakdown from a torch.profiler trace of two steps, each started together on every
rank: every stage is a record_function range "moe.<stage>" in the forward, and backward work
(autograd::engine::evaluate_function events) is attributed to the stage whose forward op created the autograd
node (matched by sequence number); on GPUs per kernel, from the host context that launched it (its innermost
stage range, which the peer exchange opens inside its autograd functions too, else that rule for its backward
node; benchmarks.trace_gaps), as GPU time; on CPU as CPU time of the ranges; shares are of the profiled total
("other": the loss and gradient accumulation; the barrier that starts each profiled step together on every
rank is left out and its wait reported as align_wait_ms); routing share = router + dispatch + chunk_sort +
combine; grouped-GEMM TFLOP/s = 3 x (2 rows H 2F + 2 rows F H) / grouped_gemm time, rows = T x K routed slots,
against dense_gemm_tflops: a [8192, 8192] x [8192, 8192] cuBLAS matmul in the same dtype, timed on the same
GPU at the start of the run (gemm_pct_of_dense); with EP > 1, all-to-all GB/s = bytes this rank sends in the 4
token exchanges of a step (4 x T K H x 2 bytes, padding not counted) / all_to_all stage time (the row
exchanges; the count exchange before them, with its host copy and its wait for the slower rank, is the
exchange_sizes stage), against a plain all_to_all_single of [T K, H] with equal splits; a2a_gbps_least_waiting
is the same bytes over the all_to_all stage of the rank whose exchanges took least (the others include waiting
for a later peer); a2a_transfer_gbps splits the wait off exactly: from every rank's trace, each exchange's
NCCL kernel counts from the latest rank's start to its own end (a2a_wait_ms: the rest, per step, mean over the
ranks; processes on one host share the clock; for the peer exchange: its barrier kernels, which only wait for
the other ranks, against its copies). exchange_ms / exposed_exchange_ms (EP > 1, GPU): per profiled step, the
time some exchange kernel runs, and the part of it with no kernel of another stage beside it
(benchmarks.trace_gaps.exposed_us; exposed_exchange_pct: of step_ms). gpu_idle_ms: per profiled step, the time
from the end of its starting barrier to its last GPU work with no kernel, copy or memset running
(benchmarks.trace_gaps; --trace DIR keeps every rank's trace). peak_allocated_gib: the caching allocator's
peak on rank 0 during the row; staging_mib: rank 0's peer-exchange staging allocation (symmetric memory, not
in that peak), rows x (H x 2 + 4) bytes for the group's largest send buffer of T K rows. A row that runs out
of memory is printed and written as OOM, and the next row runs (under torchrun an OOM on one rank only would
leave the other waiting for the collective timeout).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import trace_gaps
from benchmarks.common import (
    add_out_option,
    add_variants_option,
    router_options,
    sequences,
    variant_options,
    write_results,
)
from benchmarks.timing import dense_gemm_tflops
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES, MoELayerShape
from moetriton.torch.moe import STAGES as LAYER_STAGES
from moetriton.torch.moe import all_to_all_rows, expert_mlp, moe, peer
from moetriton.torch.moe.experts import shared_mlp

IMPLS = ("moetriton", "moetriton_a2a", "megatron")
AUX_LOSS_COEFF = 1e-2
BACKWARD = "autograd::engine::evaluate_function"
STAGES = (*LAYER_STAGES, "other")  # "other": the loss and gradient accumulation
# The range around each profiled step's start, which lines the ranks up: its wait (an NCCL barrier kernel
# spinning until the later rank arrives) is no stage of the layer, so it is reported apart.
ALIGN = "bench.align"
ROUTING_STAGES = ("router", "dispatch", "chunk_sort", "combine")
# Host contexts that launch the row exchanges: the all_to_all stage and its backward (moe.all_to_all_rows).
EXCHANGE_CONTEXTS = ("moe.all_to_all", "_ExchangeBackward")
TINY = {
    "mixtral": MoELayerShape("mixtral-tiny", 16, 16, 16, 4, 2),
    "dsv3": MoELayerShape("dsv3-tiny", 16, 16, 16, 8, 4, "sigmoid", 4, 2),
}


def _stage(name: str) -> torch.profiler.record_function:
    return torch.profiler.record_function(f"moe.{name}")


# Megatron-style baseline ------------------------------------------------------------------------------------


def _baseline_router(logits: torch.Tensor, shape: MoELayerShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in logits.dtype, indices [T, K]): top-k of the logits then softmax over the K
    (softmax), or top-k of sigmoid scores renormalised over the K, group-limited when the shape says so."""
    scores = logits.float() if shape.score_function == "softmax" else logits.float().sigmoid()
    if shape.num_groups:
        num_tokens = scores.shape[0]
        per_group = scores.view(num_tokens, shape.num_groups, -1)
        group_scores = per_group.topk(shape.topk // shape.group_topk, dim=-1).values.sum(-1)  # [T, G]
        chosen = group_scores.topk(shape.group_topk, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        expert_mask = group_mask.repeat_interleave(shape.num_experts // shape.num_groups, dim=1)
        scores = scores.masked_fill(~expert_mask, float("-inf"))
    top, indices = scores.topk(shape.topk, dim=-1)
    if shape.score_function == "softmax":
        weights = top.softmax(-1)
    else:
        weights = top / (top.sum(-1, keepdim=True) + 1e-20) if shape.topk > 1 else top
    return weights.to(logits.dtype), indices


def _baseline_aux_loss(logits, indices, shape: MoELayerShape, group) -> torch.Tensor:
    """Switch loss with the tokens per expert summed over the group (this rank's partial)."""
    scores = logits.float().softmax(-1) if shape.score_function == "softmax" else logits.float().sigmoid()
    if shape.score_function != "softmax":
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    tokens_per_expert = torch.bincount(indices.reshape(-1), minlength=shape.num_experts)
    world = 1
    if group is not None:
        dist.all_reduce(tokens_per_expert, group=group)
        world = dist.get_world_size(group)
    total = logits.shape[0] * world
    coeff = AUX_LOSS_COEFF * shape.num_experts / (shape.topk * total * total)
    return coeff * (scores.sum(0) * tokens_per_expert).sum()


def megatron_moe(
    x, gate_weight, gate_up, down, shape: MoELayerShape, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline layer: (out [T, H], aux_loss) on this rank's tokens and local experts."""
    with _stage("router"):
        logits = F.linear(x, gate_weight)
        weights, indices = _baseline_router(logits, shape)
        aux_loss = _baseline_aux_loss(logits, indices, shape, group)
    with _stage("dispatch"):
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [T K] slots in expert order
        permuted = x.index_select(0, order // shape.topk)
        counts = torch.bincount(flat, minlength=shape.num_experts)
    if group is None:
        out = expert_mlp(permuted, counts, gate_up, down, "swiglu")
    else:
        ep, rank, local = dist.get_world_size(group), dist.get_rank(group), gate_up.shape[0]
        with _stage("exchange_sizes"):
            counts_all = counts.new_empty(ep * shape.num_experts)  # [EP E]: every rank's counts
            dist.all_gather_into_tensor(counts_all, counts, group=group)
            per_pair = counts_all.view(ep, ep, local)  # [source, destination, local expert]
            on_host = per_pair.cpu()  # the one host sync, as in Megatron's all-to-all dispatcher
            send_sizes = on_host[rank].sum(-1).tolist()
            mine = on_host[:, rank]  # [source, local expert]
            recv_sizes = mine.sum(-1).tolist()
        with _stage("all_to_all"):
            received = all_to_all_rows(permuted, send_sizes, recv_sizes, sum(recv_sizes), group)
        with _stage("chunk_sort"):
            chunks = received.split(mine.reshape(-1).tolist())
            expert_major = torch.cat([chunks[p * local + j] for j in range(local) for p in range(ep)])
        out = expert_mlp(expert_major, per_pair[:, rank].sum(0), gate_up, down, "swiglu")
        with _stage("chunk_sort"):
            chunks = out.split(mine.t().reshape(-1).tolist())
            source_major = torch.cat([chunks[j * ep + p] for p in range(ep) for j in range(local)])
        with _stage("all_to_all"):
            out = all_to_all_rows(source_major, recv_sizes, send_sizes, permuted.shape[0], group)
    with _stage("combine"):
        weighted = out * weights.reshape(-1)[order, None]
        combined = torch.zeros_like(x).index_add_(0, order // shape.topk, weighted)
    return combined, aux_loss


# Measurement ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(step: Callable[[], None], steps: int, device: torch.device, group) -> float:
    """Median wall time of `steps` calls, each started together on every rank and synchronised."""
    times = []
    for _ in range(steps):
        _sync(device)
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def stage_ms(events, per_steps: int) -> dict[str, float]:
    """ms of CPU time per step of every stage from profiler events (CPU runs; see the module docstring)."""

    def spent(event) -> float:
        return event.cpu_time_total / 1e3 / per_steps

    def enclosing(event) -> str | None:
        """ "moe.<stage>" or the backward node evaluation that `event` runs in, if any."""
        while event is not None:
            if event.name.startswith(("moe.", BACKWARD)):
                return event.name
            event = event.cpu_parent
        return None

    totals: dict[str, float] = defaultdict(float)
    stage_of_node: dict[int, str] = {}
    backward = []
    for event in sorted(events, key=lambda event: event.time_range.start):
        if event.cpu_parent is None and event.device_type == torch.autograd.DeviceType.CPU:
            if event.name == ALIGN:
                totals[ALIGN] += spent(event)
            elif event.name.startswith(BACKWARD):
                backward.append(event)
            else:  # a stage range, or forward work outside the stages (the loss)
                totals[event.name.removeprefix("moe.") if event.name.startswith("moe.") else "other"] += (
                    spent(event)
                )
        context = enclosing(event)
        if event.sequence_nr >= 0 and not (context or "").startswith(BACKWARD):
            # Forward ops: the op that creates autograd node n is the last to see sequence number n.
            stage_of_node[event.sequence_nr] = context.removeprefix("moe.") if context else "other"
    for event in backward:
        totals[stage_of_node.get(event.sequence_nr, "other")] += spent(event)
    return {stage: totals.get(stage, 0.0) for stage in (*STAGES, ALIGN)}


def trace_stage_ms(timeline: list[trace_gaps.Activity], per_steps: int) -> dict[str, float]:
    """ms per step of every stage from the GPU activities of a trace (trace_gaps.Activity.layer_stage)."""
    totals: dict[str, float] = defaultdict(float)
    for activity in timeline:
        totals[activity.layer_stage] += (activity.end - activity.start) / 1e3 / per_steps
    return {stage: totals.get(stage, 0.0) for stage in (*STAGES, ALIGN)}


def _plain_all_to_all_gbps(rows: int, hidden: int, dtype, device, group) -> float:
    """GB/s this rank sends with a plain all_to_all_single of [rows, H] in equal splits."""
    ep = dist.get_world_size(group)
    rows = max(ep, rows // ep * ep)
    send = torch.randn(rows, hidden, device=device).to(dtype)
    recv = torch.empty_like(send)
    ms = _median_ms(lambda: dist.all_to_all_single(recv, send, group=group), 10, device, group)
    return send.numel() * send.element_size() / (ms * 1e-3) / 1e9


# Rows -------------------------------------------------------------------------------------------------------


def _inputs(
    shape: MoELayerShape,
    tokens: int,
    rank: int,
    ep: int,
    device,
    dtype,
    layers: int = 1,
    variant: str = "plain",
) -> dict:
    """Tokens [B, S, H], output cotangent and this rank's parameters of each of `layers` layers (with the
    variant's shared expert: [H, 2F] and [F, H], replicated), drawn on the device (dsv3's expert weights are
    billions of values); the variant's layer options and token mask."""
    generator = torch.Generator(device).manual_seed(1000 + rank)
    shared = torch.Generator(device).manual_seed(7)  # the gate is replicated: the same on every rank
    local = shape.num_experts // ep
    options, shared_experts, mask = variant_options(variant, tokens)

    def normal(*size, scale=1.0, source=generator):
        return torch.randn(*size, generator=source, device=device, dtype=dtype) * scale

    stack = []
    for _ in range(layers):
        params = [
            normal(shape.num_experts, shape.hidden, scale=shape.hidden**-0.5, source=shared),  # gate_weight
            normal(local, shape.hidden, 2 * shape.ffn, scale=shape.hidden**-0.5),  # gate_up
            normal(local, shape.ffn, shape.hidden, scale=shape.ffn**-0.5),  # down
        ]
        if shared_experts:
            width = shared_experts * shape.ffn
            params.append(normal(shape.hidden, 2 * width, scale=shape.hidden**-0.5, source=shared))
            params.append(normal(width, shape.hidden, scale=width**-0.5, source=shared))
        stack.append(params)
    for param in (param for params in stack for param in params):
        param.requires_grad_()
    batch, length = sequences(tokens)
    return dict(
        x=normal(batch, length, shape.hidden),
        cotangent=normal(batch, length, shape.hidden),
        stack=stack,
        options=options,
        token_mask=None if mask is None else torch.from_numpy(mask).to(device).reshape(batch, length),
    )


def _layer_step(impl: str, shape: MoELayerShape, inputs: dict, args, group) -> Callable[[], None]:
    """One forward + backward of `impl` through the stack of layers, each feeding the next, on the inputs
    (gradients reset first, not accumulated)."""
    x = inputs["x"].requires_grad_()

    def step() -> None:
        x.grad = None
        for params in inputs["stack"]:
            for param in params:
                param.grad = None
        out, aux_losses = x, []
        for params in inputs["stack"]:
            out, aux_loss = _layer(impl, shape, out, params, inputs, args, group)
            aux_losses.append(aux_loss)
        aux_loss = torch.stack(aux_losses).sum()
        torch.autograd.backward([out, aux_loss], [inputs["cotangent"], torch.ones_like(aux_loss)])

    return step


def _layer(
    impl: str, shape: MoELayerShape, x, params, inputs, args, group
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl.startswith("moetriton"):
        gate_weight, gate_up, down, *shared = params
        out, aux_loss, *_ = moe(
            x,
            gate_weight,
            gate_up,
            down,
            topk=shape.topk,
            **router_options(shape),
            aux_loss_coeff=AUX_LOSS_COEFF,
            align_size=args.align_size,
            capacity_factor=args.capacity_factor,
            ep_group=group,
            exchange="all_to_all" if impl == "moetriton_a2a" else "auto",
            shared_gate_up=shared[0] if shared else None,
            shared_down=shared[1] if shared else None,
            token_mask=inputs["token_mask"],
            **inputs["options"],
        )
        return out, aux_loss
    out, aux_loss = megatron_moe(x.reshape(-1, shape.hidden), *params, shape, group)
    return out.reshape(x.shape), aux_loss


def _shared_ffn_ms(inputs: dict, steps: int, device, group) -> float:
    """Median ms of the shared experts' FFN alone, forward + backward, on the layer's tokens: what the
    layer step would add if nothing overlapped it."""
    _, _, _, shared_gate_up, shared_down = inputs["stack"][0]
    tokens = inputs["x"].reshape(-1, inputs["x"].shape[-1]).detach().requires_grad_()
    cotangent = inputs["cotangent"].reshape(tokens.shape)

    def step() -> None:
        torch.autograd.backward(shared_mlp(tokens, shared_gate_up, shared_down, None, "swiglu"), cotangent)

    step()
    return _median_ms(step, steps, device, group)


def run_row(impl: str, shape: MoELayerShape, args, device, dtype, group, variant: str = "plain") -> dict:
    ep = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    tokens = args.tokens or shape.num_tokens
    row = dict(impl=impl, variant=variant, shape=shape.name, ep=ep, tokens_per_gpu=tokens, layers=args.layers)
    row.update(hidden=shape.hidden, ffn=shape.ffn, experts=shape.num_experts, topk=shape.topk)
    row.update(
        policy="dropless" if args.capacity_factor is None else f"capacity {args.capacity_factor}",
        align_size=args.align_size,
        dtype=str(dtype).removeprefix("torch."),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )
    on_gpu = device.type == "cuda"
    inputs = _inputs(shape, tokens, rank, ep, device, dtype, args.layers, variant)
    step = _layer_step(impl, shape, inputs, args, group)
    for _ in range(1 if args.tiny else 2):  # compile the kernels, fill the allocator cache
        step()
    step_ms = _median_ms(step, args.steps, device, group)
    if len(inputs["stack"][0]) > 3:  # shared experts: their FFN alone, beside the step that overlaps it
        row.update(shared_ffn_ms=round(_shared_ffn_ms(inputs, args.steps, device, group), 4))
    if on_gpu:
        row.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2))
        if impl == "moetriton" and ep > 1:  # the peer exchange's (the others leave it as they found it)
            row.update(staging_mib=round(peer.staging_bytes(device) / 2**20, 1))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiled_steps = 1 if args.tiny else 2
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(profiled_steps):
            # Every rank starts the step together: otherwise a rank that starts the profiler later (CUPTI
            # initialises on first use) makes the other wait in the router's all-reduce (router stage).
            with torch.profiler.record_function(ALIGN):
                _sync(device)
                if group is not None:
                    dist.barrier(group=group)
            step()
        _sync(device)
    timeline = _timeline(profile, args.trace, f"{impl}_{shape.name}_ep{ep}_rank{rank}") if on_gpu else None
    if timeline is None:
        stages = stage_ms(profile.events(), profiled_steps)
    else:  # per kernel, from its launch context (kernels launched inside autograd functions included)
        stages = trace_stage_ms(timeline, profiled_steps)
    align_ms = stages.pop(ALIGN)
    if group is not None:
        slowest = torch.tensor([step_ms], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        step_ms = float(slowest)
    total = sum(stages.values())
    rows = tokens * shape.topk * args.layers  # routed slots of all layers
    gemm_flops = 3 * (2 * rows * shape.hidden * 2 * shape.ffn + 2 * rows * shape.ffn * shape.hidden)
    if "shared_ffn_ms" in row:  # the shared FFN's GEMMs run in the grouped_gemm stage too
        shared_width = inputs["stack"][0][4].shape[0]
        gemm_flops += 3 * 6 * tokens * args.layers * shape.hidden * shared_width
    gemm_tflops = gemm_flops / (stages["grouped_gemm"] * 1e-3) / 1e12 if stages["grouped_gemm"] else 0.0
    row.update(step_ms=round(step_ms, 4), align_wait_ms=round(align_ms, 4))
    row.update({f"{stage}_ms": round(ms, 4) for stage, ms in stages.items()})
    row.update(
        {f"{stage}_share_pct": round(100 * ms / total, 2) if total else 0.0 for stage, ms in stages.items()}
    )
    routing = sum(stages[stage] for stage in ROUTING_STAGES)
    row.update(
        routing_share_pct=round(100 * routing / total, 2) if total else 0.0,
        gemm_tflops=round(gemm_tflops, 1),
        dense_gemm_tflops=round(args.dense_tflops, 1),
        gemm_pct_of_dense=round(100 * gemm_tflops / args.dense_tflops, 1) if args.dense_tflops else 0.0,
    )
    if group is not None and stages["all_to_all"]:
        sent = 4 * rows * shape.hidden * inputs["x"].element_size()
        layer_gbps = sent / (stages["all_to_all"] * 1e-3) / 1e9
        # The rank that waited least for its peers in the exchanges: closest to the transfer rate itself.
        least = torch.tensor([stages["all_to_all"]], device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
        plain_gbps = _plain_all_to_all_gbps(tokens * shape.topk, shape.hidden, dtype, device, group)
        row.update(
            a2a_gbps=round(layer_gbps, 1),
            plain_a2a_gbps=round(plain_gbps, 1),
            a2a_pct_of_plain=round(100 * layer_gbps / plain_gbps, 1),
            a2a_gbps_least_waiting=round(sent / (float(least) * 1e-3) / 1e9, 1),
        )
        if timeline is not None:
            # NCCL row exchanges (the all-to-all path), else the peer exchange's copies and barriers.
            if any(kernel.stage in EXCHANGE_CONTEXTS for kernel in trace_gaps.nccl_kernels(timeline)):
                wait_ms, transfer_ms = _exchange_wait_and_transfer(timeline, profiled_steps, group)
            else:
                wait_ms, transfer_ms = _peer_wait_and_transfer(timeline, profiled_steps, group)
            transfer_gbps = sent / (transfer_ms * 1e-3) / 1e9
            row.update(
                a2a_wait_ms=round(wait_ms, 4),
                a2a_transfer_gbps=round(transfer_gbps, 1),
                a2a_transfer_pct_of_plain=round(100 * transfer_gbps / plain_gbps, 1),
            )
    if timeline is not None:
        row.update(gpu_idle_ms=round(statistics.mean(trace_gaps.idle_per_step(timeline)) / 1e3, 4))
        if group is not None:
            exchange_us, exposed = trace_gaps.exposed_us(timeline, "all_to_all")
            row.update(
                exchange_ms=round(exchange_us / 1e3 / profiled_steps, 4),
                exposed_exchange_ms=round(exposed / 1e3 / profiled_steps, 4),
                exposed_exchange_pct=round(100 * exposed / 1e3 / profiled_steps / step_ms, 2),
            )
    return row


def _timeline(profile, folder: Path | None, name: str) -> list[trace_gaps.Activity]:
    """The GPU activities of a profile (benchmarks.trace_gaps), through its trace, kept in `folder` (gzipped)
    when given."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{name}.json"
        profile.export_chrome_trace(str(path))
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            with path.open("rb") as raw, gzip.open(folder / f"{name}.json.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
        return trace_gaps.load(str(path))


def _exchange_wait_and_transfer(timeline, per_steps: int, group) -> tuple[float, float]:
    """(ms per step, means over the ranks) that the row exchanges' NCCL kernels spent waiting for the latest
    rank to start them, and transferring after it: every rank's kernels gathered, matched in issue order."""
    mine = [
        (kernel.start, kernel.end)
        for kernel in trace_gaps.nccl_kernels(timeline)
        if kernel.stage in EXCHANGE_CONTEXTS
    ]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    split = trace_gaps.wait_and_transfer(every)
    ranks = len(split)
    wait = sum(wait for rank in split for wait, _ in rank) / ranks / per_steps / 1e3
    transfer = sum(transfer for rank in split for _, transfer in rank) / ranks / per_steps / 1e3
    return wait, transfer


def _peer_wait_and_transfer(timeline, per_steps: int, group) -> tuple[float, float]:
    """(ms per step, means over the ranks) of the peer exchange's barrier kernels (they only wait for the
    other ranks) and of the rest of its all_to_all stage (the copies)."""
    stage = [activity for activity in timeline if activity.layer_stage == "all_to_all"]
    wait = sum(a.end - a.start for a in stage if "barrier" in a.name) / per_steps / 1e3
    copies = sum(a.end - a.start for a in stage if "barrier" not in a.name) / per_steps / 1e3
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (wait, copies), group=group)
    return statistics.mean(w for w, _ in every), statistics.mean(c for _, c in every)


# Driver -----------------------------------------------------------------------------------------------------


def _setup(tiny: bool) -> tuple[torch.device, torch.dtype, object]:
    """(device, dtype, EP group or None): torchrun's environment gives the group (NCCL on GPUs)."""
    on_gpu = torch.cuda.is_available() and not tiny
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            timeout=datetime.timedelta(minutes=5),
            device_id=device if on_gpu else None,
        )
        group = dist.group.WORLD
    return device, torch.bfloat16 if on_gpu else torch.float32, group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="mixtral,dsv3", help="comma-separated MOE_LAYER_SHAPES names")
    parser.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    add_out_option(parser)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU (default: the shape's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--align-size", type=int, default=None, help="dispatch alignment (default none)")
    parser.add_argument(
        "--capacity-factor", type=float, default=None, help="capacity policy for moetriton (default dropless)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers per step, each feeding the next, as in a model (default 1)",
    )
    add_variants_option(parser)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, one step (smoke test)")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="folder for every rank's profiler trace of the profiled steps"
        " (<impl>_<shape>_ep<N>_rank<R>.json.gz;"
        " python -m benchmarks.trace_gaps reads them)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps = 1
    if args.layers < 1:
        parser.error(f"--layers: expected an int >= 1, got {args.layers}")
    impls = [impl for impl in args.impl.split(",") if impl]
    names = [name for name in args.shapes.split(",") if name]
    for impl in impls:
        if impl not in IMPLS:
            parser.error(f"--impl: expected names from {IMPLS}, got {impl!r}")
    for name in names:
        if name not in MOE_LAYER_SHAPES:
            parser.error(f"--shapes: expected names from {sorted(MOE_LAYER_SHAPES)}, got {name!r}")
    variants = args.variants.split(",")
    device, dtype, group = _setup(args.tiny)
    rank = dist.get_rank() if group is not None else 0
    ep = dist.get_world_size() if group is not None else 1
    if not args.tiny and device.type != "cuda":
        print("the layer benchmark needs a CUDA GPU (or --tiny for a CPU smoke run); nothing to do")
        return 0
    args.dense_tflops = 0.0 if args.tiny else dense_gemm_tflops(dtype)
    rows = []

    def report(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    for name in names:
        shape = TINY[name] if args.tiny else MOE_LAYER_SHAPES[name]
        if shape.num_experts % ep:
            report(f"{shape.name}: {shape.num_experts} experts do not split over EP = {ep}; skipped")
            continue
        for impl in impls:
            if impl == "megatron" and args.capacity_factor is not None:
                report(f"{impl} {shape.name}: the baseline is dropless only; skipped under --capacity-factor")
                continue
            for variant in variants if impl.startswith("moetriton") else ["plain"]:
                try:
                    row = run_row(impl, shape, args, device, dtype, group, variant)
                except torch.OutOfMemoryError as error:
                    note = f"OOM: {str(error).splitlines()[0]}"
                    row = dict(impl=impl, variant=variant, shape=shape.name, ep=ep, note=note)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)  # peak_allocated_gib is per row
                rows.append(row)
                report(_describe(row))
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"wrote {write_results('moe_torch', rows, device_name, ep, args.out)}")
    if group is not None:
        dist.destroy_process_group()
    return 0


def _describe(row: dict) -> str:
    head = f"{row['impl']:<10} {row.get('variant', 'plain'):<7} {row['shape']:<13} EP={row['ep']}"
    if row.get("layers", 1) > 1:
        head += f" x{row['layers']} layers"
    if "note" in row:
        return f"{head}  {row['note']}"
    shares = " ".join(f"{stage} {row[f'{stage}_share_pct']:.1f}%" for stage in STAGES)
    a2a = ""
    if "a2a_gbps" in row:
        a2a = (
            f" | all-to-all {row['a2a_gbps']:.1f} GB/s = {row['a2a_pct_of_plain']:.0f}% of plain"
            f" ({row['a2a_gbps_least_waiting']:.1f} GB/s on the rank that waited least)"
        )
    if "a2a_transfer_gbps" in row:
        a2a += (
            f" | transfer {row['a2a_transfer_gbps']:.1f} GB/s"
            f" = {row['a2a_transfer_pct_of_plain']:.0f}% of plain, waiting {row['a2a_wait_ms']:.3f} ms"
        )
    if "gpu_idle_ms" in row:
        a2a += f" | GPU idle {row['gpu_idle_ms']:.3f} ms"
    if "exposed_exchange_ms" in row:
        a2a += f" | exchange {row['exchange_ms']:.3f} ms, exposed {row['exposed_exchange_ms']:.3f} ms"
    if "shared_ffn_ms" in row:
        a2a += f" | shared FFN alone {row['shared_ffn_ms']:.3f} ms"
    return (
        f"{head} {row['policy']} step {row['step_ms']:.3f} ms | routing {row['routing_share_pct']:.1f}% | "
        f"grouped GEMM {row['gemm_tflops']:.0f} TFLOP/s ({row['gemm_pct_of_dense']:.0f}% of a dense"
        f" {row['dense_gemm_tflops']:.0f})"
        f"{a2a} | {shares}"
    )


if __name__ == "__main__":
    sys.exit(main())
