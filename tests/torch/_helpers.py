"""Turns the shared numpy problems (tests/strategies.py) into torch tensors on the test device."""

from __future__ import annotations

import os

import torch

from tests.strategies import ChunkProblem, RoutingProblem

DEVICE = torch.device(os.environ.get("MOETRITON_TEST_DEVICE", "cpu"))
TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def tokens(problem: RoutingProblem | ChunkProblem, dtype: str | None = None) -> torch.Tensor:
    values = problem.tokens if isinstance(problem, RoutingProblem) else problem.rows
    return torch.from_numpy(values).to(DEVICE).to(TORCH_DTYPES[dtype or problem.dtype])


def routing_args(problem: RoutingProblem) -> tuple[torch.Tensor | None, dict]:
    """(routing_map, keyword arguments) for token_dispatch."""
    routing = torch.from_numpy(problem.routing).to(DEVICE)
    if problem.kind == "mask":
        return routing, {}
    return None, {"indices": routing, "num_experts": problem.num_experts}


def probs(problem: RoutingProblem, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(problem.probs).to(DEVICE).to(dtype)


def relayout(x: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """`x`'s values in another memory layout (tests/strategies.LAYOUTS): column-major storage, every other
    row of a taller buffer, or an interior column range of a wider one (an offset, unaligned start). 1-D
    tensors take the row and offset forms. "expanded" needs equal values: see `cotangent`."""
    if x is None or layout == "contiguous" or x.dim() == 0:  # a scalar has no layout to vary
        return x
    if layout == "transposed":
        return x.t().contiguous().t() if x.dim() == 2 else x.clone()
    if layout == "row_slice":
        taller = torch.zeros((2 * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        taller[::2] = x
        return taller[::2]
    if layout == "column_slice":
        if x.dim() == 1:
            wider = torch.zeros(x.shape[0] + 3, dtype=x.dtype, device=x.device)
            wider[1:-2] = x
            return wider[1:-2]
        wider = torch.zeros((x.shape[0], x.shape[1] + 3), dtype=x.dtype, device=x.device)
        wider[:, 1:-2] = x
        return wider[:, 1:-2]
    raise ValueError(f"unknown layout {layout!r}")


def cotangent(like: torch.Tensor, layout: str, seed: int = 0) -> torch.Tensor:
    """A gradient for `like` in `layout`: distinct values, or for "expanded" one value broadcast with stride
    0 (what autograd hands a backward op for `out.sum()`, scaled)."""
    if layout == "expanded":
        return torch.full((), 0.75, dtype=like.dtype, device=like.device).expand(like.shape)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(like.shape, generator=generator).to(like.device, like.dtype)
    return relayout(values, layout)


def bits(x: torch.Tensor) -> torch.Tensor:
    """Same-width integer view, so fp8 and NaN payloads compare bit for bit."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def assert_same(got, expected, what: str) -> None:
    """Bit-for-bit equality (shape and dtype included)."""
    assert (got is None) == (expected is None), what
    if got is None:
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    assert torch.equal(bits(got), bits(expected)), f"{what} differs"


def assert_plan_results(plan, got, expected) -> None:
    """A plan's results from the PyTorch executor against the reference's: placeholders
    (Buffer.placeholder: not produced) come back as None, every other result equal bit for bit."""
    for name, mine, theirs in zip(plan.results, got, expected, strict=True):
        if plan.buffers[name].placeholder:
            assert mine is None, name
        else:
            assert_same(mine, theirs, name)


def assert_reduced(got, expected, what: str) -> None:
    """Results of fp32 reductions: bit for bit, except that under the Triton interpreter (CPU) a final
    fp32 -> bf16 cast truncates where GPUs round to nearest even, so one bf16 ulp is allowed there."""
    if DEVICE.type == "cpu" and got.dtype == torch.bfloat16:
        assert got.shape == expected.shape, what
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0, msg=what)
    else:
        assert_same(got, expected, what)


# One rounding to the dtype from fp32 math: ~3 significant digits for bf16, relative to the largest value.
ROUNDED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def assert_rounded(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """A result computed in fp32 and rounded once to got.dtype against a float64 reference: absolute error
    within the dtype's rounding of the largest reference magnitude (at least 1)."""
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, 1.0)
    torch.testing.assert_close(
        got.cpu().double(), expected.cpu(), rtol=0, atol=ROUNDED_TOLERANCE[got.dtype] * scale, msg=what
    )
