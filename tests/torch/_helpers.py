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


def assert_reduced(got, expected, what: str) -> None:
    """Results of fp32 reductions: bit for bit, except that under the Triton interpreter (CPU) a final
    fp32 -> bf16 cast truncates where GPUs round to nearest even, so one bf16 ulp is allowed there."""
    if DEVICE.type == "cpu" and got.dtype == torch.bfloat16:
        assert got.shape == expected.shape, what
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0, msg=what)
    else:
        assert_same(got, expected, what)
