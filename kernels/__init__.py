"""Triton kernels for MoE token routing and their framework-neutral launch plans.

Imports triton and the standard library only; importing touches no GPU. Set TRITON_INTERPRET=1 before
importing to run the kernels under the Triton interpreter on CPU.
"""

from triton.runtime.interpreter import InterpretedFunction

from ._plan import Buffer, DeviceInfo, Launch, Plan, cdiv, next_pow2
from .chunk_sort import sort_chunks_plan
from .permutation import (
    _dispatch_kernel,
    buffer_rows,
    combine_backward_plan,
    combine_plan,
    dispatch_plan,
    row_map_plan,
    scatter_plan,
)

#: True when TRITON_INTERPRET=1 was set before this package was imported: kernels then run on CPU arrays.
INTERPRETER: bool = isinstance(_dispatch_kernel, InterpretedFunction)

__all__ = [
    "INTERPRETER",
    "Buffer",
    "DeviceInfo",
    "Launch",
    "Plan",
    "buffer_rows",
    "cdiv",
    "combine_backward_plan",
    "combine_plan",
    "dispatch_plan",
    "next_pow2",
    "row_map_plan",
    "scatter_plan",
    "sort_chunks_plan",
]
