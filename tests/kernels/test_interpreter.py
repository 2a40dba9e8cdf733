"""The interpreter probe (moetriton.kernels.interpreter_problem) agrees with what a real plan does under the
interpreter, and executors turn a reported problem into a clear error instead of a deep interpreter trace."""

from __future__ import annotations

import pytest
import torch

from moetriton import kernels
from moetriton.torch import executor
from tests._plans import dispatch_plan_with_defaults

pytestmark = pytest.mark.skipif(
    not kernels.INTERPRETER, reason="the probe only runs under TRITON_INTERPRET=1 (the CPU suite)"
)


def _dispatch_plan():
    plan = dispatch_plan_with_defaults(
        num_tokens=3, hidden=8, num_experts=2, num_out_tokens=4, element_bytes=4
    )
    inputs = dict(
        inp=torch.arange(24, dtype=torch.float32).reshape(3, 8),
        routing=torch.tensor([[True, True], [False, True], [True, False]]),
        probs=None,
        scales=None,
    )
    return plan, inputs


def test_probe_verdict_matches_a_real_plan():
    plan, inputs = _dispatch_plan()
    problem = kernels.interpreter_problem()
    if problem is None:
        output = executor.run_plan(plan, inputs, torch.device("cpu"))[0]
        # expert 0 takes tokens 0 and 2, expert 1 tokens 0 and 1: rows in expert-major, token order
        assert torch.equal(output, inputs["inp"][[0, 2, 0, 1]])
    else:
        with pytest.raises(RuntimeError, match="interpreter"):
            executor.run_plan(plan, inputs, torch.device("cpu"))


def test_a_reported_problem_is_raised_before_any_launch(monkeypatch):
    monkeypatch.setattr(executor, "interpreter_problem", lambda: "moetriton: the interpreter cannot run here")
    plan, inputs = _dispatch_plan()
    with pytest.raises(RuntimeError, match="cannot run here"):
        executor.run_plan(plan, inputs, torch.device("cpu"))
