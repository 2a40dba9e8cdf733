"""PyTorch router ops against the pure-torch reference: forward, gradients, ties, non-finite logits, errors.

On CPU the kernels run under the Triton interpreter (tests/conftest.py), so shapes stay small.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given

from moetriton.torch import reference_router as reference
from moetriton.torch.router import (
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

from ..strategies_router import AuxLossProblem, RouterProblem, aux_loss_problems, router_problems

DEVICE = os.environ.get("MOETRITON_TEST_DEVICE", "cpu")
# Kernels and references round fp32 differently in the last bits (sum order, exp); after the cast to the
# output dtype that is at most about one unit in the last place.
RTOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


def _tensor(values: np.ndarray, dtype: str = "float32") -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(DEVICE, getattr(torch, dtype))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: str, *, grad: bool = False) -> None:
    """Close to within the dtype's rounding; gradients (cancellation in y * (g - D)) get an absolute
    tolerance relative to their largest entry, floored for gradients that vanish (a single expert)."""
    rtol = RTOL[dtype] * (10 if grad else 1)
    finite = expected.detach().float().nan_to_num(posinf=0, neginf=0)
    scale = float(finite.abs().max()) if expected.numel() else 0.0
    atol = rtol * max(scale, 1e-2) if grad else 1e-6 * max(scale, 1.0)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def _inputs(problem: RouterProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = _tensor(problem.logits, problem.dtype)
    bias = None if problem.bias is None else _tensor(problem.bias)
    return logits, bias


@given(problem=router_problems())
def test_topk_matches_reference(problem: RouterProblem):
    logits, bias = _inputs(problem)
    mine = logits.clone().requires_grad_(problem.finite)
    theirs = logits.clone().requires_grad_(problem.finite)
    kwargs = dict(problem.topk_kwargs(), expert_bias=bias, return_indices=True)
    probs, routing_map, indices = fused_topk_with_score_function(mine, problem.topk, **kwargs)
    ref_probs, ref_map, ref_indices = reference.fused_topk_with_score_function(theirs, problem.topk, **kwargs)

    assert probs.shape == routing_map.shape == logits.shape and probs.dtype == logits.dtype
    assert indices.shape == (*problem.lead_shape, problem.topk) and indices.dtype == torch.int32
    assert torch.equal(routing_map, ref_map)
    assert torch.equal(indices, ref_indices)
    assert bool((routing_map.sum(-1) == problem.topk).all())
    assert bool((probs[~routing_map] == 0).all())
    _assert_close(probs, ref_probs, problem.dtype)
    if problem.finite and probs.numel():
        cotangent = torch.randn(probs.shape, generator=torch.Generator().manual_seed(0)).to(probs)
        (grad,) = torch.autograd.grad(probs, mine, cotangent)
        (ref_grad,) = torch.autograd.grad(ref_probs, theirs, cotangent)
        _assert_close(grad, ref_grad, problem.dtype, grad=True)


@given(problem=router_problems(groups=False, bias=False))
def test_aux_scores_match_reference(problem: RouterProblem):
    logits, _ = _inputs(problem)
    mine = logits.clone().requires_grad_(problem.finite)
    theirs = logits.clone().requires_grad_(problem.finite)
    routing_map, scores = fused_compute_score_for_moe_aux_loss(mine, problem.topk, problem.score_function)
    ref_map, ref_scores = reference.fused_compute_score_for_moe_aux_loss(
        theirs, problem.topk, problem.score_function
    )
    assert scores.dtype == torch.float32 and scores.shape == routing_map.shape == logits.shape
    assert torch.equal(routing_map, ref_map)
    _assert_close(scores, ref_scores, "float32")
    if problem.finite and scores.numel():
        cotangent = torch.randn(scores.shape, generator=torch.Generator().manual_seed(1)).to(scores)
        (grad,) = torch.autograd.grad(scores, mine, cotangent)
        (ref_grad,) = torch.autograd.grad(ref_scores, theirs, cotangent)
        _assert_close(grad, ref_grad, problem.dtype, grad=True)


@given(problem=aux_loss_problems())
def test_aux_loss_matches_reference(problem: AuxLossProblem):
    probs = _tensor(problem.probs, problem.dtype).requires_grad_(True)
    counts = _tensor(problem.tokens_per_expert, problem.counts_dtype)
    args = (problem.num_experts, problem.topk, problem.coeff)
    expected = reference.fused_moe_aux_loss(probs, counts, problem.total_num_tokens, *args)
    (ref_grad,) = torch.autograd.grad(expected, probs)
    total_tensor = torch.tensor(problem.total_num_tokens, device=DEVICE)
    for total in (problem.total_num_tokens, total_tensor):
        loss = fused_moe_aux_loss(probs, counts, total, *args)
        assert loss.shape == () and loss.dtype == probs.dtype
        _assert_close(loss, expected, problem.dtype)
        # A fixed reduction order: the same bits every run.
        assert torch.equal(loss, fused_moe_aux_loss(probs, counts, total, *args))
        (grad,) = torch.autograd.grad(loss, probs)
        _assert_close(grad, ref_grad, problem.dtype)


@pytest.mark.parametrize("total", [0, 0.5, -3], ids=["zero", "half", "negative"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_aux_loss_of_a_tensor_total_below_one_is_zero(total, dtype):
    """A tensor total_num_tokens below 1 (no tokens: a device count the host never reads) gives a loss of
    exactly 0 and a zero gradient, on every device and in the reference, even with NaN probs; a NaN total
    gives NaN. A Python int below 1 is refused (a static count, free to check)."""
    if total != int(total) and dtype != torch.float32:
        pytest.skip("a fractional total needs a float dtype")
    probs = torch.tensor([[0.5, float("nan")], [0.25, 0.75]], device=DEVICE, requires_grad=True)
    counts = torch.tensor([3, 1], device=DEVICE)
    count = torch.tensor(total, dtype=dtype, device=DEVICE)
    for function in (fused_moe_aux_loss, reference.fused_moe_aux_loss):
        loss = function(probs, counts, count, 2, 1, 1.0)
        (grad,) = torch.autograd.grad(loss, probs)
        assert loss.item() == 0 and not grad.any(), (function, loss, grad)
    nan_total = torch.tensor(float("nan"), device=DEVICE)
    assert fused_moe_aux_loss(probs.detach().nan_to_num(), counts, nan_total, 2, 1, 1.0).isnan()
    with pytest.raises(ValueError, match="total_num_tokens: expected an int in >= 1, got 0"):
        fused_moe_aux_loss(probs, counts, 0, 2, 1, 1.0)


SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
OPTION_GRID = [
    (score_function, pre, groups, bias, scale)
    for score_function in SCORE_FUNCTIONS
    for pre in ((False, True) if score_function == "softmax" else (False,))
    for groups in (None, (4, 2))
    for bias in ((False,) if score_function == "softmax" else (False, True))
    for scale in (None, 2.5)
]


@pytest.mark.parametrize(("score_function", "pre", "groups", "bias", "scale"), OPTION_GRID)
def test_every_option_combination(score_function, pre, groups, bias, scale):
    """Every score function x pre/post softmax x groups x bias x scaling, forward and gradient (bf16 logits
    when scaled, fp32 otherwise), against the reference."""
    dtype = "bfloat16" if scale else "float32"
    generator = torch.Generator().manual_seed(len(OPTION_GRID))
    logits = torch.randn(5, 12, generator=generator).to(DEVICE, getattr(torch, dtype))
    expert_bias = torch.randn(12, generator=generator).to(DEVICE) if bias else None
    num_groups, group_topk = groups or (None, None)
    args = (4, pre, num_groups, group_topk, scale, score_function, expert_bias)
    mine, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    probs, routing_map, indices = fused_topk_with_score_function(mine, *args, return_indices=True)
    expected = reference.fused_topk_with_score_function(theirs, *args, return_indices=True)
    assert torch.equal(routing_map, expected[1]) and torch.equal(indices, expected[2])
    _assert_close(probs, expected[0], dtype)
    cotangent = torch.randn(probs.shape, generator=generator).to(probs)
    (grad,) = torch.autograd.grad(probs, mine, cotangent)
    (ref_grad,) = torch.autograd.grad(expected[0], theirs, cotangent)
    _assert_close(grad, ref_grad, dtype, grad=True)


# The recipes beyond TE's: forced renormalisation (or none), group scores, K = 1, the bias with a softmax
# before the top-k. Bias, scaling and the bitmap alternate over the grid to keep it small.
RECIPE_GRID = [
    (score_function, normalize, groups, topk)
    for score_function in SCORE_FUNCTIONS
    for normalize in (None, True, False)
    for groups in (None, "topk_sum", "top2_sum", "max")
    for topk in (1, 4)
]


@pytest.mark.parametrize(("score_function", "normalize", "group_score", "topk"), RECIPE_GRID)
def test_recipe_options(score_function, normalize, group_score, topk):
    """normalize_topk x group_score x K for sigmoid, sqrtsoftplus and softmax before the top-k, with and
    without bias, scaling and the bitmap: forward (indices, map, probs) and gradient against the reference."""
    case = RECIPE_GRID.index((score_function, normalize, group_score, topk))
    generator = torch.Generator().manual_seed(case)
    logits = torch.randn(5, 12, generator=generator).to(DEVICE)
    kwargs = dict(
        use_pre_softmax=score_function == "softmax",
        score_function=score_function,
        normalize_topk=normalize,
        expert_bias=torch.randn(12, generator=generator).to(DEVICE) if case % 2 else None,
        scaling_factor=2.5 if case % 3 == 0 else None,
        routing_map_format="bitmap" if case % 4 == 1 else "bytemap",
        return_indices=True,
    )
    if group_score:
        kwargs.update(num_groups=4, group_topk=min(2, topk), group_score=group_score)
    mine, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    probs, routing_map, indices = fused_topk_with_score_function(mine, topk, **kwargs)
    expected = reference.fused_topk_with_score_function(theirs, topk, **kwargs)
    assert torch.equal(routing_map, expected[1]) and torch.equal(indices, expected[2])
    _assert_close(probs, expected[0], "float32")
    scale = kwargs["scaling_factor"] or 1.0
    selected_sums = probs.detach().sum(-1) / scale
    if normalize or (normalize is None and score_function != "softmax" and topk > 1):
        torch.testing.assert_close(selected_sums, torch.ones_like(selected_sums))
    else:
        assert not torch.allclose(selected_sums, torch.ones_like(selected_sums))
    cotangent = torch.randn(probs.shape, generator=generator).to(probs)
    (grad,) = torch.autograd.grad(probs, mine, cotangent)
    (ref_grad,) = torch.autograd.grad(expected[0], theirs, cotangent)
    _assert_close(grad, ref_grad, "float32", grad=True)


def test_group_scores_choose_different_groups():
    """One token whose best group differs by group score: "max" picks the group of the single largest
    logit, "top2_sum" the best pair, "topk_sum" with K / group_topk = 3 the best triple (softmax after the
    top-k selects on the logits)."""
    logits = torch.tensor([[5.0, -9.0, -9.0, 3.0, 3.0, -9.0, 2.0, 2.0, 2.0]], device=DEVICE)
    chosen = {}
    for group_score in ("max", "top2_sum", "topk_sum"):
        _, _, indices = fused_topk_with_score_function(
            logits, 3, False, 3, 1, group_score=group_score, return_indices=True
        )
        reference_indices = reference.fused_topk_with_score_function(
            logits, 3, False, 3, 1, group_score=group_score, return_indices=True
        )[2]
        assert torch.equal(indices, reference_indices)
        chosen[group_score] = sorted(indices[0].tolist())
    assert chosen == {"max": [0, 1, 2], "top2_sum": [3, 4, 5], "topk_sum": [6, 7, 8]}


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("use_pre_softmax", [False, True])
def test_ties_go_to_the_lowest_expert(score_function: str, use_pre_softmax: bool):
    equal = torch.zeros(3, 10, device=DEVICE)
    _, routing_map, indices = fused_topk_with_score_function(
        equal, 4, use_pre_softmax, score_function=score_function, return_indices=True
    )
    assert indices.tolist() == [[0, 1, 2, 3]] * 3
    assert routing_map[:, :4].all() and not routing_map[:, 4:].any()
    # Four identical groups: the two lowest groups win, and inside them the lowest index of each value.
    tiled = torch.tensor([[1.0, 2.0, 3.0, 4.0] * 4], device=DEVICE)
    _, _, indices = fused_topk_with_score_function(
        tiled, 4, use_pre_softmax, 4, 2, score_function=score_function, return_indices=True
    )
    assert indices.tolist() == [[3, 7, 2, 6]]
    # -0.0 ties +0.0.
    zeros = torch.tensor([[-1.0, -0.0, 0.0, -2.0]], device=DEVICE)
    _, _, indices = fused_topk_with_score_function(
        zeros, 1, use_pre_softmax, score_function=score_function, return_indices=True
    )
    assert indices.tolist() == [[1]]
    routing_map, _ = fused_compute_score_for_moe_aux_loss(equal, 3, score_function)
    assert routing_map[:, :3].all() and not routing_map[:, 3:].any()


def test_nonfinite_logits_policy():
    nan, inf = math.nan, math.inf
    logits = torch.tensor([[nan, 1.0, nan, 0.5, -inf]], device=DEVICE)
    # NaN ranks below every number, -inf included: chosen only when fewer than K experts are numbers.
    probs, routing_map, indices = fused_topk_with_score_function(logits, 2, return_indices=True)
    assert indices.tolist() == [[1, 3]]
    torch.testing.assert_close(probs[0, [1, 3]], torch.softmax(torch.tensor([1.0, 0.5]), 0).to(DEVICE))
    probs, _, indices = fused_topk_with_score_function(logits, 4, return_indices=True)
    assert indices.tolist() == [[1, 3, 4, 0]]
    # A selected NaN makes the selected probs NaN; probs stay exactly 0 outside the selection.
    assert probs[0, [0, 1, 3, 4]].isnan().all() and probs[0, 2] == 0
    # +inf under sigmoid saturates to 1; under a softmax it makes the row NaN (IEEE, like torch.softmax).
    probs, _ = fused_topk_with_score_function(
        torch.tensor([[inf, 0.0, -inf]], device=DEVICE), 2, score_function="sigmoid"
    )
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0]], device=DEVICE))
    probs, routing_map = fused_topk_with_score_function(
        torch.tensor([[0.0, inf, 1.0]], device=DEVICE), 2, use_pre_softmax=True
    )
    assert routing_map.tolist() == [[True, True, False]] and probs[0, :2].isnan().all() and probs[0, 2] == 0


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "topk", "score_function", "groups"),
    [
        (3, 1, 1, "softmax", None),
        (2, 2048, 16, "sigmoid", None),
        (2, 2048, 16, "sqrtsoftplus", (64, 8)),
        (1, 8192, 8, "softmax", None),
        (2, 96, 96, "sigmoid", (3, 3)),
    ],
)
def test_expert_count_range(num_tokens, num_experts, topk, score_function, groups):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts))
    logits = logits.to(DEVICE).requires_grad_(True)
    num_groups, group_topk = groups or (None, None)
    args = (logits, topk, False, num_groups, group_topk, 1.0, score_function)
    probs, routing_map, indices = fused_topk_with_score_function(*args, return_indices=True)
    ref_probs, ref_map, ref_indices = reference.fused_topk_with_score_function(*args, return_indices=True)
    assert torch.equal(routing_map, ref_map) and torch.equal(indices, ref_indices)
    _assert_close(probs, ref_probs, "float32")
    cotangent = torch.randn(probs.shape, generator=torch.Generator().manual_seed(0)).to(probs)
    (grad,) = torch.autograd.grad(probs, logits, cotangent)
    (ref_grad,) = torch.autograd.grad(ref_probs, logits, cotangent)
    _assert_close(grad, ref_grad, "float32", grad=True)


@pytest.mark.parametrize("shape", [(10,), (2, 3, 10), (0, 10), (2, 0, 10)])
def test_leading_dims_are_preserved(shape):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    probs, routing_map, indices = fused_topk_with_score_function(
        logits, 3, score_function="sigmoid", return_indices=True
    )
    assert probs.shape == routing_map.shape == logits.shape and indices.shape == (*shape[:-1], 3)
    expected = reference.fused_topk_with_score_function(logits, 3, score_function="sigmoid")
    assert torch.equal(routing_map, expected[1])
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, 3, "softmax")
    assert routing_map.shape == scores.shape == logits.shape


def _bias(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


SIGMOID = dict(score_function="sigmoid")


def _kind(message: str) -> type[Exception]:
    """TypeError for an argument of the wrong kind (an int, a float or a bool expected), else ValueError."""
    kinds = ("expected an int, ", "expected an int,", "expected a Python float", "expected a bool")
    wrong_kind = message.endswith("expected an int") or any(kind in message for kind in kinds)
    return TypeError if wrong_kind else ValueError


@pytest.mark.parametrize(
    ("topk", "kwargs", "message"),
    [
        (0, {}, "topk: expected an int in [1, 8]"),
        (9, {}, "topk: expected an int in [1, 8]"),
        (2.0, {}, "topk: expected an int"),
        (2, dict(score_function="relu"), "score_function: expected one of"),
        (2, dict(expert_bias=_bias(8)), "expert_bias: needs scores before the top-k to shift"),
        (2, dict(normalize_topk=False), "normalize_topk: False contradicts score_function 'softmax'"),
        (2, dict(SIGMOID, normalize_topk=1), "normalize_topk: expected a bool or None"),
        (2, dict(group_score="max"), "group_score: needs groups"),
        (2, dict(num_groups=4, group_topk=2, group_score="sum"), "group_score: expected one of"),
        (2, dict(group_score="sum"), "group_score: expected one of"),
        (
            2,
            dict(num_groups=8, group_topk=2, group_score="top2_sum"),
            "group_score: 'top2_sum' scores a group",
        ),
        (2, dict(SIGMOID, expert_bias=_bias(7)), "expert_bias: expected shape (8,)"),
        (2, dict(SIGMOID, expert_bias=_bias(8, dtype=torch.int32)), "expert_bias: expected dtype"),
        (2, dict(num_groups=4), "num_groups / group_topk: pass both"),
        (2, dict(num_groups=3, group_topk=1), "num_groups: expected a divisor of num_experts = 8"),
        (2, dict(num_groups=2, group_topk=3), "group_topk: expected an int in [1, 2]"),
        (3, dict(num_groups=4, group_topk=2), "group_topk: expected a divisor of topk = 3"),
        (6, dict(num_groups=4, group_topk=2), "topk: expected topk / group_topk <= experts per group = 2"),
        (2, dict(scaling_factor=math.inf), "scaling_factor: expected a finite number"),
        (2, dict(scaling_factor="2"), "scaling_factor: expected a Python float"),
        (2, dict(use_pre_softmax=1), "use_pre_softmax: expected a bool"),
        (2, dict(return_indices=None), "return_indices: expected a bool"),
    ],
)
def test_bad_topk_arguments(topk, kwargs, message):
    with pytest.raises((TypeError, ValueError)) as error:
        fused_topk_with_score_function(torch.zeros(4, 8, device=DEVICE), topk, **kwargs)
    assert str(error.value).startswith(message)
    assert type(error.value) is _kind(message)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (_bias(4, 8, dtype=torch.float64), "logits: expected dtype in"),
        (_bias(4, 8, dtype=torch.int32), "logits: expected dtype in"),
        (_bias(), "logits: expected shape [..., num_experts]"),
        (_bias(4, 0), "logits: expected 1 <= num_experts (last dim) <= 8192, got 0"),
        (_bias(1, 8193), "logits: expected 1 <= num_experts (last dim) <= 8192, got 8193"),
    ],
)
def test_bad_logits(logits, message):
    for call in (fused_topk_with_score_function, fused_compute_score_for_moe_aux_loss):
        with pytest.raises(ValueError) as error:
            call(logits, 1)
        assert str(error.value).startswith(message)


def test_bad_aux_scores_arguments():
    with pytest.raises(ValueError, match=r"^topk: expected an int in \[1, 8\]"):
        fused_compute_score_for_moe_aux_loss(_bias(4, 8), 9)
    with pytest.raises(ValueError, match=r"^score_function: expected one of"):
        fused_compute_score_for_moe_aux_loss(_bias(4, 8), 2, "tanh")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(probs=_bias(2, 2, 4)), "probs: expected a 2-D array"),
        (dict(probs=_bias(4, 6)), "probs: expected shape[1] a multiple of num_experts = 4"),
        (dict(probs=_bias(4, 4, dtype=torch.float64)), "probs: expected dtype"),
        (dict(tokens_per_expert=_bias(3)), "tokens_per_expert: expected shape (4,)"),
        (dict(tokens_per_expert=_bias(4, dtype=torch.int8)), "tokens_per_expert: expected dtype"),
        (dict(total_num_tokens=0), "total_num_tokens: expected an int in >= 1"),
        (dict(total_num_tokens=_bias(1)), "total_num_tokens: expected a 0-dim array"),
        (dict(total_num_tokens=4.0), "total_num_tokens: expected an int"),
        (dict(topk=5), "topk: expected an int in [1, 4]"),
        (dict(coeff=math.nan), "coeff: expected a finite number"),
    ],
)
def test_bad_aux_loss_arguments(args, message):
    call = dict(
        probs=_bias(4, 4),
        tokens_per_expert=_bias(4, dtype=torch.int32),
        total_num_tokens=4,
        num_experts=4,
        topk=2,
        coeff=1.0,
    )
    with pytest.raises((TypeError, ValueError)) as error:
        fused_moe_aux_loss(**dict(call, **args))
    assert str(error.value).startswith(message)
    assert type(error.value) is _kind(message)


def test_torch_compile_fullgraph():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 16, generator=generator).to(DEVICE).requires_grad_(True)
    bias = torch.randn(16, generator=generator).to(DEVICE)
    counts = torch.arange(16, device=DEVICE)
    total = torch.tensor(6, device=DEVICE)

    def router(x):
        kwargs = dict(num_groups=4, group_topk=2, scaling_factor=2.0, expert_bias=bias, return_indices=True)
        probs, routing_map, indices = fused_topk_with_score_function(x, 4, score_function="sigmoid", **kwargs)
        replayed = fused_topk_with_score_function(
            x * 2, 4, score_function="sigmoid", **kwargs, routing_indices=indices.flip(-1)
        )[0]
        _, scores = fused_compute_score_for_moe_aux_loss(x, 4, "sqrtsoftplus")
        loss = fused_moe_aux_loss(scores, counts, total, 16, 4, 0.1)
        return probs + replayed, routing_map, indices, loss

    compiled = torch.compile(router, fullgraph=True)
    eager = router(logits)
    traced = compiled(logits)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b)
    grads = [torch.autograd.grad(out[0].sum() + out[3], logits)[0] for out in (traced, eager)]
    torch.testing.assert_close(grads[0], grads[1])


def test_torch_compile_dynamic_token_count():
    compiled = torch.compile(
        lambda x: fused_compute_score_for_moe_aux_loss(x, 2, "sigmoid"), fullgraph=True, dynamic=True
    )
    for num_tokens in (3, 7):
        logits = torch.randn(num_tokens, 8, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
        for actual, expected in zip(
            compiled(logits),
            reference.fused_compute_score_for_moe_aux_loss(logits, 2, "sigmoid"),
            strict=True,
        ):
            torch.testing.assert_close(actual, expected)


def test_custom_ops_pass_opcheck():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 8, generator=generator).to(DEVICE).requires_grad_(True)
    bias = torch.randn(8, generator=generator).to(DEVICE)
    ops = torch.ops.moetriton
    ids = torch.tensor([[0, 1], [7, 7], [2, -1], [5, 9], [3, 4]], device=DEVICE)
    for args in [
        (logits, bias, None, 2, False, 2, 1, 1.5, "sigmoid", True, "bytemap", True, "topk_sum"),
        (logits, None, None, 3, True, 0, 0, 1.0, "softmax", False, "bytemap", False, "topk_sum"),
        (logits, bias, None, 2, False, 0, 0, 1.0, "sigmoid", True, "bitmap", True, "topk_sum"),
        (logits, bias, None, 2, True, 2, 1, 1.0, "softmax", True, "bytemap", True, "max"),
        (logits, bias, None, 1, False, 2, 1, 2.0, "sigmoid", False, "bitmap", True, "top2_sum"),
        (logits, None, ids, 2, False, 0, 0, 1.0, "softmax", True, "bytemap", True, "topk_sum"),
        (logits, bias, ids.int(), 2, False, 2, 1, 2.0, "sigmoid", True, "bitmap", True, "topk_sum"),
    ]:
        torch.library.opcheck(ops.router_topk, args)
    # opcheck's AOT helper sums the outputs in order and cannot start with an integer one (the routing map).
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for routing_map_format in ("bytemap", "bitmap"):
        args = (logits, 2, "sqrtsoftplus", routing_map_format)
        torch.library.opcheck(ops.router_aux_scores, args, test_utils=checks)
    probs = torch.rand(5, 8, generator=generator).to(DEVICE).requires_grad_(True)
    counts = torch.arange(8, device=DEVICE)
    torch.library.opcheck(ops.router_aux_loss, (probs, counts, None, 5, 8, 2, 0.5))
    torch.library.opcheck(ops.router_aux_loss, (probs, counts, torch.tensor(5, device=DEVICE), 0, 8, 2, 0.5))


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
def test_reference_gradients_pass_gradcheck(score_function: str):
    """The oracle itself, in fp64: autograd of the reference against finite differences."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 8, dtype=torch.float64, generator=generator).requires_grad_(True)
    bias = torch.randn(8, dtype=torch.float64, generator=generator)
    for use_pre_softmax, groups in [(False, (None, None)), (True, (4, 2))]:
        expert_bias = None if score_function == "softmax" else bias

        def probs(x, use_pre_softmax=use_pre_softmax, groups=groups, expert_bias=expert_bias):
            return reference.fused_topk_with_score_function(
                x, 4, use_pre_softmax, *groups, 1.5, score_function, expert_bias
            )[0]

        assert torch.autograd.gradcheck(probs, (logits,))
    assert torch.autograd.gradcheck(lambda x: reference.aux_scores(x, score_function), (logits,))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_matches_eager():
    generator = torch.Generator(device="cuda").manual_seed(8)
    logits = torch.randn(64, 32, device="cuda", generator=generator).requires_grad_(True)
    bias = torch.randn(32, device="cuda", generator=generator)
    counts = torch.arange(32, device="cuda")
    total = torch.tensor(64, device="cuda")

    def step():
        probs, _ = fused_topk_with_score_function(logits, 4, score_function="sigmoid", expert_bias=bias)
        loss = fused_moe_aux_loss(probs, counts, total, 32, 4, 0.01)
        return torch.autograd.grad(loss + probs.square().sum(), logits)[0]

    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)


# Router replay: routing_indices --------------------------------------------------------------------------

REPLAY_GRID = [
    (score_function, pre, groups, bias, dtype, routing_map_format)
    for score_function in SCORE_FUNCTIONS
    for pre in ((False, True) if score_function == "softmax" else (False,))
    for groups in (None, (4, 2))
    for bias in ((False,) if score_function == "softmax" and not pre else (False, True))
    for dtype, routing_map_format in (("float32", "bytemap"), ("bfloat16", "bitmap"))
]


def _replay_kwargs(case: int, score_function, pre, groups, bias, routing_map_format, generator) -> dict:
    num_groups, group_topk = groups or (None, None)
    return dict(
        use_pre_softmax=pre,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=2.5 if case % 2 else None,
        score_function=score_function,
        expert_bias=torch.randn(12, generator=generator).to(DEVICE) if bias else None,
        routing_map_format=routing_map_format,
        normalize_topk=None if score_function == "softmax" and not pre else bool(case % 3),
        return_indices=True,
    )


@pytest.mark.parametrize(
    ("score_function", "pre", "groups", "bias", "dtype", "routing_map_format"), REPLAY_GRID
)
def test_replay_reproduces_an_earlier_call(score_function, pre, groups, bias, dtype, routing_map_format):
    """routing_indices = an earlier call's indices: with the same logits the routing map, indices and
    gradient are that call's exactly, probs within rounding; with other logits the selection stays, and
    probs and gradient are the reference's weights of that selection."""
    case = REPLAY_GRID.index((score_function, pre, groups, bias, dtype, routing_map_format))
    generator = torch.Generator().manual_seed(100 + case)
    logits = torch.randn(2, 3, 12, generator=generator).to(DEVICE, getattr(torch, dtype))
    kwargs = _replay_kwargs(case, score_function, pre, groups, bias, routing_map_format, generator)
    cotangent = torch.randn(logits.shape, generator=generator).to(logits)

    first = logits.clone().requires_grad_(True)
    recorded = fused_topk_with_score_function(first, 4, **kwargs)
    (recorded_grad,) = torch.autograd.grad(recorded[0], first, cotangent)
    again = logits.clone().requires_grad_(True)
    replayed = fused_topk_with_score_function(again, 4, **kwargs, routing_indices=recorded[2])
    (replayed_grad,) = torch.autograd.grad(replayed[0], again, cotangent)
    assert [t.dtype for t in (*replayed, replayed_grad)] == [t.dtype for t in (*recorded, recorded_grad)]
    # The routing map, the indices and the gradient (the ordinary backward) exactly; probs up to the order
    # of the weights' fp32 sums (compiled, the replaying kernel is a kernel of its own).
    for actual, expected in zip((*replayed[1:], replayed_grad), (*recorded[1:], recorded_grad), strict=True):
        assert torch.equal(actual, expected)
    _assert_close(replayed[0], recorded[0], dtype)

    other = torch.randn(logits.shape, generator=generator).to(logits)
    mine, theirs = other.clone().requires_grad_(True), other.clone().requires_grad_(True)
    probs, routing_map, indices = fused_topk_with_score_function(
        mine, 4, **kwargs, routing_indices=recorded[2]
    )
    expected = reference.fused_topk_with_score_function(theirs, 4, **kwargs, routing_indices=recorded[2])
    assert torch.equal(routing_map, recorded[1]) and torch.equal(routing_map, expected[1])
    assert torch.equal(indices, recorded[2]) and torch.equal(indices, expected[2])
    _assert_close(probs, expected[0], dtype)
    (grad,) = torch.autograd.grad(probs, mine, cotangent)
    (ref_grad,) = torch.autograd.grad(expected[0], theirs, cotangent)
    _assert_close(grad, ref_grad, dtype, grad=True)


def _hostile_ids(num_tokens: int, topk: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Expert ids [T, K]: in range, -1, other negatives, E, past E, the dtype's extremes (past int32 for
    int64), and repeats of a row's earlier ids."""
    info = torch.iinfo(dtype)
    wild = [-1, -2, num_experts, num_experts + 1, info.min, info.max, -num_experts]
    if dtype == torch.int64:
        wild += [2**32, 2**32 + 1, -(2**32), 2**40 + 3]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_tokens, topk), generator=generator, dtype=torch.int64)
    kind = torch.randint(0, 4, (num_tokens, topk), generator=generator)
    wild_ids = torch.tensor(wild)[torch.randint(0, len(wild), (num_tokens, topk), generator=generator)]
    ids = torch.where(kind == 1, wild_ids, ids)
    repeat = torch.roll(ids, 1, dims=1)
    ids = torch.where((kind == 2) & (torch.arange(topk) > 0), repeat, ids)
    return ids.to(dtype).to(DEVICE)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("score_function", "pre"), [("softmax", False), ("softmax", True), ("sigmoid", False)]
)
def test_replay_of_hostile_ids(index_dtype, score_function, pre):
    """Ids outside [0, E) select nothing, a repeat of an earlier slot's id selects nothing: the map, the
    returned indices (-1 there), probs and gradient follow the reference, and nothing is read or written for
    those slots (a token whose ids all are bad gets zero probs)."""
    num_tokens, num_experts, topk = 24, 10, 4
    ids = _hostile_ids(num_tokens, topk, num_experts, index_dtype, seed=int(pre) + len(score_function))
    ids[0] = torch.tensor([-1, num_experts, -7, torch.iinfo(index_dtype).max])  # nothing selected
    ids[1] = torch.tensor([3, 3, 3, 3])  # one expert
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(DEVICE)
    kwargs = dict(
        use_pre_softmax=pre, score_function=score_function, return_indices=True, routing_indices=ids
    )
    mine, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    probs, routing_map, indices = fused_topk_with_score_function(mine, topk, **kwargs)
    expected = reference.fused_topk_with_score_function(theirs, topk, **kwargs)
    assert torch.equal(routing_map, expected[1]) and torch.equal(indices, expected[2])
    # An independent count of the rule: the distinct in-range ids of each row.
    for row, row_ids in enumerate(ids.tolist()):
        chosen = sorted({i for i in row_ids if 0 <= i < num_experts})
        assert routing_map[row].nonzero().flatten().tolist() == chosen
        first = [i if 0 <= i < num_experts and i not in row_ids[:k] else -1 for k, i in enumerate(row_ids)]
        assert indices[row].tolist() == first
    assert not probs[0].any() and not probs[~routing_map].any()
    _assert_close(probs, expected[0], "float32")
    cotangent = torch.randn(probs.shape, generator=generator).to(probs)
    (grad,) = torch.autograd.grad(probs, mine, cotangent)
    (ref_grad,) = torch.autograd.grad(expected[0], theirs, cotangent)
    _assert_close(grad, ref_grad, "float32", grad=True)
    assert not grad[0].any()


_IDS = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(
    ("routing_indices", "message"),
    [
        (
            _IDS[:, :1],
            "routing_indices: expected shape (4, 2) (logits' leading dims, then topk = 2), got (4, 1)",
        ),
        (_IDS[:3], "routing_indices: expected shape (4, 2)"),
        (_IDS.reshape(8), "routing_indices: expected shape (4, 2)"),
        (_IDS.float(), "routing_indices: expected dtype in ('int32', 'int64') (expert ids), got float32"),
        (_IDS.to(torch.int16), "routing_indices: expected dtype in ('int32', 'int64')"),
        (_IDS.tolist(), "routing_indices: expected a torch.Tensor"),
    ],
)
def test_bad_routing_indices(routing_indices, message):
    with pytest.raises((TypeError, ValueError)) as error:
        fused_topk_with_score_function(torch.zeros(4, 8, device=DEVICE), 2, routing_indices=routing_indices)
    assert str(error.value).startswith(message)
    assert type(error.value) is (TypeError if "torch.Tensor" in message else ValueError)


def test_routing_indices_follow_leading_dims():
    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    ids = torch.tensor([[[0, 1], [7, 7], [2, -1]], [[5, 4], [3, 8], [6, 0]]], device=DEVICE)
    probs, routing_map, indices = fused_topk_with_score_function(
        logits, 2, score_function="sigmoid", return_indices=True, routing_indices=ids
    )
    expected = reference.fused_topk_with_score_function(
        logits, 2, score_function="sigmoid", return_indices=True, routing_indices=ids
    )
    assert probs.shape == routing_map.shape == logits.shape and indices.shape == ids.shape
    assert torch.equal(routing_map, expected[1]) and torch.equal(indices, expected[2])
    _assert_close(probs, expected[0], "float32")
    with pytest.raises(ValueError, match=r"^routing_indices: expected shape \(2, 3, 2\)"):
        fused_topk_with_score_function(logits, 2, routing_indices=ids.reshape(6, 2))
