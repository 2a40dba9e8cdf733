"""Framework-neutral launch plans.

A plan says everything a binding needs to run an op: which buffers to allocate (shape, dtype, whether they
must start zeroed) and which kernels to launch, in order, with their grids, arguments and compile options.
The PyTorch and JAX bindings each have one small executor that turns a plan into allocations and launches;
neither ever computes a grid or a block size itself.

Argument convention of every kernel: input pointers and scalars first (in `Launch.args` order), then output
pointers (`Launch.outputs`), then constexprs. This is the order jax-triton passes arguments in.

Memory layout. Kernels read every input as a dense row-major array, except where a launch names a
`RowStride` argument: that input is read row by row through the given stride (its columns must be unit
stride). Executors decide the rest in one place: an input a kernel takes strided is passed as it is when its
columns are unit stride, and every other input is made contiguous first. Outputs are always allocated dense.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar


@dataclass(frozen=True)
class Buffer:
    """A buffer a plan allocates.

    `dtype` is a numpy-style name ("int32", "float32") or "like:<input>" for the dtype of a named input.
    `zero` asks for zero-initialised memory; plans use it only where a kernel does not write every element.
    `placeholder` marks a result the op does not produce under the plan's options (probs without probs,
    indices nobody asked for): a size-0 stand-in that no kernel touches, there only because an op's
    signature has a fixed number of results. Executors that can return None for it skip the allocation.
    """

    shape: tuple[int, ...]
    dtype: str
    zero: bool = False
    placeholder: bool = False

    @classmethod
    def absent(cls, dtype: str, shape: tuple[int, ...] = (0,)) -> Buffer:
        """The placeholder of a result the plan's options leave out (see `placeholder`)."""
        return cls(shape, dtype, placeholder=True)

    @property
    def like(self) -> str | None:
        """The input whose dtype this buffer takes ("like:<input>"), or None for a fixed dtype: the one
        reading of `dtype` both executors use."""
        return self.dtype.removeprefix("like:") if self.dtype.startswith("like:") else None


@dataclass(frozen=True)
class RowStride:
    """A launch argument resolved by the executor: the row stride, in elements, of the 2-D input `name`,
    which the kernel then reads through that stride (so row-sliced views are never copied). The executor also
    sets the constexpr `align` to `alignment(stride)`, the divisibility the kernel may assume (jax-triton,
    unlike PyTorch's launcher, does not tell Triton which integers are multiples of 16)."""

    name: str
    align: str


@dataclass(frozen=True)
class Launch:
    """One kernel launch. `args` holds input/buffer names (str), scalar ints and row strides of inputs
    (`RowStride`), in kernel order."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[str | int | RowStride, ...]
    outputs: tuple[str, ...]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1
    # Combine-style kernels turn fused multiply-add off so results equal a plain fp32 reference bit for bit.
    fp_fusion: bool = True
    # Launch with programmatic dependent launch (Hopper and newer, PyTorch only): the kernel may start while
    # the previous launch drains, and waits (`tl.extra.cuda.gdc_wait`) before it reads that launch's outputs.
    pdl: bool = False

    @property
    def num_programs(self) -> int:
        return math.prod(self.grid)


@dataclass(frozen=True)
class Plan:
    """Buffers plus the launches that fill them. `results` names what the op returns, in order."""

    buffers: dict[str, Buffer]
    launches: tuple[Launch, ...]
    results: tuple[str, ...]


_Builder = TypeVar("_Builder", bound=Callable[..., Any])


def cached(builder: _Builder) -> _Builder:
    """Builds each plan once per signature: a plan builder (keyword arguments only: sizes, dtypes' widths,
    options, a DeviceInfo) answers repeated calls from a cache, so the host pays for grids, tiles and the
    autotune lookup once, and executors may keep per-plan state (compiled-kernel launchers) keyed by the
    plan object. Calls with an explicit `config` (tests, the autotuner) and calls with unhashable or
    symbolic arguments are built afresh."""
    memo = functools.lru_cache(maxsize=1024)(builder)

    @functools.wraps(builder)
    def plan(**kwargs):
        if kwargs.get("config") is not None:
            return builder(**kwargs)
        try:
            hash(tuple(kwargs.values()))
        except TypeError:  # an unhashable argument (e.g. a symbolic size): no caching
            return builder(**kwargs)
        return memo(**kwargs)

    return plan  # type: ignore[return-value]


@dataclass(frozen=True)
class Sizes:
    """Which arguments of a plan builder its input arrays give, as data: what every binding derives from the
    arrays it holds (torch tensors, JAX arrays or tracers, or their fakes; anything with `.shape` and
    `.dtype.itemsize`), so no op computes its plan's sizes itself.

    `axes` maps an argument to (input, axis) or (input, axis, convert): that axis's length, passed through
    `convert` when given, or None when the input is absent. `present` maps an argument to the input whose
    presence it states. `element_bytes` names the input whose element size in bytes is the builder's
    `element_bytes`. `dtypes` maps an argument to the input whose dtype name it is (absent: the builder's
    default applies). The builder's other arguments are the op's options."""

    axes: Mapping[str, tuple] = field(default_factory=dict)
    present: Mapping[str, str] = field(default_factory=dict)
    element_bytes: str | None = None
    dtypes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The declaration flattened once: `key` runs on every eager call of a PyTorch op.
        axes = tuple((argument, *spec, None)[:4] for argument, spec in self.axes.items())
        object.__setattr__(self, "_axes", tuple((name, axis) for _, name, axis, _ in axes))
        object.__setattr__(self, "_present", tuple(self.present.values()))
        object.__setattr__(self, "_dtypes", tuple(self.dtypes.values()))
        # How `of` turns a key into the arguments, entry by entry.
        argument_of_key = [(argument, convert) for argument, _, _, convert in axes]
        argument_of_key += [(argument, None) for argument in self.present]
        argument_of_key += [("element_bytes", _itemsize)] if self.element_bytes is not None else []
        argument_of_key += [(argument, _DTYPE) for argument in self.dtypes]
        object.__setattr__(self, "_arguments", tuple(argument_of_key))

    def key(self, arrays: Mapping[str, Any]) -> tuple:
        """What the declared arguments' values for `arrays` (input name -> array or None) are a function of,
        as a tuple: the axis lengths before any `convert`, the inputs' presence, and the dtypes themselves
        (None for an absent input). Equal keys give equal `of`, so a binding may look up what it built
        from a plan by the key instead of building the arguments on every call."""
        get = arrays.get
        key = []
        for name, axis in self._axes:
            array = get(name)
            key.append(None if array is None else array.shape[axis])
        for name in self._present:
            key.append(get(name) is not None)
        if self.element_bytes is not None:
            key.append(arrays[self.element_bytes].dtype)
        for name in self._dtypes:
            array = get(name)
            key.append(None if array is None else array.dtype)
        return tuple(key)

    def of(self, arrays: Mapping[str, Any], dtype_name: Callable[[Any], str]) -> dict[str, Any]:
        """The declared arguments' values for `arrays` (input name -> array or None); `dtype_name` is the
        binding's name of a dtype ("float32")."""
        return self.of_key(self.key(arrays), dtype_name)

    def of_key(self, key: tuple, dtype_name: Callable[[Any], str]) -> dict[str, Any]:
        """The declared arguments' values for arrays of `key` (see `key`)."""
        sizes: dict[str, Any] = {}
        for (argument, convert), value in zip(self._arguments, key, strict=True):
            if convert is _DTYPE:
                if value is not None:  # an absent input's dtype: the builder's default applies
                    sizes[argument] = dtype_name(value)
            elif convert is None or value is None:
                sizes[argument] = value
            else:
                sizes[argument] = convert(value)
        return sizes


#: `Sizes.of_key`'s mark of a dtype argument.
_DTYPE = object()


def _itemsize(dtype: Any) -> int:
    return dtype.itemsize


def sized_by(sizes: Sizes) -> Callable[[_Builder], _Builder]:
    """Declares, on a plan builder, which of its arguments its input arrays give (see `Sizes`); bindings
    read it through `plan_sizes`."""

    def declare(builder: _Builder) -> _Builder:
        builder.sizes = sizes  # type: ignore[attr-defined]
        return builder

    return declare


def plan_sizes(
    builder: Callable[..., Any], arrays: Mapping[str, Any], dtype_name: Callable[[Any], str]
) -> dict[str, Any]:
    """The arguments of `builder` that its input `arrays` give (its `sized_by` declaration)."""
    return builder.sizes.of(arrays, dtype_name)


@functools.cache
def tuned_per_device(builder: Callable[..., Any]) -> bool:
    """Whether a plan builder takes the device's info (`device`: plans tuned per device), which the
    executors then pass it."""
    return "device" in inspect.signature(builder).parameters


def next_pow2(value: int) -> int:
    """Smallest power of two >= value (1 for value <= 1)."""
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def alignment(size: int) -> int:
    """The largest power of two up to 16 that divides `size` (16 for 0): what a kernel may assume about an
    integer argument (16 is the divisibility PyTorch's launcher infers, so both frameworks compile the same
    code)."""
    return math.gcd(size, 16)


def launch_arguments(
    launch: Launch, env: Mapping[str, Any], dummy: Any, row_stride: Callable[[Any], int]
) -> tuple[list, dict[str, int]]:
    """The arguments of `launch.args` in kernel order, taken from `env` (name -> array or None; None passes
    `dummy`), and the constexprs its row strides set: every executor's walk over a launch's arguments.
    `row_stride(array)` is the row stride of an input in the executor's framework."""
    args, strides = [], {}
    for arg in launch.args:
        if isinstance(arg, RowStride):
            stride = row_stride(env[arg.name])
            strides[arg.align] = alignment(stride)
            args.append(stride)
        elif isinstance(arg, str):
            args.append(dummy if env[arg] is None else env[arg])
        else:
            args.append(arg)
    return args, strides


def strided_inputs(plan: Plan) -> frozenset[str]:
    """Names of the inputs that some launch of `plan` reads through a row stride."""
    return frozenset(
        arg.name for launch in plan.launches for arg in launch.args if isinstance(arg, RowStride)
    )


@dataclass(frozen=True)
class SearchSpace:
    """Tunable parameters of one kernel and their candidate values.

    Plans take a config (a dict of these parameters); `default` validates the heuristic's choice, so every
    config a plan can use is a member of the space, and tests and the autotuner enumerate `configs()`.
    """

    kernel: str
    params: dict[str, tuple[int, ...]]

    def configs(self) -> list[dict[str, int]]:
        names = list(self.params)
        return [dict(zip(names, values, strict=True)) for values in itertools.product(*self.params.values())]

    def default(self, **choice: int) -> dict[str, int]:
        for name, value in choice.items():
            if value not in self.params[name]:
                raise ValueError(f"{self.kernel}: heuristic {name}={value} is outside the search space")
        return choice


@dataclass(frozen=True)
class DeviceInfo:
    """What plans may know about the device: a cache key, the multiprocessor count, whether launches may
    use programmatic dependent launch (a Hopper-or-newer GPU driven by an executor that supports it), and
    the architecture ("sm_90"), by which a GPU without an autotune cache of its own borrows another's."""

    name: str = "cpu"
    num_sms: int = 4
    pdl: bool = False
    arch: str = "cpu"


#: Plans made without device information (CPU, the interpreter, tests) use this.
DEFAULT_DEVICE = DeviceInfo()
