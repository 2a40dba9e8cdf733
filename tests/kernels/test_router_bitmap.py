"""The router's bitmap launches (moetriton.kernels.router): `_pack_bitmap_kernel` and `_unpack_bitmap_kernel`
launched from plans on the PyTorch executor, every buffer inside sentinel margins (tests/torch/_guards.py)
and every input inside margins of set bits, against numpy's packbits / unpackbits (bitorder="little"); the
router plans of the bitmap format, whose float launch is the bool map's launch; both kernels compile for
sm_90."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moetriton import kernels
from moetriton.kernels import Buffer, Plan
from moetriton.kernels.router import bitmap as bitmap_kernels
from moetriton.kernels.router import scores, topk
from moetriton.kernels.rules.layout import bitmap_columns
from moetriton.torch.executor import Executable
from tests.torch._guards import guarded, guarded_input
from tests.torch._helpers import DEVICE

from ._compile import in_child

# E not a multiple of 8, below 8, 1, a multiple of 8, and wider than one program's bytes (64 per row).
_EXPERTS = [1, 3, 7, 8, 13, 40, 530]


def _margined(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` [T, C] inside four rows of set bits on each side (True for a bool map, 0xFF for a bitmap),
    so that a read past it shows in the result."""
    fill = True if tensor.dtype == torch.bool else 0xFF
    padded = torch.full((tensor.shape[0] + 8, tensor.shape[1]), fill, dtype=tensor.dtype, device=DEVICE)
    padded[4 : 4 + tensor.shape[0]] = tensor
    return padded[4 : 4 + tensor.shape[0]]


def _run_guarded(plan: Plan, inputs: dict) -> tuple:
    """The plan's results with every allocation inside sentinel margins, which must come back intact."""
    with guarded() as guards:
        results = Executable(plan, DEVICE)(inputs)
    guards.check()  # reads the margins back, after the launches
    return results


def _copy_plan(kernel, source: str, target: str, num_tokens: int, num_experts: int) -> Plan:
    """A plan of the one bitmap launch the router plans add, from input `source` to result `target`."""
    shape = (num_tokens, bitmap_columns(num_experts) if target == "bitmap" else num_experts)
    buffer = Buffer(shape, "uint8" if target == "bitmap" else "bool")
    launch = bitmap_kernels._bitmap_launch(kernel, source, target, num_tokens, num_experts)
    return Plan({target: buffer}, (launch,), (target,))


def _pack(flags: torch.Tensor, num_experts: int) -> torch.Tensor:
    plan = _copy_plan(bitmap_kernels._pack_bitmap_kernel, "flags", "bitmap", flags.shape[0], num_experts)
    return _run_guarded(plan, dict(flags=flags))[0]


def _unpack(bitmap: torch.Tensor, num_experts: int) -> torch.Tensor:
    plan = _copy_plan(bitmap_kernels._unpack_bitmap_kernel, "bitmap", "flags", bitmap.shape[0], num_experts)
    return _run_guarded(plan, dict(bitmap=bitmap))[0]


def _random_flags(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(num_tokens, num_experts, generator=generator) < 0.4).to(DEVICE)


@pytest.mark.parametrize("num_experts", _EXPERTS)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_pack_is_numpys_little_endian_packbits(num_tokens, num_experts):
    """Unused high bits of the last byte are 0, as in packbits; the margins of set flags are not read."""
    flags = _random_flags(num_tokens, num_experts, seed=num_experts)
    bitmap = _pack(_margined(flags), num_experts)
    assert bitmap.dtype == torch.uint8 and bitmap.shape == (num_tokens, bitmap_columns(num_experts))
    expected = np.packbits(flags.cpu().numpy(), axis=1, bitorder="little")
    np.testing.assert_array_equal(bitmap.cpu().numpy(), expected)


@pytest.mark.parametrize("num_experts", _EXPERTS)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_unpack_reads_bits_below_e_and_ignores_the_rest(num_tokens, num_experts):
    """Every byte random, the unused high bits included: flag e is bit e % 8 of byte e // 8."""
    generator = torch.Generator().manual_seed(num_experts)
    shape = (num_tokens, bitmap_columns(num_experts))
    bitmap = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(DEVICE)
    flags = _unpack(_margined(bitmap), num_experts)
    assert flags.dtype == torch.bool and flags.shape == (num_tokens, num_experts)
    expected = np.unpackbits(bitmap.cpu().numpy(), axis=1, bitorder="little")[:, :num_experts]
    np.testing.assert_array_equal(flags.cpu().numpy(), expected.astype(bool))
    assert torch.equal(_pack(flags, num_experts), bitmap & _pack(torch.ones_like(flags), num_experts))


@pytest.mark.parametrize("num_experts", [5, 13, 40])
def test_strided_and_expanded_inputs_are_read_as_their_values(num_experts):
    """The executor makes such inputs contiguous; the kernels see their values, wherever they come from."""
    flags = _random_flags(6, num_experts, seed=1)
    bitmap = _pack(flags, num_experts)
    wide = torch.zeros(6, 3 * bitmap.shape[1], dtype=torch.uint8, device=DEVICE)
    wide[:, ::3] = bitmap
    assert torch.equal(_unpack(wide[:, ::3], num_experts), flags)
    assert torch.equal(_unpack(bitmap[2:3].expand(6, -1), num_experts), flags[2:3].expand(6, -1))
    assert torch.equal(_pack(flags.t().contiguous().t(), num_experts), bitmap)
    assert torch.equal(_pack(flags[4:5].expand(6, -1), num_experts), bitmap[4:5].expand(6, -1))


def _router_plans(num_tokens: int, num_experts: int, routing_map_format: str) -> tuple[Plan, Plan, Plan]:
    """(top-k forward, top-k backward, aux scores) plans: softmax, K = min(3, E)."""
    sizes = dict(num_tokens=num_tokens, num_experts=num_experts, topk=min(3, num_experts))
    sizes.update(score_function="softmax", routing_map_format=routing_map_format)
    options = dict(sizes, use_pre_softmax=False, scaling_factor=1.0)
    forward = kernels.topk_plan(**options, num_groups=0, group_topk=0, has_bias=False, return_indices=True)
    return forward, kernels.topk_backward_plan(**options), kernels.aux_scores_plan(**sizes)


@pytest.mark.parametrize("num_experts", [5, 16, 40])
def test_the_float_launch_is_the_bool_maps_with_the_map_in_scratch(num_experts):
    """What makes probs, scores and gradients the same bits in both formats on every device: the bitmap
    plan runs the bool map's launch (kernel, grid, constexprs, warps) on a bool [T, E] scratch map, plus one
    pack launch after it or one unpack launch before it."""
    for bytemap, bitmap in zip(
        *(_router_plans(37, num_experts, f) for f in ("bytemap", "bitmap")), strict=True
    ):
        (float_launch,) = bytemap.launches
        packs = float_launch.kernel is not topk._topk_backward_kernel
        extra, same = bitmap.launches if not packs else bitmap.launches[::-1]
        assert extra.kernel is (
            bitmap_kernels._pack_bitmap_kernel if packs else bitmap_kernels._unpack_bitmap_kernel
        )
        assert (same.kernel, same.grid, same.constexprs, same.num_warps) == (
            float_launch.kernel,
            float_launch.grid,
            float_launch.constexprs,
            float_launch.num_warps,
        )
        renamed = {"routing_map": scores._FLAGS}
        assert same.args == tuple(renamed.get(arg, arg) for arg in float_launch.args)
        assert same.outputs == tuple(renamed.get(name, name) for name in float_launch.outputs)
        assert bitmap.results == bytemap.results
        assert bitmap.buffers[scores._FLAGS] == Buffer((37, num_experts), "bool")


@pytest.mark.parametrize("num_experts", [3, 13, 40])
def test_bitmap_plans_equal_the_bool_maps_bit_for_bit_inside_guard_zones(num_experts):
    """Results and scratch inside sentinel margins, float inputs inside NaN margins, the bitmap given to the
    backward with every unused high bit set."""
    generator = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(37, num_experts, generator=generator).to(DEVICE)
    grad = torch.randn(37, num_experts, generator=generator).to(DEVICE)
    (forward, backward, scores), (packed_forward, packed_backward, packed_scores) = (
        _router_plans(37, num_experts, f) for f in ("bytemap", "bitmap")
    )
    inputs = dict(logits=guarded_input(logits), bias=None)
    probs, mask, indices = _run_guarded(forward, inputs)
    packed_probs, bitmap, packed_indices = _run_guarded(packed_forward, inputs)
    expected = np.packbits(mask.cpu().numpy(), axis=1, bitorder="little")
    np.testing.assert_array_equal(bitmap.cpu().numpy(), expected)
    assert torch.equal(packed_probs, probs) and torch.equal(packed_indices, indices)
    assert bool(probs.isfinite().all())  # nothing read from the NaN margins
    if num_experts % 8:
        bitmap[:, -1] |= 0xFF << (num_experts % 8) & 0xFF
    grads = [
        _run_guarded(plan, dict(grad_probs=guarded_input(grad), logits=inputs["logits"], routing_map=routing))
        for plan, routing in ((backward, mask), (packed_backward, _margined(bitmap)))
    ]
    assert torch.equal(grads[1][0], grads[0][0]) and bool(grads[0][0].isfinite().all())
    mask, values = _run_guarded(scores, dict(logits=inputs["logits"]))
    bitmap, packed_values = _run_guarded(packed_scores, dict(logits=inputs["logits"]))
    np.testing.assert_array_equal(
        bitmap.cpu().numpy(), np.packbits(mask.cpu().numpy(), axis=1, bitorder="little")
    )
    assert torch.equal(packed_values, values)


@pytest.mark.parametrize("num_experts", [1, 13])
def test_no_tokens_launch_nothing_and_give_empty_bitmaps(num_experts):
    forward, backward, scores = _router_plans(0, num_experts, "bitmap")
    assert forward.launches == backward.launches == scores.launches == ()
    assert forward.buffers["routing_map"] == Buffer((0, bitmap_columns(num_experts)), "uint8")
    assert scores.buffers["routing_map"] == Buffer((0, bitmap_columns(num_experts)), "uint8")
    logits = torch.zeros(0, num_experts, device=DEVICE)
    _, bitmap, _ = _run_guarded(forward, dict(logits=logits, bias=None))
    assert bitmap.shape == (0, bitmap_columns(num_experts)) and bitmap.dtype == torch.uint8
    routing = torch.zeros(0, bitmap_columns(num_experts), dtype=torch.uint8, device=DEVICE)
    (grad,) = _run_guarded(backward, dict(grad_probs=logits, logits=logits, routing_map=routing))
    assert grad.shape == (0, num_experts)


def _compile_all() -> None:
    """Child process: compile both kernels for sm_90 at the plans' constexprs, print their count as JSON."""
    from ._compile import compile_sm90

    compiled = 0
    for num_experts in (1, 5, 13, 256, 8192):
        for kernel in (bitmap_kernels._pack_bitmap_kernel, bitmap_kernels._unpack_bitmap_kernel):
            launch = bitmap_kernels._bitmap_launch(kernel, "source", "target", 4096, num_experts)
            compile_sm90(kernel, launch.constexprs, dict(flags_ptr="*i1", bitmap_ptr="*u8"))
            compiled += 1
    print(json.dumps(compiled))


def test_kernels_compile_for_sm90():
    assert in_child("tests.kernels.test_router_bitmap:_compile_all") == 10
