"""Tiny transformers MoE models for the tests: each model type's config beside the common small sizes, built
from a local config (no download) with every parameter drawn at random, so biases, gates and norms matter."""

from __future__ import annotations

import torch
import transformers

_COMMON = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MLA = dict(
    num_key_value_heads=4,
    head_dim=None,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)
_GROUPED = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=0,
)
_QWEN = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[]
)

# model type -> its config beside _COMMON: the routing recipes transformers' MoE models cover.
MODELS = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(_QWEN, norm_topk_prob=True)),
    "qwen3_moe-unnormalised": ("qwen3_moe", dict(_QWEN, norm_topk_prob=False)),
    "qwen2_moe-shared": ("qwen2_moe", dict(_QWEN, shared_expert_intermediate_size=24)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("deepseek_v3", dict(_COMMON, **_MLA, **_GROUPED)),
    "deepseek_v2-group-greedy": (
        "deepseek_v2",
        dict(_COMMON, **_MLA, **_GROUPED, topk_method="group_limited_greedy"),
    ),
    # Kimi-style: no renormalisation, and K / topk_group = 4 (a group still scored by its top 2).
    "deepseek_v3-unnormalised-top4": (
        "deepseek_v3",
        dict(_COMMON, **_MLA, **dict(_GROUPED, num_experts_per_tok=4), norm_topk_prob=False),
    ),
    "deepseek_v2-greedy": ("deepseek_v2", dict(_COMMON, **_MLA, **_GROUPED, topk_method="greedy")),
    "glm4_moe": ("glm4_moe", dict(_GROUPED)),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        dict(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_layer_start_index=0,
            moe_num_shared_experts=1,
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention", "full_attention"]),
    ),
    "llama4": (
        "llama4_text",
        dict(
            num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=40, interleave_moe_layer_step=1
        ),
    ),
}


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    model_type, options = MODELS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **options})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():  # biases, router bias, norms: all nonzero, all in play
            parameter.normal_(0.0, 0.3)
    return model.float()
