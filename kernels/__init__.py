"""Triton kernels for MoE token routing and their framework-neutral launch plans.

The tree shows the layers: one module (or package) per kernel family (permutation, chunk_sort, router,
grouped_gemm (bf16 and FP8), quantize (the FP8 copies), activation, and the expert-parallel copies
block_copy and peer_copy: kernels and their launch plans), `_jit` (jit helpers several families share),
`rules/` (argument rules, one module per family, shape arithmetic, the MoE layer's rules and sizes) and
`runtime/` (plans, the executors' shared step, the autotune caches, the interpreter). This package exports
every family the same way: its plan builders and the output shapes its ops' fakes use, by name, and its
search spaces in SEARCH_SPACES; beside them the plan types, the buffer shapes and the interpreter's state.
Rules and runtime modules are imported by their paths. Imports triton and the standard library only;
importing touches no GPU. Set TRITON_INTERPRET=1 before importing to run the kernels under the Triton
interpreter on CPU.
"""

from . import chunk_sort, grouped_gemm, permutation, router
from .activation import activation_backward_plan, activation_plan
from .block_copy import place_blocks_plan, take_blocks_plan
from .chunk_sort import sort_chunks_plan
from .grouped_gemm import grouped_matmul_plan, grouped_matmul_wgrad_plan
from .grouped_gemm.fp8 import fp8_grouped_matmul_plan, fp8_grouped_matmul_wgrad_plan
from .peer_copy import pull_rows_plan, push_rows_plan
from .permutation.combine import combine_backward_plan, combine_plan
from .permutation.dispatch import dispatch_outputs, dispatch_plan, scatter_plan
from .permutation.row_map import expert_count_plan
from .quantize import quantize_plan, quantize_weights_plan
from .router.aux_loss import (
    aux_loss_backward_outputs,
    aux_loss_backward_plan,
    aux_loss_outputs,
    aux_loss_plan,
    aux_scores_backward_plan,
    aux_scores_outputs,
    aux_scores_plan,
)
from .router.bitmap import routing_map_buffer
from .router.scores import grad_logits_outputs
from .router.topk import topk_backward_plan, topk_outputs, topk_plan
from .rules.layout import buffer_rows, row_map_columns, row_map_slots
from .runtime.interpreter import INTERPRETER, interpreter_problem
from .runtime.plan import Buffer, DeviceInfo, Launch, Plan, Sizes

#: Every kernel's search space, by kernel name (the families with tuned kernels).
SEARCH_SPACES = {
    space.kernel: space
    for family in (permutation, chunk_sort, router, grouped_gemm)
    for space in family.SEARCH_SPACES
}

__all__ = [
    "INTERPRETER",
    "SEARCH_SPACES",
    "Buffer",
    "DeviceInfo",
    "Launch",
    "Plan",
    "Sizes",
    "activation_backward_plan",
    "activation_plan",
    "aux_loss_backward_outputs",
    "aux_loss_backward_plan",
    "aux_loss_outputs",
    "aux_loss_plan",
    "aux_scores_backward_plan",
    "aux_scores_outputs",
    "aux_scores_plan",
    "buffer_rows",
    "combine_backward_plan",
    "combine_plan",
    "dispatch_outputs",
    "dispatch_plan",
    "expert_count_plan",
    "fp8_grouped_matmul_plan",
    "fp8_grouped_matmul_wgrad_plan",
    "grad_logits_outputs",
    "grouped_matmul_plan",
    "grouped_matmul_wgrad_plan",
    "interpreter_problem",
    "place_blocks_plan",
    "pull_rows_plan",
    "push_rows_plan",
    "quantize_plan",
    "quantize_weights_plan",
    "routing_map_buffer",
    "row_map_columns",
    "row_map_slots",
    "scatter_plan",
    "sort_chunks_plan",
    "take_blocks_plan",
    "topk_backward_plan",
    "topk_outputs",
    "topk_plan",
]
