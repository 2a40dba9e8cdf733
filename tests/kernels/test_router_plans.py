"""Router launch plans: every tile configuration gives the same results, and the grids are what the
docstrings say (run through the PyTorch plan executor, interpreted on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from moetriton.kernels import router as plans
from moetriton.torch._launch import run_plan

DEVICE = os.environ.get("MOETRITON_TEST_DEVICE", "cpu")
CONFIGS = [dict(block_t=b, num_warps=w) for b in (1, 2, 8, 32) for w in (1, 4)]


@pytest.mark.parametrize(
    ("num_experts", "topk", "score_function", "num_groups", "group_topk"),
    [(6, 2, "softmax", 0, 0), (12, 4, "sigmoid", 3, 2), (40, 5, "sqrtsoftplus", 0, 0)],
)
def test_topk_configs_agree(num_experts, topk, score_function, num_groups, group_topk):
    generator = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(13, num_experts, generator=generator).to(DEVICE)
    grad = torch.randn(13, num_experts, generator=generator).to(DEVICE)
    common = dict(num_tokens=13, num_experts=num_experts, topk=topk, score_function=score_function)
    forward = dict(
        common,
        use_pre_softmax=False,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=1.0,
        has_bias=False,
        return_indices=True,
    )
    backward = dict(common, use_pre_softmax=False, scaling_factor=1.0)
    expected = run_plan(plans.topk_plan(**forward), dict(logits=logits, bias=None), logits.device)
    inputs = dict(grad_probs=grad, logits=logits, routing_map=expected[1])
    expected_grad = run_plan(plans.topk_backward_plan(**backward), inputs, logits.device)
    for config in CONFIGS:
        plan = plans.topk_plan(**forward, **config)
        assert plan.launches[0].grid == (-(-13 // config["block_t"]),)
        for actual, want in zip(
            run_plan(plan, dict(logits=logits, bias=None), logits.device), expected, strict=True
        ):
            assert torch.equal(actual, want)
        grad_logits = run_plan(plans.topk_backward_plan(**backward, **config), inputs, logits.device)
        assert torch.equal(grad_logits[0], expected_grad[0])


def test_aux_loss_grid_depends_on_shape_only():
    common = dict(num_cols=8, num_experts=8, topk=2, coeff=1.0, total=None)
    assert plans.aux_loss_plan(num_rows=0, **common).launches[0].grid == (1,)
    assert plans.aux_loss_plan(num_rows=10**6, **common).launches[0].grid == (512,)
    probs = torch.rand(1000, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    counts = torch.arange(8, device=DEVICE)
    plan = plans.aux_loss_plan(num_rows=1000, **common)
    (loss,) = run_plan(
        plan, dict(probs=probs, counts=counts, total=torch.tensor(1000, device=DEVICE)), probs.device
    )
    expected = (probs.double().sum(0) * counts).sum() * 8 / 2 / 1000**2
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_empty_plans_launch_nothing():
    forward = plans.topk_plan(
        num_tokens=0,
        num_experts=4,
        topk=2,
        score_function="softmax",
        use_pre_softmax=False,
        num_groups=0,
        group_topk=0,
        scaling_factor=1.0,
        has_bias=False,
        return_indices=True,
    )
    assert forward.launches == () and forward.buffers["indices"].shape == (0, 2)
    assert plans.aux_scores_plan(num_tokens=0, num_experts=4, topk=2, score_function="sigmoid").launches == ()
