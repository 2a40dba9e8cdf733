"""One expert-parallel MoE layer step in JAX (forward + backward, bf16): moetriton.jax.moe against a baseline
built the MaxText way (argsort permutation + jax.lax.ragged_dot, no Triton).

    python -m benchmarks.moe_jax                         # mixtral and dsv3, 1 GPU and EP = 2 (needs 2 GPUs)
    python -m benchmarks.moe_jax --shapes mixtral --ep 1 --steps 20 --out /tmp/results
    python -m benchmarks.moe_jax --tiny --steps 1        # CPU smoke test: tiny shapes, 2 host devices
    python -m benchmarks.moe_jax --processes 1,2         # EP = 2 as 1 process of 2 GPUs and 2 processes of 1
    python -m benchmarks.moe_jax --processes 2 --tiny --steps 1   # CPU: 2 processes of one CPU device each

Rows (one per impl x variant x shape x EP x process count; printed and written to <out>/<gpu>/moe_jax.csv,
benchmarks.common: <gpu> is prefixed with the largest EP run, e.g. 2x_NVIDIA_H200):

* variant (`--variants plain,shared,recipe,...`, benchmarks.common.LAYER_VARIANTS; moetriton rows): the
  layer plain, with a shared expert of the routed FFN size (its weights differentiated too), with one
  training-recipe option or all of them; its step_ms against plain's is what the option costs. The
  per-stage timings (the method off GPUs, below) time the plain layer's stages whatever the variant.

* processes: how many processes ran the step. 1: this module as one process driving every device (the
  default). N > 1 (`--processes N`): a jax.distributed group of N processes on this machine, one GPU each
  (module section "Processes").
* step_ms: median wall time of the jitted step (value_and_grad of the layer w.r.t. x and every weight),
  inputs resident, one block_until_ready per step; in a group, process 0's time of a step all processes
  start together (section "Processes").
* stage shares (moetriton rows), stage_method says which of two methods gave them:
  - on GPUs in one process, a profile of the real step: the compiled step runs PROFILED_STEPS times under
    CUPTI (through torch.profiler: benchmarks.timing.gpu_activities_by_device), and every GPU activity of
    every device goes to a stage by its name. Our Triton kernels keep their Python names (KERNEL_STAGES
    lists every one):
    router (top-k, aux-loss scores and loss, forward and backward), dispatch (count, scan, dispatch),
    chunk_sorts (only the row map of the expert-major order now: the GEMMs read and write the received
    rows through it), grouped_gemm (forward, input and weight gradients), combine (combine
    and its backward).
    all_to_all: NCCL kernels, XLA's own collective kernels (the one-shot ragged all-to-all) and peer copies,
    so besides both exchanges and their transposes it holds the count all-gather and the psums of the
    routed counts, the aux loss and the replicated gate's gradient (small next to the exchanges), and a
    collective's time includes waiting for its peers. other: everything else, XLA's kernels (the gate matmul
    x @ gate and its gradients, the activation (our `_activate*` kernels), the exchange's block building,
    compaction and placement (XLA's, our `_place_blocks` / `_take_blocks` kernels), casts, the loss, gradient
    sums), memsets and local copies; other_top names its OTHER_TOP longest kernels with their ms per GPU and
    step. `_combine_kernel` serves token_combine's forward and, unweighted, the backward of token_dispatch:
    its name cannot tell the two apart, nor can their order (the loss is linear in the output, so XLA may run
    the forward combine after the backward), so both count as combine and dispatch holds its forward kernels
    only; dispatch + combine, and so routing_share, are exact. A share is the stage's activity time over the
    time of all activities (the stages and other add up to 1); gpu_busy_ms is the latter per GPU and step,
    beside step_ms (activities that overlap, a collective beside compute, count twice there).
  - on CPU (nothing to profile; --tiny) and in a group of processes (the profile is one-process only:
    each process would record its own GPU alone, and gathering those across processes is not built),
    per-stage jitted forward + backward timings, NOT a profile:
    every stage (router incl. the gate matmul and aux loss; dispatch; all-to-all = count all-gather +
    exchange + reverse exchange; grouped GEMMs, on the received rows through their expert-major row
    permutation; combine) runs as its own
    jitted value_and_grad on the inputs the layer gives it, and its share is its time over step_ms. They
    need not add up to 100% (XLA overlaps and fuses across stages inside the step) and inflate small stages
    (each also sums its outputs and builds their cotangents); no other_share or gpu_busy_ms.
  routing_share = router + dispatch + chunk sorts + combine.
* exchange_ms / exposed_exchange_ms (EP > 1, the profile only): per GPU and step, the time some all_to_all
  activity runs, and the part of it with no activity of another stage beside it (what XLA's scheduling
  hides of the exchange behind independent work, e.g. the shared experts, is the difference;
  benchmarks.trace_gaps.exposed_time); exposed_exchange_pct: of step_ms.
* gemm_tflops: grouped-GEMM flops (2 * rows * H * 2F + 2 * rows * F * H forward, x3 for forward +
  backward, rows = routed slots T * K per GPU) over the grouped-GEMM stage time per GPU and step (step time
  for the baseline), beside dense_gemm_tflops ([8192, 8192] x [8192, 8192] bf16 matmuls, several per jitted
  call, on the same GPU in the same run) as gemm_pct_of_dense.
* a2a_gbps (EP > 1): routed-slot bytes of the four exchanges of a step (forward, reverse, and their
  transposes: 4 * T * K * H * 2 bytes per GPU) over the all-to-all stage time per GPU and step, beside
  plain_a2a_gbps: the same bytes through four plain jax.lax.all_to_all calls (median wall time).
  a2a_gbps_least_waiting (GPU profiles): the same bytes over the all-to-all time of the GPU with the least
  of it, the one that waited least for its peers (a collective's time includes that wait: every GPU waits
  for the one with the most expert rows), so closer to the transfer rate.
  a2a_moved_ratio (padded exchange): rows the exchange moves per GPU and direction (EP blocks of the size
  the step's largest (source, destination) pair picks, EPLayout.exchange_block_rows) over the routed rows
  T * K: what the padding costs on this routing.

Each row catches its own failure (out of memory included), prints it and goes on. With EP > 1 in one process a
failure on one device can leave the others waiting in a collective for good (the MaxText-style baseline's
out-of-memory at EP = 2 did, on two H200s): `--isolate SECONDS` runs every row in a child process of its own
(this module, that row's arguments) and records a row that fails, crashes or takes longer as an error.
On CPU the exchange is the padded all_to_all fallback (XLA:CPU has no ragged all-to-all) and the ops run the
pure-JAX reference unless TRITON_INTERPRET=1: --tiny only checks that everything runs.

Processes. `--processes 1,2,4` runs the same measurements once per count, each in children of this process
(which never starts a backend, so the children own the devices), and writes all their rows to one results
file; every run is killed after --timeout seconds. 1 is one child driving every device (--isolate passes on to
it). N > 1 is a group started by examples/jax_moe_multiprocess.launch_local_group: N copies of this module, a
free local port for the coordinator, copy i sees GPU i (CUDA_VISIBLE_DEVICES) or, without GPUs, one CPU
device. Each copy calls jax.distributed.initialize (gloo collectives on CPU), builds the "ep" mesh over every
process's devices (EP = N: --ep sizes other than the group's device count are skipped; without --ep the
one-process run takes the groups' sizes, so both modes give rows of the same shape and EP), draws the inputs
as global arrays (each process its own shards) and runs the same measurements; process 0 prints the rows and
writes them after each one. Before every timed call of a step (or stage) all processes meet at a barrier
(multihost_utils.sync_global_devices, outside the timed span), then each runs the step and waits
(block_until_ready) for its shards of the outputs: step_ms is process 0's time, which the step's collectives
make include waiting for the slowest peer. `--exchange auto` is the padded exchange in both modes; `--exchange
ragged` across processes needs XLA_FLAGS that allow XLA's NCCL fallback
(tests/jax/multiprocess_checks.RAGGED_ACROSS_PROCESSES_FLAG), which the launch passes on. A failure that hits
every process alike (out of memory at compile) is an error row as in one process; one that hits some processes
(an exception, a crash) leaves the others waiting in a collective, so when any process fails or the group runs
past --timeout every process of the group is killed, the rows process 0 wrote stay, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

# Host devices for EP on CPU (--tiny); the flag only concerns the CPU platform, harmless on GPU machines. A
# process of a group keeps the one CPU device its launcher gives it (JAX_NUM_CPU_DEVICES).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and (
    "JAX_NUM_CPU_DEVICES" not in os.environ
):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moetriton.jax import reference_router, token_combine, token_dispatch
from moetriton.jax.activation import apply_activation
from moetriton.jax.moe import MoEConfig, dropless_forward, dropless_reverse, exchange_sizes, moe
from moetriton.jax.moe.exchange import resolve_exchange
from moetriton.jax.moe.experts import ExpertWeights, expert_major_rows, expert_mlp
from moetriton.jax.moe.routing import route
from moetriton.jax.router import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss
from moetriton.kernels.rules.expert_parallel import ep_layout
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES, MoELayerShape

from .common import (
    add_out_option,
    add_variants_option,
    router_options,
    shape_layout,
    variant_options,
    write_results,
)
from .trace_gaps import exposed_time

#: Side of the square bf16 matmul whose rate, measured in the same run, is the layer GEMMs' ceiling.
DENSE_GEMM_SIZE = 8192
TINY_SHAPES = {
    "mixtral": MoELayerShape("mixtral-tiny", 64, 32, 48, 8, 2),
    "dsv3": MoELayerShape("dsv3-tiny", 64, 32, 16, 16, 4, "sigmoid", 4, 2),
}
STAGES = ("router", "dispatch", "all_to_all", "chunk_sorts", "grouped_gemm", "combine")
ROUTING_STAGES = ("router", "dispatch", "chunk_sorts", "combine")
PROFILED_STEPS = 3
OTHER_TOP = 6
#: Stage of every Triton kernel of moetriton.kernels, by the name it runs under on the GPU (its Python name).
KERNEL_STAGES = {
    "_topk_forward_kernel": "router",
    "_topk_backward_kernel": "router",
    "_aux_scores_forward_kernel": "router",
    "_aux_scores_backward_kernel": "router",
    "_aux_loss_partial_kernel": "router",
    "_aux_loss_finish_kernel": "router",
    "_aux_loss_backward_kernel": "router",
    "_count_experts_kernel": "dispatch",
    "_scan_counts_kernel": "dispatch",
    "_dispatch_kernel": "dispatch",
    "_sort_chunks_kernel": "chunk_sorts",
    "_grouped_matmul_kernel": "grouped_gemm",
    "_grouped_matmul_wgrad_kernel": "grouped_gemm",
    "_combine_kernel": "combine",  # also the backward of token_dispatch (module doc)
    "_combine_backward_kernel": "combine",
    "_scatter_kernel": "combine",  # backward of the unweighted token_combine (not in this layer)
}
#: Collectives on the GPU: NCCL's kernels, XLA's own collective kernels, copies between devices.
COLLECTIVE_ACTIVITY = re.compile(r"nccl|alltoall|allgather|allreduce|memcpy ptop", re.IGNORECASE)
COLUMNS = (
    "impl",
    "variant",
    "shape",
    "ep",
    "processes",
    "exchange",
    "tokens_per_gpu",
    "step_ms",
    "gpu_busy_ms",
    *(f"{stage}_share" for stage in STAGES),
    "other_share",
    "routing_share",
    "stage_method",
    "gemm_tflops",
    "dense_gemm_tflops",
    "gemm_pct_of_dense",
    "a2a_gbps",
    "plain_a2a_gbps",
    "a2a_gbps_least_waiting",
    "a2a_moved_ratio",
    "exchange_ms",
    "exposed_exchange_ms",
    "exposed_exchange_pct",
    "other_top",
    "error",
)


@dataclass(frozen=True)
class Case:
    shape: MoELayerShape
    ep: int
    align_size: int | None
    seq: int  # tokens per sequence: x is [EP * tokens / seq, seq, H]
    exchange: str = "auto"  # the moetriton layer's `exchange` argument
    variant: str = "plain"  # of benchmarks.common.LAYER_VARIANTS (moetriton rows)

    @property
    def batch(self) -> int:
        return self.ep * self.shape.num_tokens // self.seq


def router_stage(x_flat, gate, expert_bias, config: MoEConfig, num_tokens_global: int):
    """The layer's router stage alone (moetriton.jax.moe.routing.route), without a mask, as this benchmark
    times it: (merging weights [T, K] fp32, indices [T, K] int32, routed slots per expert [E] int32, partial
    load-balancing loss of this shard (fp32 scalar; the psum over token shards is the global loss))."""
    logits, weights, indices, routing_map = route(x_flat, gate, None, expert_bias, None, config)
    routed = routing_map.sum(0, dtype=jnp.int32)
    if config.aux_loss_coeff == 0 or num_tokens_global == 0:  # no tokens anywhere: no loss
        return weights, indices, routed, jnp.zeros((), jnp.float32)
    _, scores = fused_compute_score_for_moe_aux_loss(logits, config.topk, config.score_function)
    routed_global = jax.lax.psum(routed, config.token_axes) if config.token_axes else routed
    num_experts = gate.shape[1]
    loss = fused_moe_aux_loss(
        scores, routed_global, num_tokens_global, num_experts, config.topk, config.aux_loss_coeff
    )
    return weights, indices, routed, loss.astype(jnp.float32)


def _significant(value: float) -> float:
    """`value` to 4 significant digits (tiny CPU figures must not round to 0)."""
    return float(f"{value:.4g}")


def median_ms(function, *args, steps: int) -> float:
    """Median wall ms of `function(*args)` (jitted) over `steps` calls after two warm-up calls. In a group of
    processes every timed call starts once all processes have reached it (a barrier, outside the timed
    span), and each process times its own call up to block_until_ready on its shards of the outputs."""
    jax.block_until_ready(function(*args))
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(steps):
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("benchmarks.moe_jax step")
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


#: Independent [N, N] x [N, N] matmuls in the one jitted call that `dense_gemm_tflops` times: the call's
#: launch and wait (about 0.3 ms on an H200, a fifth of one matmul) spread over them.
DENSE_GEMM_REPEATS = 8


@functools.cache
def dense_gemm_tflops(steps: int) -> float:
    """TFLOP/s of jitted [N, N] x [N, N] bf16 matmuls (N = DENSE_GEMM_SIZE; DENSE_GEMM_REPEATS independent
    ones per timed call, so the wall time is the GPU's) on the first device, measured once per process: the
    ceiling of the layer's GEMMs on the same GPU in the same run (0 on CPU smoke runs)."""
    if jax.devices()[0].platform == "cpu":
        return 0.0
    size, repeats = DENSE_GEMM_SIZE, DENSE_GEMM_REPEATS
    keys = jax.random.split(jax.random.key(0), 2 * repeats)
    lhs, rhs = (
        [jax.random.normal(key, (size, size), jnp.bfloat16) for key in half]
        for half in (keys[::2], keys[1::2])
    )
    products = jax.jit(lambda lhs, rhs: [left @ right for left, right in zip(lhs, rhs, strict=True)])
    return repeats * 2 * size**3 / (median_ms(products, lhs, rhs, steps=steps) * 1e-3) / 1e12


def make_mesh(ep: int) -> Mesh | None:
    """The "ep" mesh over the first `ep` devices in process order (each process's token shards consecutive
    rows of the batch), or None for EP = 1."""
    devices = sorted(jax.devices(), key=lambda device: (device.process_index, device.id))
    return None if ep == 1 else Mesh(np.array(devices[:ep]), ("ep",))


def make_inputs(case: Case, mesh: Mesh | None):
    """(x [B, S, H], gate [H, E], gate_up [E, H, 2F], down [E, F, H], then the variant's shared_gate_up
    [H, 2F] and shared_down [F, H] and its token_mask [B, S]) in bf16 (the mask bool), placed as the layer
    wants: global arrays drawn under jit with the layer's shardings, so each device draws only its own shard
    (in a group of processes, each process builds the shards of its devices), the same values in every
    mode."""
    shape, dtype = case.shape, jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 6)
    hidden, ffn, experts = shape.hidden, shape.ffn, shape.num_experts

    def place(make, spec):
        if mesh is None:
            return jax.jit(make)()
        return jax.jit(make, out_shardings=NamedSharding(mesh, spec))()

    def normal(key, dims, scale, spec):
        # Drawn in bf16: an fp32 draw of dsv3's expert weights alone would take 45 GB.
        return place(lambda: jax.random.normal(key, dims, dtype) * jnp.asarray(scale, dtype), spec)

    tokens, experts_spec = PartitionSpec("ep"), PartitionSpec("ep")
    arrays = [
        normal(keys[0], (case.batch, case.seq, hidden), 1.0, tokens),
        normal(keys[1], (hidden, experts), hidden**-0.5, PartitionSpec()),
        normal(keys[2], (experts, hidden, 2 * ffn), hidden**-0.5, experts_spec),
        normal(keys[3], (experts, ffn, hidden), ffn**-0.5, experts_spec),
    ]
    _, shared, mask = variant_options(case.variant, case.batch * case.seq)
    if shared:
        width = shared * ffn
        arrays.append(normal(keys[4], (hidden, 2 * width), hidden**-0.5, PartitionSpec()))
        arrays.append(normal(keys[5], (width, hidden), width**-0.5, PartitionSpec()))
    if mask is not None:
        arrays.append(place(lambda: jnp.asarray(mask).reshape(case.batch, case.seq), tokens))
    return tuple(arrays)


def moetriton_layer(case: Case, mesh: Mesh | None):
    options, shared, mask = variant_options(case.variant, 0)

    def layer(x, gate, gate_up, down, *extra):
        named = dict(shared_gate_up=extra[0], shared_down=extra[1]) if shared else {}
        if mask is not None:
            named["token_mask"] = extra[-1]
        return moe(
            x,
            gate,
            gate_up,
            down,
            topk=case.shape.topk,
            aux_loss_coeff=1e-2,
            align_size=case.align_size,
            mesh=mesh,
            ep_axis="ep",
            exchange=case.exchange,
            **router_options(case.shape),
            **options,
            **named,
        )

    return layer


# Baseline: MaxText-style (argsort permutation, ragged_dot, no Triton) -----------------------------------


def _baseline_shard(x, gate, gate_up, down, *, case: Case, config: MoEConfig):
    """One token shard of the baseline layer: pure-JAX router (moetriton.jax.reference_router), argsort
    dispatch, the same exchange, argsort to local-expert order, ragged_dot, unsort, weighted sum."""
    shape = case.shape
    batch, seq, hidden = x.shape
    num_tokens, experts, topk = batch * seq, shape.num_experts, shape.topk
    x_flat = x.reshape(num_tokens, hidden)
    logits = jnp.dot(x_flat, gate, preferred_element_type=jnp.float32)
    probs, routing_map, indices = reference_router.fused_topk_with_score_function(
        logits, topk, **router_options(shape), return_indices=True
    )
    _, scores = reference_router.fused_compute_score_for_moe_aux_loss(logits, topk, shape.score_function)
    routed = routing_map.sum(0, dtype=jnp.int32)
    if config.ep_axis:
        routed = jax.lax.psum(routed, "ep")
    aux_loss = reference_router.fused_moe_aux_loss(
        scores, routed, num_tokens * case.ep, experts, topk, 1e-2
    ).astype(jnp.float32)
    weights = jnp.take_along_axis(probs, indices, axis=1).astype(x.dtype)  # [T, K]
    flat_experts = indices.reshape(-1)  # [T * K]
    order = jnp.argsort(flat_experts, stable=True)
    send = x_flat[order // topk]  # [T * K, H], expert-major
    counts = jnp.bincount(flat_experts, length=experts).astype(jnp.int32)
    if config.ep_axis is None:
        expert_out = _baseline_experts(send, counts, gate_up, down)
    else:
        layout = ep_layout(num_tokens=num_tokens, num_experts=experts, topk=topk, ep_size=case.ep)
        sizes = exchange_sizes(jax.lax.all_gather(counts, "ep"), jax.lax.axis_index("ep"), layout)
        recv = dropless_forward(send, sizes, layout, config)
        # Local expert of every received row (source-major chunks), then a second argsort to expert-major.
        chunk_ends = jnp.cumsum(sizes["chunk_sizes"])
        chunk = jnp.searchsorted(chunk_ends, jnp.arange(layout.recv_rows), side="right")
        local_expert = jnp.where(
            chunk < chunk_ends.shape[0], chunk % layout.local_experts, layout.local_experts
        )
        local_order = jnp.argsort(local_expert, stable=True)
        out_sorted = _baseline_experts(recv[local_order], sizes["group_sizes"], gate_up, down)
        source_rows = jnp.zeros_like(out_sorted).at[local_order].set(out_sorted)
        expert_out = dropless_reverse(source_rows, sizes, layout, config)
    unsorted = jnp.zeros_like(expert_out).at[order].set(expert_out)  # [T * K, H] in (token, slot) order
    out = jnp.sum(unsorted.reshape(num_tokens, topk, hidden) * weights[..., None], axis=1)
    if config.ep_axis:
        aux_loss = jax.lax.psum(aux_loss, "ep")
    return out.reshape(x.shape), aux_loss, jnp.zeros((), jnp.int32)


def _baseline_experts(rows, group_sizes, gate_up, down):
    hidden = jax.lax.ragged_dot(rows, gate_up, group_sizes, preferred_element_type=rows.dtype)
    return jax.lax.ragged_dot(
        apply_activation(hidden, "swiglu"), down, group_sizes, preferred_element_type=rows.dtype
    )


def _config(case: Case, mesh: Mesh | None) -> MoEConfig:
    shape = case.shape
    return MoEConfig(
        topk=shape.topk,
        **router_options(shape),
        use_pre_softmax=False,
        scaling_factor=None,
        aux_loss_coeff=1e-2,
        align_size=case.align_size,
        capacity_factor=None,
        activation="swiglu",
        dtype="bfloat16",
        mesh=mesh,
        ep_axis="ep" if mesh is not None else None,
        data_axes=(),
        exchange=resolve_exchange(case.exchange),
        num_shards=case.ep,
        ep_size=case.ep,
    )


def _shard_mapped(mesh: Mesh | None, function, in_specs, out_specs):
    """`function` under shard_map over the "ep" axis, or itself without a mesh."""
    if mesh is None:
        return function
    return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def baseline_layer(case: Case, mesh: Mesh | None):
    config = _config(case, mesh)

    def shard(x, gate, gate_up, down):
        return _baseline_shard(x, gate, gate_up, down, case=case, config=config)

    tokens, replicated = PartitionSpec("ep"), PartitionSpec()
    return _shard_mapped(mesh, shard, (tokens, replicated, tokens, tokens), (tokens, replicated, replicated))


# Steps and stages ---------------------------------------------------------------------------------------


def train_step(layer, num_diff: int = 4):
    """jit(value_and_grad) of <out, 1> + aux loss w.r.t. x and every weight (the first `num_diff` arrays; a
    token mask after them is no weight)."""

    def loss(*arrays):
        out, aux_loss, *rest = layer(*arrays)  # rest: dropped (and the stats): outputs of the step
        return jnp.sum(out.astype(jnp.float32)) * 1e-3 + aux_loss, rest

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(num_diff)), has_aux=True))


def _fwd_bwd(function, num_diff: int):
    """jit(value_and_grad) of the sum of `function`'s float outputs w.r.t. its first num_diff arguments."""

    def total(*args):
        outs = function(*args)
        return sum(
            jnp.sum(o.astype(jnp.float32))
            for o in jax.tree.leaves(outs)
            if jnp.issubdtype(o.dtype, jnp.floating)
        )

    return jax.jit(jax.value_and_grad(total, argnums=tuple(range(num_diff))))


def activity_stage(name: str) -> str:
    """The stage of one GPU activity of the step, by its name (module doc)."""
    for kernel, stage in KERNEL_STAGES.items():
        if kernel in name:
            return stage
    return "all_to_all" if COLLECTIVE_ACTIVITY.search(name) else "other"


def profiled_stage_ms(step, arrays, ep: int) -> tuple[dict[str, float], float, str, tuple[float, float]]:
    """(ms per GPU and step of every stage and "other": the summed durations of their GPU activities over
    PROFILED_STEPS runs of the compiled `step` on `ep` GPUs (module doc); the all-to-all ms per step of the
    GPU with the least; the OTHER_TOP longest kernels of "other" as "name:ms ...", ms per GPU and step;
    (exchange ms, exposed exchange ms) per GPU and step: the time some all_to_all activity runs, and the
    part of it with no activity of another stage beside it)."""
    from .timing import gpu_activities_by_device  # imports torch: only where CUDA profiles

    def runs() -> None:
        for _ in range(PROFILED_STEPS):
            jax.block_until_ready(step(*arrays))

    by_device = gpu_activities_by_device(runs)
    if len(by_device) != ep:
        raise RuntimeError(
            f"the profile saw GPU activities on {len(by_device)} devices, expected {ep} (torch.profiler"
            " records them through a CUDA build of torch)"
        )
    totals = dict.fromkeys((*STAGES, "other"), 0.0)
    other: dict[str, float] = {}
    all_to_all = []
    exchange = [0.0, 0.0]  # µs over every device: some all_to_all activity running, and nothing else beside
    for activities in by_device.values():
        device_all_to_all = totals["all_to_all"]
        intervals = {True: [], False: []}
        for name, start, end in activities:
            stage = activity_stage(name)
            totals[stage] += end - start
            if stage == "other":
                other[name] = other.get(name, 0.0) + end - start
            intervals[stage == "all_to_all"].append((start, end))
        all_to_all.append(totals["all_to_all"] - device_all_to_all)
        for i, micros in enumerate(exposed_time(intervals[True], intervals[False])):
            exchange[i] += micros
    per_step = 1e-3 / (ep * PROFILED_STEPS)
    stages = {stage: micros * per_step for stage, micros in totals.items()}
    longest = sorted(other.items(), key=lambda item: -item[1])[:OTHER_TOP]
    other_top = " ".join(f"{name[:48].replace(' ', '_')}:{micros * per_step:.3f}" for name, micros in longest)
    exchange_ms = tuple(micros * per_step for micros in exchange)
    return stages, min(all_to_all) * 1e-3 / PROFILED_STEPS, other_top, exchange_ms


def stage_times(case: Case, mesh: Mesh | None, arrays, steps: int) -> dict[str, float]:
    """ms of every stage of the moetriton layer, forward + backward, each jitted on its own (module doc: the
    method where the step cannot be profiled)."""
    config = _config(case, mesh)
    shape = case.shape
    tokens_per_shard = shape.num_tokens
    layout = shape_layout(case.shape, case.ep, case.align_size)
    tok, rep = PartitionSpec("ep"), PartitionSpec()
    x, gate, gate_up, down = arrays
    x_flat = x.reshape(-1, shape.hidden)

    def router(x_flat, gate):
        weights, indices, routed, aux = router_stage(x_flat, gate, None, config, tokens_per_shard * case.ep)
        return weights, indices, routed[None], aux[None]

    def dispatch(tokens, indices):
        send, _, row_id_map, _, counts = token_dispatch(
            tokens, indices=indices, num_experts=shape.num_experts, align_size=layout.align_size
        )
        return send, row_id_map, counts

    def sizes_of(counts):
        if mesh is None:
            return exchange_sizes(counts[None], 0, layout)
        return exchange_sizes(jax.lax.all_gather(counts, "ep"), jax.lax.axis_index("ep"), layout)

    def all_to_all(send, counts):
        sizes = sizes_of(counts)
        recv = dropless_forward(send, sizes, layout, config)
        return recv, dropless_reverse(recv, sizes, layout, config)

    def gemm(rows, gate_up, down, counts):
        sizes = sizes_of(counts)
        order = None
        if case.ep > 1:  # received rows, source-major: read and written in expert-major order
            order = expert_major_rows(sizes["chunk_sizes"], layout, False, rows.shape[0])
        return expert_mlp(rows, sizes["group_sizes"], ExpertWeights(gate_up, down), config, order)

    def combine(rows, weights, row_id_map):
        return token_combine(rows, row_id_map, weights)

    shard = partial(_shard_mapped, mesh)
    run_router = shard(router, (tok, rep), (tok, tok, tok, tok))
    weights, indices, _, _ = jax.jit(run_router)(x_flat, gate)
    run_dispatch = shard(dispatch, (tok, tok), (tok, tok, tok))
    send, row_id_map, counts = jax.jit(run_dispatch)(x_flat, indices)
    run_gemm = shard(gemm, (tok, tok, tok, tok), tok)
    run_combine = shard(combine, (tok, tok, tok), tok)
    times = {
        "router": median_ms(_fwd_bwd(run_router, 2), x_flat, gate, steps=steps),
        "dispatch": median_ms(_fwd_bwd(run_dispatch, 1), x_flat, indices, steps=steps),
        "all_to_all": 0.0,  # one EP rank: the send buffer is the receive buffer, already expert-major
        "chunk_sorts": 0.0,  # none in the layer
        "combine": median_ms(_fwd_bwd(run_combine, 2), send, weights, row_id_map, steps=steps),
    }
    rows = send
    if case.ep > 1:
        run_a2a = shard(all_to_all, (tok, tok), (tok, tok))
        rows, _ = jax.jit(run_a2a)(send, counts)
        times["all_to_all"] = median_ms(_fwd_bwd(run_a2a, 1), send, counts, steps=steps)
    times["grouped_gemm"] = median_ms(_fwd_bwd(run_gemm, 3), rows, gate_up, down, counts, steps=steps)
    return times


def moved_rows_ratio(case: Case, mesh: Mesh, arrays) -> float:
    """The padded exchange's rows moved per GPU and direction over the routed rows T * K, on the routing of
    `arrays` (module doc: a2a_moved_ratio)."""
    config = _config(case, mesh)
    shape = case.shape
    layout = shape_layout(case.shape, case.ep, case.align_size)
    x, gate, _, _ = arrays

    def block_index(x_flat, gate):
        _, indices, _, _ = router_stage(x_flat, gate, None, config, shape.num_tokens * case.ep)
        *_, counts = token_dispatch(
            x_flat, indices=indices, num_experts=shape.num_experts, align_size=layout.align_size
        )
        sizes = exchange_sizes(jax.lax.all_gather(counts, "ep"), jax.lax.axis_index("ep"), layout)
        return sizes["block_index"][None]

    run = jax.jit(
        _shard_mapped(mesh, block_index, (PartitionSpec("ep"), PartitionSpec()), PartitionSpec("ep"))
    )
    # Every shard holds the same index (it comes from the all-gathered counts): read one of this process's.
    index = int(run(x.reshape(-1, shape.hidden), gate).addressable_data(0)[0])
    return case.ep * layout.exchange_block_rows[index] / (shape.num_tokens * shape.topk)


def plain_all_to_all_ms(case: Case, mesh: Mesh, steps: int) -> float:
    """Four chained jax.lax.all_to_all calls moving T * K rows of H bf16 per GPU each."""
    shape = case.shape
    rows = shape.num_tokens * shape.topk
    buffer = jax.jit(
        lambda: jnp.ones((case.ep * rows, shape.hidden), jnp.bfloat16),
        out_shardings=NamedSharding(mesh, PartitionSpec("ep")),
    )()

    def four(block):
        slabs = block.reshape(case.ep, -1, block.shape[1])
        for _ in range(4):
            slabs = jax.lax.all_to_all(slabs, "ep", 0, 0)
        return slabs.reshape(block.shape)

    run = jax.jit(_shard_mapped(mesh, four, (PartitionSpec("ep"),), PartitionSpec("ep")))
    return median_ms(run, buffer, steps=steps)


# Rows ---------------------------------------------------------------------------------------------------


def measure(impl: str, case: Case, steps: int) -> dict:
    shape = case.shape
    row = dict(impl=impl, variant=case.variant, shape=shape.name, ep=case.ep, processes=jax.process_count())
    row.update(exchange=case.exchange, tokens_per_gpu=shape.num_tokens)
    mesh = make_mesh(case.ep)
    arrays = make_inputs(case, mesh)
    layer = moetriton_layer(case, mesh) if impl == "moetriton" else baseline_layer(case, mesh)
    shared = variant_options(case.variant, 0)[1]
    step = train_step(layer, 6 if shared else 4)
    step_ms = median_ms(step, *arrays, steps=steps)
    row["step_ms"] = _significant(step_ms)
    rows = shape.num_tokens * shape.topk
    flops = 3 * (2 * rows * shape.hidden * 2 * shape.ffn + 2 * rows * shape.ffn * shape.hidden)
    gemm_ms = step_ms
    if impl == "moetriton":
        if jax.default_backend() == "gpu" and jax.process_count() == 1:
            profile = profiled_stage_ms(step, arrays, case.ep)
            stages, least_all_to_all_ms, row["other_top"], exchange_ms = profile
            if case.ep > 1:
                row["exchange_ms"], row["exposed_exchange_ms"] = map(_significant, exchange_ms)
                row["exposed_exchange_pct"] = _significant(100 * exchange_ms[1] / step_ms)
            share_denominator_ms = sum(stages.values())
            row["gpu_busy_ms"] = _significant(share_denominator_ms)
            row["stage_method"] = f"CUPTI profile of {PROFILED_STEPS} steps"
        else:
            stages, least_all_to_all_ms = stage_times(case, mesh, arrays[:4], steps), None
            share_denominator_ms = step_ms
            row["stage_method"] = "per-stage jitted fwd+bwd timings"
        for stage, ms in stages.items():
            row[f"{stage}_share"] = _significant(ms / share_denominator_ms)
        row["routing_share"] = _significant(
            sum(stages[stage] for stage in ROUTING_STAGES) / share_denominator_ms
        )
        gemm_ms = stages["grouped_gemm"]
        if case.ep > 1:
            a2a_bytes = 4 * rows * shape.hidden * 2
            row["a2a_gbps"] = _significant(a2a_bytes / (stages["all_to_all"] * 1e-3) / 1e9)
            plain_ms = plain_all_to_all_ms(case, mesh, steps)
            row["plain_a2a_gbps"] = _significant(a2a_bytes / (plain_ms * 1e-3) / 1e9)
            if least_all_to_all_ms:
                row["a2a_gbps_least_waiting"] = _significant(a2a_bytes / (least_all_to_all_ms * 1e-3) / 1e9)
            if _config(case, mesh).exchange == "padded":
                row["a2a_moved_ratio"] = _significant(moved_rows_ratio(case, mesh, arrays[:4]))
    tflops = flops / (gemm_ms * 1e-3) / 1e12
    row["gemm_tflops"] = _significant(tflops)
    dense = dense_gemm_tflops(steps)
    row["dense_gemm_tflops"] = _significant(dense)
    row["gemm_pct_of_dense"] = _significant(100 * tflops / dense) if dense else 0.0
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="mixtral,dsv3", help="comma-separated MOE_LAYER_SHAPES names")
    parser.add_argument("--impl", default="moetriton,maxtext", help="moetriton and/or maxtext (the baseline)")
    parser.add_argument(
        "--ep",
        help="EP sizes (EP > 1 needs that many devices; default 1,2, or a group of processes' device count)",
    )
    parser.add_argument("--tokens", type=int, help="tokens per GPU (default: the shape's)")
    parser.add_argument("--align", type=int, default=0, help="align_size of the moetriton layer (0: none)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement (median)")
    add_out_option(parser)
    parser.add_argument("--exchange", default="auto", help="the moetriton layer's: auto, ragged or padded")
    add_variants_option(parser)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument(
        "--isolate",
        type=float,
        default=0,
        help="run each row in a child process, killed after this many seconds",
    )
    parser.add_argument(
        "--processes",
        help="process counts, comma-separated: 1 is one process driving every device, N > 1 a group of N"
        " processes of one GPU each (module doc)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds each run of --processes may take, then killed",
    )
    parser.add_argument("--coordinator", help="set by --processes: HOST:PORT of process 0's coordinator")
    parser.add_argument("--num-processes", type=int, help="set by --processes: processes in the group")
    parser.add_argument("--process-id", type=int, help="set by --processes: this process's index")
    args = parser.parse_args(argv)

    def say(text: str) -> None:
        print(text, flush=True)

    if args.processes:
        return _run_process_counts(args, say)
    table = TINY_SHAPES if args.tiny else MOE_LAYER_SHAPES
    rows = []
    if args.isolate:  # the children own the devices: this process never starts a backend
        status = 0
        ep_sizes = args.ep or "1,2"
        for name in args.shapes.split(","):
            for ep in ep_sizes.split(","):
                for impl in args.impl.split(","):
                    rows += _row_in_child(args, name, ep, impl, say)
                    # Written after every row: a run stopped at its time limit keeps the rows it measured.
                    status = _write(rows, args.out, say, args.tiny, gpus=max(map(int, ep_sizes.split(","))))
        return status
    process, status = 0, 0
    if args.process_id is not None:
        # Cross-process collectives on CPU; no effect on GPUs, where they are NCCL's.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        process = args.process_id
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=process)
    report = say if process == 0 else lambda text: None  # process 0 prints the rows and writes them
    devices = len(jax.devices())
    backend = f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.process_count()} process(es)"
    report(f"{backend}, devices {jax.devices()}")
    ep_sizes = args.ep or (str(devices) if jax.process_count() > 1 else "1,2")
    for name in args.shapes.split(","):
        shape = table[name]
        if args.tokens:
            shape = replace(shape, num_tokens=args.tokens)
        for ep in (int(ep) for ep in ep_sizes.split(",")):
            if ep > devices or (jax.process_count() > 1 and ep != devices):
                need = "EP = the group's devices" if jax.process_count() > 1 else "EP devices"
                report(f"skipping {name} EP={ep}: {devices} device(s), {need}")
                continue
            case = Case(shape, ep, args.align or None, seq=min(shape.num_tokens, 512), exchange=args.exchange)
            runs = [(impl, "plain") for impl in args.impl.split(",") if impl != "moetriton"]
            if "moetriton" in args.impl.split(","):
                runs[:0] = [("moetriton", variant) for variant in args.variants.split(",")]
            for impl, variant in runs:
                try:
                    row = measure(impl, replace(case, variant=variant), args.steps)
                except Exception as error:  # out of memory and any other failure: report the row, go on
                    say(f"process {process}: {traceback.format_exc(limit=3)}")
                    row = dict(
                        impl=impl, variant=variant, shape=shape.name, ep=ep, processes=jax.process_count()
                    )
                    row["tokens_per_gpu"] = shape.num_tokens
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.append(row)
                report(" ".join(f"{key}={row[key]}" for key in COLUMNS if key in row))
                if process == 0:  # after every row: a group killed at its time limit keeps what it measured
                    _write(rows, args.out, lambda text: None, args.tiny, jax.devices()[0].device_kind)
    if process == 0:
        status = _write(rows, args.out, say, args.tiny, jax.devices()[0].device_kind)
    if args.process_id is not None:
        jax.distributed.shutdown()
    return status


def _run_process_counts(args: argparse.Namespace, say) -> int:
    """--processes: for every count, this module with the same options in children of this process (which
    never starts a backend, so the children own the devices): one child driving every device for 1, a group
    of N (examples/jax_moe_multiprocess.launch_local_group) for N; their rows in one results file. A run that
    fails or takes longer than --timeout (its processes killed) makes the exit status 1; the rows it wrote
    stay."""
    from examples.jax_moe_multiprocess import launch_local_group

    counts = [int(count) for count in args.processes.split(",")]
    group_sizes = ",".join(str(count) for count in counts if count > 1)
    rows, failed = [], False
    for count in counts:
        with tempfile.TemporaryDirectory() as child_out:
            command = [sys.executable, "-m", "benchmarks.moe_jax", *_child_options(args), "--out", child_out]
            command += ["--shapes", args.shapes, "--impl", args.impl]
            if count == 1:  # EP sizes of the groups by default: the same rows in both modes
                command += ["--ep", args.ep or group_sizes or "1,2"]
                command += ["--isolate", str(args.isolate)] if args.isolate else []
                try:
                    statuses = [subprocess.run(command, timeout=args.timeout).returncode]
                except subprocess.TimeoutExpired:
                    say(f"one process: killed after {args.timeout:g} s")
                    statuses = [-9]
            else:
                command += ["--ep", args.ep] if args.ep else []
                statuses = launch_local_group(command, count, args.timeout)
            if any(statuses):
                say(f"{count} process(es): exit statuses {statuses}")
                failed = True
            rows += _child_rows(Path(child_out))
        status = _write(rows, args.out, say, args.tiny)
    return 1 if failed else status


def _child_options(args: argparse.Namespace) -> list[str]:
    """The measurement options of `args` as a child of this module takes them."""
    options = ["--steps", str(args.steps), "--align", str(args.align), "--exchange", args.exchange]
    options += ["--variants", args.variants]
    options += ["--tokens", str(args.tokens)] if args.tokens else []
    return options + (["--tiny"] if args.tiny else [])


def _child_rows(child_out: Path) -> list[dict]:
    """The rows of the results file a child wrote under `child_out` (none if it wrote none), without empty
    cells."""
    tables = sorted(child_out.glob("*/moe_jax.csv"))
    if not tables:
        return []
    with tables[0].open() as file:
        return [{key: value for key, value in row.items() if value != ""} for row in csv.DictReader(file)]


def _row_in_child(args: argparse.Namespace, name: str, ep: str, impl: str, say) -> list[dict]:
    """The rows of one (shape, EP, impl) measured by a child process running this module with the same
    options narrowed to that row, given `args.isolate` seconds; a child that fails or overruns: error row."""
    limit = args.isolate
    error_row = dict(impl=impl, shape=name, ep=ep, processes=1)
    with tempfile.TemporaryDirectory() as child_out:
        command = [sys.executable, "-m", "benchmarks.moe_jax", *_child_options(args), "--shapes", name]
        command += ["--ep", ep, "--impl", impl, "--out", child_out]
        try:
            done = subprocess.run(
                command,
                cwd=Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=limit,
            )
        except subprocess.TimeoutExpired:
            say(f"{impl} {name} EP={ep}: killed after {limit:g} s")
            return [dict(error_row, error=f"timed out after {limit:g} s (isolated row)")]
        for line in done.stdout.splitlines():
            if not line.startswith(("jax ", "wrote ")):
                say(line)
        rows = _child_rows(Path(child_out))
        if not rows:
            say(done.stderr[-2000:])
            return [dict(error_row, error=f"child exited with {done.returncode} before writing a row")]
        return rows


def _write(
    rows: list[dict], root: Path, say, tiny: bool, device: str | None = None, gpus: int | None = None
) -> int:
    """The results file (benchmarks.common.write_results): the device from this process or, for isolated
    rows, from the children's rows; `gpus` GPUs, by default as many as the largest EP measured."""
    device = device or next((row["device"] for row in rows if row.get("device")), "cpu")
    gpus = gpus or max((int(row["ep"]) for row in rows if str(row.get("ep", "")).isdigit()), default=1)
    rows = [{key: row[key] for key in COLUMNS if key in row} for row in rows]
    say(f"wrote {write_results('moe_jax', rows, device, gpus, root, columns=list(COLUMNS))}")
    return 1 if tiny and any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
