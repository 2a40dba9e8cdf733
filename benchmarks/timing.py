"""GPU timing for PyTorch callables (device/METHOD.md: warm-up, median, rotating inputs, graphs).

`time_graph` captures `repeats` calls, each on its own input set so that no call finds the previous one's
data in L2, into one CUDA graph and times its replays with CUDA events: the median replay over `repeats`
is the time per call without Python launch overhead (what a CUDA-graphed training step sees).
`time_eager` times plain calls with events (for baselines that sync with the host and cannot be captured).
`time_jax` jits R calls (one per input set) into one program and reads the GPU timeline of its runs with
CUPTI (through torch.profiler, which records the kernels of every library in the process): the median span
from the first GPU activity of a run to the end of its last, divided by R. Like a graph replay, this counts
the gaps between launches but not the host's dispatch, which a training step's jit overlaps with GPU work.
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
    device_ms: float  # median GPU span of a run of the program, per call
    wall_ms: float  # median host wall time of a run with a sync after it, per call


def time_jax(fn: Callable, sets: list[tuple], repeats: int = 20) -> JaxTiming:
    """Times `fn(*args)` for every `args` in `sets`, all inside one jax.jit program (see the module doc)."""
    import jax

    torch.cuda.init()  # CUPTI records through torch's CUDA context
    program = jax.jit(lambda sets: [fn(*args) for args in sets])
    jax.block_until_ready(program(sets))
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(sets))
        walls.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            jax.block_until_ready(program(sets))
    events = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profile.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    if not events or len(events) % repeats:
        raise RuntimeError(f"expected the same GPU activities in each of {repeats} runs, got {len(events)}")
    per_run = len(events) // repeats
    spans = [
        max(end for _, end in events[i : i + per_run]) - events[i][0] for i in range(0, len(events), per_run)
    ]
    return JaxTiming(statistics.median(spans) * 1e-3 / len(sets), statistics.median(walls) * 1e3 / len(sets))
