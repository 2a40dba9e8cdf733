"""moetriton for PyTorch: token dispatch / combine / chunk sort and the fused router, as torch.library ops,
and the expert-parallel MoE layer built on them (MoELayer, moe).

On CUDA the Triton kernels run compiled; on CPU they run under the Triton interpreter when TRITON_INTERPRET=1
was set before import, and otherwise the pure-PyTorch reference (`moetriton.torch.reference`) runs instead.
"""

from . import reference, reference_moe, reference_router
from .chunk_sort import sort_chunks_by_index
from .fp8 import fp8_grouped_linear, grouped_matmul_fp8, grouped_matmul_fp8_wgrad, quantize, quantize_weights
from .moe import MoELayer, MoEStats, moe, update_expert_bias
from .permutation import token_combine, token_dispatch
from .router import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss, fused_topk_with_score_function
from .te import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)

__all__ = [
    "MoELayer",
    "MoEStats",
    "fp8_grouped_linear",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "grouped_matmul_fp8",
    "grouped_matmul_fp8_wgrad",
    "moe",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
    "quantize",
    "quantize_weights",
    "reference",
    "reference_moe",
    "reference_router",
    "sort_chunks_by_index",
    "token_combine",
    "token_dispatch",
    "update_expert_bias",
]
