"""A minimal executor of the FP8 kernels' plans for their tests: allocates every buffer of a plan, each
inside guard zones (a view into a larger buffer filled with a sentinel, so that a write out of bounds shows
in the margins, and what a kernel leaves unwritten stays recognisable), and launches its kernels in order.
The package's executors run the same plans; this one exists for the guard zones.
"""

from __future__ import annotations

import math

import torch

from moetriton.kernels.runtime.plan import Plan

DTYPES = {
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
#: The sentinel each dtype's guard zones are filled with: byte 0x5a for FP8, a value no kernel writes.
SENTINELS = {torch.float8_e4m3fn: 0x5A, torch.float8_e5m2: 0x5A}
_FLOAT_SENTINEL = -777.0


def _dtype(spec: str, inputs: dict) -> torch.dtype:
    if spec.startswith("like:"):
        return inputs[spec.removeprefix("like:")].dtype
    return DTYPES[spec]


class Guarded:
    """A tensor of `shape` inside a flat buffer with `guard` sentinel elements before and after it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, guard: int) -> None:
        size = math.prod(shape)
        self.guard = guard
        self.full = torch.empty(size + 2 * guard, dtype=dtype, device=device)
        self.sentinel = SENTINELS.get(dtype, _FLOAT_SENTINEL)
        bits = self.full.view(torch.uint8) if dtype.itemsize == 1 else self.full
        bits.fill_(self.sentinel)
        self.view = self.full[guard : guard + size].view(shape)

    def margins_intact(self) -> bool:
        margins = torch.cat([self.full[: self.guard], self.full[self.full.numel() - self.guard :]])
        if margins.dtype.itemsize == 1:
            return bool((margins.view(torch.uint8) == self.sentinel).all())
        return bool((margins == self.sentinel).all())


def allocate(plan: Plan, inputs: dict, device, guard: int = 0) -> tuple[dict, dict]:
    """(buffers by name, their Guarded holders) for `plan`. With guard > 0 every buffer sits between
    guard zones, and a buffer's own elements start as the sentinel too (what a kernel leaves unwritten
    stays recognisable); zeroed buffers start zeroed."""
    buffers, holders = {}, {}
    for name, spec in plan.buffers.items():
        dtype = _dtype(spec.dtype, inputs)
        if guard:
            holder = Guarded(spec.shape, dtype, device, guard)
            if spec.zero:
                holder.view.zero_()
            holders[name] = holder
            buffers[name] = holder.view
        else:
            alloc = torch.zeros if spec.zero else torch.empty
            buffers[name] = alloc(spec.shape, dtype=dtype, device=device)
    return buffers, holders


def launch_all(plan: Plan, environment: dict) -> None:
    """Every launch of `plan`, in order, with `environment` holding its inputs and buffers by name."""
    for launch in plan.launches:
        args = [environment[arg] if isinstance(arg, str) else arg for arg in launch.args]
        outputs = [environment[name] for name in launch.outputs]
        launch.kernel[launch.grid](
            *args,
            *outputs,
            **launch.constexprs,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )


def run_plan(plan: Plan, inputs: dict, device=None, guard: int = 0) -> tuple[dict, dict]:
    """Runs `plan` on `inputs` (name -> tensor); returns (every buffer by name, their Guarded holders)."""
    device = device or next(t.device for t in inputs.values() if isinstance(t, torch.Tensor))
    buffers, holders = allocate(plan, inputs, device, guard)
    launch_all(plan, {**inputs, **buffers})
    return buffers, holders


class Runner:
    """A plan bound to its inputs and to buffers allocated once, for timing: each call zeroes the buffers
    the plan wants zeroed and launches its kernels (the steady state of an executor)."""

    def __init__(self, plan: Plan, inputs: dict, device) -> None:
        self.plan = plan
        self.buffers, _ = allocate(plan, inputs, device)
        self.zeroed = [self.buffers[name] for name, spec in plan.buffers.items() if spec.zero]
        self.environment = {**inputs, **self.buffers}

    def __call__(self) -> None:
        for buffer in self.zeroed:
            buffer.zero_()
        launch_all(self.plan, self.environment)
