"""Bit-packed routing maps in PyTorch: the router packs them after its float kernel and unpacks them before
its backward's; dispatch reads them in place.

Every bitmap result is held to the bool map's from the same logits, bit for bit (map, probs, aux scores
and gradients, interpreted and compiled: the float math is the same kernel for both formats, see
docs/router.md), and the packed layout to numpy's packbits(bitorder="little"), an implementation of its
own. On a GPU, TransformerEngine's test sizes run too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moetriton.torch as mt
from moetriton.torch import reference, reference_router
from tests.strategies_router import large_bitmap_cases

from ._helpers import DEVICE

# (E, K, groups, group_topk): E a multiple of 8, not one, below 8, 1; groups of a power-of-two size and not.
_SHAPES = [(16, 3, None, None), (12, 4, 2, 2), (5, 2, None, None), (1, 1, None, None), (24, 4, 3, 1)]


class _Format:
    """A stand-in for TE's RoutingMapFormat member: the format is read from its name."""

    name = "BITMAP_U8"


def _logits(num_tokens: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_experts, generator=generator).to(DEVICE)


def _packbits(mask: torch.Tensor) -> np.ndarray:
    return np.packbits(mask.cpu().numpy(), axis=1, bitorder="little")


def _topk_and_grad(logits, topk, groups, group_topk, score_function, routing_map_format):
    x = logits.clone().requires_grad_()
    probs, routing_map = mt.fused_topk_with_score_function(
        x, topk, False, groups, group_topk, 2.0, score_function, None, routing_map_format
    )
    grad = torch.linspace(-1, 1, probs.numel(), device=probs.device).reshape(probs.shape)
    (probs * grad).sum().backward()
    return probs.detach(), routing_map, x.grad


@pytest.mark.parametrize("num_tokens", [0, 5])
@pytest.mark.parametrize(("num_experts", "topk", "groups", "group_topk"), _SHAPES)
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_topk_bitmap_is_the_packed_bytemap_with_the_same_gradients(
    num_tokens, num_experts, topk, groups, group_topk, score_function
):
    logits = _logits(num_tokens, num_experts)
    probs, mask, grad = _topk_and_grad(logits, topk, groups, group_topk, score_function, "bytemap")
    packed_probs, bitmap, packed_grad = _topk_and_grad(
        logits, topk, groups, group_topk, score_function, "bitmap"
    )
    assert bitmap.dtype == torch.uint8 and bitmap.shape == (num_tokens, (num_experts + 7) // 8)
    np.testing.assert_array_equal(bitmap.cpu().numpy(), _packbits(mask))
    assert torch.equal(packed_probs, probs) and torch.equal(packed_grad, grad)


def _assert_aux_scores_bitwise(num_tokens, num_experts, topk, score_function):
    logits = _logits(num_tokens, num_experts, seed=1).requires_grad_()
    mask, scores = mt.fused_compute_score_for_moe_aux_loss(logits, topk, score_function)
    bitmap, packed_scores = mt.fused_compute_score_for_moe_aux_loss(logits, topk, score_function, "bitmap")
    np.testing.assert_array_equal(bitmap.cpu().numpy(), _packbits(mask))
    assert torch.equal(packed_scores, scores)
    (grad,) = torch.autograd.grad(scores.square().sum(), logits)
    (packed_grad,) = torch.autograd.grad(packed_scores.square().sum(), logits)
    assert torch.equal(packed_grad, grad)


@pytest.mark.parametrize(("num_experts", "topk"), [(16, 3), (11, 4), (3, 2), (1, 1)])
def test_aux_scores_bitmap_is_the_packed_bytemap(num_experts, topk):
    _assert_aux_scores_bitwise(6, num_experts, topk, "sigmoid")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="sizes for compiled kernels (the interpreter is slow)")
@large_bitmap_cases
def test_large_bitmap_results_are_bitwise_the_bytemaps(
    num_tokens, num_experts, topk, groups, group_topk, score_function
):
    """TransformerEngine's bitmap test sizes and DeepSeek-V3's router: top-k probs and gradient, aux scores
    and their gradient."""
    logits = _logits(num_tokens, num_experts, seed=num_experts)
    probs, mask, grad = _topk_and_grad(logits, topk, groups, group_topk, score_function, "bytemap")
    packed_probs, bitmap, packed_grad = _topk_and_grad(
        logits, topk, groups, group_topk, score_function, "bitmap"
    )
    np.testing.assert_array_equal(bitmap.cpu().numpy(), _packbits(mask))
    assert torch.equal(packed_probs, probs) and torch.equal(packed_grad, grad)
    _assert_aux_scores_bitwise(num_tokens, num_experts, topk, score_function)


def test_leading_dims_are_kept_and_te_spellings_are_accepted():
    logits = _logits(6, 10).reshape(2, 3, 10)
    _, mask = mt.fused_topk_with_score_function(logits, 3)
    for spelling in ("bitmap", "BITMAP_U8", _Format()):
        _, bitmap = mt.fused_topk_with_score_function(logits, 3, routing_map_format=spelling)
        assert bitmap.shape == (2, 3, 2)
        np.testing.assert_array_equal(bitmap.reshape(6, 2).cpu().numpy(), _packbits(mask.reshape(6, 10)))


def test_references_pack_like_numpy_and_agree_with_the_kernels():
    logits = _logits(7, 13, seed=2)
    _, mask = reference_router.fused_topk_with_score_function(logits, 4, score_function="sigmoid")
    _, bitmap = reference_router.fused_topk_with_score_function(
        logits, 4, score_function="sigmoid", routing_map_format="bitmap"
    )
    np.testing.assert_array_equal(bitmap.cpu().numpy(), _packbits(mask))
    assert torch.equal(reference.unpack_bitmap(bitmap, 13), mask)
    _, kernel_bitmap = mt.fused_topk_with_score_function(
        logits, 4, score_function="sigmoid", routing_map_format="bitmap"
    )
    assert torch.equal(kernel_bitmap, bitmap)


def _assert_identical(mine: tuple, theirs: tuple) -> None:
    """Equal tensors (dtype, shape and bits) or both None, position by position."""
    for a, b in zip(mine, theirs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def _dispatch_both(num_experts, *, align_size=None, capacity=None, garbage=False, dtype=torch.float32):
    """token_dispatch from a bool map and from its bitmap (optionally with every unused high bit set), with
    the gradients of tokens and probs: (results, gradients) of each."""
    num_tokens, topk = 9, min(3, num_experts)
    logits = _logits(num_tokens, num_experts, seed=3)
    probs, mask = mt.fused_topk_with_score_function(logits, topk)
    _, bitmap = mt.fused_topk_with_score_function(logits, topk, routing_map_format="bitmap")
    if garbage and num_experts % 8:
        high = torch.tensor(0xFF << (num_experts % 8) & 0xFF, dtype=torch.uint8, device=bitmap.device)
        bitmap = bitmap.clone()
        bitmap[:, -1] |= high
    tokens = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    rows = None if capacity is not None else num_tokens * topk
    outcomes = []
    for routing, extra in ((mask, {}), (bitmap, dict(num_experts=num_experts, routing_map_format="bitmap"))):
        x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        result = mt.token_dispatch(x, routing, rows, p, align_size, capacity=capacity, **extra)
        (result[0].float().square().sum() + result[1].square().sum()).backward()
        outcomes.append((result, (x.grad, p.grad)))
    return outcomes


@pytest.mark.parametrize("num_experts", [16, 11, 5, 1])
@pytest.mark.parametrize(("align_size", "capacity"), [(None, None), (4, None), (None, 2)])
def test_dispatch_from_a_bitmap_equals_dispatch_from_the_mask(num_experts, align_size, capacity):
    (mask_result, mask_grads), (bitmap_result, bitmap_grads) = _dispatch_both(
        num_experts, align_size=align_size, capacity=capacity
    )
    _assert_identical(bitmap_result + bitmap_grads, mask_result + mask_grads)


@pytest.mark.parametrize("num_experts", [11, 5, 1])
def test_dispatch_ignores_bits_past_the_last_expert(num_experts):
    (mask_result, _), (bitmap_result, _) = _dispatch_both(num_experts, garbage=True)
    _assert_identical(bitmap_result, mask_result)
    assert int(bitmap_result[4].sum()) == 9 * min(3, num_experts)  # every routed slot, none past E


def test_dispatch_of_no_tokens_from_a_bitmap():
    empty = torch.zeros(0, 2, dtype=torch.uint8, device=DEVICE)
    out, _, row_id_map, _, counts = mt.token_dispatch(
        torch.zeros(0, 8, device=DEVICE), empty, 0, num_experts=12, routing_map_format="bitmap"
    )
    assert out.shape == (0, 8) and row_id_map.shape == (0, 26) and counts.tolist() == [0] * 12


def test_reference_dispatch_reads_the_bitmap_like_the_kernels():
    (mask_result, _), _ = _dispatch_both(11)
    logits = _logits(9, 11, seed=3)
    probs, mask = mt.fused_topk_with_score_function(logits, 3)
    tokens = torch.randn(9, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expected = reference.token_dispatch(
        tokens, reference.pack_bitmap(mask), 27, probs, num_experts=11, routing_map_format="bitmap"
    )
    _assert_identical(mask_result, expected)


@pytest.mark.parametrize(
    ("routing_map", "kwargs", "message"),
    [
        (
            torch.zeros(4, 2, dtype=torch.uint8),
            dict(num_experts=20),
            r"routing_map: expected shape\[1\] = ceil",
        ),
        (torch.zeros(4, 2, dtype=torch.uint8), {}, "num_experts: required with a bitmap"),
        (torch.zeros(4, 2, dtype=torch.bool), dict(num_experts=12), "routing_map: expected dtype in"),
        (torch.zeros(3, 2, dtype=torch.uint8), dict(num_experts=12), r"routing_map: expected shape\[0\]"),
        (torch.zeros(4, 2, dtype=torch.uint8), dict(num_experts=0), "num_experts: expected > 0"),
    ],
)
def test_bad_bitmaps_are_refused_with_clear_errors(routing_map, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mt.token_dispatch(
            torch.zeros(4, 8, device=DEVICE), routing_map.to(DEVICE), 4, routing_map_format="bitmap", **kwargs
        )


def test_bad_formats_are_refused_with_clear_errors():
    logits = _logits(2, 4)
    with pytest.raises(ValueError, match="routing_map_format: expected one of"):
        mt.fused_topk_with_score_function(logits, 2, routing_map_format="bits")
    with pytest.raises(ValueError, match="routing_map_format: expected one of"):
        mt.fused_compute_score_for_moe_aux_loss(logits, 2, "softmax", 1.5)
    with pytest.raises(ValueError, match="'bitmap' describes a routing_map"):
        mt.token_dispatch(
            torch.zeros(2, 8, device=DEVICE),
            indices=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
            num_experts=4,
            routing_map_format="bitmap",
        )


def test_probs_keep_the_expert_layout_with_a_bitmap():
    bitmap = torch.zeros(4, 2, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"probs: expected shape \(4, 12\)"):
        mt.token_dispatch(
            torch.zeros(4, 8, device=DEVICE),
            bitmap,
            4,
            torch.zeros(4, 2, device=DEVICE),
            num_experts=12,
            routing_map_format="bitmap",
        )


def _route_and_dispatch(logits, tokens):
    probs, bitmap = mt.fused_topk_with_score_function(logits, 2, routing_map_format="bitmap")
    out, permuted_probs, row_id_map, _, _ = mt.token_dispatch(
        tokens, bitmap, 12, probs, num_experts=10, routing_map_format="bitmap"
    )
    return mt.token_combine(out * permuted_probs[:, None], row_id_map)


def test_compile_fullgraph_of_the_bitmap_router_and_dispatch_matches_eager():
    logits, tokens = _logits(6, 10, seed=6), _logits(6, 8, seed=7)
    results = []
    for fn in (_route_and_dispatch, torch.compile(_route_and_dispatch, fullgraph=True)):
        lg, tg = logits.clone().requires_grad_(), tokens.clone().requires_grad_()
        y = fn(lg, tg)
        y.square().sum().backward()
        results.append((y.detach(), lg.grad, tg.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
