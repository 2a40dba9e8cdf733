"""Router launch plans: every config of the router search spaces gives the same results as the heuristic
(so nothing the autotuner can pick is untested), and the grids are what the docstrings say. Runs the plans
through the PyTorch executor (interpreted on CPU, where num_warps has no effect, so configs that differ only
in warp_elements run once)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moetriton import kernels
from moetriton.kernels import DeviceInfo
from moetriton.torch.executor import run_plan

from ._compile import in_child

DEVICE = os.environ.get("MOETRITON_TEST_DEVICE", "cpu")


def _agree(actual: torch.Tensor, want: torch.Tensor) -> None:
    """Selections (maps, indices) agree exactly; float results to fp32 rounding, since on a GPU the order
    of a reduction depends on the tile shape."""
    if actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(actual, want)


def _configs(space) -> list[dict]:
    configs = space.configs()
    if DEVICE == "cpu":
        configs = list({config["tile"]: config for config in configs}.values())
    return configs


@pytest.mark.parametrize(
    ("num_experts", "topk", "score_function", "num_groups", "group_topk"),
    [(6, 2, "softmax", 0, 0), (12, 4, "sigmoid", 3, 2), (40, 5, "sqrtsoftplus", 0, 0)],
)
def test_every_topk_config_agrees(num_experts, topk, score_function, num_groups, group_topk):
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
    inputs = dict(logits=logits, bias=None)
    expected = run_plan(kernels.topk_plan(**forward), inputs, logits.device)
    grad_inputs = dict(grad_probs=grad, logits=logits, routing_map=expected[1])
    expected_grad = run_plan(kernels.topk_backward_plan(**backward), grad_inputs, logits.device)
    for config in _configs(kernels.SEARCH_SPACES["router_topk"]):
        plan = kernels.topk_plan(**forward, config=config)
        block_t = plan.launches[0].constexprs["BLOCK_T"]
        assert plan.launches[0].grid == (-(-13 // block_t),)
        for actual, want in zip(run_plan(plan, inputs, logits.device), expected, strict=True):
            _agree(actual, want)
    for config in _configs(kernels.SEARCH_SPACES["router_topk_backward"]):
        grad_logits = run_plan(
            kernels.topk_backward_plan(**backward, config=config), grad_inputs, logits.device
        )
        _agree(grad_logits[0], expected_grad[0])
    # Replaying the selection gives the same results at every config.
    replay_inputs = dict(inputs, routing_indices=expected[2].flip(-1).long())
    replayed = run_plan(kernels.topk_plan(**forward, replay=True), replay_inputs, logits.device)
    assert torch.equal(replayed[1], expected[1]) and torch.equal(replayed[2], expected[2].flip(-1))
    for config in _configs(kernels.SEARCH_SPACES["router_topk"]):
        plan = kernels.topk_plan(**forward, replay=True, config=config)
        for actual, want in zip(run_plan(plan, replay_inputs, logits.device), replayed, strict=True):
            _agree(actual, want)


@pytest.mark.parametrize("score_function", ["softmax", "sqrtsoftplus"])
def test_every_aux_scores_config_agrees(score_function):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(13, 20, generator=generator).to(DEVICE)
    grad = torch.randn(13, 20, generator=generator).to(DEVICE)
    args = dict(num_tokens=13, num_experts=20, score_function=score_function)
    expected = run_plan(kernels.aux_scores_plan(**args, topk=3), dict(logits=logits), logits.device)
    grad_inputs = dict(grad_scores=grad, logits=logits)
    expected_grad = run_plan(kernels.aux_scores_backward_plan(**args), grad_inputs, logits.device)
    for config in _configs(kernels.SEARCH_SPACES["router_aux_scores"]):
        got = run_plan(
            kernels.aux_scores_plan(**args, topk=3, config=config), dict(logits=logits), logits.device
        )
        for a, b in zip(got, expected, strict=True):
            _agree(a, b)
    for config in _configs(kernels.SEARCH_SPACES["router_aux_scores_backward"]):
        got = run_plan(kernels.aux_scores_backward_plan(**args, config=config), grad_inputs, logits.device)
        _agree(got[0], expected_grad[0])


def test_heuristic_tiles():
    """About 1024 elements per program and 8 per thread; one row for wide rows; four programs per SM."""
    h100 = DeviceInfo("H100", 132)

    def launch(num_tokens, num_experts):
        plan = kernels.topk_backward_plan(
            num_tokens=num_tokens,
            num_experts=num_experts,
            topk=2,
            score_function="softmax",
            use_pre_softmax=False,
            scaling_factor=1.0,
            device=h100,
        )
        return plan.launches[0].constexprs["BLOCK_T"], plan.launches[0].num_warps

    assert launch(16384, 256) == (4, 4)
    assert launch(16384, 2048) == (1, 8)
    assert launch(16384, 8) == (32, 1)  # 16384 tokens over 4 * 132 programs
    assert launch(100, 64) == (1, 1)


def test_aux_loss_grid_depends_on_shape_only():
    common = dict(num_cols=8, num_experts=8, topk=2, coeff=1.0, total=None)
    assert kernels.aux_loss_plan(num_rows=0, **common).launches[0].grid == (1,)
    assert kernels.aux_loss_plan(num_rows=10**6, **common).launches[0].grid == (512,)
    probs = torch.rand(1000, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    counts = torch.arange(8, device=DEVICE)
    plan = kernels.aux_loss_plan(num_rows=1000, **common)
    (loss,) = run_plan(
        plan, dict(probs=probs, counts=counts, total=torch.tensor(1000, device=DEVICE)), probs.device
    )
    expected = (probs.double().sum(0) * counts).sum() * 8 / 2 / 1000**2
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_empty_plans_launch_nothing():
    forward = kernels.topk_plan(
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
    assert (
        kernels.aux_scores_plan(num_tokens=0, num_experts=4, topk=2, score_function="sigmoid").launches == ()
    )


# The top-k kernels' constexpr variants at DeepSeek-V3's, DeepSeek-V2's, ERNIE-4.5's and Qwen3-MoE's sizes:
# score function, pre-softmax, renormalisation, groups and group score, bias, indices.
_VARIANT_FIELDS = (
    "num_experts",
    "topk",
    "score_function",
    "use_pre_softmax",
    "normalize_topk",
    "num_groups",
    "group_topk",
    "group_score",
    "has_bias",
    "return_indices",
)
_TOPK_VARIANTS = [
    dict(zip(_VARIANT_FIELDS, values, strict=True))
    for values in [
        (256, 8, "sigmoid", False, True, 8, 4, "top2_sum", True, True),
        (256, 8, "sigmoid", False, False, 8, 4, "topk_sum", True, False),
        (160, 6, "softmax", True, False, 8, 3, "max", False, True),
        (128, 8, "softmax", True, True, 0, 0, "topk_sum", True, True),
        (64, 1, "sqrtsoftplus", False, True, 0, 0, "topk_sum", False, True),
        (64, 4, "softmax", False, None, 0, 0, "topk_sum", False, False),
    ]
]


# Replay variants (routing_indices given): grouped and ungrouped layouts, int32 and int64 ids, with and
# without indices.
_REPLAY_VARIANTS = [
    (dict(_TOPK_VARIANTS[0], replay=True), "*i64"),
    (dict(_TOPK_VARIANTS[3], replay=True), "*i32"),
    (dict(_TOPK_VARIANTS[5], replay=True), "*i64"),
]


def _compile_topk_variants() -> None:
    """Child process: compile the top-k forward and backward kernels for sm_90 at the plans' constexprs of
    every variant, and the forward of every replay variant; print the count as JSON."""
    from moetriton.kernels.router import topk

    from ._compile import compile_sm90

    device = DeviceInfo("Compile GPU", 132, arch="sm_90")
    common = dict(num_tokens=4096, scaling_factor=2.5, device=device)
    backward_options = ("num_experts", "topk", "score_function", "use_pre_softmax", "normalize_topk")
    launches = []  # (launch, the Triton type of its routing_indices_ptr)
    for variant in _TOPK_VARIANTS:
        forward = kernels.topk_plan(**common, **variant)
        backward = kernels.topk_backward_plan(**common, **{name: variant[name] for name in backward_options})
        launches += [(launch, "*i32") for launch in (*forward.launches, *backward.launches)]
    for variant, ids_type in _REPLAY_VARIANTS:
        launches += [(launch, ids_type) for launch in kernels.topk_plan(**common, **variant).launches]
    compiled = 0
    for launch, ids_type in launches:
        if launch.kernel in (topk._topk_forward_kernel, topk._topk_backward_kernel):
            pointers = {name: "*fp32" for name in launch.kernel.arg_names if name.endswith("_ptr")}
            pointers.update(routing_map_ptr="*i1", indices_ptr="*i32", routing_indices_ptr=ids_type)
            compile_sm90(launch.kernel, launch.constexprs, pointers, num_warps=launch.num_warps)
            compiled += 1
    print(json.dumps(compiled))


def test_topk_kernels_compile_for_sm90():
    expected = 2 * len(_TOPK_VARIANTS) + len(_REPLAY_VARIANTS)
    assert in_child("tests.kernels.test_router_plans:_compile_topk_variants") == expected
