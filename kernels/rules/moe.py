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
from typing import Any, NamedTuple

from .expert_parallel import GATED_ACTIVATIONS, gate_up_width
from .fp8 import RECIPES as FP8_RECIPES
from .router import BIAS_DTYPES as ROUTER_BIAS_DTYPES
from .router import SCORE_FUNCTIONS, TOPK_OPTIONS, check_topk

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


#: Capacity drop policies (with capacity_factor): which of its routed slots a full expert keeps. Either way
#: every expert keeps min(routed, C) slots, so `dropped` is the same number.
DROP_POLICIES = {
    "position": "its first C slots in (token, slot) order: earlier tokens win",
    "probs": "its C slots of highest routing probability, ties to the earlier slot in (token, slot) order",
}

#: The counts the two load-balancing losses (load_balancing_loss, seq_load_balancing_loss) weigh the scores
#: by, `balance_counts`: where an expert bias or group limits steer the selection, the slots routed and the
#: top-K of the unbiased scores differ.
BALANCE_COUNTS = {
    "routed": "the slots the router routed (expert bias and group limits included, before any capacity "
    "drop): the load the experts are asked to take, which the bias update balances too",
    "scores": "the top-K of the aux-loss scores themselves (no bias, no groups: the routing map of "
    "fused_compute_score_for_moe_aux_loss), as Megatron-Core counts them and DeepSeek-V3 defines its "
    "sequence-wise loss",
}

#: The layer's one rule for a token whose logits, probabilities or activations are not finite (NaN, +-inf),
#: under every score function, drop policy and capacity, the same in both frameworks and their references
#: (docs/moe.md, "Non-finite values"), by the stage it concerns:
NON_FINITE = {
    "padding": "a masked token's values are never read (it enters the layer as zeros), whatever they hold",
    "routing": "the router's rule (docs/router.md): NaN scores rank below every number, so a token with "
    "NaN logits takes its experts among its other scores first, then the lowest-index NaN ones; its "
    "probabilities and merging weights follow IEEE arithmetic (NaN, or inf, where the formula meets one)",
    "position": "a slot's place under drop_policy 'position' depends on its position alone: a token with "
    "non-finite values takes its places like any other",
    "probs": "drop_policy 'probs' ranks an expert's slots by merging weight, descending, NaN below every "
    "number (-inf included), equal weights (-0.0 and +0.0, NaN and NaN) to the earlier slot: a slot of "
    "NaN weight is the first to be dropped",
    "kept": "a kept slot adds w * expert(x) to its token's output in fp32, with IEEE arithmetic: a "
    "non-finite weight, token or activation makes that token's output non-finite; every row is computed "
    "on its own, so no other token's output changes",
    "dropped": "a dropped slot adds exactly nothing, whatever its weight or expert output: a token with "
    "every slot dropped and no shared experts gets a zero row",
    "shared": "every unmasked token's shared-expert output is added, with IEEE arithmetic",
    "statistics": "counts (routed, kept, dropped, loads) are exact integers whatever the values; the losses "
    "follow IEEE arithmetic, so a non-finite logit of an unmasked token makes every loss that reads it "
    "non-finite and the training step sees it",
    "gradients": "IEEE arithmetic: the sums over tokens (the router weight's gradient, the shared "
    "experts', the expert weights' of the experts that kept a slot) take a non-finite token's terms as "
    "they come, so they are non-finite wherever such a term is (an overflowing activation times a zero "
    "derivative can still add 0); a finite token's own input gradient stays finite",
}

#: The layer's losses, by coefficient. Each is global over the token group (every rank's unmasked tokens),
#: scaled by its coefficient, and added into the layer's aux_loss; MoEStats reports each one.
#: T: unmasked tokens of the token group; E experts, top K; routed_e: slots routed to expert e (with
#: balance_counts="scores": tokens whose top K of score_t. holds e; BALANCE_COUNTS); score_te: the
#: normalised aux scores of `fused_compute_score_for_moe_aux_loss` (softmax, or sigmoid / sqrtsoftplus
#: divided by their sum over E); logits_t: the router logits in fp32.
LOSSES = {
    "aux_loss_coeff": "load_balancing_loss = coeff * E / (K * T^2) * sum_e routed_e * sum_t score_te "
    "(switch / GShard)",
    "seq_aux_loss_coeff": "seq_load_balancing_loss = coeff * mean over sequences b with n_b > 0 unmasked "
    "tokens of sum_e (E / (K * n_b) * routed_be) * (1 / n_b * sum_{t in b} score_te) (DeepSeek-V3's "
    "sequence-wise loss; needs x [B, S, H])",
    "z_loss_coeff": "z_loss = coeff / T * sum_t logsumexp(logits_t)^2 (ST-MoE router z-loss)",
}


class MoEStats(NamedTuple):
    """What one layer call measured, every field a device array (no host sync), global over the token
    group; the layers return it with `return_stats=True`.

    load_balancing_loss, seq_load_balancing_loss, z_loss: fp32 scalars, each times its coefficient
    (LOSSES; zero with a zero coefficient); their sum is the layer's aux_loss.
    routed: [E] int32, slots routed to each expert; kept: [E] int32, those the capacity policy kept
    (routed when dropless); dropped: int32 scalar, sum(routed - kept); max_load: int32 scalar, max(kept);
    mean_load: fp32 scalar, mean(kept) (max_load / mean_load is the load imbalance)."""

    load_balancing_loss: Any
    seq_load_balancing_loss: Any
    z_loss: Any
    routed: Any
    kept: Any
    dropped: Any
    max_load: Any
    mean_load: Any

    @classmethod
    def of(cls, losses: Any, routed: Any, kept: Any, dropped: Any, mean_load: Any) -> MoEStats:
        """From the [3] losses (LOSSES' order), the counts and the mean load, in the framework's arrays."""
        return cls(losses[0], losses[1], losses[2], routed, kept, dropped, kept.max(), mean_load)


#: Dtypes of update_expert_bias's counts: integers. A float count may already be rounded (bf16 holds 257 as
#: 256, fp32 every count above 2^24 only to a multiple of 2 or more), and a rounded count can flip its
#: expert's update; MoEStats.routed is int32.
BIAS_COUNT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
BIAS_DTYPES = ROUTER_BIAS_DTYPES

#: Dtypes of the layers' tokens and weights (and JAX's compute dtype).
LAYER_DTYPES = ("float32", "bfloat16", "float16")


def check_layer_dtypes(
    *, x: str, weights: dict[str, str | None], same_as_x: bool, compute: str | None = None
) -> None:
    """The dtype names of the layer's arrays: x in LAYER_DTYPES; every weight given (None: absent) x's
    dtype exactly where `same_as_x` (PyTorch: parameters are used as they are, never cast per call), else
    any of LAYER_DTYPES (JAX: cast to the compute dtype `compute`, itself one of them, default x's)."""
    if x not in LAYER_DTYPES:
        _fail("x", f"expected dtype in {LAYER_DTYPES}, got {x}")
    if compute is not None and compute not in LAYER_DTYPES:
        _fail("dtype", f"expected a compute dtype in {LAYER_DTYPES}, got {compute}")
    for name, dtype in weights.items():
        if dtype is None:
            continue
        if dtype not in LAYER_DTYPES:
            _fail(name, f"expected dtype in {LAYER_DTYPES}, got {dtype}")
        if same_as_x and dtype != x:
            _fail(name, f"expected dtype {x} (as x), got {dtype}")


#: The router's options of the layers, in this order: the top-k's but for the outputs' forms (the layer
#: needs the indices and a bool map).
ROUTER_OPTIONS = tuple(name for name in TOPK_OPTIONS if name not in ("return_indices", "routing_map_format"))


def check_router(*, num_tokens: int, num_experts: int, logits_dtype: str, expert_bias, **router) -> None:
    """The router's options (ROUTER_OPTIONS, by name) and expert bias (shape, dtype name), by the router's
    own rules
    (moetriton.kernels.rules.router.check_topk), at the start of the layer call: before any collective, so
    that a bad option fails on every rank alike rather than on some after they have started one."""
    check_topk(logits=((num_tokens, num_experts), logits_dtype), expert_bias=expert_bias, **router)


def check_bias_update(
    *, expert_bias: tuple[tuple[int, ...], str], routed: tuple[tuple[int, ...], str], update_rate
) -> None:
    """update_expert_bias's arguments as (shape, dtype name): expert_bias a float [E] (BIAS_DTYPES), routed
    integer counts [E] (BIAS_COUNT_DTYPES: float counts are refused, not converted), update_rate a finite
    Python number >= 0 (TypeError for a non-number)."""
    check_coefficient("update_rate", update_rate)
    (bias_shape, bias_dtype), (shape, dtype) = expert_bias, routed
    if len(bias_shape) != 1 or bias_dtype not in BIAS_DTYPES:
        _fail(
            "expert_bias",
            f"expected a float [E] (dtype in {BIAS_DTYPES}), got {bias_dtype} {list(bias_shape)}",
        )
    if list(shape) != list(bias_shape):
        _fail("routed", f"expected [E] = {list(bias_shape)}, got {list(shape)}")
    if dtype not in BIAS_COUNT_DTYPES:
        _fail(
            "routed",
            f"expected integer counts (dtype in {BIAS_COUNT_DTYPES}), got {dtype}: a float count may already"
            " be rounded (bf16 holds 257 as 256), which can flip an expert's update",
        )


def check_bias_counts_value(smallest: int) -> None:
    """Value rule of update_expert_bias's counts, for bindings that read them (free on the host, or with the
    debug switch): no count is negative."""
    if smallest < 0:
        _fail("routed", f"expected counts >= 0, got {smallest}")


def bias_update_direction(routed: Any) -> Any:
    """sign(mean(routed) - routed) [E] of integer counts [E], exactly: +1 below the mean, -1 above it, 0 at
    it, with no float rounding and no sum larger than the largest count can overflow (numpy, JAX and
    PyTorch arrays alike; JAX without x64 computes in int32).

    With q, r = divmod(routed, E) elementwise (floor division), sum(routed) = E * (sum(q) + sum(r) // E) +
    sum(r) % E, so the mean lies in [m, m + 1) with m = sum(q) + sum(r) // E and equals m exactly when
    sum(r) % E == 0: a count below m is below the mean, one above m above it, and one equal to m below it
    unless the mean is m. sum(q) <= sum(routed) / E <= the largest count and sum(r) < E^2, so no partial sum
    passes the counts' own range. Exact for negative counts too (floor semantics in every framework).

    Example:
        >>> import numpy as np
        >>> bias_update_direction(np.array([2**24 + 1, 2**24 - 1, 2**24, 2**24])).tolist()
        [-1, 1, 0, 0]
    """
    num_experts = routed.shape[0]
    quotients, remainders = routed // num_experts, routed % num_experts
    spread = remainders.sum()
    mean_floor = quotients.sum() + spread // num_experts
    mean_above_floor = spread % num_experts > 0
    below = (routed < mean_floor) | ((routed == mean_floor) & mean_above_floor)
    return below * 1 - (routed > mean_floor) * 1


#: The shared experts' weight arguments of both layers (and parameters of both modules), in this order.
SHARED_WEIGHTS = ("shared_gate_up", "shared_down", "shared_gate")


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check_coefficient(name: str, value) -> None:
    """A loss coefficient or rate: a finite Python number >= 0 (TypeError for a non-number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    if not (0 <= value < math.inf):  # comparisons: torch.compile traces them on a Python float
        _fail(name, f"expected a finite number >= 0, got {value!r}")


def check_options(
    *,
    activation,
    score_function,
    exchange,
    exchanges: tuple[str, ...],
    drop_policy="position",
    pipeline_chunks=1,
    capacity_factor=None,
    return_stats=False,
    balance_counts="routed",
    probs_on_input=False,
    topk=None,
    fp8=None,
    **coefficients,
) -> None:
    """The layer's option values: an activation of ACTIVATIONS, a score function, an exchange among the
    framework's `exchanges`, a drop policy of DROP_POLICIES, pipeline_chunks an int >= 1 (above 1 only
    dropless: capacity_factor None), return_stats a bool (TypeError otherwise: it decides how many results
    come back), balance_counts one of BALANCE_COUNTS, fp8 None or an FP8 recipe's name (FP8_RECIPES),
    probs_on_input a bool and True only with topk 1
    (where given), and, for each loss coefficient given by name (aux_loss_coeff, seq_aux_loss_coeff,
    z_loss_coeff: LOSSES), a finite number >= 0 (TypeError for a non-number)."""
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats: expected a bool, got {type(return_stats).__name__}")
    if activation not in ACTIVATIONS:
        _fail("activation", f"expected one of {ACTIVATIONS}, got {activation!r}")
    if score_function not in SCORE_FUNCTIONS:
        _fail("score_function", f"expected one of {SCORE_FUNCTIONS}, got {score_function!r}")
    for name, coeff in coefficients.items():
        if name not in LOSSES:
            raise TypeError(f"check_options: unexpected keyword {name!r}")
        check_coefficient(name, coeff)
    if exchange not in exchanges:
        _fail("exchange", f"expected one of {exchanges}, got {exchange!r}")
    if drop_policy not in DROP_POLICIES:
        _fail("drop_policy", f"expected one of {tuple(DROP_POLICIES)}, got {drop_policy!r}")
    if balance_counts not in BALANCE_COUNTS:
        _fail("balance_counts", f"expected one of {tuple(BALANCE_COUNTS)}, got {balance_counts!r}")
    if fp8 is not None and fp8 not in FP8_RECIPES:
        _fail("fp8", f"expected None or one of {tuple(FP8_RECIPES)}, got {fp8!r}")
    if not isinstance(probs_on_input, bool):
        _fail("probs_on_input", f"expected a bool, got {probs_on_input!r}")
    if probs_on_input and topk is not None and topk != 1:
        # The weight scales the token before the expert sees it: with K > 1 every slot of a token would
        # need its own scaled copy of the row (Megatron-Core's moe_apply_probs_on_input has the same rule).
        _fail("probs_on_input", f"expected topk 1 (one weight per token to scale its input), got topk {topk}")
    if not isinstance(pipeline_chunks, int) or isinstance(pipeline_chunks, bool) or pipeline_chunks < 1:
        _fail("pipeline_chunks", f"expected an int >= 1, got {pipeline_chunks!r}")
    if pipeline_chunks > 1 and capacity_factor is not None:
        # Chunks of a capacity layer would each keep C slots per expert: other slots dropped than the
        # layer's, so its results would depend on the chunking.
        _fail(
            "pipeline_chunks",
            f"expected 1 with capacity_factor={capacity_factor} (chunks are dropless only),"
            f" got {pipeline_chunks}",
        )


def check_tokens(
    *,
    x_shape: tuple[int, ...],
    token_mask: tuple[tuple[int, ...], str] | None,
    seq_aux_loss_coeff,
    routing_indices: tuple[tuple[int, ...], str] | None = None,
    topk: int = 0,
) -> None:
    """x [..., H] against the token options: token_mask (its shape and dtype name, or None) must be bool
    of x's leading shape (True: a token the layer routes; False: padding, routed nowhere, counted in no
    loss, load or capacity, output zero); the sequence-wise loss needs x [B, S, H]. routing_indices (router
    replay: the expert ids the router takes instead of choosing, moetriton's router `routing_indices`) must
    be int32 or int64 [..., K] of x's leading shape."""
    if seq_aux_loss_coeff and len(x_shape) != 3:
        _fail("x", f"expected [B, S, H] with seq_aux_loss_coeff > 0 (sequences), got {list(x_shape)}")
    if token_mask is not None:
        shape, dtype = token_mask
        if list(shape) != list(x_shape[:-1]) or dtype != "bool":
            _fail(
                "token_mask",
                f"expected bool {list(x_shape[:-1])} (x's leading shape), got {dtype} {list(shape)}",
            )
    if routing_indices is not None:
        shape, dtype = routing_indices
        expected = [*x_shape[:-1], topk]
        if list(shape) != expected or dtype not in ("int32", "int64"):
            _fail(
                "routing_indices",
                f"expected int32 or int64 {expected} (x's leading shape, topk), got {dtype} {list(shape)}",
            )


@dataclass(frozen=True)
class LayerOptions:
    """The layer's scalar options with the defaults both layers give them (the functional layers and
    modules spell them out as keywords; the dense references take them as ``**options`` through this
    record, so an option added here reaches both references at once)."""

    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    normalize_topk: bool | None = None
    group_score: str = "topk_sum"
    aux_loss_coeff: float = 0.0
    align_size: int | None = None
    activation: str = "swiglu"
    capacity_factor: float | None = None
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    drop_policy: str = "position"
    pipeline_chunks: int = 1  # the dropless routed path in this many token chunks (results unchanged)
    probs_on_input: bool = False  # the merging weight scales the expert's input, not its output (top-1)
    fp8: str | None = None  # the routed experts' GEMMs in FP8 by this recipe (FP8_RECIPES), else as the dtype
    balance_counts: str = "routed"  # BALANCE_COUNTS: the counts of the two load-balancing losses


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
    use_pre_softmax: bool = False,
) -> LayerShape:
    """Shapes of the layer's arrays; returns (H, E, F).

    x_shape: [..., H]. gate: (argument name, its layout as the framework writes it, e.g. "[E, H]", E, H)
    as read from the router weight. gate_up [n, H, 2F] (gated) or [n, H, F], down [n, F, H], with n the
    experts a rank's weights hold: `experts_held` (PyTorch: L = E / EP), or E when None (JAX).
    expert_bias: [E] or None (sigmoid / sqrtsoftplus, or softmax with use_pre_softmax: a score before the
    top-k for it to shift)."""
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
        if score_function == "softmax" and use_pre_softmax is not True:
            _fail(
                "expert_bias",
                "only supported with score_function 'sigmoid' or 'sqrtsoftplus', or 'softmax' with "
                "use_pre_softmax=True (a softmax after the top-k only sees the selected logits)",
            )
        if list(expert_bias) != [num_experts]:
            _fail("expert_bias", f"expected [E] = [{num_experts}], got {list(expert_bias)}")
    return LayerShape(hidden, num_experts, ffn)


#: The layers' optional bias arrays (GPT-OSS's): the router's logit bias and each expert's projection biases.
BIASES = ("gate_bias", "gate_up_bias", "down_bias")


def bias_shapes(
    *,
    hidden: int,
    ffn: int,
    num_experts: int,
    experts_held: int,
    activation: str,
    gate_bias: bool,
    projection_biases: bool,
) -> dict[str, tuple[int, ...]]:
    """The modules' bias parameters by name: gate_bias [E] with `gate_bias`, and gate_up_bias [n, 2F] ([n, F]
    non-gated) and down_bias [n, H] with `projection_biases` (n: the experts a rank's weights hold)."""
    shapes = dict(gate_bias=(num_experts,)) if gate_bias else {}
    if projection_biases:
        shapes.update(
            gate_up_bias=(experts_held, gate_up_width(activation, ffn)), down_bias=(experts_held, hidden)
        )
    return shapes


def check_biases(
    *,
    shape: LayerShape,
    experts_held: int | None,
    activation: str,
    gate_bias: tuple[int, ...] | None,
    gate_up_bias: tuple[int, ...] | None,
    down_bias: tuple[int, ...] | None,
) -> None:
    """Shapes of the optional biases, each independent of the others: gate_bias [E] (added to the router's
    logits before any score), gate_up_bias [n, 2F] (gated; [n, F] otherwise) and down_bias [n, H] (added
    to each expert's projections), n the experts a rank's weights hold as in `check_weights`."""
    held = shape.num_experts if experts_held is None else experts_held
    expected = dict(
        gate_bias=("[E]", [shape.num_experts]),
        gate_up_bias=(
            f"[n, {'2F' if GATED_ACTIVATIONS[activation] else 'F'}]",
            [held, gate_up_width(activation, shape.ffn)],
        ),
        down_bias=("[n, H]", [held, shape.hidden]),
    )
    given = dict(gate_bias=gate_bias, gate_up_bias=gate_up_bias, down_bias=down_bias)
    for name, bias_shape in given.items():
        layout, sizes = expected[name]
        if bias_shape is not None and list(bias_shape) != sizes:
            _fail(name, f"expected {layout} = {sizes} (n = {held} experts held), got {list(bias_shape)}")


def shared_ffn_dim(num_shared_experts, ffn: int, shared_expert_gate: bool) -> int:
    """Width Fs of the modules' shared FFN: `num_shared_experts` always-on experts of F = `ffn` columns
    each are one FFN of width num_shared_experts * F (as Megatron builds them); 0 for none. A gate needs a
    shared FFN to scale."""
    count = num_shared_experts
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        _fail("num_shared_experts", f"expected an int >= 0, got {num_shared_experts!r}")
    if shared_expert_gate and num_shared_experts == 0:
        _fail("shared_expert_gate", "expected False without shared experts (num_shared_experts = 0)")
    return num_shared_experts * ffn


def shared_weight_shapes(
    *, hidden: int, ffn: int, num_shared_experts, shared_expert_gate: bool, activation: str
) -> dict[str, tuple[int, ...]]:
    """The modules' shared-expert parameters by name (validating the two options): shared_gate_up [H, 2Fs]
    (gated) or [H, Fs] and shared_down [Fs, H] with Fs = num_shared_experts * F, and shared_gate [H, 1]
    with the gate; none without shared experts."""
    shared_ffn = shared_ffn_dim(num_shared_experts, ffn, shared_expert_gate)
    if not shared_ffn:
        return {}
    shapes = dict(shared_gate_up=(hidden, gate_up_width(activation, shared_ffn)))
    shapes["shared_down"] = (shared_ffn, hidden)
    if shared_expert_gate:
        shapes["shared_gate"] = (hidden, 1)
    return shapes


def check_shared_weights(
    *,
    hidden: int,
    activation: str,
    shared_gate_up: tuple[int, ...] | None,
    shared_down: tuple[int, ...] | None,
    shared_gate: tuple[int, ...] | None,
) -> int | None:
    """Shapes of the shared experts' weights; returns the shared FFN width Fs, or None without one.

    The routed experts' layout without the expert axis, the same in both frameworks: shared_gate_up
    [H, 2Fs] ([gate | up], gated activations) or [H, Fs], shared_down [Fs, H] (both or neither), and the
    optional per-token gate weight shared_gate [H, 1] (only with the shared FFN)."""
    if shared_gate_up is None and shared_down is None:
        if shared_gate is not None:
            _fail("shared_gate", "expected None without shared_gate_up and shared_down (nothing to gate)")
        return None
    for name, shape in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down)):
        if shape is None:
            _fail(name, "expected an array: shared_gate_up and shared_down come together, got None")
    if len(shared_down) != 2 or shared_down[1] != hidden:
        _fail("shared_down", f"expected [Fs, H] with H = {hidden}, got shape {list(shared_down)}")
    shared_ffn = shared_down[0]
    expected = [hidden, gate_up_width(activation, shared_ffn)]
    if list(shared_gate_up) != expected:
        columns = "2Fs" if GATED_ACTIVATIONS[activation] else "Fs"
        _fail(
            "shared_gate_up",
            f"expected [H, {columns}] = {expected} (Fs = {shared_ffn} from shared_down), got"
            f" {list(shared_gate_up)}",
        )
    if shared_gate is not None and list(shared_gate) != [hidden, 1]:
        _fail("shared_gate", f"expected [H, 1] = [{hidden}, 1], got {list(shared_gate)}")
    return shared_ffn
