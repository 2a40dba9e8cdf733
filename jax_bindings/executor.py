"""Runs a framework-neutral launch plan on JAX arrays.

GPU, kernels compiled: every launch becomes a `jax_triton.triton_call` (imported lazily: jax-triton refuses
to import without GPU JAX), with the plan's grid, warps and stages, and the plan's zero-initialised buffers
passed as `zeroed_outputs`. TRITON_INTERPRET=1, any backend: the whole plan runs inside one
`jax.pure_callback`, the kernels interpreted on numpy buffers, one plan at a time. Never imports torch.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from moetriton.kernels.rules import validation
from moetriton.kernels.runtime.interpreter import (
    INTERPRETER,
    HostArray,
    interpreter_problem,
    say_reference_fallback,
)
from moetriton.kernels.runtime.plan import (
    DeviceInfo,
    Plan,
    launch_arguments,
    plan_sizes,
    tuned_per_device,
)


def dtype_name(dtype) -> str:
    """numpy-style name of a JAX dtype, as moetriton.kernels.rules.validation expects."""
    return jnp.dtype(dtype).name


def describe(x) -> tuple[tuple[int, ...], str] | None:
    """(shape, numpy-style dtype name) of an array (a jax.Array or numpy array), None for None; anything
    else gets validation.not_an_array's description, for which the rules raise TypeError."""
    if x is None:
        return None
    if not isinstance(x, jax.Array | np.ndarray):
        return validation.not_an_array(x, "a jax.Array")
    return (tuple(x.shape), dtype_name(x.dtype))


def described(**arrays) -> dict[str, tuple[tuple[int, ...], str] | None]:
    """Every array argument `describe`d, by name: the array arguments of a rule."""
    return {name: describe(x) for name, x in arrays.items()}


def on_gpu() -> bool:
    """Whether plans run as compiled Triton kernels (the default JAX backend is a GPU)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def uses_kernels() -> bool:
    """Kernels run compiled on GPU, interpreted on CPU under TRITON_INTERPRET=1; otherwise the reference
    (said once per process)."""
    if on_gpu() or INTERPRETER:
        return True
    say_reference_fallback("JAX")
    return False


def device_info() -> DeviceInfo:
    if on_gpu():
        device = jax.devices()[0]
        capability = str(getattr(device, "compute_capability", "")).replace(".", "")
        return DeviceInfo(
            name=device.device_kind,
            num_sms=getattr(device, "core_count", None) or 132,
            arch=f"sm_{capability}" if capability else "unknown",
        )
    return DeviceInfo()


def _dtype(spec, inputs: dict) -> jnp.dtype:
    return jnp.dtype(inputs[spec.like].dtype if spec.like else spec.dtype)


def _result_specs(plan: Plan, inputs: dict) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        name: jax.ShapeDtypeStruct(spec.shape, _dtype(spec, inputs)) for name, spec in plan.buffers.items()
    }


def compiles_kernels() -> bool:
    """Whether plans run as compiled Triton kernels through jax-triton: on a GPU backend, unless
    TRITON_INTERPRET=1 made the kernels interpreted functions (which jax-triton cannot compile)."""
    return on_gpu() and not INTERPRETER


def run_plan(plan: Plan, inputs: dict) -> tuple[jax.Array, ...]:
    """Runs `plan` on `inputs` (name -> array or None) and returns the arrays named by `plan.results`."""
    if INTERPRETER:
        problem = interpreter_problem()
        if problem:
            raise RuntimeError(problem)
        return _run_interpreted(plan, inputs)
    if on_gpu():
        return _run_triton(plan, inputs)
    raise RuntimeError("moetriton: no GPU backend and TRITON_INTERPRET is not set; use the reference instead")


def run_builder(builder, inputs: dict, **options) -> dict[str, jax.Array]:
    """Runs the plan that `builder` (a plan builder of moetriton.kernels) makes for `inputs` (the sizes its
    `sized_by` declaration reads from them), `options` and, for builders tuned per device, this process's
    device; returns its results by name. An option also named by the declaration overrides it."""
    if tuned_per_device(builder):
        options["device"] = device_info()
    plan = builder(**(plan_sizes(builder, inputs, dtype_name) | options))
    return dict(zip(plan.results, run_plan(plan, inputs), strict=True))


def _jax_triton():
    """jax_triton, imported on first use. Its import empties TRITON_CACHE_DIR, after which every other
    Triton user in the process (PyTorch launches included) fails with "Could not create or locate cache
    dir"; the caller's setting is put back."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


def _row_stride(array) -> int:
    """JAX arrays are dense and row-major: a row stride is the row length."""
    return array.shape[1]


def _run_triton(plan: Plan, inputs: dict) -> tuple[jax.Array, ...]:
    jax_triton = _jax_triton()
    specs = _result_specs(plan, inputs)
    env = dict(inputs)
    dummy = jnp.zeros((0,), jnp.int32)
    for launch in plan.launches:
        if launch.num_programs == 0:
            # No program would run (an empty batch): skipped, as Triton's own launcher skips it; XLA would
            # pass the zero grid to CUDA, which refuses it. Its outputs stay unwritten (zeros below).
            continue
        for name in launch.args:
            # A buffer no earlier launch wrote (the empty block counts when T = 0) starts as zeros.
            if isinstance(name, str) and name not in env:
                env[name] = jnp.zeros(specs[name].shape, specs[name].dtype)
        args, strides = launch_arguments(launch, env, dummy, _row_stride)
        outputs = jax_triton.triton_call(
            *args,
            kernel=launch.kernel,
            out_shape=[specs[name] for name in launch.outputs],
            grid=launch.grid,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            enable_fp_fusion=launch.fp_fusion,
            zeroed_outputs=tuple(i for i, name in enumerate(launch.outputs) if plan.buffers[name].zero),
            **launch.constexprs,
            **strides,
        )
        env.update(zip(launch.outputs, outputs, strict=True))
    results = []
    for name in plan.results:
        if name not in env:  # written by no launch (empty op): zeros of its shape
            env[name] = jnp.zeros(specs[name].shape, specs[name].dtype)
        results.append(env[name])
    return tuple(results)


# The Triton interpreter keeps global state (the current program id), so interpreted plans must not overlap
# when XLA runs independent callbacks on several threads.
_INTERPRETER_LOCK = threading.Lock()


def _run_interpreted(plan: Plan, inputs: dict) -> tuple[jax.Array, ...]:
    specs = _result_specs(plan, inputs)
    names = [name for name, value in inputs.items() if value is not None]

    def host(*arrays):
        with _INTERPRETER_LOCK:
            return _interpret(plan, specs, inputs, names, arrays)

    return tuple(
        jax.pure_callback(
            host,
            tuple(specs[name] for name in plan.results),
            *(inputs[name] for name in names),
            vmap_method="sequential",
        )
    )


def host_buffer(shape: tuple[int, ...], dtype, zero: bool) -> np.ndarray:
    """A buffer of an interpreted plan (zeroed when the plan asks). One place, so that tests can allocate
    every buffer inside guard zones."""
    return (np.zeros if zero else np.empty)(shape, dtype)


def _interpret(plan: Plan, specs: dict, inputs: dict, names: list[str], arrays) -> tuple[np.ndarray, ...]:
    env = {name: None for name in inputs}
    env.update({name: np.ascontiguousarray(array) for name, array in zip(names, arrays, strict=True)})
    buffers = {
        name: host_buffer(spec.shape, specs[name].dtype, spec.zero) for name, spec in plan.buffers.items()
    }
    env.update(buffers)
    dummy = np.zeros(0, np.int32)
    for launch in plan.launches:
        args, strides = launch_arguments(launch, env, dummy, _row_stride)
        args = [HostArray(arg) if isinstance(arg, np.ndarray) else arg for arg in args]
        outputs = [HostArray(buffers[name]) for name in launch.outputs]
        launch.kernel[launch.grid](*args, *outputs, **launch.constexprs, **strides)
    return tuple(buffers[name] for name in plan.results)
