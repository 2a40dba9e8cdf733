"""The expert activation in PyTorch: moetriton::activate and its backward, one kernel per direction over
every row of the expert hidden states (the MoE layer's expert MLP runs it between its grouped GEMMs)."""

from __future__ import annotations

from torch import Tensor

from moetriton import kernels

from . import reference
from ._op import Op, PlanBinding, trailing

_ACTIVATE = PlanBinding(
    kernels.activation_plan,
    lambda hidden, activation: dict(hidden=hidden, group_sizes=None),
    trailing("activation"),
    reference.activate,
    first=True,
)


def _activate(hidden: Tensor, activation: str) -> Tensor:
    """[M, F]: the expert activation of every row of hidden [M, 2F] (gated) or [M, F], in one kernel."""
    return _ACTIVATE.run(hidden, activation)


def _activate_setup(ctx, inputs, output):
    hidden, ctx.activation = inputs
    ctx.save_for_backward(hidden)


def _activate_backward(ctx, grad):
    if grad is None:
        return None, None
    (hidden,) = ctx.saved_tensors
    return ACTIVATE_BACKWARD(grad, hidden, ctx.activation), None


_ACTIVATE_BACKWARD = PlanBinding(
    kernels.activation_backward_plan,
    lambda grad, hidden, activation: dict(hidden=hidden, grad=grad.to(hidden.dtype), group_sizes=None),
    trailing("activation"),
    reference.activate_backward,
    first=True,
)


def _activate_backward_op(grad: Tensor, hidden: Tensor, activation: str) -> Tensor:
    """[M, W]: the gradient of `_activate` with respect to hidden, in one kernel."""
    return _ACTIVATE_BACKWARD.run(grad, hidden, activation)


ACTIVATE_BACKWARD = Op("activate_backward", _activate_backward_op, _ACTIVATE_BACKWARD.fake)
ACTIVATE = Op("activate", _activate, _ACTIVATE.fake, setup=_activate_setup, backward=_activate_backward)
