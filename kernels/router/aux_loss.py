"""The load-balancing loss: the aux-loss scores (fused_compute_score_for_moe_aux_loss) and the aux loss
(fused_moe_aux_loss), forward and backward kernels and plans."""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ..runtime.plan import (
    DEFAULT_DEVICE,
    Buffer,
    DeviceInfo,
    Launch,
    Plan,
    SearchSpace,
    Sizes,
    cached,
    cdiv,
    next_pow2,
    sized_by,
)
from .bitmap import routing_map_buffer
from .scores import (
    _INT64_MIN,
    _TILE_ELEMENTS,
    _TILE_PARAMS,
    _activation,
    _activation_grad,
    _kth_key,
    _logits_tile,
    _order_keys,
    _rows_plan,
    _softmax_rows,
    grad_logits_outputs,
)

AUX_SCORES_SPACE = SearchSpace("router_aux_scores", _TILE_PARAMS)


AUX_SCORES_BACKWARD_SPACE = SearchSpace("router_aux_scores_backward", _TILE_PARAMS)


#: Aux-loss partial sums: at most this many programs, each over at least _MIN_LOSS_ROWS rows.
_MAX_LOSS_BLOCKS = 512


_MIN_LOSS_ROWS = 64


@triton.jit
def _aux_scores_forward_kernel(
    logits_ptr,  # [T, E]
    num_tokens,
    routing_map_ptr,  # [T, E] bool
    scores_ptr,  # [T, E] fp32
    NUM_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    SCORE_FUNCTION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
):
    """Aux-loss scores. Grid (cdiv(T, BLOCK_T),): program b writes, for tokens [b*BLOCK_T, (b+1)*BLOCK_T),
    scores = softmax(x), or a / (sum_E a + 1e-20) for sigmoid / sqrtsoftplus (always normalised), and the
    top-K mask of those scores (no bias, groups or scaling)."""
    cols, valid, offsets, x = _logits_tile(logits_ptr, num_tokens, NUM_EXPERTS, BLOCK_T, EXPERTS_POW2)
    if SCORE_FUNCTION == 0:
        scores = _softmax_rows(x, valid)
    else:
        act = tl.where(valid, _activation(x, SCORE_FUNCTION), 0.0)
        scores = act / (tl.sum(act, axis=1)[:, None] + 1e-20)
    keys = tl.where(valid, _order_keys(scores, cols[None, :], EXPERTS_POW2), _INT64_MIN)
    selected = valid & (keys >= _kth_key(keys, TOPK)[:, None])
    tl.store(scores_ptr + offsets, scores, mask=valid)
    tl.store(routing_map_ptr + offsets, selected, mask=valid)


@triton.jit
def _aux_scores_backward_kernel(
    grad_scores_ptr,  # [T, E]
    logits_ptr,  # [T, E]
    num_tokens,
    grad_logits_ptr,  # [T, E] logits dtype
    NUM_EXPERTS: tl.constexpr,
    SCORE_FUNCTION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
):
    """Backward of the aux-loss scores. Grid (cdiv(T, BLOCK_T),): program b recomputes the scores of its
    tokens and writes grad_logits: softmax s * (g - sum g s); sigmoid / sqrtsoftplus
    (g / S - sum(g a) / S^2) * da/dx over all E, S = sum_E a + 1e-20."""
    _, valid, offsets, x = _logits_tile(logits_ptr, num_tokens, NUM_EXPERTS, BLOCK_T, EXPERTS_POW2)
    grad = tl.load(grad_scores_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    if SCORE_FUNCTION == 0:
        scores = _softmax_rows(x, valid)
        dot = tl.sum(tl.where(valid, grad * scores, 0.0), axis=1)
        dx = scores * (grad - dot[:, None])
    else:
        act = tl.where(valid, _activation(x, SCORE_FUNCTION), 0.0)
        total = tl.sum(act, axis=1)[:, None] + 1e-20
        dot = tl.sum(tl.where(valid, grad * act, 0.0), axis=1)[:, None]
        dx = (grad / total - dot / (total * total)) * _activation_grad(x, act, SCORE_FUNCTION)
    tl.store(grad_logits_ptr + offsets, dx.to(grad_logits_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _total_tokens(total_ptr, total, TOTAL_ON_DEVICE: tl.constexpr):
    """total_num_tokens as an fp32 scalar, from a 0-dim device array or a scalar argument."""
    if TOTAL_ON_DEVICE:
        return tl.load(total_ptr).to(tl.float32)
    else:
        # `total` may arrive as a constexpr (Triton specialises 1), so it is widened by addition.
        return tl.full([], 0.0, tl.float32) + total


@triton.jit
def _aux_loss_scale(tokens, COEFF: tl.constexpr):
    """C = COEFF / tokens^2 for tokens >= 1 (a NaN total gives NaN); below 1 the division is not made."""
    no_tokens = tokens < 1.0
    return no_tokens, COEFF / tl.where(no_tokens, 1.0, tokens * tokens)


@triton.jit
def _aux_loss_partial_kernel(
    probs_ptr,  # [R, C]
    counts_ptr,  # [C] tokens per expert (column)
    num_rows,
    num_cols,
    rows_per_block,
    partials_ptr,  # [B] fp32
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Aux-loss stage 1. Grid (B,): program b sums rows [b*rows_per_block, (b+1)*rows_per_block) of
    probs per column (fp32, fixed order), weights each column by its token count and stores the sum."""
    block = tl.program_id(0)
    first = block * rows_per_block
    last = tl.minimum(first + rows_per_block, num_rows)
    partial = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, num_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < num_cols
        acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        for r0 in range(first, last, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows[:, None] < last) & col_ok[None, :]
            acc += tl.load(
                probs_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0
            ).to(tl.float32)
        counts = tl.load(counts_ptr + cols, mask=col_ok, other=0).to(tl.float32)
        partial += tl.sum(acc, axis=0) * counts
    tl.store(partials_ptr + block, tl.sum(partial, axis=0))


@triton.jit
def _aux_loss_finish_kernel(
    partials_ptr,  # [B] fp32
    total_ptr,  # 0-dim total_num_tokens (TOTAL_ON_DEVICE)
    total,
    num_blocks,
    loss_ptr,  # 0-dim
    COEFF: tl.constexpr,
    TOTAL_ON_DEVICE: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    """Aux-loss stage 2. Grid (1,): adds the B partials in a fixed order and scales by
    C = COEFF / total^2, COEFF = num_experts * coeff / topk; a total below 1 (no tokens) gives 0."""
    blocks = tl.arange(0, BLOCKS_POW2)
    partials = tl.load(partials_ptr + blocks, mask=blocks < num_blocks, other=0.0)
    no_tokens, scale = _aux_loss_scale(_total_tokens(total_ptr, total, TOTAL_ON_DEVICE), COEFF)
    # No tokens, no loss: exactly 0 whatever the probs hold.
    loss = tl.where(no_tokens, 0.0, tl.sum(partials, axis=0) * scale)
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))


@triton.jit
def _aux_loss_backward_kernel(
    grad_loss_ptr,  # 0-dim
    counts_ptr,  # [C]
    total_ptr,  # 0-dim total_num_tokens (TOTAL_ON_DEVICE)
    total,
    num_rows,
    num_cols,
    grad_probs_ptr,  # [R, C]
    COEFF: tl.constexpr,
    TOTAL_ON_DEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Aux-loss backward. Grid (cdiv(R, BLOCK_R), cdiv(C, BLOCK_C)): program (i, j) writes its tile of
    grad_probs[r, c] = C * tokens_per_expert[c] * grad_loss (the loss is linear in probs); 0 for a total
    below 1."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < num_cols
    no_tokens, scale = _aux_loss_scale(_total_tokens(total_ptr, total, TOTAL_ON_DEVICE), COEFF)
    scale *= tl.load(grad_loss_ptr).to(tl.float32)
    counts = tl.load(counts_ptr + cols, mask=col_ok, other=0).to(tl.float32)
    grad = tl.zeros([BLOCK_R, BLOCK_C], tl.float32) + tl.where(no_tokens, 0.0, counts * scale)[None, :]
    tl.store(
        grad_probs_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :],
        grad.to(grad_probs_ptr.dtype.element_ty),
        mask=(rows[:, None] < num_rows) & col_ok[None, :],
    )


def aux_scores_outputs(num_tokens, num_experts, routing_map_format: str = "bytemap") -> dict[str, Buffer]:
    """routing_map (`routing_map_buffer`), scores [T, E] fp32."""
    return {
        "routing_map": routing_map_buffer(num_tokens, num_experts, routing_map_format),
        "scores": Buffer((num_tokens, num_experts), "float32"),
    }


def aux_loss_outputs(loss_dtype: str = "like:probs") -> dict[str, Buffer]:
    """The 0-dim loss."""
    return {"loss": Buffer((), loss_dtype)}


def aux_loss_backward_outputs(num_rows, num_cols, probs_dtype: str) -> dict[str, Buffer]:
    """grad_probs [R, C]."""
    return {"grad_probs": Buffer((num_rows, num_cols), probs_dtype)}


@sized_by(Sizes(axes=dict(num_tokens=("logits", 0), num_experts=("logits", 1))))
@cached
def aux_scores_plan(
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    score_function: str,
    routing_map_format: str = "bytemap",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """fused_compute_score_for_moe_aux_loss forward. Input "logits" [T, E]. Results: routing_map (bool
    [T, E], or with routing_map_format "bitmap" uint8 [T, ceil(E / 8)], packed from a bool scratch map by a
    second launch), scores [T, E] fp32."""
    return _rows_plan(
        _aux_scores_forward_kernel,
        AUX_SCORES_SPACE,
        inputs=("logits",),
        buffers=aux_scores_outputs(num_tokens, num_experts, routing_map_format),
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        routing_map_format=routing_map_format,
        device=device,
        config=config,
    )


@sized_by(Sizes(axes=dict(num_tokens=("logits", 0), num_experts=("logits", 1))))
@cached
def aux_scores_backward_plan(
    *,
    num_tokens: int,
    num_experts: int,
    score_function: str,
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Backward of the aux-loss scores. Inputs: "grad_scores" [T, E], "logits" [T, E]. Result:
    grad_logits [T, E] in the logits dtype."""
    return _rows_plan(
        _aux_scores_backward_kernel,
        AUX_SCORES_BACKWARD_SPACE,
        inputs=("grad_scores", "logits"),
        buffers=grad_logits_outputs(num_tokens, num_experts),
        num_tokens=num_tokens,
        num_experts=num_experts,
        score_function=score_function,
        device=device,
        config=config,
    )


def _loss_tiles(num_cols: int) -> tuple[int, int]:
    block_c = min(next_pow2(num_cols), 1024)
    return max(1, _TILE_ELEMENTS // block_c), block_c


def _coeff(num_experts: int, topk: int, coeff: float) -> float:
    return num_experts * coeff / topk


@sized_by(Sizes(axes=dict(num_rows=("probs", 0), num_cols=("probs", 1))))
@cached
def aux_loss_plan(
    *,
    num_rows: int,
    num_cols: int,
    num_experts: int,
    topk: int,
    coeff: float,
    total: int | None,
    loss_dtype: str = "like:probs",
) -> Plan:
    """fused_moe_aux_loss forward. Inputs: "probs" [R, C], "counts" [C], "total" (0-dim, used when
    `total` is None). Result: loss, a 0-dim array of `loss_dtype`.

    The partial-sum grid depends on the shape only (not on the device), so the result is the same bits on
    every run and every GPU.
    """
    block_r, block_c = _loss_tiles(num_cols)
    num_blocks = max(1, min(_MAX_LOSS_BLOCKS, cdiv(num_rows, _MIN_LOSS_ROWS)))
    rows_per_block = cdiv(num_rows, num_blocks)
    buffers = {"partials": Buffer((num_blocks,), "float32"), **aux_loss_outputs(loss_dtype)}
    on_device = total is None
    partial = Launch(
        kernel=_aux_loss_partial_kernel,
        grid=(num_blocks,),
        args=("probs", "counts", num_rows, num_cols, rows_per_block),
        outputs=("partials",),
        constexprs=dict(BLOCK_R=block_r, BLOCK_C=block_c),
        num_warps=4,
    )
    finish = Launch(
        kernel=_aux_loss_finish_kernel,
        grid=(1,),
        args=("partials", "total", 0 if on_device else total, num_blocks),
        outputs=("loss",),
        constexprs=dict(
            COEFF=_coeff(num_experts, topk, coeff),
            TOTAL_ON_DEVICE=on_device,
            BLOCKS_POW2=next_pow2(num_blocks),
        ),
        num_warps=4,
    )
    return Plan(buffers, (partial, finish), ("loss",))


@sized_by(Sizes())
@cached
def aux_loss_backward_plan(
    *,
    num_rows: int,
    num_cols: int,
    num_experts: int,
    topk: int,
    coeff: float,
    total: int | None,
    probs_dtype: str,
) -> Plan:
    """Backward of the aux loss. Inputs: "grad_loss" (0-dim), "counts" [C], "total" (0-dim, used when
    `total` is None). Result: grad_probs [R, C] of `probs_dtype`."""
    buffers = aux_loss_backward_outputs(num_rows, num_cols, probs_dtype)
    if num_rows == 0:
        return Plan(buffers, (), ("grad_probs",))
    block_r, block_c = _loss_tiles(num_cols)
    on_device = total is None
    launch = Launch(
        kernel=_aux_loss_backward_kernel,
        grid=(cdiv(num_rows, block_r), cdiv(num_cols, block_c)),
        args=("grad_loss", "counts", "total", 0 if on_device else total, num_rows, num_cols),
        outputs=("grad_probs",),
        constexprs=dict(
            COEFF=_coeff(num_experts, topk, coeff),
            TOTAL_ON_DEVICE=on_device,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        ),
        num_warps=4,
    )
    return Plan(buffers, (launch,), ("grad_probs",))
