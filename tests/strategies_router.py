"""Hypothesis strategies for the router ops (framework-neutral: numpy arrays plus arguments).

`router_problems()` draws one call of fused_topk_with_score_function / fused_compute_score_for_moe_aux_loss:
leading token dims ([T] or [B, S], T = 0 and 1 included), E experts, top-k, a score function, pre/post
softmax, valid group settings (group sizes and counts that are not powers of two included) and group scores,
the renormalisation of the selected weights (None, True, or False where allowed), an expert bias (sigmoid,
sqrtsoftplus or softmax before the top-k), a scaling factor, a logits dtype and a logits pattern:

* "random": continuous values, rounded to the logits dtype (bf16/fp16 rounding creates exact ties);
* "ties": values from a small set (with -0.0 and +0.0), so experts tie exactly. The set holds no x and -x
  pair, so sigmoid scores of different logits never tie only "mathematically" (sigma(x) + sigma(-x) = 1),
  which fp32 rounding could break differently in the kernels and the references;
* "tied_groups": every group holds the same logits, so groups tie exactly;
* "nonfinite": random values with NaN, +inf and -inf sprinkled in (forward only: no gradient policy).

`aux_loss_problems()` draws probs [R, C], counts per column, a total and the loss arguments.
`run_test_module()` runs a test module's checks in a fresh interpreter, for settings read at import.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

from .strategies import numpy_dtype

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOGITS_DTYPES = ("float32", "bfloat16", "float16")
PATTERNS = ("random", "random", "ties", "tied_groups", "nonfinite")
TIE_VALUES = np.array([-1.5, -0.25, -0.0, 0.0, 0.5, 1.25, 2.0], dtype=np.float32)


def large_bitmap_cases(test):
    """Parametrizes a bitmap-against-bytemap test of both frameworks with TransformerEngine's bitmap test
    sizes and DeepSeek-V3's router, under both score functions (sizes for compiled kernels)."""
    sizes = pytest.mark.parametrize(
        ("num_tokens", "num_experts", "topk", "groups", "group_topk"),
        [(2048, 32, 4, None, None), (2048, 128, 4, None, None), (4096, 256, 8, 8, 4)],
    )
    return pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])(sizes(test))


@dataclass(frozen=True)
class RouterProblem:
    lead_shape: tuple[int, ...]
    num_experts: int
    topk: int
    score_function: str
    use_pre_softmax: bool
    num_groups: int | None
    group_topk: int | None
    scaling_factor: float | None
    dtype: str
    pattern: str
    logits: np.ndarray  # [*lead_shape, E] float32, exactly representable in `dtype`
    bias: np.ndarray | None  # [E] float32
    normalize_topk: bool | None = None
    group_score: str = "topk_sum"

    @property
    def finite(self) -> bool:
        return self.pattern != "nonfinite"

    def topk_kwargs(self) -> dict:
        """Arguments of fused_topk_with_score_function after (logits, topk), bias excluded."""
        return dict(
            use_pre_softmax=self.use_pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
            score_function=self.score_function,
            normalize_topk=self.normalize_topk,
            group_score=self.group_score,
        )


def _in_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(numpy_dtype(dtype)).astype(np.float32)


def _logits(rng: np.random.Generator, shape: tuple[int, ...], pattern: str, num_groups: int) -> np.ndarray:
    if pattern == "ties":
        return rng.choice(TIE_VALUES, size=shape)
    if pattern == "tied_groups":
        group = rng.standard_normal((*shape[:-1], shape[-1] // num_groups)).astype(np.float32)
        return np.concatenate([group] * num_groups, axis=-1)
    values = (2.0 * rng.standard_normal(shape)).astype(np.float32)
    if pattern == "nonfinite":
        special = rng.choice(np.array([np.nan, np.inf, -np.inf], dtype=np.float32), size=shape)
        values = np.where(rng.random(shape) < 0.25, special, values)
    return values


@st.composite
def router_problems(
    draw,
    *,
    max_tokens: int = 12,
    max_experts: int = 16,
    score_functions: tuple[str, ...] = SCORE_FUNCTIONS,
    dtypes: tuple[str, ...] = LOGITS_DTYPES,
    patterns: tuple[str, ...] = PATTERNS,
    groups: bool = True,
    bias: bool = True,
) -> RouterProblem:
    num_experts = draw(st.integers(1, max_experts))
    score_function = draw(st.sampled_from(score_functions))
    use_pre_softmax = score_function == "softmax" and draw(st.booleans())
    num_groups = group_topk = None
    if groups and draw(st.booleans()):
        num_groups = draw(st.sampled_from([g for g in range(1, num_experts + 1) if num_experts % g == 0]))
        group_topk = draw(st.integers(1, num_groups))
        topk = group_topk * draw(st.integers(1, num_experts // num_groups))
        counts = dict(topk_sum=topk // group_topk, top2_sum=2, max=1)
        group_score = draw(
            st.sampled_from([name for name, count in counts.items() if count <= num_experts // num_groups])
        )
    else:
        topk = draw(st.integers(1, num_experts))
        group_score = "topk_sum"
    # False contradicts a softmax after the top-k (normalised by construction).
    post_softmax = score_function == "softmax" and not use_pre_softmax
    normalize_topk = draw(st.sampled_from([None, True] if post_softmax else [None, True, False]))
    has_bias = bias and not post_softmax and draw(st.booleans())
    scaling_factor = draw(st.sampled_from([None, 1.0, 2.5, 0.3]))
    dtype = draw(st.sampled_from(dtypes))
    num_tokens = draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, max_tokens)))
    if num_tokens > 1 and draw(st.booleans()):
        batch = draw(st.sampled_from([d for d in range(1, num_tokens + 1) if num_tokens % d == 0]))
        lead_shape = (batch, num_tokens // batch)
    else:
        lead_shape = (num_tokens,)
    pattern = draw(st.sampled_from(patterns))
    if pattern == "tied_groups" and num_groups is None:
        pattern = "ties"
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = _in_dtype(_logits(rng, (*lead_shape, num_experts), pattern, num_groups or 1), dtype)
    expert_bias = None
    if has_bias:
        expert_bias = (
            rng.choice(np.array([0.0, 0.25], dtype=np.float32), size=num_experts)
            if pattern in ("ties", "tied_groups")
            else (0.5 * rng.standard_normal(num_experts)).astype(np.float32)
        )
        if pattern == "tied_groups":
            expert_bias = np.tile(expert_bias[: num_experts // num_groups], num_groups)
    return RouterProblem(
        lead_shape=lead_shape,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        dtype=dtype,
        pattern=pattern,
        logits=logits,
        bias=expert_bias,
        normalize_topk=normalize_topk,
        group_score=group_score,
    )


@dataclass(frozen=True)
class AuxLossProblem:
    probs: np.ndarray  # [R, C] float32, exactly representable in `dtype`
    tokens_per_expert: np.ndarray  # [C]
    total_num_tokens: int
    num_experts: int
    topk: int
    coeff: float
    dtype: str
    counts_dtype: str


@st.composite
def aux_loss_problems(draw, *, max_rows: int = 150, max_experts: int = 12) -> AuxLossProblem:
    num_experts = draw(st.integers(1, max_experts))
    num_cols = num_experts * draw(st.sampled_from([1, 1, 2, 3]))  # > 1: a sequence-level [seq, batch * E]
    num_rows = draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, max_rows)))
    dtype = draw(st.sampled_from(LOGITS_DTYPES))
    counts_dtype = draw(st.sampled_from(["int32", "int64", "float32"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return AuxLossProblem(
        probs=_in_dtype(rng.random((num_rows, num_cols)).astype(np.float32), dtype),
        tokens_per_expert=rng.integers(0, 3 * max(num_rows, 1), size=num_cols).astype(counts_dtype),
        total_num_tokens=max(num_rows, 1) * draw(st.sampled_from([1, 2])),
        num_experts=num_experts,
        topk=draw(st.integers(1, num_experts)),
        coeff=draw(st.sampled_from([1.0, 1e-2, 0.37])),
        dtype=dtype,
        counts_dtype=counts_dtype,
    )


@functools.cache
def interpreted_kernels_problem() -> str | None:
    """Why the kernels cannot run under TRITON_INTERPRET=1 in a fresh process on this machine
    (moetriton.kernels.interpreter_problem: Triton 3.6's interpreter with NumPy 2.4), or None. Tests that
    force the interpreter in a subprocess skip with this reason."""
    code = "from moetriton.kernels import interpreter_problem; print(interpreter_problem() or '')"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip() or None


def skip_unless_interpreter_runs(what: str) -> None:
    """Skips the calling test, naming `what`, where the kernels cannot run under TRITON_INTERPRET=1 in a
    fresh process (interpreted_kernels_problem)."""
    if problem := interpreted_kernels_problem():
        pytest.skip(f"{what} runs the kernels interpreted, which cannot run here: {problem}")


def run_test_module(module: str, *, drop: tuple[str, ...] = (), **env: str) -> str:
    """Runs `python -m <module>` from the repository root with the current environment, minus the
    variables in `drop`, plus `env` (e.g. XLA_FLAGS, which jax reads once, at import); fails with its
    output unless it exits 0. Returns its stdout."""
    environment = {name: value for name, value in os.environ.items() if name not in drop}
    result = subprocess.run(
        [sys.executable, "-m", module],
        cwd=Path(__file__).resolve().parents[1],
        env=dict(environment, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
