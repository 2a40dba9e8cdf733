"""The names TransformerEngine's tests/pytorch/test_permutation.py imports from transformer_engine.pytorch,
for moetriton's runner of that test (scripts/te_torch_tests.sh): the six permutation functions are
moetriton.torch's own; the rest is written here, as small as the test allows.

- DType: the members the test compares against (it maps them to torch dtypes itself).
- is_bf16_available: whether moetriton's ops take bf16 on this machine's device.
- is_fp8_available, is_mxfp8_available, is_fp8_block_scaling_available: False, with the reason. The FP8
  test quantizes with TE's quantizers into TE's tensor subclasses (Float8Tensor, MXFP8Tensor,
  Float8BlockwiseQTensor) and hands those to moe_permute; moetriton has neither, so that test skips.
- Float8Quantizer and its siblings: only so that the import resolves; making one skips the test.
- Fp8Padding / Fp8Unpadding: TE's per-expert row padding modules, which the padding tests use as the
  unfused reference for moe_permute_and_pad_with_probs; the same row arithmetic in plain torch ops here.
"""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn.functional as F

from moetriton.torch import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)

__all__ = [
    "DType",
    "Float8BlockQuantizer",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Fp8Padding",
    "Fp8Unpadding",
    "MXFP8Quantizer",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
]

#: Why every FP8 test of TE's file skips here.
NO_TE_FP8_TENSORS = (
    "moetriton has no TE quantizers or FP8 tensor subclasses (Float8Tensor, MXFP8Tensor, "
    "Float8BlockwiseQTensor): it permutes plain float8_e4m3fn / float8_e5m2 tensors, with row-wise scales "
    "passed as token_dispatch(..., scales=) (docs/te_migration.md)"
)


class DType(enum.Enum):
    """The members of TE's tensor dtype enum that the permutation test names."""

    kFloat32 = enum.auto()
    kFloat16 = enum.auto()
    kBFloat16 = enum.auto()
    kFloat8E4M3 = enum.auto()
    kFloat8E5M2 = enum.auto()


def _answer(available: bool, reason: str, return_reason: bool) -> bool | tuple[bool, str]:
    return (available, "" if available else reason) if return_reason else available


def is_bf16_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """moetriton's ops take bf16 on the CPU and on any CUDA GPU torch does bf16 on."""
    available = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    return _answer(available, "torch has no bf16 on this CUDA GPU", return_reason)


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    return _answer(False, NO_TE_FP8_TENSORS, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    return _answer(False, NO_TE_FP8_TENSORS, return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    return _answer(False, NO_TE_FP8_TENSORS, return_reason)


class _TEQuantizer:
    """A TE quantizer's name; making one skips the test that does (moetriton has none)."""

    def __init__(self, *args, **kwargs) -> None:
        pytest.skip(NO_TE_FP8_TENSORS)


class Float8Quantizer(_TEQuantizer):
    """TE's delayed-scaling quantizer (not provided)."""


class Float8CurrentScalingQuantizer(_TEQuantizer):
    """TE's current-scaling quantizer (not provided)."""


class Float8BlockQuantizer(_TEQuantizer):
    """TE's block-scaling quantizer (not provided)."""


class MXFP8Quantizer(_TEQuantizer):
    """TE's MXFP8 quantizer (not provided)."""


def _padded_splits(num_gemms: int, align_size: int | None, m_splits: list[int]) -> list[int]:
    if align_size is None:  # TE reads it from the active FP8 recipe, which does not exist here
        raise ValueError("align_size: required (TE's default comes from its FP8 recipe state)")
    if len(m_splits) != num_gemms:
        raise ValueError(f"m_splits: expected {num_gemms} splits, got {len(m_splits)}")
    return [-(-rows // align_size) * align_size for rows in m_splits]


class Fp8Padding(torch.nn.Module):
    """TE's Fp8Padding: forward(inp [sum(m_splits), H], m_splits) -> (out [sum(padded), H], padded), each
    split followed by zero rows up to a multiple of `align_size`; `inp` itself when no split needs any."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        padded = _padded_splits(self.num_gemms, self.align_size, m_splits)
        if padded == m_splits:
            return inp, m_splits
        chunks = torch.split(inp, m_splits)
        out = torch.cat(
            [
                F.pad(chunk, (0, 0, 0, rows - chunk.shape[0]))
                for chunk, rows in zip(chunks, padded, strict=True)
            ]
        )
        return out, padded


class Fp8Unpadding(torch.nn.Module):
    """TE's Fp8Unpadding: forward(inp [sum(padded), H], m_splits) -> [sum(m_splits), H], the padding rows
    Fp8Padding added for the same splits taken out; `inp` itself when no split has any."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        padded = _padded_splits(self.num_gemms, self.align_size, m_splits)
        if padded == m_splits:
            return inp
        chunks = torch.split(inp, padded)
        return torch.cat([chunk[:rows] for chunk, rows in zip(chunks, m_splits, strict=True)])
