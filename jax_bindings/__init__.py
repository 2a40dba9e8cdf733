"""moetriton for JAX: MoE token dispatch / combine / chunk sort and the fused router on the moetriton Triton
kernels.

On GPU the kernels run compiled through jax-triton (imported lazily); on CPU they run under the Triton
interpreter (through jax.pure_callback) when TRITON_INTERPRET=1 was set before import, and otherwise the
pure-JAX reference (`moetriton.jax.reference`) runs instead. Every op is differentiable (custom_vjp), works
under jax.jit and jax.vmap, and partitions along the token axis under jax.jit sharding (custom_partitioning
with Shardy rules). `moe` is the expert-parallel MoE layer built on them (docs/moe.md), with
`update_expert_bias` for aux-loss-free balancing; its Flax Linen module lives in `moetriton.jax.moe.flax`,
the only module that imports flax. Never imports torch. See docs/jax.md.
"""

from . import reference, reference_router, te
from .activation import grouped_activation
from .chunk_sort import sort_chunks_by_index
from .fp8 import fp8_grouped_linear, grouped_matmul_fp8, grouped_matmul_fp8_wgrad, quantize, quantize_weights
from .grouped_gemm import grouped_matmul
from .moe import MoEStats, moe, update_expert_bias
from .permutation import token_combine, token_dispatch
from .router import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss, fused_topk_with_score_function

__all__ = [
    "MoEStats",
    "fp8_grouped_linear",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "grouped_activation",
    "grouped_matmul",
    "grouped_matmul_fp8",
    "grouped_matmul_fp8_wgrad",
    "moe",
    "quantize",
    "quantize_weights",
    "reference",
    "reference_router",
    "sort_chunks_by_index",
    "te",
    "token_combine",
    "token_dispatch",
    "update_expert_bias",
]
