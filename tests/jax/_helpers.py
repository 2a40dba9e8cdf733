"""Turns the shared numpy problems (tests/strategies.py) into JAX arrays, and compares results; counts the
GPUs and runs the checks that need a JAX of their own in a Python subprocess."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests.strategies import ChunkProblem, RoutingProblem, numpy_dtype

ROOT = Path(__file__).resolve().parents[2]

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def tokens(problem: RoutingProblem | ChunkProblem, dtype: str | None = None) -> jnp.ndarray:
    values = problem.tokens if isinstance(problem, RoutingProblem) else problem.rows
    return jnp.asarray(values.astype(numpy_dtype(dtype or problem.dtype)))


def routing_args(problem: RoutingProblem) -> tuple[jnp.ndarray | None, dict]:
    """(routing_map, keyword arguments) for token_dispatch."""
    routing = jnp.asarray(problem.routing)
    if problem.kind == "mask":
        return routing, {}
    return None, {"indices": routing, "num_experts": problem.num_experts}


def probs(problem: RoutingProblem, dtype: str = "float32") -> jnp.ndarray:
    return jnp.asarray(problem.probs.astype(numpy_dtype(dtype)))


def bits(x) -> np.ndarray:
    """Same-width unsigned integer view, so fp8, -0.0 and NaN payloads compare bit for bit."""
    x = np.asarray(x)
    return x.view(_BITS[x.dtype.itemsize])


def assert_same(got, expected, what: str) -> None:
    """Bit-for-bit equality (shape and dtype included)."""
    assert (got is None) == (expected is None), what
    if got is None:
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    np.testing.assert_array_equal(bits(got), bits(expected), err_msg=f"{what} differs")


#: Relative tolerance of fp32 sums rounded to each dtype: the kernels add without fused multiply-add while XLA
#: may fuse (a last-bit fp32 difference that can flip one rounding step), and the Triton interpreter
#: truncates the final fp32 -> 16-bit cast where GPUs round to nearest even.
_REDUCED_RTOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2**-6, "float16": 2**-9}


def assert_reduced(got, expected, what: str) -> None:
    """Results of fp32 reductions: equal up to a few last-place differences of the output dtype."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    rtol = _REDUCED_RTOL[np.dtype(got.dtype).name]
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=rtol, err_msg=what
    )


def split_into_shards(problem: RoutingProblem, num_shards: int) -> RoutingProblem:
    """The problem trimmed to a multiple of num_shards tokens, with num_out_tokens a multiple too."""
    num_tokens = problem.num_tokens // num_shards * num_shards
    per_shard = -(-problem.num_out_tokens // num_shards)
    return dataclasses.replace(
        problem,
        num_tokens=num_tokens,
        num_out_tokens=per_shard * num_shards,
        tokens=problem.tokens[:num_tokens],
        routing=problem.routing[:num_tokens],
        probs=problem.probs[:num_tokens],
    )


def concat_shards(per_shard_results: list[tuple]) -> tuple:
    """Per-shard results (tuples, None for absent entries) joined along their first axes."""
    return tuple(
        None if parts[0] is None else jnp.concatenate(parts) for parts in zip(*per_shard_results, strict=True)
    )


def gpu_count() -> int:
    """How many GPUs this process's JAX sees (0 without a GPU backend)."""
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def run_python(argv: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python *argv` in the repository root with its output captured as text: checks whose JAX must start
    with flags of their own (host device counts, platforms) run so, as do the examples and benchmarks."""
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
