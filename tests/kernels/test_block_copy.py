"""The padded exchange's block placement and its inverse (moetriton.kernels.block_copy) launched straight from
their plans on torch buffers pre-filled with NaN: every block's first sizes[p] rows land at p * out_rows (or
the permuted row, or the block's offset) and come back, bit for bit, sizes clipped to [0, rows], rows a bad
offset puts outside the layout skipped, and nothing else is written; both kernels compile for sm_90."""

from __future__ import annotations

import json

import pytest
import torch

from moetriton import kernels
from tests.torch._helpers import DEVICE

from ._compile import in_child


def _run(
    take: bool, source: torch.Tensor, sizes: list[int], rows: int, out_rows: int, dest_rows, offsets=None
) -> torch.Tensor:
    """The place (take) plan on `source`, its result pre-filled with NaN; `offsets` (a [P] tensor) for the
    layout of out_rows rows in all with blocks at those rows."""
    builder = kernels.take_blocks_plan if take else kernels.place_blocks_plan
    plan = builder(
        num_blocks=len(sizes),
        rows=rows,
        out_rows=out_rows,
        width=source.shape[1],
        element_bytes=source.element_size(),
        permuted=dest_rows is not None,
        offsets=offsets is not None,
    )
    (result,) = plan.results
    out = torch.full(plan.buffers[result].shape, float("nan"), dtype=source.dtype, device=DEVICE)
    inputs = {"layout" if take else "blocks": source, "dest_rows": dest_rows, "offsets": offsets}
    wide = max(map(abs, sizes)) >= 2**31  # a size no int32 holds: as the int64 a caller may pass
    inputs["sizes"] = torch.tensor(sizes, dtype=torch.int64 if wide else torch.int32, device=DEVICE)
    for launch in plan.launches:
        args = [inputs.get(arg, arg) if isinstance(arg, str) else arg for arg in launch.args]
        launch.kernel[launch.grid](*args, out, **launch.constexprs, num_warps=launch.num_warps)
    return out


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("rows", "out_rows", "sizes"),
    [(6, 11, [6, 0, 3]), (5, 5, [2, 5]), (7, 9, [9, -1, 4])],
    ids=["tails", "same-size", "clipped"],
)
def test_blocks_land_in_place_and_back_and_nothing_else_is_written(dtype, rows, out_rows, sizes, permuted):
    """Block p's row j (j < sizes[p], clipped) lands at layout row p * out_rows + j, or at dest_rows of it;
    taking the blocks back out reads the same rows; neither writes any other row."""
    width = 40  # not a power of two: masked columns
    generator = torch.Generator().manual_seed(rows)
    blocks = torch.randn(len(sizes) * rows, width, generator=generator).to(dtype)
    layout_rows = len(sizes) * out_rows
    dest = torch.randperm(layout_rows, generator=generator).int() if permuted else None
    placed = _run(False, blocks.to(DEVICE), sizes, rows, out_rows, None if dest is None else dest.to(DEVICE))
    taken = _run(True, placed, sizes, rows, out_rows, None if dest is None else dest.to(DEVICE)).cpu()
    placed = placed.cpu()
    written, kept = torch.zeros(layout_rows, dtype=torch.bool), torch.zeros(blocks.shape[0], dtype=torch.bool)
    for block, size in enumerate(sizes):
        size = min(max(size, 0), rows)
        source = torch.arange(block * rows, block * rows + size)
        target = torch.arange(block * out_rows, block * out_rows + size)
        target = target if dest is None else dest[target].long()
        assert torch.equal(placed[target], blocks[source]), block
        written[target], kept[source] = True, True
    assert placed[~written].isnan().all(), "a row past a block's size was placed"
    assert torch.equal(taken[kept], blocks[kept]) and taken[~kept].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("layout_rows", "offsets", "sizes"),
    [
        (20, [0, 7, 12], [6, 5, 8]),  # a send buffer's rank blocks, a tail after them
        (9, [4, 0], [5, 4]),  # blocks out of order
        (10, [8, -3, 2**40, 3], [6, 6, 2, 2**33]),  # past the end, before the start, huge, huge size
    ],
    ids=["send-buffer", "out-of-order", "hostile"],
)
def test_blocks_at_offsets_come_out_and_go_back_and_nothing_else_is_written(
    dtype, layout_rows, offsets, sizes
):
    """With offsets: block p's row j (j < sizes[p], clipped to [0, rows]) is layout row offsets[p] + j where
    that row is inside the layout; taking blocks out of a layout and placing them into another one moves
    exactly those rows, hostile offsets and sizes included, and writes nothing else (NaN guards)."""
    rows, width = 8, 40
    generator = torch.Generator().manual_seed(layout_rows)
    layout = torch.randn(layout_rows, width, generator=generator).to(dtype)
    starts = torch.tensor(offsets, dtype=torch.int64)
    taken = _run(True, layout.to(DEVICE), sizes, rows, layout_rows, None, starts.to(DEVICE))
    placed = _run(False, taken, sizes, rows, layout_rows, None, starts.to(DEVICE)).cpu()
    taken = taken.cpu()
    written = torch.zeros(layout_rows, dtype=torch.bool)
    kept = torch.zeros(len(sizes) * rows, dtype=torch.bool)
    for block, (start, size) in enumerate(zip(offsets, sizes, strict=True)):
        for j in range(min(max(size, 0), rows)):
            if 0 <= start + j < layout_rows:
                assert torch.equal(taken[block * rows + j], layout[start + j]), (block, j)
                kept[block * rows + j], written[start + j] = True, True
    assert taken[~kept].isnan().all(), "a row outside a block's size or the layout was taken"
    assert torch.equal(placed[written], layout[written]) and placed[~written].isnan().all()


def test_plan_checks_and_empty_blocks():
    with pytest.raises(ValueError, match="out_rows >= rows"):
        kernels.place_blocks_plan(num_blocks=2, rows=5, out_rows=4, width=8, element_bytes=2)
    with pytest.raises(ValueError, match="take_blocks: expected"):
        kernels.take_blocks_plan(num_blocks=-1, rows=5, out_rows=5, width=8, element_bytes=2)
    plan = kernels.place_blocks_plan(num_blocks=2, rows=0, out_rows=4, width=8, element_bytes=2)
    assert plan.launches == () and plan.buffers["out"].shape == (8, 8)
    with pytest.raises(ValueError, match="exclusive"):
        kernels.take_blocks_plan(
            num_blocks=2, rows=5, out_rows=9, width=8, element_bytes=2, permuted=True, offsets=True
        )
    # With offsets out_rows is the whole layout, which may hold fewer rows than a block.
    plan = kernels.place_blocks_plan(num_blocks=2, rows=5, out_rows=3, width=8, element_bytes=2, offsets=True)
    assert plan.buffers["out"].shape == (3, 8)


def _compile_all() -> None:
    """Child process: compile the kernel for sm_90, print its name as JSON."""
    from ._compile import compile_sm90

    compiled = []
    pointers = dict(
        blocks_ptr="*bf16",
        layout_ptr="*bf16",
        sizes_ptr="*i32",
        dest_rows_ptr="*i32",
        offsets_ptr="*i64",
        out_ptr="*bf16",
    )
    for take in (False, True):
        for mode in ("plain", "permuted", "offsets"):
            builder = kernels.take_blocks_plan if take else kernels.place_blocks_plan
            plan = builder(
                num_blocks=2,
                rows=4096,
                out_rows=8192,
                width=7168,
                element_bytes=2,
                permuted=mode == "permuted",
                offsets=mode == "offsets",
            )
            compile_sm90(plan.launches[0].kernel, plan.launches[0].constexprs, pointers)
            compiled.append(f"{plan.launches[0].kernel.__name__}-{mode}")
    print(json.dumps(compiled))


def test_kernels_compile_for_sm90():
    assert len(in_child("tests.kernels.test_block_copy:_compile_all")) == 6
