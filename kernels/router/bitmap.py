"""The routing map's bitmap format: the kernels that pack a bool [T, E] map into uint8 [T, ceil(E / 8)] (bit
e % 8 of byte e // 8, LSB first) and unpack it, and their launches."""

from __future__ import annotations

import triton
import triton.language as tl

from .._jit import _as_bits
from ..rules.layout import bitmap_columns
from ..runtime.plan import Buffer, Launch, cdiv, next_pow2

#: Bit-packing tiles: about _BITMAP_TILE flags per program, at most _BITMAP_BLOCK_BYTES bytes of a row.
_BITMAP_TILE = 4096


_BITMAP_BLOCK_BYTES = 64


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


def routing_map_buffer(num_tokens, num_experts, routing_map_format: str) -> Buffer:
    """The routing map: bool [T, E] ("bytemap"), or uint8 [T, ceil(E / 8)] ("bitmap": bit e % 8 of byte
    e // 8 set when the token routes to expert e, LSB first, unused high bits 0)."""
    if routing_map_format == "bitmap":
        return Buffer((num_tokens, bitmap_columns(num_experts)), "uint8")
    return Buffer((num_tokens, num_experts), "bool")
