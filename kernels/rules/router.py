"""Argument rules of the router ops, shared by both bindings.

Bindings describe arrays as (shape, dtype name) with numpy-style dtype names and call these functions
before launching. Every error names the argument and what was expected: TypeError for an argument of the
wrong kind (a float where an int is expected, a list for an array), ValueError for a wrong value. The rules
here need no array values, so they never cost a device sync.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from .validation import INDEX_DTYPES, check_routing_map_format, fail, require_array

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOGITS_DTYPES = ("float32", "bfloat16", "float16")
BIAS_DTYPES = ("float32", "bfloat16", "float16")
PROBS_DTYPES = ("float32", "bfloat16", "float16")
COUNT_DTYPES = ("int32", "int64", "float32", "bfloat16", "float16")
TOTAL_DTYPES = ("int32", "int64", "float32")
#: Largest number of experts the router kernels take: one token's scores live in one program's registers.
MAX_EXPERTS = 8192
#: Each op's options (its plan builder's arguments that no array gives), in the order both bindings and
#: the references take them.
TOPK_OPTIONS = (
    "topk",
    "use_pre_softmax",
    "num_groups",
    "group_topk",
    "scaling_factor",
    "score_function",
    "return_indices",
    "routing_map_format",
    "normalize_topk",
    "group_score",
)
TOPK_BACKWARD_OPTIONS = (
    "topk",
    "use_pre_softmax",
    "scaling_factor",
    "score_function",
    "routing_map_format",
    "normalize_topk",
)
#: How group-limited routing scores a group: the sum of its top K / group_topk selection scores (TE), the
#: sum of its top 2 whatever K (DeepSeek-V3), or its largest score (DeepSeek-V2's group_limited_greedy).
GROUP_SCORES = ("topk_sum", "top2_sum", "max")
AUX_SCORES_OPTIONS = ("topk", "score_function", "routing_map_format")

Desc = tuple[tuple[int, ...], str]


def _int(name: str, value, *, low: int, high: int | None = None) -> int:
    """A Python (or numpy) integer in [low, high]; bools and floats are rejected (TypeError)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        fail(name, f"expected an int in {bound}, got {value}")
    return value


def _real(name: str, value) -> float:
    """A finite Python real number (int or float, not bool; TypeError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    if not math.isfinite(value):
        fail(name, f"expected a finite number, got {value}")
    return float(value)


def _score_function(score_function) -> str:
    if score_function not in SCORE_FUNCTIONS:
        fail("score_function", f"expected one of {SCORE_FUNCTIONS}, got {score_function!r}")
    return score_function


def _logits(logits: Desc) -> tuple[int, int]:
    """(tokens, experts) of logits [..., E]: leading dimensions flatten to tokens."""
    require_array("logits", logits)
    shape, dtype = logits
    if len(shape) < 1:
        fail("logits", f"expected shape [..., num_experts] (at least 1-D), got {tuple(shape)}")
    if dtype not in LOGITS_DTYPES:
        fail("logits", f"expected dtype in {LOGITS_DTYPES} (router math is fp32), got {dtype}")
    num_experts = shape[-1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        fail("logits", f"expected 1 <= num_experts (last dim) <= {MAX_EXPERTS}, got {num_experts}")
    return math.prod(shape[:-1]), num_experts


def normalizes_topk(score_function: str, use_pre_softmax: bool, topk: int, normalize_topk) -> bool:
    """Whether the K selected weights are renormalised (w / (sum_selected w + 1e-20)).

    None keeps TE's rule: sigmoid / sqrtsoftplus renormalise iff K > 1, softmax over all E before the
    top-k does not. True / False force it for those paths. A softmax after the top-k is normalised by
    construction (True), so False contradicts it and is refused.
    """
    if normalize_topk is not None and not isinstance(normalize_topk, bool):
        raise TypeError(f"normalize_topk: expected a bool or None, got {type(normalize_topk).__name__}")
    if score_function == "softmax" and not use_pre_softmax:
        if normalize_topk is False:
            fail(
                "normalize_topk",
                "False contradicts score_function 'softmax' with use_pre_softmax=False (a softmax over "
                "the selected logits sums to 1); pass use_pre_softmax=True for unnormalised softmax weights",
            )
        return True
    if normalize_topk is None:
        return score_function != "softmax" and topk > 1
    return normalize_topk


def group_score_count(group_score, topk: int, group_topk: int) -> int:
    """How many of a group's largest selection scores add up to its score (`GROUP_SCORES`)."""
    if group_score not in GROUP_SCORES:
        fail("group_score", f"expected one of {GROUP_SCORES}, got {group_score!r}")
    if group_score == "max":
        return 1
    if group_score == "top2_sum":
        return 2
    return topk // group_topk


@dataclass(frozen=True)
class TopkConfig:
    """Normalised arguments of fused_topk_with_score_function. num_groups = group_topk = 0: no groups."""

    num_tokens: int
    num_experts: int
    topk: int
    score_function: str
    use_pre_softmax: bool
    num_groups: int
    group_topk: int
    scaling_factor: float
    has_bias: bool
    routing_map_format: str = "bytemap"
    #: Resolved by `normalizes_topk` (always a bool).
    normalize_topk: bool = False
    group_score: str = "topk_sum"
    #: routing_indices given: the selection is replayed from them.
    replay: bool = False


def _check_routing_indices(routing_indices: Desc, lead_shape: tuple[int, ...], topk: int) -> None:
    """routing_indices [..., K]: logits' leading dims, K = topk, an integer dtype of `INDEX_DTYPES`."""
    require_array("routing_indices", routing_indices)
    shape, dtype = routing_indices
    expected = (*lead_shape, topk)
    if tuple(shape) != expected:
        fail(
            "routing_indices",
            f"expected shape {expected} (logits' leading dims, then topk = {topk}), got {tuple(shape)}",
        )
    if dtype not in INDEX_DTYPES:
        fail("routing_indices", f"expected dtype in {INDEX_DTYPES} (expert ids), got {dtype}")


def check_topk(
    *,
    logits: Desc,
    topk,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    score_function,
    expert_bias: Desc | None,
    routing_map_format="bytemap",
    normalize_topk=None,
    group_score="topk_sum",
    routing_indices: Desc | None = None,
) -> TopkConfig:
    """Validates fused_topk_with_score_function arguments.

    `use_pre_softmax` only matters for softmax and is ignored for sigmoid/sqrtsoftplus (as in TE). Groups:
    both `num_groups` and `group_topk` or neither; E % num_groups == 0, group_topk <= num_groups,
    topk % group_topk == 0 and topk / group_topk <= E / num_groups (each chosen group supplies the same
    number of experts). `group_score` (`GROUP_SCORES`) needs groups unless it is the default, and its
    count of scores per group must fit in a group. `normalize_topk`: see `normalizes_topk`.
    `expert_bias` needs a score before the top-k that it can shift: sigmoid, sqrtsoftplus, or softmax with
    use_pre_softmax=True. `routing_map_format`: see `check_routing_map_format`. `routing_indices`
    (replay): expert ids shaped like logits with the last dim topk instead of E, int32 or int64; every
    other argument is checked as without it (groups and bias are valid arguments that then change nothing).
    Their values are not checked: an id outside [0, E) or repeated in its row selects nothing.
    """
    num_tokens, num_experts = _logits(logits)
    topk = _int("topk", topk, low=1, high=num_experts)
    score_function = _score_function(score_function)
    if group_score not in GROUP_SCORES:
        fail("group_score", f"expected one of {GROUP_SCORES}, got {group_score!r}")
    if not isinstance(use_pre_softmax, bool):
        raise TypeError(f"use_pre_softmax: expected a bool, got {type(use_pre_softmax).__name__}")
    if (num_groups is None) != (group_topk is None):
        fail(
            "num_groups / group_topk",
            f"pass both (group-limited top-k) or neither, got num_groups={num_groups}, "
            f"group_topk={group_topk}",
        )
    if num_groups is None:
        num_groups = group_topk = 0
        if group_score != "topk_sum":
            fail("group_score", f"needs groups (num_groups and group_topk), got group_score={group_score!r}")
    else:
        num_groups = _int("num_groups", num_groups, low=1, high=num_experts)
        if num_experts % num_groups:
            fail("num_groups", f"expected a divisor of num_experts = {num_experts}, got {num_groups}")
        group_topk = _int("group_topk", group_topk, low=1, high=num_groups)
        if topk % group_topk:
            fail("group_topk", f"expected a divisor of topk = {topk}, got {group_topk}")
        if topk // group_topk > num_experts // num_groups:
            fail(
                "topk",
                f"expected topk / group_topk <= experts per group = {num_experts // num_groups}, "
                f"got {topk} / {group_topk}",
            )
        per_group = group_score_count(group_score, topk, group_topk)
        if per_group > num_experts // num_groups:
            fail(
                "group_score",
                f"{group_score!r} scores a group by its top {per_group}, but a group has "
                f"{num_experts // num_groups} experts",
            )
    use_pre_softmax = use_pre_softmax and score_function == "softmax"
    normalize_topk = normalizes_topk(score_function, use_pre_softmax, topk, normalize_topk)
    scaling_factor = 1.0 if scaling_factor is None else _real("scaling_factor", scaling_factor)
    if expert_bias is not None:
        require_array("expert_bias", expert_bias)
        if score_function == "softmax" and not use_pre_softmax:
            fail(
                "expert_bias",
                "needs scores before the top-k to shift: score_function 'sigmoid' or 'sqrtsoftplus', or "
                "'softmax' with use_pre_softmax=True (a softmax after the top-k only sees the selected "
                "logits)",
            )
        shape, dtype = expert_bias
        if tuple(shape) != (num_experts,):
            fail("expert_bias", f"expected shape ({num_experts},) (one per expert), got {tuple(shape)}")
        if dtype not in BIAS_DTYPES:
            fail("expert_bias", f"expected dtype in {BIAS_DTYPES}, got {dtype}")
    if routing_indices is not None:
        _check_routing_indices(routing_indices, tuple(logits[0][:-1]), topk)
    return TopkConfig(
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        has_bias=expert_bias is not None,
        routing_map_format=check_routing_map_format(routing_map_format),
        normalize_topk=normalize_topk,
        group_score=group_score,
        replay=routing_indices is not None,
    )


def check_aux_scores(
    *, logits: Desc, topk, score_function, routing_map_format="bytemap"
) -> tuple[int, int, int, str, str]:
    """Validates fused_compute_score_for_moe_aux_loss; returns (tokens, experts, topk, score_function,
    routing-map format name)."""
    num_tokens, num_experts = _logits(logits)
    topk = _int("topk", topk, low=1, high=num_experts)
    format_name = check_routing_map_format(routing_map_format)
    return num_tokens, num_experts, topk, _score_function(score_function), format_name


@dataclass(frozen=True)
class AuxLossConfig:
    num_rows: int
    num_cols: int
    num_experts: int
    topk: int
    coeff: float
    total: int | None  # a Python int total, or None when it is a device scalar


def check_aux_loss(
    *, probs: Desc, tokens_per_expert: Desc, total_num_tokens, num_experts, topk, coeff
) -> AuxLossConfig:
    """Validates fused_moe_aux_loss. `total_num_tokens` is a Python int >= 1 or a Desc of a 0-dim array
    (whose value is never checked: below 1 it means no tokens, and the loss is 0).

    probs is [rows, cols] with cols a multiple of num_experts (a sequence-level loss passes
    [seq, batch * E]); tokens_per_expert has one count per column.
    """
    require_array("probs", probs)
    require_array("tokens_per_expert", tokens_per_expert)
    shape, dtype = probs
    if len(shape) != 2:
        fail("probs", f"expected a 2-D array [tokens, cols], got shape {tuple(shape)}")
    if dtype not in PROBS_DTYPES:
        fail("probs", f"expected dtype in {PROBS_DTYPES}, got {dtype}")
    num_rows, num_cols = shape
    num_experts = _int("num_experts", num_experts, low=1)
    if num_cols % num_experts:
        fail("probs", f"expected shape[1] a multiple of num_experts = {num_experts}, got {num_cols}")
    counts_shape, counts_dtype = tokens_per_expert
    if tuple(counts_shape) != (num_cols,):
        fail("tokens_per_expert", f"expected shape ({num_cols},) (probs.shape[1]), got {tuple(counts_shape)}")
    if counts_dtype not in COUNT_DTYPES:
        fail("tokens_per_expert", f"expected dtype in {COUNT_DTYPES}, got {counts_dtype}")
    topk = _int("topk", topk, low=1, high=num_experts)
    coeff = _real("coeff", coeff)
    if isinstance(total_num_tokens, tuple):
        require_array("total_num_tokens", total_num_tokens)
        total_shape, total_dtype = total_num_tokens
        if tuple(total_shape) != ():
            fail("total_num_tokens", f"expected a 0-dim array or a Python int, got shape {total_shape}")
        if total_dtype not in TOTAL_DTYPES:
            fail("total_num_tokens", f"expected dtype in {TOTAL_DTYPES}, got {total_dtype}")
        total = None
    else:
        total = _int("total_num_tokens", total_num_tokens, low=1)
    return AuxLossConfig(num_rows, num_cols, num_experts, topk, coeff, total)
