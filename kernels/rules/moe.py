"""The MoE layer's rules, shared by the PyTorch and JAX layers: option names and values, and the shapes of
the weights, checked with the same messages in both frameworks.

What differs between the frameworks is idiomatic and passed in as data: the router weight's layout
(PyTorch's nn.Linear [E, H], JAX's [H, E]), how many experts a rank's expert weights hold (PyTorch: the
local L = E / EP; JAX: all E, sharded by the mesh) and which row exchanges the framework offers. Sizes of
the exchange itself come from `expert_parallel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .expert_parallel import GATED_ACTIVATIONS, gate_up_width
from .router import SCORE_FUNCTIONS

#: Expert activations, in both layers: gated ones take gate_up [.., H, 2F] ([gate | up]), the others
#: [.., H, F].
ACTIVATIONS = tuple(GATED_ACTIVATIONS)

#: Row exchanges of the dropless layer with EP > 1, by name. Every framework offers "auto" and
#: "all_to_all"; the others are one framework's.
EXCHANGES = {
    "auto": "the fastest exchange the group allows (both frameworks; docs/moe.md says which)",
    "all_to_all": "exactly the routed rows through the framework's all-to-all (PyTorch "
    "all_to_all_single with chunk sorts; JAX ragged_all_to_all, also named 'ragged')",
    "ragged": "JAX: the same as 'all_to_all'",
    "padded": "JAX: each pair's rows padded to one of a few block sizes, one fixed-size all_to_all",
    "peer": "PyTorch, GPUs of one host: rows copied through peer memory straight into expert-major order",
}
TORCH_EXCHANGES = ("auto", "all_to_all", "peer")
JAX_EXCHANGES = ("auto", "all_to_all", "ragged", "padded")


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check_options(
    *, activation, score_function, aux_loss_coeff, exchange, exchanges: tuple[str, ...]
) -> None:
    """The layer's option values: an activation of ACTIVATIONS, a score function, a finite aux-loss
    coefficient >= 0 (TypeError for a non-number) and an exchange among the framework's `exchanges`."""
    if activation not in ACTIVATIONS:
        _fail("activation", f"expected one of {ACTIVATIONS}, got {activation!r}")
    if score_function not in SCORE_FUNCTIONS:
        _fail("score_function", f"expected one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if isinstance(aux_loss_coeff, bool) or not isinstance(aux_loss_coeff, int | float):
        raise TypeError(f"aux_loss_coeff: expected a Python float, got {type(aux_loss_coeff).__name__}")
    if not (0 <= aux_loss_coeff < math.inf):  # comparisons: torch.compile traces them on a Python float
        _fail("aux_loss_coeff", f"expected a finite number >= 0, got {aux_loss_coeff!r}")
    if exchange not in exchanges:
        _fail("exchange", f"expected one of {exchanges}, got {exchange!r}")


@dataclass(frozen=True)
class LayerShape:
    hidden: int  # H
    num_experts: int  # E
    ffn: int  # F


def check_weights(
    *,
    x_shape: tuple[int, ...],
    gate: tuple[str, str, int, int],
    gate_up: tuple[int, ...],
    down: tuple[int, ...],
    expert_bias: tuple[int, ...] | None,
    experts_held: int | None,
    activation: str,
    score_function: str,
) -> LayerShape:
    """Shapes of the layer's arrays; returns (H, E, F).

    x_shape: [..., H]. gate: (argument name, its layout as the framework writes it, e.g. "[E, H]", E, H)
    as read from the router weight. gate_up [n, H, 2F] (gated) or [n, H, F], down [n, F, H], with n the
    experts a rank's weights hold: `experts_held` (PyTorch: L = E / EP), or E when None (JAX).
    expert_bias: [E] or None (sigmoid / sqrtsoftplus only)."""
    gate_name, gate_layout, num_experts, hidden = gate
    if len(x_shape) < 1 or x_shape[-1] != hidden:
        _fail("x", f"expected [..., H] with H = {hidden} (as {gate_name} {gate_layout}), got {list(x_shape)}")
    held = num_experts if experts_held is None else experts_held
    gated = GATED_ACTIVATIONS[activation]
    if len(down) != 3:
        _fail("down", f"expected [n, F, H] (n = {held} experts held), got shape {list(down)}")
    ffn = down[1]
    width = gate_up_width(activation, ffn)
    expected = [held, hidden, width]
    if list(gate_up) != expected:
        _fail(
            "gate_up",
            f"expected [n, H, {'2F' if gated else 'F'}] = {expected} (n = {held} experts held, F = {ffn} from"
            f" down), got {list(gate_up)}",
        )
    if list(down) != [held, ffn, hidden]:
        _fail("down", f"expected [n, F, H] = {[held, ffn, hidden]}, got {list(down)}")
    if expert_bias is not None:
        if score_function == "softmax":
            _fail("expert_bias", "only supported with score_function 'sigmoid' or 'sqrtsoftplus'")
        if list(expert_bias) != [num_experts]:
            _fail("expert_bias", f"expected [E] = [{num_experts}], got {list(expert_bias)}")
    return LayerShape(hidden, num_experts, ffn)
