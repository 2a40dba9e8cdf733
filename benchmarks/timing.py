"""GPU timing for PyTorch callables: warm-up, median over replays, rotating input sets, CUDA graphs.

`time_graph` captures `repeats` calls, each on its own input set so that no call finds the previous one's
data in L2, into one CUDA graph and times its replays with CUDA events: the median replay over `repeats`
is the time per call without Python launch overhead (what a CUDA-graphed training step sees).
`time_eager` times plain calls with events (for baselines that sync with the host and cannot be captured).
`time_jax` jits R calls (one per input set) into one program and reads the GPU timeline of its runs with
CUPTI (through torch.profiler, which records the kernels of every library in the process): the median span
from the first GPU activity of a run to the end of its last, divided by R, with the run queued behind other
GPU work (as in a training step, and as in a graph replay: gaps between launches count, the host's dispatch
does not) and, for comparison, with the GPU idle when the run is dispatched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

L2_FLUSH_BYTES = 2 * 60 * 2**20  # rotate through at least twice the largest L2 of the devices we use


def input_sets(bytes_per_call: int, minimum: int = 2, maximum: int = 16) -> int:
    """How many input sets to rotate through so their total exceeds twice the L2."""
    return max(minimum, min(maximum, -(-L2_FLUSH_BYTES // max(bytes_per_call, 1))))


def time_graph(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median ms per call of `calls` (one per input set), captured together in one CUDA graph."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):  # warm-up replays: the first graph of a run otherwise meets an idle-clocked GPU
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def time_eager(calls: list[Callable[[], object]], rounds: int = 5) -> float:
    """Median ms per call of plain (uncaptured) calls, rotating through the input sets."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        for call in calls:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


#: Side of the square matmul whose rate is the GEMM ceiling of the layer and grouped-GEMM benchmarks.
DENSE_GEMM_SIZE = 8192


def dense_gemm_tflops(dtype: torch.dtype = torch.bfloat16, size: int = DENSE_GEMM_SIZE) -> float:
    """TFLOP/s of a [size, size] x [size, size] cuBLAS matmul in `dtype` on the current GPU (CUDA-graph
    replays): the ceiling a benchmark's GEMMs are measured against, taken in the same run as they are."""
    lhs, rhs = (torch.randn(size, size, device="cuda").to(dtype) for _ in range(2))
    return 2 * size**3 / (time_graph([lambda: lhs @ rhs]) * 1e-3) / 1e12


@triton.jit
def _copy_kernel(src_ptr, num_elements, dst_ptr, BLOCK: tl.constexpr):
    """Grid (cdiv(n, BLOCK),): program p copies elements [p*BLOCK, (p+1)*BLOCK) in 16-byte vectors."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def copy_bandwidth_gbps(num_bytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (the ceiling we divide by):
    the best over a few sizes of torch's copy and a plain vectorised Triton copy kernel."""
    best = 0.0
    for size in (num_bytes // 4, num_bytes // 2, num_bytes):
        src = torch.randint(0, 1 << 30, (size // 8,), dtype=torch.int64, device="cuda")
        dst = torch.empty_like(src)
        copies = {
            "torch": lambda src=src, dst=dst: dst.copy_(src),
            "triton": lambda src=src, dst=dst: _copy_kernel[(triton.cdiv(src.numel(), 2048),)](
                src, src.numel(), dst, BLOCK=2048, num_warps=8
            ),
        }
        for copy in copies.values():
            ms = time_graph([copy] * 4, replays=10)
            best = max(best, 2 * size / (ms * 1e-3) / 1e9)
    return best


@dataclass(frozen=True)
class JaxTiming:
    device_ms: float  # median GPU span of a run queued behind other work (steady state), per call
    cold_ms: float  # the same with the GPU idle when the run starts (host launch gaps included), per call
    wall_ms: float  # median host wall time of a run with a sync after it, per call


def gpu_activities_by_device(runs: Callable[[], None]) -> dict[int, list[tuple[str, float, float]]]:
    """Device index -> (name, start, end), times in µs, of every GPU activity (kernels, copies, memsets) that
    `runs` issues on that device, in order of start, read with CUPTI through torch.profiler."""
    torch.cuda.init()  # CUPTI records through torch's CUDA context
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        runs()
    by_device: dict[int, list[tuple[str, float, float]]] = {}
    for event in sorted(profile.events(), key=lambda event: event.time_range.start):
        if event.device_type == torch.autograd.DeviceType.CUDA:
            activity = (event.name, event.time_range.start, event.time_range.end)
            by_device.setdefault(event.device_index, []).append(activity)
    return by_device


def gpu_activities(runs: Callable[[], None]) -> list[tuple[str, float, float]]:
    """(name, start, end), times in µs, of every GPU activity that `runs` issues on any device, in order of
    start (gpu_activities_by_device)."""
    activities = (activity for device in gpu_activities_by_device(runs).values() for activity in device)
    return sorted(activities, key=lambda activity: activity[1])


def _median_span_us(events: list[tuple[str, float, float]], repeats: int, skip: int = 0) -> float:
    """Median over `repeats` equal groups of events of the span of each group, its first `skip` left out."""
    if not events or len(events) % repeats:
        raise RuntimeError(f"expected the same GPU activities in each of {repeats} runs, got {len(events)}")
    size = len(events) // repeats
    groups = [events[i + skip : i + size] for i in range(0, len(events), size)]
    return statistics.median(max(end for _, _, end in group) - group[0][1] for group in groups)


def time_jax(fn: Callable, sets: list[tuple], repeats: int = 20) -> JaxTiming:
    """Times `fn(*args)` for every `args` in `sets`, all inside one jax.jit program (see the module doc).

    Steady state: each run is dispatched right behind a ~1 ms matmul, so the host has enqueued the run's
    launches before the GPU reaches them, as inside a training step; the span counts the run's own
    activities only. Cold: the GPU is idle when a run is dispatched, so gaps where the GPU waits for the
    host to launch the next custom call count too."""
    import jax
    import jax.numpy as jnp

    program = jax.jit(lambda sets: [fn(*args) for args in sets])
    filler = jax.jit(lambda a: (a @ a).sum())
    matrix = jnp.ones((8192, 8192), jnp.bfloat16)
    jax.block_until_ready((program(sets), filler(matrix)))
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(sets))
        walls.append(time.perf_counter() - start)

    def cold() -> None:
        for _ in range(repeats):
            jax.block_until_ready(program(sets))

    def queued() -> None:
        for _ in range(repeats):
            filler(matrix)
            jax.block_until_ready(program(sets))

    def filler_alone() -> None:
        for _ in range(repeats):
            jax.block_until_ready(filler(matrix))

    filler_events = len(gpu_activities(filler_alone)) // repeats
    return JaxTiming(
        device_ms=_median_span_us(gpu_activities(queued), repeats, skip=filler_events) * 1e-3 / len(sets),
        cold_ms=_median_span_us(gpu_activities(cold), repeats) * 1e-3 / len(sets),
        wall_ms=statistics.median(walls) * 1e3 / len(sets),
    )


@dataclass(frozen=True)
class EagerTiming:
    host_ms: float  # median host time to issue one call (the device keeps up, so nothing waits)
    eager_ms: float  # wall time per call of `calls` calls back to back, one sync at the end


def time_host_and_eager(
    call: Callable[[], object],
    sync: Callable[[object], None],
    calls: int = 200,
    issues: int = 50,
    bursts: int = 3,
) -> EagerTiming:
    """What an eager user sees: the host cost of issuing one call (the median of `issues` timed calls), and
    the wall time per call when `calls` calls follow each other with a single sync at the end (max of host
    and device time, plus what does not overlap), the median of `bursts` such bursts so that one stray pause
    of the host (another process, a garbage collection) does not decide the figure. `sync(result)` waits for
    the device (torch.cuda.synchronize, jax.block_until_ready). Smaller counts are for smoke runs under the
    Triton interpreter, where one call takes a fraction of a second."""
    for _ in range(3):  # compile, autotune and warm the caches outside the timing
        sync(call())
    issue = []
    while len(issue) < issues:
        for _ in range(min(10, issues - len(issue))):  # few enough calls that the launch queue never fills
            start = time.perf_counter()
            result = call()
            issue.append(time.perf_counter() - start)
        sync(result)
    walls = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(calls):
            result = call()
        sync(result)
        walls.append(time.perf_counter() - start)
    return EagerTiming(
        host_ms=statistics.median(issue) * 1e3, eager_ms=statistics.median(walls) * 1e3 / calls
    )
