"""What every token-block router kernel shares: the score functions, the ordered keys that rank candidates,
the [BLOCK_T, E] logits tile, and the token-block plan (grid, tiles, config, and the routing map in either
format around the float kernel)."""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ..runtime import autotune
from ..runtime.plan import Buffer, DeviceInfo, Launch, Plan, SearchSpace, cdiv, next_pow2
from .bitmap import _bitmap_launch, _pack_bitmap_kernel, _unpack_bitmap_kernel

#: Score-function ids used as constexprs (the kernels branch on them), one for each of rules.SCORE_FUNCTIONS.
SCORE_FUNCTION_IDS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


#: Heuristic tile: about 1024 elements per program (BLOCK_T = tile / WIDTH, at least one row) and 256 per
#: warp; 8 elements per thread keep the forward at 40-80 registers on sm_90, so an SM holds 64 warps.
_TILE_ELEMENTS = 1024


_WARP_ELEMENTS = 256


# Tunable parameters of the token-block kernels (every config is tested). The aux loss is not tuned: its
# partial-sum grid must depend on the shape only, so that the loss has the same bits on every device.
_TILE_PARAMS = {"tile": (256, 512, 1024, 2048, 4096), "warp_elements": (128, 256, 512)}


# Sentinels for keys: excluded candidates, "no previous key", and the ordered image of NaN.
_INT64_MIN = tl.constexpr(-(2**63))


_INT64_MAX = tl.constexpr(2**63 - 1)


_NAN_ORDER = tl.constexpr(-(2**31))


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


def grad_logits_outputs(num_tokens, num_experts) -> dict[str, Buffer]:
    """grad_logits [T, E] in the logits dtype (both router backwards)."""
    return {"grad_logits": Buffer((num_tokens, num_experts), "like:logits")}


#: The bool [T, E] scratch map that a router kernel writes or reads when the op's routing map is a bitmap.
_FLAGS = "routing_flags"


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
