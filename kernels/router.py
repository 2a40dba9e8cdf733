"""Router kernels (fused top-k with score functions, aux-loss scores, aux loss) and their launch plans.

Symbols: T tokens, E experts, K = topk, G groups of GS = E / G experts, R x C the aux-loss probs.

Semantics (per token, x = fp32(logits[t]); all math in fp32, outputs in the logits dtype):
    softmax, pre:  s = softmax(x)            select on s,          w = s[selected]
    softmax, post: -                          select on x,          w = softmax(x[selected])
    sigmoid:       a = sigmoid(x)             select on a + bias,   w = a[selected]
    sqrtsoftplus:  a = sqrt(softplus(x))      select on a + bias,   w = a[selected]
    (sigmoid / sqrtsoftplus with K > 1: w = w / (sum(w) + 1e-20))
    probs[t, selected] = scaling_factor * w; routing_map[t, selected] = True; everything else 0 / False.
softplus follows PyTorch (x > 20 -> x). The weights use the unbiased score a itself, not TE's
(a + bias) - bias. Group-limited top-k: a group's score is the sum of its top (K / group_topk) selection
scores (added in descending order); the group_topk best groups are kept and the K experts are chosen only
inside them.

Order. Every selection (experts, groups) ranks by score descending and breaks ties by the LOWEST index.
NaN ranks below every number, -inf included, so a NaN score is only chosen when a token has fewer than K
non-NaN candidates; -0.0 ties with +0.0. Values follow IEEE arithmetic: a NaN or +inf that enters a
softmax or a normalisation makes the affected probs NaN (as the framework references do); outside the
selection probs are exactly 0 regardless.

Ranking works on int64 keys, one per candidate: the fp32 score mapped to an order-preserving int32 in the
high word and (WIDTH - column) in the low word. Keys are unique within a row, so the K-th largest key is
found by K rounds of "largest key below the previous one" (one integer max-reduction each), and the
selection is "key >= K-th key". Excluded candidates (padding, unchosen groups) get the smallest int64.

Layout. One program owns BLOCK_T tokens and holds their scores in registers as a [BLOCK_T, WIDTH] tile.
Without groups WIDTH = next_pow2(E). With groups, column c holds expert (c // GS_POW2) * GS + c % GS_POW2,
so that a reshape to [BLOCK_T, G_POW2, GS_POW2] gives per-group rows; WIDTH = G_POW2 * GS_POW2.
Backward kernels recompute the scores from the logits and the routing map, so nothing fp32 is saved.

Aux loss (TE's definition): loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c],
C = num_experts * coeff / (topk * total_num_tokens^2), and 0 when total_num_tokens is below 1 (a device
total of no tokens). It is reduced without atomics: every program of a
fixed, shape-only grid sums its row stripe to one fp32 partial, and a single program adds the partials in a
fixed order, so the result is bitwise reproducible run to run.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ._jit import _as_bits
from .rules.layout import bitmap_columns
from .runtime import autotune
from .runtime.plan import (
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

#: Score-function ids used as constexprs (the kernels branch on them), one for each of rules.SCORE_FUNCTIONS.
SCORE_FUNCTION_IDS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
#: Heuristic tile: about 1024 elements per program (BLOCK_T = tile / WIDTH, at least one row) and 256 per
#: warp; 8 elements per thread keep the forward at 40-80 registers on sm_90, so an SM holds 64 warps.
_TILE_ELEMENTS = 1024
_WARP_ELEMENTS = 256
# Tunable parameters of the token-block kernels (every config is tested). The aux loss is not tuned: its
# partial-sum grid must depend on the shape only, so that the loss has the same bits on every device.
_TILE_PARAMS = {"tile": (256, 512, 1024, 2048, 4096), "warp_elements": (128, 256, 512)}
TOPK_SPACE = SearchSpace("router_topk", _TILE_PARAMS)
TOPK_BACKWARD_SPACE = SearchSpace("router_topk_backward", _TILE_PARAMS)
AUX_SCORES_SPACE = SearchSpace("router_aux_scores", _TILE_PARAMS)
AUX_SCORES_BACKWARD_SPACE = SearchSpace("router_aux_scores_backward", _TILE_PARAMS)
SEARCH_SPACES = (TOPK_SPACE, TOPK_BACKWARD_SPACE, AUX_SCORES_SPACE, AUX_SCORES_BACKWARD_SPACE)
#: Aux-loss partial sums: at most this many programs, each over at least _MIN_LOSS_ROWS rows.
_MAX_LOSS_BLOCKS = 512
_MIN_LOSS_ROWS = 64

# Sentinels for keys: excluded candidates, "no previous key", and the ordered image of NaN.
_INT64_MIN = tl.constexpr(-(2**63))
_INT64_MAX = tl.constexpr(2**63 - 1)
_NAN_ORDER = tl.constexpr(-(2**31))


# ----------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)); softplus(x) = x for x > 20 (PyTorch's threshold), else log1p(exp(x)).

    log1p is Kahan's log(u) * e / (u - 1) with u = 1 + e, accurate for tiny e = exp(x). `tl.where`, not
    tl.minimum, clamps the exponent, so NaN stays NaN.
    """
    e = tl.exp(tl.where(x > 20.0, 20.0, x))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.sqrt(tl.where(x > 20.0, x, log1p))


@triton.jit
def _activation(x, SCORE_FUNCTION: tl.constexpr):
    """a(x) of sigmoid (1) or sqrtsoftplus (2)."""
    if SCORE_FUNCTION == 1:
        return tl.sigmoid(x)
    else:
        return _sqrt_softplus(x)


@triton.jit
def _activation_grad(x, a, SCORE_FUNCTION: tl.constexpr):
    """da/dx given a = a(x): a(1 - a) for sigmoid; sigmoid(x) / (2a + eps) for sqrtsoftplus (1 / (2a + eps)
    past the softplus threshold), eps = 1e-20 as in TE, so a = 0 gives 0 rather than 0 / 0."""
    if SCORE_FUNCTION == 1:
        return a * (1.0 - a)
    else:
        slope = tl.where(x > 20.0, 1.0, tl.sigmoid(x))
        return slope / (2.0 * a + 1e-20)


@triton.jit
def _softmax_rows(x, valid):
    """Row softmax over the `valid` entries of a [BLOCK_T, WIDTH] tile (0 elsewhere)."""
    xm = tl.where(valid, x, float("-inf"))
    m = tl.max(xm, axis=1)
    e = tl.where(valid, tl.exp(xm - m[:, None]), 0.0)
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _order_keys(score, cols, WIDTH: tl.constexpr):
    """int64 keys ordered like (score descending, column ascending), NaN below -inf, -0.0 == +0.0.

    High word: the fp32 bits as a signed int32 with the magnitude bits of negatives flipped (an
    order-preserving map); low word: WIDTH - column (>= 1, so real keys stay above the int64 minimum).
    """
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(score != score, _NAN_ORDER, ordered)
    return (ordered.to(tl.int64) << 32) | (WIDTH - cols).to(tl.int64)


@triton.jit
def _key_score(keys):
    """The fp32 score a key was made from (NaN for NaN and for excluded keys)."""
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _kth_key(keys, K: tl.constexpr):
    """K-th largest key of every row of a 2-D key tile (keys are unique within a row)."""
    kth = tl.full([keys.shape[0]], _INT64_MAX, tl.int64)
    for _ in range(K):
        kth = tl.max(tl.where(keys < kth[:, None], keys, _INT64_MIN), axis=1)
    return kth


@triton.jit
def _ranked_columns(keys, K: tl.constexpr, K_POW2: tl.constexpr, WIDTH: tl.constexpr):
    """(K-th largest key, [BLOCK_T, K_POW2] columns of the K largest keys in rank order)."""
    kth = tl.full([keys.shape[0]], _INT64_MAX, tl.int64)
    ranks = tl.arange(0, K_POW2)
    columns = tl.zeros([keys.shape[0], K_POW2], tl.int32)
    for k in range(K):
        kth = tl.max(tl.where(keys < kth[:, None], keys, _INT64_MIN), axis=1)
        column = WIDTH - kth.to(tl.int32)  # the low word: int64 -> int32 keeps it
        columns = tl.where(ranks[None, :] == k, column[:, None], columns)
    return kth, columns


@triton.jit
def _logits_tile(
    logits_ptr, num_tokens, NUM_EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr, EXPERTS_POW2: tl.constexpr
):
    """The [BLOCK_T, EXPERTS_POW2] tile of program b's tokens [b*BLOCK_T, (b+1)*BLOCK_T) in [T, E] arrays
    (the ungrouped kernels' layout, column == expert): (columns, the mask of the entries inside [T, E],
    their int64 offsets, the logits in fp32, 0 outside)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, EXPERTS_POW2)
    valid = row_ok[:, None] & (cols[None, :] < NUM_EXPERTS)
    offsets = rows.to(tl.int64)[:, None] * NUM_EXPERTS + cols[None, :]
    x = tl.load(logits_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    return cols, valid, offsets, x


@triton.jit
def _keep_best_groups(
    keys,
    BLOCK_T: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    PER_GROUP: tl.constexpr,
    GROUP_TOPK: tl.constexpr,
):
    """Group-limited selection: keys of experts outside the GROUP_TOPK best groups become the minimum.

    A group's score is the sum of its PER_GROUP largest scores, added in descending order.
    """
    keys3 = tl.reshape(keys, [BLOCK_T, GROUPS_POW2, GROUP_POW2])
    group_score = tl.zeros([BLOCK_T, GROUPS_POW2], tl.float32)
    kth = tl.full([BLOCK_T, GROUPS_POW2], _INT64_MAX, tl.int64)
    for _ in range(PER_GROUP):
        kth = tl.max(tl.where(keys3 < kth[:, :, None], keys3, _INT64_MIN), axis=2)
        group_score += _key_score(kth)
    groups = tl.arange(0, GROUPS_POW2)
    group_keys = _order_keys(group_score, groups[None, :], GROUPS_POW2)
    group_keys = tl.where(groups[None, :] < NUM_GROUPS, group_keys, _INT64_MIN)
    chosen = group_keys >= _kth_key(group_keys, GROUP_TOPK)[:, None]
    kept = tl.where(chosen[:, :, None], keys3, _INT64_MIN)
    return tl.reshape(kept, [BLOCK_T, GROUPS_POW2 * GROUP_POW2])


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _topk_forward_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] (HAS_BIAS)
    num_tokens,
    probs_ptr,  # [T, E] logits dtype
    routing_map_ptr,  # [T, E] bool
    indices_ptr,  # [T, K] int32 (RETURN_INDICES)
    NUM_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    SCORE_FUNCTION: tl.constexpr,
    USE_PRE_SOFTMAX: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP_TOPK: tl.constexpr,
    SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RETURN_INDICES: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Fused top-k with score function. Grid (cdiv(T, BLOCK_T),): program b routes tokens
    [b*BLOCK_T, (b+1)*BLOCK_T): one coalesced [BLOCK_T, WIDTH] load of logits, scores and keys in
    registers, optional group pruning, K max-reductions for the top-k, then probs, routing map and
    (optionally) the ranked expert ids are stored. Ungrouped calls pass NUM_GROUPS = 1, GROUP_SIZE = E;
    WIDTH = GROUPS_POW2 * GROUP_POW2.
    """
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, WIDTH)
    if GROUPS_POW2 == 1:
        # One group: column == expert, so loads and stores are plainly contiguous.
        experts = cols
        col_ok = cols < NUM_EXPERTS
    else:
        experts = (cols // GROUP_POW2) * GROUP_SIZE + cols % GROUP_POW2
        col_ok = (cols // GROUP_POW2 < NUM_GROUPS) & (cols % GROUP_POW2 < GROUP_SIZE)
    valid = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * NUM_EXPERTS + experts[None, :]
    x = tl.load(logits_ptr + offsets, mask=valid, other=0.0).to(tl.float32)

    if SCORE_FUNCTION == 0:
        if USE_PRE_SOFTMAX:
            soft = _softmax_rows(x, valid)
            select = soft
        else:
            select = x
    else:
        act = _activation(x, SCORE_FUNCTION)
        select = act
        if HAS_BIAS:
            bias = tl.load(bias_ptr + experts, mask=col_ok, other=0.0).to(tl.float32)
            select = act + bias[None, :]

    keys = tl.where(valid, _order_keys(select, cols[None, :], WIDTH), _INT64_MIN)
    if GROUP_TOPK > 0:
        keys = _keep_best_groups(
            keys, BLOCK_T, NUM_GROUPS, GROUPS_POW2, GROUP_POW2, TOPK // GROUP_TOPK, GROUP_TOPK
        )
    if RETURN_INDICES:
        kth, ranked = _ranked_columns(keys, TOPK, TOPK_POW2, WIDTH)
        ranks = tl.arange(0, TOPK_POW2)
        if GROUPS_POW2 == 1:
            ranked_experts = ranked
        else:
            ranked_experts = (ranked // GROUP_POW2) * GROUP_SIZE + ranked % GROUP_POW2
        tl.store(
            indices_ptr + rows.to(tl.int64)[:, None] * TOPK + ranks[None, :],
            ranked_experts,
            mask=row_ok[:, None] & (ranks[None, :] < TOPK),
        )
    else:
        kth = _kth_key(keys, TOPK)
    selected = valid & (keys >= kth[:, None])

    if SCORE_FUNCTION == 0:
        if USE_PRE_SOFTMAX:
            weights = tl.where(selected, soft, 0.0)
        else:
            weights = tl.where(selected, _softmax_rows(x, selected), 0.0)
    else:
        weights = tl.where(selected, act, 0.0)
        if TOPK > 1:
            # The outer where keeps unselected probs exactly 0 when a selected score is NaN.
            weights = tl.where(selected, weights / (tl.sum(weights, axis=1)[:, None] + 1e-20), 0.0)
    probs = weights * SCALE
    tl.store(probs_ptr + offsets, probs.to(probs_ptr.dtype.element_ty), mask=valid)
    tl.store(routing_map_ptr + offsets, selected, mask=valid)


@triton.jit
def _topk_backward_kernel(
    grad_probs_ptr,  # [T, E]
    logits_ptr,  # [T, E]
    routing_map_ptr,  # [T, E] bool
    num_tokens,
    grad_logits_ptr,  # [T, E] logits dtype
    NUM_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    SCORE_FUNCTION: tl.constexpr,
    USE_PRE_SOFTMAX: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
):
    """Backward of the fused top-k. Grid (cdiv(T, BLOCK_T),): program b recomputes the scores of tokens
    [b*BLOCK_T, (b+1)*BLOCK_T) from their logits and routing map and writes grad_logits. With
    g = grad_probs * scaling_factor and r the routing map:
      softmax post: y = softmax(x[r]); dx = r * y * (g - sum_r g y)
      softmax pre:  y = softmax(x); g' = r * g; dx = y * (g' - sum g' y)
      sigmoid / sqrtsoftplus: ga = r * (g / S - sum_r(g a) / S^2), S = sum_r a + 1e-20 (ga = r * g when
      K == 1); dx = ga * da/dx. The expert bias gets no gradient.
    """
    _, valid, offsets, x = _logits_tile(logits_ptr, num_tokens, NUM_EXPERTS, BLOCK_T, EXPERTS_POW2)
    grad = tl.load(grad_probs_ptr + offsets, mask=valid, other=0.0).to(tl.float32) * SCALE
    routed = valid & (tl.load(routing_map_ptr + offsets, mask=valid, other=0) != 0)

    if SCORE_FUNCTION == 0:
        if USE_PRE_SOFTMAX:
            y = _softmax_rows(x, valid)
            grad = tl.where(routed, grad, 0.0)
            dot = tl.sum(tl.where(valid, grad * y, 0.0), axis=1)
            dx = tl.where(valid, y * (grad - dot[:, None]), 0.0)
        else:
            y = _softmax_rows(x, routed)
            dot = tl.sum(tl.where(routed, grad * y, 0.0), axis=1)
            dx = tl.where(routed, y * (grad - dot[:, None]), 0.0)
    else:
        act = _activation(x, SCORE_FUNCTION)
        if TOPK > 1:
            total = tl.sum(tl.where(routed, act, 0.0), axis=1)[:, None] + 1e-20
            dot = tl.sum(tl.where(routed, grad * act, 0.0), axis=1)[:, None]
            grad_act = tl.where(routed, grad / total - dot / (total * total), 0.0)
        else:
            grad_act = tl.where(routed, grad, 0.0)
        dx = tl.where(routed, grad_act * _activation_grad(x, act, SCORE_FUNCTION), 0.0)
    tl.store(grad_logits_ptr + offsets, dx.to(grad_logits_ptr.dtype.element_ty), mask=valid)


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
def _bitmap_tile(num_tokens, NUM_EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Program (i, j)'s tile of a bool [T, E] map and of its uint8 [T, ceil(E / 8)] bitmap: tokens
    [i*BLOCK_T, (i+1)*BLOCK_T), bytes [j*BLOCK_BYTES, (j+1)*BLOCK_BYTES) and their experts. Returns the
    [BLOCK_T, BLOCK_BYTES] byte offsets with the mask of those inside the bitmap, the
    [BLOCK_T, BLOCK_BYTES, 8] flag offsets (expert 8 * byte + bit) with the mask of those inside the map
    (experts below E, so bits at and past E have no flag), and the [1, 1, 8] bit of each flag."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    columns = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bits = tl.arange(0, 8)
    experts = columns[:, None] * 8 + bits[None, :]  # [BLOCK_BYTES, 8]
    row_ok = rows < num_tokens
    row_bytes: tl.constexpr = (NUM_EXPERTS + 7) // 8
    byte_offsets = rows.to(tl.int64)[:, None] * row_bytes + columns[None, :]
    byte_ok = row_ok[:, None] & (columns < row_bytes)[None, :]
    flag_offsets = rows.to(tl.int64)[:, None, None] * NUM_EXPERTS + experts[None, :, :]
    flag_ok = row_ok[:, None, None] & (experts < NUM_EXPERTS)[None, :, :]
    return byte_offsets, byte_ok, flag_offsets, flag_ok, bits[None, None, :]


@triton.jit
def _pack_bitmap_kernel(
    flags_ptr,  # [T, E] bool
    num_tokens,
    bitmap_ptr,  # uint8 [T, ceil(E / 8)]
    NUM_EXPERTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """Packs a bool routing map into its bitmap. Grid (cdiv(T, BLOCK_T), cdiv(ceil(E / 8), BLOCK_BYTES)):
    program (i, j) reads the flags of its `_bitmap_tile` as [BLOCK_T, BLOCK_BYTES, 8] and writes its
    [BLOCK_T, BLOCK_BYTES] bytes: bit e % 8 of byte e // 8 is flag e (LSB first). Flags at and past E are not
    read, so the unused high bits of a row's last byte are written 0; nothing outside the two buffers is read
    or written."""
    byte_offsets, byte_ok, flag_offsets, flag_ok, bits = _bitmap_tile(
        num_tokens, NUM_EXPERTS, BLOCK_T, BLOCK_BYTES
    )
    flags = tl.load(_as_bits(flags_ptr) + flag_offsets, mask=flag_ok, other=0)
    # Distinct bits: their sum is their OR.
    packed = tl.sum((flags != 0).to(tl.int32) << bits, axis=2)
    tl.store(bitmap_ptr + byte_offsets, packed.to(tl.uint8), mask=byte_ok)


@triton.jit
def _unpack_bitmap_kernel(
    bitmap_ptr,  # uint8 [T, ceil(E / 8)]
    num_tokens,
    flags_ptr,  # [T, E] bool
    NUM_EXPERTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """Unpacks a bitmap into a bool routing map. Grid (cdiv(T, BLOCK_T), cdiv(ceil(E / 8), BLOCK_BYTES)):
    program (i, j) reads the [BLOCK_T, BLOCK_BYTES] bytes of its `_bitmap_tile` and writes flag e = bit
    e % 8 of byte e // 8 (LSB first) for each of their experts below E. Bits at and past E are ignored;
    nothing outside the two buffers is read or written."""
    byte_offsets, byte_ok, flag_offsets, flag_ok, bits = _bitmap_tile(
        num_tokens, NUM_EXPERTS, BLOCK_T, BLOCK_BYTES
    )
    packed = tl.load(bitmap_ptr + byte_offsets, mask=byte_ok, other=0)
    flags = (packed.to(tl.int32)[:, :, None] >> bits) & 1
    # Bool maps hold one byte per flag: stored as bytes, the stores vectorise.
    tl.store(_as_bits(flags_ptr) + flag_offsets, flags.to(tl.uint8), mask=flag_ok)


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


# ----------------------------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------------------------


def _row_tiles(
    space: SearchSpace,
    num_tokens: int,
    width: int,
    features: dict[str, int],
    device: DeviceInfo,
    config: Mapping[str, int] | None,
) -> tuple[int, int]:
    """(BLOCK_T, num_warps) for a [BLOCK_T, width] register tile per program, from the config (the
    caller's, the autotune cache's, else the heuristic): BLOCK_T fills `tile` elements but stays small
    enough to give every SM about four programs; each warp holds about `warp_elements`."""
    heuristic = dict(tile=_TILE_ELEMENTS, warp_elements=_WARP_ELEMENTS)
    cfg = autotune.resolve(space, heuristic, config, features, device)
    spread = next_pow2(cdiv(max(num_tokens, 1), 4 * device.num_sms))
    block_t = max(1, min(cfg["tile"] // width, spread))
    return block_t, max(1, min(16, block_t * width // cfg["warp_elements"]))


def _group_layout(num_experts: int, num_groups: int) -> tuple[int, int, int, int]:
    """(groups, group size, groups_pow2, group size pow2); one group of E experts when ungrouped."""
    groups = num_groups or 1
    size = num_experts // groups
    return groups, size, next_pow2(groups), next_pow2(size)


# Output buffers: shape arithmetic only, so that fake (meta) implementations can call these with symbolic
# sizes; the plans below add their launches (and internal buffers) on top.


def routing_map_buffer(num_tokens, num_experts, routing_map_format: str) -> Buffer:
    """The routing map: bool [T, E] ("bytemap"), or uint8 [T, ceil(E / 8)] ("bitmap": bit e % 8 of byte
    e // 8 set when the token routes to expert e, LSB first, unused high bits 0)."""
    if routing_map_format == "bitmap":
        return Buffer((num_tokens, bitmap_columns(num_experts)), "uint8")
    return Buffer((num_tokens, num_experts), "bool")


def topk_outputs(
    num_tokens, num_experts, topk, return_indices: bool, routing_map_format: str = "bytemap"
) -> dict[str, Buffer]:
    """probs [T, E] (logits dtype), routing_map (`routing_map_buffer`), indices [T, K] int32 ([T, 0] if not
    asked)."""
    return {
        "probs": Buffer((num_tokens, num_experts), "like:logits"),
        "routing_map": routing_map_buffer(num_tokens, num_experts, routing_map_format),
        "indices": (
            Buffer((num_tokens, topk), "int32") if return_indices else Buffer.absent("int32", (num_tokens, 0))
        ),
    }


def grad_logits_outputs(num_tokens, num_experts) -> dict[str, Buffer]:
    """grad_logits [T, E] in the logits dtype (both router backwards)."""
    return {"grad_logits": Buffer((num_tokens, num_experts), "like:logits")}


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


#: Bit-packing tiles: about _BITMAP_TILE flags per program, at most _BITMAP_BLOCK_BYTES bytes of a row.
_BITMAP_TILE = 4096
_BITMAP_BLOCK_BYTES = 64
#: The bool [T, E] scratch map that a router kernel writes or reads when the op's routing map is a bitmap.
_FLAGS = "routing_flags"


def _bitmap_launch(kernel, source: str, target: str, num_tokens: int, num_experts: int) -> Launch:
    """A launch of `_pack_bitmap_kernel` or `_unpack_bitmap_kernel` from buffer `source` into `target`."""
    row_bytes = bitmap_columns(num_experts)
    block_bytes = min(next_pow2(row_bytes), _BITMAP_BLOCK_BYTES)
    block_t = max(1, _BITMAP_TILE // (8 * block_bytes))
    return Launch(
        kernel=kernel,
        grid=(cdiv(num_tokens, block_t), cdiv(row_bytes, block_bytes)),
        args=(source, num_tokens),
        outputs=(target,),
        constexprs=dict(NUM_EXPERTS=num_experts, BLOCK_T=block_t, BLOCK_BYTES=block_bytes),
    )


def _rows_plan(
    kernel,
    space: SearchSpace,
    *,
    num_tokens: int,
    num_experts: int,
    score_function: str,
    inputs: tuple[str, ...],
    buffers: dict[str, Buffer],
    device: DeviceInfo,
    config: Mapping[str, int] | None,
    topk: int | None = None,
    constexprs: Mapping[str, object] | None = None,
    routing_map_format: str = "bytemap",
    width: int | None = None,
) -> Plan:
    """A plan of one token-block kernel: grid (cdiv(T, BLOCK_T),), arguments (*inputs, T, *buffers), and
    the constexprs NUM_EXPERTS, SCORE_FUNCTION, TOPK (unless None) and BLOCK_T beside `constexprs`; the
    config's features are T, E and K (unless None). `width` is the tile's width; None: column == expert,
    width next_pow2(E), passed as EXPERTS_POW2.

    The kernel reads or writes the routing map as bool [T, E] in either format. With routing_map_format
    "bitmap" that map is a scratch buffer: an `_unpack_bitmap_kernel` launch fills it from the "routing_map"
    input first, or a `_pack_bitmap_kernel` launch packs it into the "routing_map" result after. The float
    math is thus one kernel, launched with the same constexprs, grid and warps for both formats: compiled,
    Triton picks register layouts (and with them the order of fp32 sums) per kernel, so packing inside it
    would change the bits of probs, scores and gradients.
    """
    results = tuple(buffers)
    if num_tokens == 0:
        return Plan(buffers, (), results)
    constexprs = dict(
        constexprs or {}, NUM_EXPERTS=num_experts, SCORE_FUNCTION=SCORE_FUNCTION_IDS[score_function]
    )
    features = dict(num_tokens=num_tokens, num_experts=num_experts)
    if topk is not None:
        constexprs["TOPK"] = features["topk"] = topk
    if width is None:
        width = constexprs["EXPERTS_POW2"] = next_pow2(num_experts)
    block_t, num_warps = _row_tiles(space, num_tokens, width, features, device, config)
    packed = routing_map_format == "bitmap"

    def unpacked(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_FLAGS if packed and name == "routing_map" else name for name in names)

    launch = Launch(
        kernel=kernel,
        grid=(cdiv(num_tokens, block_t),),
        args=(*unpacked(inputs), num_tokens),
        outputs=unpacked(results),
        constexprs=dict(constexprs, BLOCK_T=block_t),
        num_warps=num_warps,
    )
    if not packed:
        return Plan(buffers, (launch,), results)
    buffers = dict(buffers, **{_FLAGS: Buffer((num_tokens, num_experts), "bool")})
    if "routing_map" in inputs:
        unpack = _bitmap_launch(_unpack_bitmap_kernel, "routing_map", _FLAGS, num_tokens, num_experts)
        return Plan(buffers, (unpack, launch), results)
    pack = _bitmap_launch(_pack_bitmap_kernel, _FLAGS, "routing_map", num_tokens, num_experts)
    return Plan(buffers, (launch, pack), results)


@sized_by(
    Sizes(axes=dict(num_tokens=("logits", 0), num_experts=("logits", 1)), present=dict(has_bias="bias"))
)
@cached
def topk_plan(
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int,
    group_topk: int,
    scaling_factor: float,
    has_bias: bool,
    return_indices: bool,
    routing_map_format: str = "bytemap",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """fused_topk_with_score_function forward. num_groups = group_topk = 0: no groups.

    Inputs: "logits" [T, E], "bias" [E] or None. Results: probs [T, E] (logits dtype), routing_map (bool
    [T, E], or with routing_map_format "bitmap" uint8 [T, ceil(E / 8)], packed from a bool scratch map by a
    second launch), indices [T, K] int32 ([T, 0] unless `return_indices`): the selected experts by rank.
    """
    groups, size, groups_pow2, size_pow2 = _group_layout(num_experts, num_groups)
    return _rows_plan(
        _topk_forward_kernel,
        TOPK_SPACE,
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        width=groups_pow2 * size_pow2,
        inputs=("logits", "bias"),
        buffers=topk_outputs(num_tokens, num_experts, topk, return_indices, routing_map_format),
        constexprs=dict(
            TOPK_POW2=next_pow2(topk),
            USE_PRE_SOFTMAX=use_pre_softmax,
            NUM_GROUPS=groups,
            GROUP_SIZE=size,
            GROUPS_POW2=groups_pow2,
            GROUP_POW2=size_pow2,
            WIDTH=groups_pow2 * size_pow2,
            GROUP_TOPK=group_topk,
            SCALE=scaling_factor,
            HAS_BIAS=has_bias,
            RETURN_INDICES=return_indices,
        ),
        routing_map_format=routing_map_format,
        device=device,
        config=config,
    )


@sized_by(Sizes(axes=dict(num_tokens=("logits", 0), num_experts=("logits", 1))))
@cached
def topk_backward_plan(
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    scaling_factor: float,
    routing_map_format: str = "bytemap",
    device: DeviceInfo = DEFAULT_DEVICE,
    config: Mapping[str, int] | None = None,
) -> Plan:
    """Backward of the fused top-k. Inputs: "grad_probs" [T, E], "logits" [T, E], "routing_map" (the
    forward's: bool [T, E], or with routing_map_format "bitmap" uint8 [T, ceil(E / 8)], unpacked into a bool
    scratch map by a first launch). Result: grad_logits [T, E] in the logits dtype."""
    return _rows_plan(
        _topk_backward_kernel,
        TOPK_BACKWARD_SPACE,
        inputs=("grad_probs", "logits", "routing_map"),
        buffers=grad_logits_outputs(num_tokens, num_experts),
        constexprs=dict(USE_PRE_SOFTMAX=use_pre_softmax, SCALE=scaling_factor),
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
