"""The executor: runs a framework-neutral launch plan on torch tensors (arrange inputs, allocate, launch).

Two layers. `run_plan` is the executor itself, a plain loop: every input laid out by the rule below, every
buffer allocated, every launch through Triton's JIT, in order; tests and the autotuner call it. The fast
path (`bound`, `Executable`) is what the ops call on every eager step: the same work with a per-call path
generated for each plan and, after a specialization's first call, Triton's compiled launcher called
directly, because every interpreted step is paid on every call (tests/torch/test_executor.py holds the two
equal on every plan family).

Memory layout is decided here, once for every op (see moetriton.kernels.runtime.plan): an input that a launch
reads through a `RowStride` is passed as it is when its columns are unit stride (row slices, offset views,
rows expanded with stride 0: no copy), and every other input, or any other layout (transposed, column-strided,
fully expanded), is made contiguous first. Results are always dense.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from moetriton.kernels.runtime.interpreter import INTERPRETER, interpreter_problem, say_reference_fallback
from moetriton.kernels.runtime.plan import (
    DeviceInfo,
    Plan,
    RowStride,
    alignment,
    launch_arguments,
    strided_inputs,
    tuned_per_device,
)

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
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """numpy-style name of a torch dtype, as moetriton.kernels.rules.validation expects."""
    return str(dtype).removeprefix("torch.")


def uses_kernels(device: torch.device) -> bool:
    """Kernels run compiled on CUDA, interpreted on CPU under TRITON_INTERPRET=1; otherwise the reference
    (said once per process)."""
    if device.type == "cuda" or INTERPRETER:
        return True
    say_reference_fallback("PyTorch")
    return False


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        name=props.name,
        num_sms=props.multi_processor_count,
        pdl=props.major >= 9,
        arch=f"sm_{props.major}{props.minor}",
    )


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceInfo()


def _buffer_dtype(spec, inputs: dict[str, torch.Tensor | None]) -> torch.dtype:
    return inputs[spec.like].dtype if spec.like else _DTYPES[spec.dtype]


def allocate(
    plan: Plan, inputs: dict[str, torch.Tensor | None], device: torch.device, *, fake: bool = False
) -> dict[str, torch.Tensor]:
    """Buffers of a plan, one tensor each; `fake` allocates without zeroing (torch.library fake
    implementations, which may see symbolic sizes)."""
    buffers = {}
    for name, spec in plan.buffers.items():
        alloc = torch.zeros if spec.zero and not fake else torch.empty
        buffers[name] = alloc(spec.shape, dtype=_buffer_dtype(spec, inputs), device=device)
    return buffers


class _Launcher:
    """One launch of a plan, bound to its kernel. The first call of each specialization (the dtypes and
    16-byte alignment of the inputs, and the class of each row stride: what Triton specialises a kernel
    on, beside the plan's fixed sizes) goes through Triton's JIT, which compiles or loads the kernel. That
    call also builds the specialization's fast launch (`fast`): a function generated for this launch that
    passes every argument as the launcher takes it (device pointers and sizes as ints, constants inline)
    to the compiled kernel's own launcher (`CompiledKernel.run`, the call Triton's JIT itself makes),
    skipping the JIT's argument binding and cache-key work and the launcher's per-pointer driver queries.
    Launches while a profiler hooks Triton (an enter hook registered) take the JIT-style path with tensor
    arguments and launch metadata, so the hook sees every launch as it would from Triton."""

    def __init__(self, launch, scratch: frozenset[str]) -> None:
        self.launch = launch
        self.scratch = scratch  # buffers passed as workspace addresses by fast launches
        self.grid = (*launch.grid, 1, 1)[:3]  # Triton's launcher reads three grid dimensions
        # (kind, value): 0 = a tensor from the environment, 1 = the row stride of one, 2 = a constant.
        self.template = [
            (1, arg.name) if isinstance(arg, RowStride) else (0, arg) if isinstance(arg, str) else (2, arg)
            for arg in launch.args
        ]
        names = launch.kernel.arg_names
        self.constexpr_names = names[len(launch.args) + len(launch.outputs) :]
        self.options = _options(launch)
        self.runners: dict[tuple, tuple] = {}
        self.fast: dict[tuple, object] = {}

    def __call__(self, env: dict, dummy: torch.Tensor, key: tuple, stream: int | None) -> None:
        """The JIT-style launch; `stream` is None under the interpreter."""
        args, strides = launch_arguments(self.launch, env, dummy, _row_stride)
        for name in self.launch.outputs:
            tensor = env[name]
            args.append(dummy if tensor is None else tensor)
        runner = self.runners.get(key)
        if runner is not None:
            compiled, constexpr_values = runner
            args += constexpr_values
            runtime = _triton_knobs().runtime
            enter = runtime.launch_enter_hook
            metadata = compiled.launch_metadata(self.grid, stream, *args) if _hooked(enter) else None
            compiled.run(
                *self.grid,
                stream,
                compiled.function,
                compiled.packed_metadata,
                metadata,
                enter,
                runtime.launch_exit_hook,
                *args,
            )
            return
        launch = self.launch
        compiled = launch.kernel[launch.grid](*args, **launch.constexprs, **strides, **self.options)
        if stream is not None and compiled is not None:  # compiled (not interpreted) kernels only
            constexprs = {**launch.constexprs, **strides}
            constexpr_values = [constexprs[name] for name in self.constexpr_names]
            self.runners[key] = (compiled, constexpr_values)
            self.fast[key] = self._fast_launch(compiled, constexpr_values, env, dummy)

    def _fast_launch(self, compiled, constexpr_values: list, env: dict, dummy: torch.Tensor):
        """The generated launch of one specialization: `launch(env, stream)`, where `env` maps input and
        result names to tensors and scratch names to device addresses (ints). Which inputs are absent is
        part of the specialization's key, so their dummy pointer is a constant here."""
        constants = [
            self.grid[0],
            self.grid[1],
            self.grid[2],
            compiled.run,
            compiled.function,
            compiled.packed_metadata,
        ]
        args = []

        def constant(value) -> str:
            constants.append(value)
            return f"c[{len(constants) - 1}]"

        def pointer(name: str) -> str:
            value = env[name]
            if value is None:
                return constant(dummy.data_ptr())
            return f"env[{name!r}]" if name in self.scratch else f"env[{name!r}].data_ptr()"

        for kind, value in self.template:
            if kind == 0:
                args.append(pointer(value))
            elif kind == 1:
                args.append(f"env[{value!r}].stride(0)")
            else:
                args.append(constant(value))
        args += [pointer(name) for name in self.launch.outputs]
        args += [constant(value) for value in constexpr_values]
        # No launch metadata and no hooks: fast launches run only while no profiler hooks Triton.
        source = (
            "def launch(env, stream):\n"
            f"    c[3](c[0], c[1], c[2], stream, c[4], c[5], None, None, None, {', '.join(args)})\n"
        )
        namespace = {"c": constants}
        exec(compile(source, f"<moetriton launch {self.launch.kernel.__name__}>", "exec"), namespace)
        return namespace["launch"]


def _hooked(chain) -> bool:
    """Whether a launch hook is registered in `chain` (Triton >= 3.5 keeps always-present chains)."""
    return chain is not None and bool(getattr(chain, "calls", True))


class _Fill(threading.local):
    active = False


_FILL = _Fill()


@contextlib.contextmanager
def filling_placeholders():
    """Within: executables return placeholder results as size-0 tensors instead of None (what a
    torch.library custom op, whose schema fixes its results as tensors, must return)."""
    previous, _FILL.active = _FILL.active, True
    try:
        yield
    finally:
        _FILL.active = previous


class Executable:
    """A plan bound to a device: buffer specs resolved once, the scratch buffers (those the op does not
    return) carved from a single allocation, and one `_Launcher` per launch. Calling it with the inputs
    arranges them (layouts, see the module docstring), allocates, launches and returns the results
    (None for placeholders, see `filling_placeholders`), through a per-call path generated for the plan.
    Once every launch of a specialization has its fast launch, scratch buffers are passed as addresses
    into the workspace (no tensor views built per call)."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.cuda = device.type == "cuda"
        self.strided = strided_inputs(plan)
        results = set(plan.results)
        # Own allocations: (name, shape, fixed dtype or None, the input whose dtype it takes, zeroed,
        # returned, placeholder): the results, in order, then scratch buffers whose dtype follows an
        # input's or that start zeroed. Placeholders are never allocated for kernels (they get the dummy
        # pointer): None is returned in their place, or a size-0 tensor while `filling_placeholders`.
        self.allocations = []

        def in_workspace(name: str, spec) -> bool:
            return name not in results and spec.like is None and not spec.zero

        scratch_like = [
            name
            for name, spec in plan.buffers.items()
            if name not in results and not in_workspace(name, spec)
        ]
        owned = list(plan.results) + scratch_like
        for name in owned:
            spec = plan.buffers[name]
            like = spec.like
            dtype = None if like else _DTYPES[spec.dtype]
            self.allocations.append(
                (name, spec.shape, dtype, like, spec.zero, name in results, spec.placeholder)
            )
        # Scratch: fixed dtypes, each at a 128-byte offset of one uint8 workspace.
        self.scratch, self.scratch_bytes, self.scratch_offsets = [], [], []
        for name, spec in plan.buffers.items():
            if in_workspace(name, spec):
                dtype = _DTYPES[spec.dtype]
                nbytes = dtype.itemsize * _numel(spec.shape)
                self.scratch.append((name, dtype))
                self.scratch_offsets.append((name, sum(self.scratch_bytes)))
                self.scratch_bytes.append(-(-nbytes // 128) * 128)
        self.workspace_bytes = sum(self.scratch_bytes)
        scratch_names = frozenset(name for name, _ in self.scratch)
        self.launchers = [_Launcher(launch, scratch_names) for launch in plan.launches]
        # Fast launches of every launcher, per specialization key, once all exist.
        self.fast: dict[tuple, list] = {}
        # The inputs the launches read or take a dtype from, in order of first use.
        used = [
            arg.name if isinstance(arg, RowStride) else arg
            for launch in plan.launches
            for arg in launch.args
            if isinstance(arg, str | RowStride)
        ]
        used += [like for _, _, _, like, _, _, _ in self.allocations if like]
        self.input_names = tuple(dict.fromkeys(name for name in used if name not in plan.buffers))
        self.run = self._generate_run()
        self._run_into = None

    def __call__(self, inputs: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """The results of the plan run on `inputs` (name -> tensor or None)."""
        return self.run(inputs)

    def into(self, inputs: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """As calling it, but a result named in `inputs` is written there instead of a new tensor: a
        contiguous, 16-byte aligned tensor of the result's shape and dtype (checked), e.g. a view of a
        buffer that other GPUs read. Results that start zeroed cannot be given."""
        for name, shape, dtype, like, zero, returned, placeholder in self.allocations:
            given = inputs.get(name)
            if given is None or not returned or placeholder:
                continue
            expected = inputs[like].dtype if like else dtype
            if zero:
                raise ValueError(f"{name}: a result that starts zeroed cannot be given")
            if tuple(given.shape) != tuple(shape) or given.dtype != expected:
                raise ValueError(
                    f"{name}: expected {tuple(shape)} {expected}, got {tuple(given.shape)} {given.dtype}"
                )
            if not given.is_contiguous() or given.data_ptr() % 16 or given.device.type != self.device.type:
                raise ValueError(f"{name}: expected a contiguous, 16-byte aligned tensor on {self.device}")
        if self._run_into is None:
            self._run_into = self._generate_run(into=True)
        return self._run_into(inputs)

    def _generate_run(self, into: bool = False):
        """The per-call path, generated for this executable (`self.run(inputs)`): what a loop over the
        plan's inputs and buffers would do, unrolled, with the plan's shapes and dtypes inline, because
        every interpreted step of it is paid on every eager call. Per input: the layout rule of the module
        docstring, then its part of the specialization key (what Triton specialises a kernel on beyond
        the plan's fixed sizes: dtype, 16-byte alignment and, for inputs read through a row stride, the
        stride's divisibility and whether it is 1). Then the allocations, and the fast launches of the
        key if every launch has one and no profiler hooks Triton; else `_launch_first`. `into`: the
        results named in the inputs are taken from there, the others allocated."""
        constants = [self.device, self, self.fast, _FILL, _triton_knobs().runtime]
        lines = ["def run(inputs):", "    env = {}"]

        def constant(value) -> str:
            constants.append(value)
            return f"c[{len(constants) - 1}]"

        keys = []
        for name in self.input_names:
            index = len(keys)
            keys.append(f"k{index}")
            lines += [
                f"    t = inputs.get({name!r})",
                "    if t is None:",
                f"        k{index} = None",
                "    else:",
            ]
            if name in self.strided:
                lines += [
                    "        if t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1):",
                    "            t = t.contiguous()",
                    "        s = t.stride(0)",
                    f"        k{index} = (t.dtype, t.data_ptr() % 16 == 0, alignment(s),"
                    " s == 1 or s >= 2**31)",
                ]
            else:
                lines += [
                    "        if not t.is_contiguous():",
                    "            t = t.contiguous()",
                    f"        k{index} = (t.dtype, t.data_ptr() % 16 == 0)",
                ]
            lines.append(f"    env[{name!r}] = t")
        results = []
        for name, shape, dtype, like, zero, returned, placeholder in self.allocations:
            variable = f"b{len(results)}" if returned else "b"
            alloc = "zeros" if zero else "empty"
            dtype_code = f"env[{like!r}].dtype" if like else constant(dtype)
            if placeholder:
                lines += [
                    f"    {variable} = empty({constant(shape)}, dtype={dtype_code}, device=c[0])"
                    " if c[3].active else None",
                    f"    env[{name!r}] = None",
                ]
            else:
                allocation = f"{alloc}({constant(shape)}, dtype={dtype_code}, device=c[0])"
                if into and returned:
                    lines += [
                        f"    {variable} = inputs.get({name!r})",
                        f"    if {variable} is None:",
                        f"        {variable} = {allocation}",
                    ]
                else:
                    lines.append(f"    {variable} = {allocation}")
                lines.append(f"    env[{name!r}] = {variable}")
            if returned:
                results.append(variable)
        returned = f"({', '.join(results)},)" if results else "()"
        if self.launchers:
            lines += [
                f"    key = ({', '.join(keys)},)",
                "    fast = c[2].get(key)",
                "    hooks = c[4]",
                "    if fast is None or hooked(hooks.launch_enter_hook) or hooked(hooks.launch_exit_hook):",
                f"        return c[1]._launch_first(env, key, {returned})",
            ]
            if self.scratch:  # the workspace stays referenced until the launches are queued
                uint8 = constant(torch.uint8)
                lines += [
                    f"    workspace = empty({self.workspace_bytes}, dtype={uint8}, device=c[0])",
                    "    base = workspace.data_ptr()",
                ]
                lines += [f"    env[{name!r}] = base + {offset}" for name, offset in self.scratch_offsets]
            lines.append("    c[1]._launch_on_device(fast, env)")
        lines.append(f"    return {returned}")
        namespace = {
            "c": constants,
            "empty": torch.empty,
            "zeros": torch.zeros,
            "alignment": alignment,
            "hooked": _hooked,
        }
        source = "\n".join(lines) + "\n"
        exec(compile(source, f"<moetriton run {'/'.join(self.plan.results)}>", "exec"), namespace)
        return namespace["run"]

    def _launch_first(self, env: dict, key: tuple, results: tuple) -> tuple:
        """Launches through Triton's JIT (a specialization's first call, the interpreter, a hooked
        profiler), with scratch buffers as tensor views of one workspace; records the key's fast launches
        once every launch has one."""
        device = self.device
        if INTERPRETER:
            problem = interpreter_problem()
            if problem:
                raise RuntimeError(problem)
        if self.scratch:
            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
            for (name, dtype), part in zip(
                self.scratch, workspace.split_with_sizes(self.scratch_bytes), strict=True
            ):
                # Kernels see only the data pointer and dtype: a flat view of the part is all they need.
                env[name] = part if dtype == torch.uint8 else part.view(dtype)
        dummy = _dummy(device)
        if self.cuda:
            self._launch_on_device(self.launchers, env, dummy, key)
            if all(key in launcher.fast for launcher in self.launchers):
                self.fast[key] = [launcher.fast[key] for launcher in self.launchers]
        else:
            for launcher in self.launchers:
                launcher(env, dummy, key, None)
        return results

    def _launch_on_device(self, launches: list, *arguments) -> None:
        """Calls every launch with `arguments` and the current stream of this executable's CUDA device,
        that device made current for the calls."""
        index = self.device.index
        current = torch.cuda.current_device()
        if index is not None and index != current:
            with torch.cuda.device(index):
                self._launch_on_device(launches, *arguments)
            return
        stream = _driver().active.get_current_stream(current)
        for launch in launches:
            launch(*arguments, stream)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@functools.cache
def _dummy(device: torch.device) -> torch.Tensor:
    """The argument passed for an absent optional input (its kernel never reads it)."""
    return torch.empty(0, dtype=torch.int32, device=device)


@functools.cache
def _driver():
    from triton.runtime import driver

    return driver


@functools.cache
def _triton_knobs():
    from triton import knobs

    return knobs


def _options(launch) -> dict:
    """Triton's launch options of a launch: warps, stages, fp fusion, programmatic dependent launch."""
    options = dict(
        num_warps=launch.num_warps, num_stages=launch.num_stages, enable_fp_fusion=launch.fp_fusion
    )
    if launch.pdl:
        options["launch_pdl"] = True
    return options


def _row_stride(tensor: torch.Tensor) -> int:
    return tensor.stride(0)


def _arranged(tensor: torch.Tensor, strided: bool) -> torch.Tensor:
    """The layout rule: a 2-D input read through a row stride stays as it is when its columns are unit
    stride; everything else is made contiguous."""
    if strided and tensor.dim() == 2 and (tensor.stride(1) == 1 or tensor.shape[1] <= 1):
        return tensor
    return tensor.contiguous()


def run_plan(
    plan: Plan, inputs: dict[str, torch.Tensor | None], device: torch.device
) -> tuple[torch.Tensor | None, ...]:
    """Runs `plan` on `inputs` (name -> tensor or None; an input the plan reads but `inputs` lacks counts
    as None) on `device` and returns its results: the plain executor (module docstring). Placeholder
    results come back as None, or as size-0 tensors within `filling_placeholders`.

    Example (token 0 listed at row 1, token 1 at row 0):
        >>> from moetriton.kernels import combine_plan
        >>> plan = combine_plan(num_tokens=2, hidden=4, num_slots=1, num_rows=2, element_bytes=4,
        ...                     has_weights=False, gather_probs=False)
        >>> row_map = torch.tensor([[1, 0, 1, 2], [0, 0, 1, 2]], dtype=torch.int32)
        >>> inputs = dict(inp=torch.eye(2, 4), row_id_map=row_map, weights=None, permuted_probs=None)
        >>> run_plan(plan, inputs, torch.device("cpu"))[0][0].tolist()
        [0.0, 1.0, 0.0, 0.0]
    """
    if INTERPRETER and interpreter_problem():
        raise RuntimeError(interpreter_problem())
    strided = strided_inputs(plan)
    env = dict.fromkeys(arg for launch in plan.launches for arg in launch.args if isinstance(arg, str))
    env.update(
        (name, None if tensor is None else _arranged(tensor, name in strided))
        for name, tensor in inputs.items()
    )
    for name, spec in plan.buffers.items():
        alloc = torch.zeros if spec.zero else torch.empty
        # A placeholder is None (kernels get the dummy pointer), or its size-0 tensor for a custom op.
        skipped = spec.placeholder and not _FILL.active
        env[name] = None if skipped else alloc(spec.shape, dtype=_buffer_dtype(spec, env), device=device)
    dummy = _dummy(device)
    context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with context:
        for launch in plan.launches:
            args, strides = launch_arguments(launch, env, dummy, _row_stride)
            args += [dummy if env[name] is None else env[name] for name in launch.outputs]
            launch.kernel[launch.grid](*args, **launch.constexprs, **strides, **_options(launch))
    return tuple(env[name] for name in plan.results)


@functools.lru_cache(maxsize=1024)
def _bound(builder, device: torch.device, sizes: tuple) -> Executable:
    sizes = dict(sizes)
    if tuned_per_device(builder):
        sizes["device"] = device_info(device)
    return Executable(builder(**sizes), device)


def bound(builder, device: torch.device, **sizes) -> Executable:
    """The Executable of `builder(**sizes)` (a plan builder of moetriton.kernels) on `device`: the plan, the
    device's info and the executable found in one lookup per call signature (an op's eager hot path)."""
    return _bound(builder, device, tuple(sizes.items()))
