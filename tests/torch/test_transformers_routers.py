"""transformers' MoE routers reproduced by fused_topk_with_score_function in fp32.

Each router is transformers' own module (its installed forward is the reference), built from a tiny local
config (no download) with random weights and correction bias. Its router logits go through moetriton's
fused router with the options that express the model's recipe; per token, the selected expert sets agree
and the weights gathered at them agree to fp32 rounding. Random fp32 logits leave no ties. The recipes:
DeepSeek-V3 and GLM-4-MoE (sigmoid, correction bias, groups scored by their top 2 with K / topk_group != 2,
norm_topk_prob both ways, routed_scaling_factor), DeepSeek-V2 (group_limited_greedy: softmax over all E,
groups scored by their best expert, no renormalisation), Qwen3-MoE (softmax over all E, norm_topk_prob
both ways) and ERNIE-4.5-MoE (softmax over all E, selection on softmax + bias, renormalised weights).
"""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

from moetriton.torch import fused_topk_with_score_function  # noqa: E402

HIDDEN = 16
TOKENS = 64
_GROUPED = dict(
    n_routed_experts=16, num_experts_per_tok=6, n_group=4, topk_group=2, routed_scaling_factor=2.5
)

# name -> (model type, router class, config beside HIDDEN, moetriton's options for it).
ROUTERS = {
    "deepseek_v3": (
        "deepseek_v3",
        "DeepseekV3TopkRouter",
        dict(_GROUPED, norm_topk_prob=True),
        dict(
            score_function="sigmoid", num_groups=4, group_topk=2, group_score="top2_sum", normalize_topk=True
        ),
    ),
    "deepseek_v3-unnormalised": (
        "deepseek_v3",
        "DeepseekV3TopkRouter",
        dict(_GROUPED, norm_topk_prob=False),
        dict(
            score_function="sigmoid", num_groups=4, group_topk=2, group_score="top2_sum", normalize_topk=False
        ),
    ),
    "glm4_moe": (
        "glm4_moe",
        "Glm4MoeTopkRouter",
        dict(_GROUPED, norm_topk_prob=True),
        dict(
            score_function="sigmoid", num_groups=4, group_topk=2, group_score="top2_sum", normalize_topk=True
        ),
    ),
    "deepseek_v2-group-greedy": (
        "deepseek_v2",
        "DeepseekV2TopkRouter",
        dict(_GROUPED, topk_method="group_limited_greedy"),
        dict(use_pre_softmax=True, num_groups=4, group_topk=2, group_score="max"),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeTopKRouter",
        dict(num_experts=12, num_experts_per_tok=4, norm_topk_prob=True),
        dict(use_pre_softmax=True, normalize_topk=True),
    ),
    "qwen3_moe-unnormalised": (
        "qwen3_moe",
        "Qwen3MoeTopKRouter",
        dict(num_experts=12, num_experts_per_tok=4, norm_topk_prob=False),
        dict(use_pre_softmax=True, normalize_topk=False),
    ),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        "Ernie4_5_MoeTopKRouter",
        dict(moe_num_experts=12, moe_k=4),
        dict(use_pre_softmax=True, normalize_topk=True),
    ),
}


def _router(name: str) -> tuple[torch.nn.Module, dict]:
    """transformers' router module of `name` with random weights and correction bias (where it has one),
    and moetriton's options for it (the bias and scaling factor included)."""
    model_type, class_name, config_options, options = ROUTERS[name]
    sizes = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4)
    config = transformers.AutoConfig.for_model(model_type, **sizes, **config_options)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(len(name))
    router = getattr(module, class_name)(config).float()
    options = dict(options, scaling_factor=getattr(router, "routed_scaling_factor", None))
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        holder = getattr(router, "moe_statics", router)
        if hasattr(holder, "e_score_correction_bias"):
            holder.e_score_correction_bias.normal_(0.0, 0.3)
            options["expert_bias"] = holder.e_score_correction_bias.detach().reshape(-1).clone()
    return router, options


@pytest.mark.parametrize("name", ROUTERS)
def test_fused_router_reproduces_transformers(name):
    router, options = _router(name)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, indices = router(hidden)
    topk = indices.shape[-1]
    probs, routing_map, ours = fused_topk_with_score_function(
        logits.float(), topk, return_indices=True, **options
    )
    expected = indices.sort(-1).values
    assert torch.equal(ours.long().sort(-1).values, expected), name
    assert bool((routing_map.sum(-1) == topk).all())
    torch.testing.assert_close(
        probs.gather(-1, expected), weights.float().gather(-1, indices.sort(-1).indices), rtol=1e-5, atol=1e-6
    )
