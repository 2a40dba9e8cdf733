"""Runs a framework-neutral launch plan on torch tensors: allocate, launch, return."""

from __future__ import annotations

import contextlib
import functools

import torch

from moetriton.kernels import INTERPRETER, DeviceInfo, Plan, interpreter_problem

_DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """numpy-style name of a torch dtype, as moetriton.kernels.validation expects."""
    return str(dtype).removeprefix("torch.")


def describe(x: torch.Tensor | None) -> tuple[tuple[int, ...], str] | None:
    return None if x is None else (tuple(x.shape), dtype_name(x.dtype))


def uses_kernels(device: torch.device) -> bool:
    """Kernels run compiled on CUDA, interpreted on CPU under TRITON_INTERPRET=1; otherwise the reference."""
    return device.type == "cuda" or INTERPRETER


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(name=props.name, num_sms=props.multi_processor_count, pdl=props.major >= 9)


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceInfo()


def _buffer_dtype(spec_dtype: str, inputs: dict[str, torch.Tensor | None]) -> torch.dtype:
    if spec_dtype.startswith("like:"):
        return inputs[spec_dtype.removeprefix("like:")].dtype
    return _DTYPES[spec_dtype]


def allocate(
    plan: Plan, inputs: dict[str, torch.Tensor | None], device: torch.device, *, fake: bool = False
) -> dict[str, torch.Tensor]:
    """Buffers of a plan; `fake` allocates without zeroing (for torch.library fake implementations)."""
    buffers = {}
    for name, spec in plan.buffers.items():
        alloc = torch.zeros if spec.zero and not fake else torch.empty
        buffers[name] = alloc(spec.shape, dtype=_buffer_dtype(spec.dtype, inputs), device=device)
    return buffers


def run_plan(
    plan: Plan, inputs: dict[str, torch.Tensor | None], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Allocates the plan's buffers, runs its launches in order and returns its results."""
    if INTERPRETER and plan.launches:
        problem = interpreter_problem()
        if problem:
            raise RuntimeError(problem)
    buffers = allocate(plan, inputs, device)
    if plan.launches:
        env = {**inputs, **buffers}
        dummy = torch.empty(0, dtype=torch.int32, device=device)
        context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with context:
            for launch in plan.launches:
                args = [
                    (dummy if env[arg] is None else env[arg]) if isinstance(arg, str) else arg
                    for arg in launch.args
                ]
                outputs = [buffers[name] for name in launch.outputs]
                options = dict(
                    num_warps=launch.num_warps,
                    num_stages=launch.num_stages,
                    enable_fp_fusion=launch.fp_fusion,
                )
                if launch.checks and device.type == "cuda":
                    options["debug"] = True
                if launch.pdl:
                    options["launch_pdl"] = True
                launch.kernel[launch.grid](*args, *outputs, **launch.constexprs, **options)
    return tuple(buffers[name] for name in plan.results)
