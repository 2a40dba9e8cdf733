"""Guard zones for kernel tests: every buffer a plan allocates (results and scratch) lies inside a larger one
whose margins hold a sentinel byte pattern, and inputs sit inside margins of NaN, so a kernel that writes
past a buffer changes a margin (checked after the call) and one that reads past an input reads NaN."""

from __future__ import annotations

import contextlib
import math

import torch

from moetriton.torch.executor import Executable

SENTINEL = 0xA5
#: Margin on each side of a buffer: at least 256 bytes and 4 rows, so an entry one or a few rows out of
#: range (the likely mistakes: -1, N, N + 1) lands in it. Far-off indices would fault outright.
MARGIN_BYTES = 256


class Guards:
    """Allocations with sentinel margins, and the check that the margins are intact."""

    def __init__(self) -> None:
        self.zones: list[tuple[torch.Tensor, int, int, str]] = []

    def allocate(self, shape, *, dtype: torch.dtype, device, zero: bool) -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        row_bytes = math.prod(shape[1:]) * itemsize if len(shape) > 1 else itemsize
        margin = -(-max(MARGIN_BYTES, 4 * row_bytes) // 16) * 16
        raw = torch.full((2 * margin + nbytes,), SENTINEL, dtype=torch.uint8, device=device)
        middle = raw[margin : margin + nbytes].view(dtype).view(shape)
        if zero:
            middle.zero_()
        self.zones.append((raw, margin, nbytes, f"{tuple(shape)} {dtype}"))
        return middle

    def check(self) -> None:
        for raw, margin, nbytes, what in self.zones:
            before, after = raw[:margin], raw[margin + nbytes :]
            assert bool((before == SENTINEL).all()), f"written before the buffer {what}"
            assert bool((after == SENTINEL).all()), f"written past the buffer {what}"


@contextlib.contextmanager
def guarded():
    """Within: torch.empty / torch.zeros (what the executor allocates with) return guarded buffers."""
    guards = Guards()
    empty, zeros = torch.empty, torch.zeros

    def guarded_empty(*shape, dtype=None, device=None, **_):
        size = shape[0] if len(shape) == 1 else shape
        return guards.allocate(size, dtype=dtype or torch.float32, device=device, zero=False)

    def guarded_zeros(*shape, dtype=None, device=None, **_):
        size = shape[0] if len(shape) == 1 else shape
        return guards.allocate(size, dtype=dtype or torch.float32, device=device, zero=True)

    torch.empty, torch.zeros = guarded_empty, guarded_zeros
    try:
        yield guards
    finally:
        torch.empty, torch.zeros = empty, zeros


def guarded_input(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor`'s values inside a buffer with margins of NaN (floats) or of the largest value (integers) of
    four rows each side: a read past it shows in the results."""
    if tensor is None:
        return None
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)
    fill = float("nan") if tensor.dtype.is_floating_point else torch.iinfo(tensor.dtype).max
    padded = torch.full((rows.shape[0] + 8, rows.shape[1]), fill, dtype=tensor.dtype, device=tensor.device)
    padded[4 : 4 + rows.shape[0]] = rows
    return padded[4 : 4 + rows.shape[0]].reshape(tensor.shape)


def run_guarded(plan, inputs: dict, device: torch.device) -> tuple:
    """The plan's results, run with every input inside NaN margins and every allocation inside sentinel
    margins, which must come back intact."""
    inputs = {name: guarded_input(value) for name, value in inputs.items()}
    with guarded() as guards:
        results = Executable(plan, device)(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    guards.check()
    return results
