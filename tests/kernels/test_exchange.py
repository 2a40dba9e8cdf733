"""The padded exchange's block placement (moetriton.kernels.exchange) launched straight from its plan on
torch buffers pre-filled with NaN: every block's first sizes[p] rows land at p * out_rows, bit for bit,
sizes clipped to [0, rows], and nothing else is written; the kernel compiles for sm_90."""

from __future__ import annotations

import json

import pytest
import torch

from moetriton import kernels
from tests.torch._helpers import DEVICE

from ._compile import in_child


def _place(blocks: torch.Tensor, sizes: list[int], rows: int, out_rows: int) -> torch.Tensor:
    plan = kernels.place_blocks_plan(
        num_blocks=len(sizes),
        rows=rows,
        out_rows=out_rows,
        width=blocks.shape[1],
        element_bytes=blocks.element_size(),
    )
    out = torch.full(plan.buffers["out"].shape, float("nan"), dtype=blocks.dtype, device=DEVICE)
    sizes_tensor = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    for launch in plan.launches:
        args = [{"blocks": blocks, "sizes": sizes_tensor}.get(arg, arg) for arg in launch.args]
        launch.kernel[launch.grid](*args, out, **launch.constexprs, num_warps=launch.num_warps)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("rows", "out_rows", "sizes"),
    [(6, 11, [6, 0, 3]), (5, 5, [2, 5]), (7, 9, [9, -1, 4])],
    ids=["tails", "same-size", "clipped"],
)
def test_blocks_land_in_place_and_nothing_else_is_written(dtype, rows, out_rows, sizes):
    width = 40  # not a power of two: masked columns
    blocks = torch.randn(len(sizes) * rows, width, generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = _place(blocks.to(DEVICE), sizes, rows, out_rows).cpu()
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    for block, size in enumerate(sizes):
        size = min(max(size, 0), rows)
        target = slice(block * out_rows, block * out_rows + size)
        assert torch.equal(out[target], blocks[block * rows : block * rows + size]), block
        written[target] = True
    assert out[~written].isnan().all(), "a row past a block's size was written"


def test_plan_checks_and_empty_blocks():
    with pytest.raises(ValueError, match="out_rows >= rows"):
        kernels.place_blocks_plan(num_blocks=2, rows=5, out_rows=4, width=8, element_bytes=2)
    plan = kernels.place_blocks_plan(num_blocks=2, rows=0, out_rows=4, width=8, element_bytes=2)
    assert plan.launches == () and plan.buffers["out"].shape == (8, 8)


def _compile_all() -> None:
    """Child process: compile the kernel for sm_90, print its name as JSON."""
    from moetriton.kernels import exchange

    from ._compile import compile_sm90

    plan = kernels.place_blocks_plan(num_blocks=2, rows=4096, out_rows=8192, width=7168, element_bytes=2)
    pointers = dict(blocks_ptr="*bf16", sizes_ptr="*i32", out_ptr="*bf16")
    compile_sm90(exchange._place_blocks_kernel, plan.launches[0].constexprs, pointers)
    print(json.dumps(["_place_blocks_kernel"]))


def test_kernel_compiles_for_sm90():
    assert in_child("tests.kernels.test_exchange:_compile_all") == ["_place_blocks_kernel"]
