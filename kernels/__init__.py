"""Triton kernels for MoE token routing and their framework-neutral launch plans.

The tree shows the layers: one file per kernel family (permutation, chunk_sort, router, grouped_gemm,
activation, exchange, peer_exchange: kernels and their launch plans), `_jit` (jit helpers several families
share), `rules/` (validation, shape arithmetic, the MoE layer's rules and sizes) and `runtime/` (plans,
the autotune caches, the interpreter). This package exports the plan builders, their search spaces and
the plan types; rules and runtime modules are imported by their paths. Imports triton and the standard
library only; importing touches no GPU. Set TRITON_INTERPRET=1 before importing to run the kernels under
the Triton interpreter on CPU.
"""

from . import router
from .activation import activation_backward_plan, activation_plan
from .chunk_sort import SORT_CHUNKS_SPACE, sort_chunks_plan
from .exchange import place_blocks_plan, take_blocks_plan
from .grouped_gemm import (
    GROUPED_MATMUL_SPACE,
    GROUPED_MATMUL_WGRAD_SPACE,
    grouped_matmul_plan,
    grouped_matmul_wgrad_plan,
)
from .peer_exchange import pull_rows_plan, push_rows_plan
from .permutation import (
    COMBINE_BACKWARD_SPACE,
    COMBINE_SPACE,
    DISPATCH_SPACE,
    ROW_MAP_SPACE,
    combine_backward_plan,
    combine_plan,
    dispatch_outputs,
    dispatch_plan,
    expert_count_plan,
    scatter_plan,
)
from .rules.layout import buffer_rows, row_map_columns, row_map_slots
from .runtime.interpreter import INTERPRETER, interpreter_problem
from .runtime.plan import (
    Buffer,
    DeviceInfo,
    Launch,
    Plan,
    RowStride,
    SearchSpace,
    Sizes,
    alignment,
    cdiv,
    next_pow2,
    plan_sizes,
    sized_by,
    strided_inputs,
)

#: Every kernel's search space, by kernel name.
SEARCH_SPACES = {
    space.kernel: space
    for space in (
        ROW_MAP_SPACE,
        DISPATCH_SPACE,
        COMBINE_SPACE,
        COMBINE_BACKWARD_SPACE,
        SORT_CHUNKS_SPACE,
        GROUPED_MATMUL_SPACE,
        GROUPED_MATMUL_WGRAD_SPACE,
        *router.SEARCH_SPACES,
    )
}

__all__ = [
    "INTERPRETER",
    "SEARCH_SPACES",
    "Buffer",
    "DeviceInfo",
    "Launch",
    "Plan",
    "RowStride",
    "SearchSpace",
    "Sizes",
    "activation_backward_plan",
    "activation_plan",
    "alignment",
    "buffer_rows",
    "cdiv",
    "combine_backward_plan",
    "combine_plan",
    "dispatch_outputs",
    "dispatch_plan",
    "expert_count_plan",
    "grouped_matmul_plan",
    "grouped_matmul_wgrad_plan",
    "interpreter_problem",
    "next_pow2",
    "place_blocks_plan",
    "plan_sizes",
    "pull_rows_plan",
    "push_rows_plan",
    "router",
    "row_map_columns",
    "row_map_slots",
    "scatter_plan",
    "sized_by",
    "sort_chunks_plan",
    "strided_inputs",
    "take_blocks_plan",
]
