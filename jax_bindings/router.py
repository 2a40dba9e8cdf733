"""JAX router: fused top-k with score functions, aux-loss scores and the aux loss.

Same names, arguments and semantics as moetriton.torch.router (see moetriton.kernels.router and
docs/router.md). Every op is a jax.custom_vjp over kernel calls that run through `executor.run_builder`:
jax-triton on GPU, the Triton interpreter through jax.pure_callback on CPU when TRITON_INTERPRET=1, and
otherwise `moetriton.jax.reference_router`.

Sharding: every kernel call is a token-parallel ShardedOp (moetriton.jax._sharding, the partitioning code of
every op). Tokens are independent, so the token axis keeps its sharding and each device routes its own
tokens; the expert axis is replicated. The aux
loss reduces over tokens: each device sums its rows and the partial losses are psum-ed over the token mesh
axes, so a token-sharded `fused_moe_aux_loss` returns the GLOBAL loss (the same value as unsharded). Inside
a partitioned computation the kernels run only on GPU: JAX cannot keep a host callback alive there
(https://github.com/jax-ml/jax/issues/23620), so on CPU meshes each device runs the reference. The
token-wise ops also work under jax.vmap (the batch folds into the token axis). Never imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from moetriton import kernels
from moetriton.kernels.rules import router as rules

from . import reference_router as reference
from ._sharding import SUM, WHOLE, ShardedOp, call, explicit_results, on_explicit_mesh
from .executor import describe, run_builder

# Local computations: (use_kernels, options, *arrays) -> results. `options` holds the static arguments in the
# order the reference functions take them after their array arguments.


def _topk_local(use_kernels, options, logits, bias=None, routing_indices=None):
    if not use_kernels:
        return reference.topk_forward(logits, bias, *options, routing_indices=routing_indices)
    named = dict(zip(rules.TOPK_OPTIONS, options, strict=True))
    inputs = dict(logits=logits, bias=bias, routing_indices=routing_indices)
    return tuple(run_builder(kernels.topk_plan, inputs, **named).values())


def _replay_local(use_kernels, options, logits, routing_indices):
    """`_topk_local` replaying the selection `routing_indices` (the bias would change nothing: not taken)."""
    return _topk_local(use_kernels, options, logits, routing_indices=routing_indices)


def _topk_backward_local(use_kernels, options, grad_probs, logits, routing_map):
    if not use_kernels:
        return (reference.topk_backward(grad_probs, logits, routing_map, *options),)
    inputs = dict(grad_probs=grad_probs, logits=logits, routing_map=routing_map)
    named = dict(zip(rules.TOPK_BACKWARD_OPTIONS, options, strict=True))
    return tuple(run_builder(kernels.topk_backward_plan, inputs, **named).values())


def _scores_local(use_kernels, options, logits):
    if not use_kernels:
        return reference.aux_scores_forward(logits, *options)
    named = dict(zip(rules.AUX_SCORES_OPTIONS, options, strict=True))
    return tuple(run_builder(kernels.aux_scores_plan, dict(logits=logits), **named).values())


def _scores_backward_local(use_kernels, options, grad_scores, logits):
    (score_function,) = options
    if not use_kernels:
        return (reference.aux_scores_backward(grad_scores, logits, score_function),)
    inputs = dict(grad_scores=grad_scores, logits=logits)
    return tuple(
        run_builder(kernels.aux_scores_backward_plan, inputs, score_function=score_function).values()
    )


def _loss_local(use_kernels, options, probs, counts, total=None):
    """Sum of this shard's rows, scaled by the global coefficient: an fp32 0-dim partial loss."""
    total_int, num_experts, topk, coeff = options
    total_num_tokens = total_int if total is None else total
    if not use_kernels:
        return (reference.aux_loss(probs, counts, total_num_tokens, num_experts, topk, coeff),)
    results = run_builder(
        kernels.aux_loss_plan,
        dict(probs=probs, counts=counts, total=total),
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
        total=total_int if total is None else None,
        loss_dtype="float32",
    )
    return tuple(results.values())


def _loss_backward_local(use_kernels, options, rows, grad_loss, counts, total=None):
    """grad_probs of this shard's rows. `rows` is the forward's probs, never read: it gives the backward a
    token axis, so the gradient takes the sharding of probs (a zero-width slice loses it under Shardy)."""
    probs_dtype, total_int, num_experts, topk, coeff = options
    total_num_tokens = total_int if total is None else total
    if not use_kernels:
        grad = reference.aux_loss_backward(
            grad_loss, rows.shape[0], probs_dtype, counts, total_num_tokens, num_experts, topk, coeff
        )
        return (grad,)
    results = run_builder(
        kernels.aux_loss_backward_plan,
        dict(grad_loss=grad_loss, counts=counts, total=total),
        num_rows=rows.shape[0],
        num_cols=counts.shape[0],
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
        total=total_int if total is None else None,
        probs_dtype=probs_dtype,
    )
    return tuple(results.values())


# Sharded ops -----------------------------------------------------------------------------------------------
# Every kernel call is a token-parallel ShardedOp (moetriton.jax._sharding): tokens keep their sharding, the
# expert axis and the replicated inputs (bias, counts, total) stay whole, and the aux loss is a SUM result,
# psum-ed over the token mesh axes.

_op = dataclasses.dataclass(frozen=True, kw_only=True)


@_op
class _RouterOp(ShardedOp):
    """A router kernel call: `local(use_kernels, options, *arrays)` runs it on one shard's arrays."""

    local: Callable
    options: tuple
    arg_names: tuple[str, ...]
    result_names: tuple[str, ...]

    token_parallel: ClassVar[bool] = True
    layouts: ClassVar[dict[str, tuple[str, ...]]] = {
        "logits": ("t", "e"),
        "bias": (WHOLE, "e"),
        "probs": ("t", "e"),
        "routing_map": ("t", "e"),
        "bitmap": ("t", "b"),
        "indices": ("t", "k"),
        "routing_indices": ("t", "k"),
        "grad_probs": ("t", "e"),
        "grad_logits": ("t", "e"),
        "scores": ("t", "e"),
        "grad_scores": ("t", "e"),
        "rows": ("t", "c"),
        "loss_probs": ("t", "c"),
        "counts": (WHOLE, "c"),
        "total": (WHOLE,),
        "grad_loss": (WHOLE,),
        "loss": (SUM,),
        "grad_rows": ("t", "c"),
    }

    @property
    def args(self) -> tuple[str, ...]:
        return self.arg_names

    @property
    def results(self) -> tuple[str, ...]:
        return self.result_names

    def one_shard(self, arrays: dict[str, jax.Array], use_kernels: bool) -> dict[str, jax.Array]:
        outs = self.local(use_kernels, self.options, *(arrays[name] for name in self.arg_names))
        return dict(zip(self.result_names, outs, strict=True))


def _op_of(local: Callable, options: tuple, args: dict[str, jax.Array | None], results: tuple[str, ...]):
    """The router kernel call of `local` on the present `args` (name -> array or None), and those arrays."""
    present = {name: value for name, value in args.items() if value is not None}
    op = _RouterOp(local=local, options=options, arg_names=tuple(present), result_names=results)
    return op, tuple(present.values())


def _call(local: Callable, options: tuple, args: dict[str, jax.Array | None], results: tuple[str, ...]):
    """Runs a router kernel call on the present `args` (name -> array or None)."""
    op, arrays = _op_of(local, options, args, results)
    return call(op, *arrays)


def _explicit(local: Callable, options: tuple, args: dict[str, jax.Array | None], results: tuple[str, ...]):
    """`explicit_results` of the router kernel call a differentiable op's forward makes."""
    op, arrays = _op_of(local, options, args, results)
    return explicit_results(op, *arrays)


def _map_name(routing_map_format: str) -> str:
    """The name a routing map goes by in a router call: its layout differs by format (a bitmap's second axis
    is ceil(E / 8) bytes, not the E experts of the probs beside it)."""
    return "bitmap" if routing_map_format == "bitmap" else "routing_map"


# Differentiable ops ------------------------------------------------------------------------------------


def _topk_call(logits, bias, routing_indices, options) -> tuple:
    """(local, options, args, results) of the top-k kernel call: a replay of `routing_indices` when they
    are given (without the bias, which changes nothing there), else the top-k of the scores."""
    map_name = _map_name(dict(zip(rules.TOPK_OPTIONS, options, strict=True))["routing_map_format"])
    results = ("probs", map_name, "indices")
    if routing_indices is None:
        return _topk_local, options, dict(logits=logits, bias=bias), results
    return _replay_local, options, dict(logits=logits, routing_indices=routing_indices), results


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _topk(logits, bias, routing_indices, options):
    return _topk_fwd(logits, bias, routing_indices, options)[0]


def _topk_fwd(logits, bias, routing_indices, options):
    probs, routing_map, indices = _call(*_topk_call(logits, bias, routing_indices, options))
    return (probs, routing_map, indices), (logits, routing_map)


def _topk_bwd(options, residuals, cotangents):
    logits, routing_map = residuals
    named = dict(zip(rules.TOPK_OPTIONS, options, strict=True))
    routing_map_format = named["routing_map_format"]
    (grad_logits,) = _call(
        _topk_backward_local,
        tuple(named[name] for name in rules.TOPK_BACKWARD_OPTIONS),
        {"grad_probs": cotangents[0], "logits": logits, _map_name(routing_map_format): routing_map},
        ("grad_logits",),
    )
    return grad_logits, None, None


_topk.defvjp(_topk_fwd, _topk_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scores(logits, options):
    return _scores_fwd(logits, options)[0]


def _scores_fwd(logits, options):
    results = (_map_name(options[-1]), "scores")
    routing_map, scores = _call(_scores_local, options, dict(logits=logits), results)
    return (routing_map, scores), logits


def _scores_bwd(options, logits, cotangents):
    (grad_logits,) = _call(
        _scores_backward_local,
        (options[1],),
        dict(grad_scores=cotangents[1], logits=logits),
        ("grad_logits",),
    )
    return (grad_logits,)


_scores.defvjp(_scores_fwd, _scores_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _loss(probs, counts, total, options):
    return _loss_fwd(probs, counts, total, options)[0]


def _loss_fwd(probs, counts, total, options):
    _, total_int, num_experts, topk, coeff = options
    (loss,) = _call(
        _loss_local,
        (total_int, num_experts, topk, coeff),
        dict(loss_probs=probs, counts=counts, total=total),
        ("loss",),
    )
    return loss, (probs, counts, total)


def _loss_bwd(options, residuals, grad_loss):
    rows, counts, total = residuals
    (grad_probs,) = _call(
        _loss_backward_local,
        options,
        dict(rows=rows, grad_loss=grad_loss, counts=counts, total=total),
        ("grad_rows",),
    )
    return grad_probs, None, None


_loss.defvjp(_loss_fwd, _loss_bwd)


# Public API --------------------------------------------------------------------------------------------


def fused_topk_with_score_function(
    logits: jax.Array,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: jax.Array | None = None,
    routing_map_format: str = "bytemap",
    *,
    return_indices: bool = False,
    normalize_topk: bool | None = None,
    group_score: str = "topk_sum",
    routing_indices: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Route every token to its top-k experts (fused score function, group limit, bias, scaling).

    Args:
        logits: [..., E] router logits, float32/bfloat16/float16; 1 <= E <= 8192. Leading dims are tokens.
        topk: K experts per token, 1 <= K <= E (a Python int).
        use_pre_softmax: softmax only: softmax over all E before the top-k (probs are those softmax values),
            instead of a softmax over the K selected logits. Ignored for sigmoid / sqrtsoftplus (as TE).
        num_groups, group_topk: group-limited top-k (DeepSeek-V3): experts form num_groups equal groups,
            scored by `group_score`; experts are chosen only in the group_topk best groups. Both or neither.
        scaling_factor: multiplies the probs (a Python float; None = 1.0), after any renormalisation.
        score_function: "softmax", "sigmoid" or "sqrtsoftplus" (sqrt(softplus(x))).
        expert_bias: [E] float bias added to the scores for selection only (the weights use the unbiased
            score; no gradient): with sigmoid / sqrtsoftplus, or softmax with use_pre_softmax=True (the
            softmax over all E is what it shifts; ERNIE-4.5). Not allowed with a softmax after the top-k.
        routing_map_format: "bytemap" (bool [..., E]) or "bitmap" (uint8 [..., ceil(E / 8)]: bit e % 8 of
            byte e // 8 set when the token routes to expert e, LSB first, unused high bits 0); TE's
            "bitmap_u8" and RoutingMapFormat members are accepted too. The bitmap is packed from the bool
            map after the float kernel and unpacked before the backward's, so probs and gradients are the
            bytemap's bit for bit. `token_dispatch(..., routing_map_format="bitmap", num_experts=E)` takes
            the bitmap directly.
        return_indices: also return the selected expert ids [..., K] int32 in rank order (best first).
        normalize_topk: renormalise the K selected weights, w / (sum w + 1e-20). None (TE's rule):
            sigmoid / sqrtsoftplus when K > 1, not the softmax over all E. True / False force it for
            sigmoid / sqrtsoftplus at any K and for use_pre_softmax=True (Qwen3-MoE's and DeepSeek-V3's
            norm_topk_prob). A softmax after the top-k sums to 1 already: False is refused there.
        group_score: how a group is scored: "topk_sum" (the sum of its top K / group_topk selection
            scores, TE), "top2_sum" (the sum of its top 2, DeepSeek-V3) or "max" (its best score,
            DeepSeek-V2's group_limited_greedy). Needs groups; the count must fit in a group.
        routing_indices: replay a selection: [..., K] int32/int64 expert ids (logits' leading dims, K =
            topk), e.g. the `indices` of an earlier call; token-sharded like logits. The selection is these
            ids (groups and expert_bias do not change it); the weights are this call's, computed from
            `logits` as for any selection (score function, use_pre_softmax, normalize_topk,
            scaling_factor), with their gradient. An id outside [0, E), or one repeated in its row after
            its first slot, selects nothing (weight 0, not in the map; -1 in the returned indices). Ids
            are never read on the host.

    Returns:
        (probs [..., E] in logits.dtype, zero outside the selection; routing_map [..., E] bool, or
        [..., ceil(E / 8)] uint8) and, with `return_indices`, indices [..., K] int32 (with
        `routing_indices`: those ids, -1 where a slot selects nothing). Ties go to the lowest expert index;
        NaN scores rank below every number. Math is fp32. Differentiable in logits; token-sharded inputs
        stay sharded.

    Example:
        >>> logits = jnp.array([[1.0, 3.0, 2.0, 3.0]])
        >>> probs, routing_map, indices = fused_topk_with_score_function(logits, 2, return_indices=True)
        >>> routing_map.tolist(), indices.tolist()
        ([[False, True, False, True]], [[1, 3]])
        >>> fused_topk_with_score_function(logits, 2, routing_map_format="bitmap")[1].tolist()
        [[10]]
        >>> replayed = fused_topk_with_score_function(logits, 2, routing_indices=indices, return_indices=True)
        >>> all(bool((a == b).all()) for a, b in zip(replayed, (probs, routing_map, indices)))
        True
        >>> fused_topk_with_score_function(logits, 2, routing_indices=jnp.array([[0, 9]]))[1].tolist()
        [[True, False, False, False]]
    """
    config = rules.check_topk(
        logits=describe(logits),
        topk=topk,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        expert_bias=describe(expert_bias),
        routing_map_format=routing_map_format,
        normalize_topk=normalize_topk,
        group_score=group_score,
        routing_indices=describe(routing_indices),
    )
    if not isinstance(return_indices, bool):
        raise TypeError(f"return_indices: expected a bool, got {type(return_indices).__name__}")
    options = (
        config.topk,
        config.use_pre_softmax,
        config.num_groups,
        config.group_topk,
        config.scaling_factor,
        config.score_function,
        return_indices,
        config.routing_map_format,
        config.normalize_topk,
        config.group_score,
    )
    shape = logits.shape
    flat = logits.reshape(config.num_tokens, config.num_experts)
    if routing_indices is not None:
        routing_indices = routing_indices.reshape(config.num_tokens, config.topk)
    results = _explicit(*_topk_call(flat, expert_bias, routing_indices, options))
    probs, routing_map, indices = on_explicit_mesh(partial(_topk, options=options), results)(
        flat, expert_bias, routing_indices
    )
    result = (probs.reshape(shape), routing_map.reshape(*shape[:-1], routing_map.shape[-1]))
    return (*result, indices.reshape(*shape[:-1], config.topk)) if return_indices else result


def fused_compute_score_for_moe_aux_loss(
    logits: jax.Array, topk: int, score_function: str = "softmax", routing_map_format: str = "bytemap"
) -> tuple[jax.Array, jax.Array]:
    """Scores for the load-balancing loss and their top-k mask (no bias, groups or scaling).

    Args:
        logits: [..., E] float32/bfloat16/float16, 1 <= E <= 8192.
        topk: K, 1 <= K <= E.
        score_function: "softmax" (softmax over E), or "sigmoid" / "sqrtsoftplus", whose activations are
            always normalised over all E experts: a / (sum a + 1e-20).
        routing_map_format: "bytemap" (bool) or "bitmap" (uint8 [..., ceil(E / 8)], LSB first), as in
            fused_topk_with_score_function.

    Returns:
        (routing_map [..., E] bool, or [..., ceil(E / 8)] uint8: the top-K of the scores, ties to the lowest
        index; scores [..., E] float32). Differentiable in logits (through scores).

    Example:
        >>> routing_map, scores = fused_compute_score_for_moe_aux_loss(jnp.zeros((1, 4)), 2, "softmax")
        >>> routing_map.tolist(), scores.tolist()
        ([[True, True, False, False]], [[0.25, 0.25, 0.25, 0.25]])
    """
    num_tokens, num_experts, topk, score_function, routing_map_format = rules.check_aux_scores(
        logits=describe(logits),
        topk=topk,
        score_function=score_function,
        routing_map_format=routing_map_format,
    )
    options = (topk, score_function, routing_map_format)
    flat = logits.reshape(num_tokens, num_experts)
    results = _explicit(_scores_local, options, dict(logits=flat), (_map_name(routing_map_format), "scores"))
    routing_map, scores = on_explicit_mesh(partial(_scores, options=options), results)(flat)
    return routing_map.reshape(*logits.shape[:-1], routing_map.shape[-1]), scores.reshape(logits.shape)


def fused_moe_aux_loss(
    probs: jax.Array,
    tokens_per_expert: jax.Array,
    total_num_tokens: int | jax.Array,
    num_experts: int,
    topk: int,
    coeff: float,
) -> jax.Array:
    """Switch-style load-balancing loss, reduced deterministically (no atomics).

    loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c], C = num_experts * coeff /
    (topk * total_num_tokens^2). Under token sharding the result is the global loss: every device sums its
    rows and the partial losses are psum-ed (TE's JAX op would silently return a per-shard loss).

    Args:
        probs: [R, C] float32/bfloat16/float16 scores (C a multiple of num_experts, e.g. [seq, batch * E]
            for a sequence-level loss).
        tokens_per_expert: [C] int32/int64/float counts (replicated).
        total_num_tokens: a Python int >= 1, or a 0-dim int32/int64/float32 array (traced, no host sync;
            never read on the host). An array total below 1 means no tokens: the loss is exactly 0 and so
            is its gradient (a NaN total gives NaN).
        num_experts, topk: E and K (coefficient only); coeff: the loss weight (a Python float).

    Returns:
        0-dim array in probs.dtype. Differentiable in probs.

    Example:
        >>> probs = jnp.full((4, 2), 0.5)
        >>> float(fused_moe_aux_loss(probs, jnp.array([4, 4]), 4, num_experts=2, topk=1, coeff=1.0))
        2.0
    """
    total_is_array = isinstance(total_num_tokens, jax.Array | np.ndarray)
    config = rules.check_aux_loss(
        probs=describe(probs),
        tokens_per_expert=describe(tokens_per_expert),
        total_num_tokens=describe(total_num_tokens) if total_is_array else total_num_tokens,
        num_experts=num_experts,
        topk=topk,
        coeff=coeff,
    )
    options = (jnp.dtype(probs.dtype).name, config.total or 0, config.num_experts, config.topk, config.coeff)
    total = total_num_tokens if total_is_array else None
    arrays = dict(loss_probs=probs, counts=tokens_per_expert, total=total)
    results = _explicit(_loss_local, options[1:], arrays, ("loss",))
    loss = on_explicit_mesh(partial(_loss, options=options), results and results[0])(*arrays.values())
    return loss.astype(probs.dtype)
