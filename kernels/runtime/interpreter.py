"""Whether kernels run under the Triton interpreter, and whether this process's interpreter can run them.

Triton 3.6's interpreter holds a kernel's integer scalars as one-element arrays and turns loop bounds into
Python ints with int(array); NumPy 2.4 removed that conversion for arrays that are not 0-d, so there every
kernel with a loop over a runtime bound fails (Triton 3.9 squeezes the array first). A one-program probe
kernel with such a loop tells which case this process is in, so that callers get a clear error instead.
"""

from __future__ import annotations

import functools
import importlib.metadata

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _count_to_kernel(limit, out_ptr):
    """Grid (1,): counts to `limit` in a loop whose bound is a runtime scalar, as moetriton's kernels do."""
    total = 0
    for _ in range(0, limit):
        total += 1
    tl.store(out_ptr, total)


#: True when TRITON_INTERPRET=1 was set before moetriton.kernels was imported: kernels then run on CPU arrays.
INTERPRETER: bool = isinstance(_count_to_kernel, InterpretedFunction)


@functools.cache
def interpreter_problem() -> str | None:
    """None when kernels are compiled, or interpreted by an interpreter that can run them; else the reason
    they cannot run (an error message naming the versions and the ways out)."""
    if not INTERPRETER:
        return None
    import numpy as np  # a dependency of Triton's interpreter itself

    out = np.zeros(1, np.int32)
    try:
        _count_to_kernel[(1,)](2, HostArray(out))
    except Exception as error:  # whatever the interpreter raises is the answer
        numpy_version = importlib.metadata.version("numpy")
        return (
            f"moetriton: the Triton {triton.__version__} interpreter (TRITON_INTERPRET=1) failed a probe "
            f"kernel that loops over a runtime bound ({error!r}), so it cannot run moetriton's kernels. "
            f"Triton 3.6's interpreter fails this way under NumPy >= 2.4 (here {numpy_version}): use "
            "Triton 3.9 or NumPy < 2.4, or unset TRITON_INTERPRET to use the pure-framework reference."
        )
    if int(out[0]) != 2:
        return f"moetriton: Triton {triton.__version__}'s interpreter miscounted a loop ({int(out[0])} != 2)"
    return None


# The Triton interpreter's names for the numpy dtypes moetriton moves.
_TRITON_DTYPES = {
    "bool": tl.int1,
    "uint8": tl.uint8,
    "int8": tl.int8,
    "int16": tl.int16,
    "int32": tl.int32,
    "int64": tl.int64,
    "float16": tl.float16,
    "bfloat16": tl.bfloat16,
    "float32": tl.float32,
    "float64": tl.float64,
    "float8_e4m3fn": tl.float8e4nv,
    "float8_e5m2": tl.float8e5,
}


class HostArray:
    """The slice of torch.Tensor's interface the Triton interpreter touches, over a numpy buffer, so that
    kernels can be interpreted without torch (the JAX executor and the probe above use it)."""

    def __init__(self, array):
        self.array = array
        self.dtype = _TRITON_DTYPES[array.dtype.name]

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> HostArray:
        return self

    def cpu(self) -> HostArray:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self, *dims):
        strides = tuple(s // self.array.itemsize for s in self.array.strides)
        return strides[dims[0]] if dims else strides

    def new_empty(self, *args, **kwargs) -> HostArray:
        return self

    def set_(self, *args, **kwargs) -> HostArray:
        return self

    def copy_(self, other) -> HostArray:
        return self


@functools.cache
def say_reference_fallback(framework: str) -> None:
    """Warns once per process and framework that ops run the pure-`framework` reference: no GPU, and the
    interpreter off (TRITON_INTERPRET=1 must be set before moetriton is imported to run the kernels)."""
    import warnings

    warnings.warn(
        f"moetriton: no GPU and TRITON_INTERPRET unset: ops run the pure-{framework} reference. Set "
        "TRITON_INTERPRET=1 before importing moetriton to run the Triton kernels interpreted instead.",
        stacklevel=4,
    )
