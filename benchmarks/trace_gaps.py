"""Where a profiled layer step leaves the GPU idle, and how long its collectives wait for each other.

    python -m benchmarks.trace_gaps TRACE_RANK0.json.gz [TRACE_RANK1.json.gz ...] [--gaps 12]

Reads the traces that `python -m benchmarks.moe_torch --trace DIR` writes (one per rank of one row). Per
rank: the GPU window of every profiled step (from the end of the barrier that starts it to the last GPU work
before the next one), the share of it with a kernel, copy or memset running, and the longest idle gaps, each
with the host context that launched the work ending it (its moe.<stage> range or autograd node) and how long
after the gap began the host launched that work (a launch at the gap's end: the host was the bottleneck).

With several ranks' traces: their NCCL kernels, matched by order (every rank issues the same collectives in
the same order), each split into its wait (from its own start to the latest rank's start) and its transfer
(from the latest start to its own end), summed per launching stage. Timestamps of processes on one host
share the host's clock.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
ALIGN = "bench.align"
BACKWARD = "autograd::engine::evaluate_function: "


@dataclass
class Activity:
    """One GPU kernel, copy or memset: [start, end) in µs, the host context that launched it."""

    name: str
    start: float
    end: float
    launched: float | None = None  # host time of its launch call
    context: list[str] = field(default_factory=list)  # enclosing host ranges, outermost first
    # The layer stage it belongs to: its innermost moe.<stage> range (without "moe."), or in a backward node
    # outside any, the stage of the forward op that created the node; ALIGN for the step barrier's work.
    layer_stage: str = "other"

    @property
    def stage(self) -> str:
        for name in reversed(self.context):
            if name.startswith(("moe.", "bench.")):
                return name
            if name.startswith(BACKWARD):
                return name.removeprefix(BACKWARD)
        return "other"


def load(path: str) -> list[Activity]:
    """The GPU activities of one trace, in start order, each with its launch context."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    host_ranges: dict[object, list[tuple[float, float, str, int | None]]] = defaultdict(list)
    launches: dict[int, tuple[object, float]] = {}
    activities = []
    for event in events:
        if event.get("ph") != "X":
            continue
        category, args = event.get("cat"), event.get("args", {})
        if category in ("cpu_op", "user_annotation"):
            end = event["ts"] + event["dur"]
            host_ranges[event["tid"]].append((event["ts"], end, event["name"], args.get("Sequence number")))
        elif category in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = (event["tid"], event["ts"])
        elif category in GPU_CATEGORIES:
            activities.append(
                (Activity(event["name"], event["ts"], event["ts"] + event["dur"]), args.get("correlation"))
            )
    for ranges in host_ranges.values():
        ranges.sort(key=lambda host_range: (host_range[0], -host_range[1]))
    starts = {tid: [begin for begin, *_ in ranges] for tid, ranges in host_ranges.items()}

    def enclosing(tid, when: float) -> list[tuple[str, int | None]]:
        """Host ranges of thread `tid` open at `when`, outermost first (ranges nest: starts order them)."""
        last = bisect.bisect_right(starts.get(tid, []), when)
        return [(name, sequence) for begin, end, name, sequence in host_ranges[tid][:last] if end >= when]

    # Forward ops: the op that creates autograd node n is the last to see sequence number n. One sweep per
    # thread, the ranges open around each one on a stack (they nest, in start order).
    stage_of_node: dict[int, str] = {}
    for ranges in host_ranges.values():
        open_ranges: list[tuple[float, str, int | None]] = []
        for begin, end, name, sequence in ranges:
            while open_ranges and open_ranges[-1][0] < begin:
                open_ranges.pop()
            context = [(outer, outer_sequence) for _, outer, outer_sequence in open_ranges]
            backward = name.startswith(BACKWARD) or any(outer.startswith(BACKWARD) for outer, _ in context)
            if sequence is not None and not backward:
                stage_of_node[sequence] = _innermost_stage(context, {})
            open_ranges.append((end, name, sequence))
    for activity, correlation in activities:
        if correlation not in launches:
            continue
        tid, when = launches[correlation]
        activity.launched = when
        context = enclosing(tid, when) if tid in host_ranges else []
        activity.context = [name for name, _ in context]
        activity.layer_stage = _innermost_stage(context, stage_of_node)
    return sorted((activity for activity, _ in activities), key=lambda activity: activity.start)


def _innermost_stage(context: list[tuple[str, int | None]], stage_of_node: dict[int, str]) -> str:
    """The layer stage of work under `context` (host ranges and their sequence numbers, outermost first):
    Activity.layer_stage's rule."""
    for name, sequence in reversed(context):
        if name.startswith("moe."):
            return name.removeprefix("moe.")
        if name == ALIGN:
            return ALIGN
        if name.startswith(BACKWARD):
            return stage_of_node.get(sequence, "other")
    return "other"


def step_windows(activities: list[Activity]) -> list[tuple[float, float]]:
    """[start, end) of every profiled step: from its barrier's last GPU work to the last work before the next
    barrier (the whole trace where there is no barrier)."""
    windows: list[tuple[float, float]] = []
    begin = finish = None
    for activity in activities:
        if activity.stage == ALIGN:
            if finish is not None:
                windows.append((begin, finish))
            begin, finish = activity.end, None
        else:
            begin = activity.start if begin is None else begin
            finish = activity.end if finish is None else max(finish, activity.end)
    if finish is not None:
        windows.append((begin, finish))
    return windows


def busy_and_gaps(activities: list[Activity], window: tuple[float, float]) -> tuple[float, list[tuple]]:
    """(busy µs in the window, idle gaps [(µs, gap start, the activity that ends it)])."""
    begin, finish = window
    inside = [a for a in activities if begin <= a.start < finish and a.stage != ALIGN]
    busy, gaps, covered = 0.0, [], begin
    for activity in inside:
        if activity.start > covered:
            gaps.append((activity.start - covered, covered, activity))
        busy += max(0.0, activity.end - max(activity.start, covered))
        covered = max(covered, activity.end)
    return busy, gaps


def idle_per_step(activities: list[Activity]) -> list[float]:
    """µs with nothing running on the GPU in each profiled step's window (`step_windows`)."""
    windows = step_windows(activities)
    return [end - begin - busy_and_gaps(activities, (begin, end))[0] for begin, end in windows]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, ordered intervals covering `intervals`."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def exposed_time(mine: list[tuple[float, float]], others: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by the intervals `mine`, the part of it that no interval of `others` covers), each
    overlap counted once however the intervals nest or repeat."""
    mine, others = _union(mine), _union(others)
    total = sum(end - start for start, end in mine)
    covered, index = 0.0, 0
    for start, end in mine:
        while index < len(others) and others[index][1] <= start:
            index += 1
        probe = index
        while probe < len(others) and others[probe][0] < end:
            covered += min(end, others[probe][1]) - max(start, others[probe][0])
            probe += 1
    return total, total - covered


def exposed_us(activities: list[Activity], stage: str) -> tuple[float, float]:
    """(µs with some activity of layer stage `stage` running, µs of those with nothing of any other stage
    running beside it): for the exchange, its time and its exposed time (what overlapping it with compute,
    e.g. with independent work such as the shared experts, takes off the step). The step barriers' work is no
    stage."""
    return exposed_time(
        [(a.start, a.end) for a in activities if a.layer_stage == stage],
        [(a.start, a.end) for a in activities if a.layer_stage not in (stage, ALIGN)],
    )


def report_rank(rank: int, activities: list[Activity], top: int) -> None:
    windows = step_windows(activities)
    for step, window in enumerate(windows):
        busy, gaps = busy_and_gaps(activities, window)
        span = window[1] - window[0]
        idle = span - busy
        print(
            f"rank {rank} step {step}: GPU window {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms"
            f" ({100 * busy / span:.1f}%), idle {idle / 1e3:.3f} ms in {len(gaps)} gaps"
        )
        by_stage: dict[str, float] = defaultdict(float)
        for length, _, after in gaps:
            by_stage[after.stage] += length
        ranked = sorted(by_stage.items(), key=lambda item: -item[1])
        print("  idle before work of: " + ", ".join(f"{stage} {us / 1e3:.3f} ms" for stage, us in ranked[:8]))
        for length, start, after in sorted(gaps, key=lambda gap: -gap[0])[:top]:
            late = (
                ""
                if after.launched is None
                else f", launched {after.launched - start:+.0f} µs after the gap began"
            )
            print(f"  {length:9.1f} µs before {after.name[:60]!r} [{after.stage}]{late}")


def nccl_kernels(activities: list[Activity]) -> list[Activity]:
    """The NCCL kernels of one rank's trace, in start order."""
    return [activity for activity in activities if "nccl" in activity.name.lower()]


def wait_and_transfer(kernels_per_rank: list[list[tuple[float, float]]]) -> list[list[tuple[float, float]]]:
    """Per rank, per collective: (µs waiting for the latest rank to start, µs transferring after it), from
    every rank's (start, end) of the same collectives in issue order. Raises if the ranks' counts differ."""
    counts = {len(kernels) for kernels in kernels_per_rank}
    if len(counts) != 1:
        raise ValueError(f"NCCL kernels per rank differ: {[len(kernels) for kernels in kernels_per_rank]}")
    latest = [
        max(starts)
        for starts in zip(*([start for start, _ in kernels] for kernels in kernels_per_rank), strict=True)
    ]
    return [
        [(last - start, end - last) for (start, end), last in zip(kernels, latest, strict=True)]
        for kernels in kernels_per_rank
    ]


def collective_times(traces: list[list[Activity]]) -> dict[str, tuple[int, float, float, float]]:
    """Per launching stage: (NCCL kernels per rank, µs in them, µs of that waiting for the latest rank to
    start, µs transferring after it), means over the ranks; kernels matched by order over the ranks."""
    kernels = [nccl_kernels(activities) for activities in traces]
    split = wait_and_transfer([[(kernel.start, kernel.end) for kernel in rank] for rank in kernels])
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for rank_kernels, rank_split in zip(kernels, split, strict=True):
        for kernel, (wait, transfer) in zip(rank_kernels, rank_split, strict=True):
            entry = totals[kernel.stage]
            entry[0] += 1
            entry[1] += kernel.end - kernel.start
            entry[2] += wait
            entry[3] += transfer
    ranks = len(traces)
    return {
        stage: (calls // ranks, *(us / ranks for us in times)) for stage, (calls, *times) in totals.items()
    }


def report_collectives(traces: list[list[Activity]]) -> None:
    print(f"NCCL kernels of the traced steps, mean over {len(traces)} ranks (ms):")
    ranked = sorted(collective_times(traces).items(), key=lambda item: -item[1][1])
    for stage, (calls, spent, wait, transfer) in ranked:
        print(
            f"  {stage:<40} kernels {calls:3d}  in kernel {spent / 1e3:8.3f}"
            f"  waiting {wait / 1e3:8.3f}  transferring {transfer / 1e3:8.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+", help="one trace per rank, in rank order")
    parser.add_argument("--gaps", type=int, default=12, help="longest gaps listed per step")
    args = parser.parse_args(argv)
    traces = [load(path) for path in args.traces]
    for rank, activities in enumerate(traces):
        report_rank(rank, activities, args.gaps)
    if len(traces) > 1:
        report_collectives(traces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
