"""The FP8 recipes in plain PyTorch, written from the rules alone (nothing shared with the kernels): block
quantization by the scale rule, the layouts the GEMMs read, and the three GEMMs of a projection computed
from the dequantized operands in float64, per group, with the error bound of an fp32 accumulation.

Rule (kernels/rules/fp8.py): per block, amax over the finite values; s = 1 for amax 0, else
max(amax / FP8_MAX, 2**-126); q = saturate(x / s) rounded to nearest even (PyTorch's conversion), NaN
(code 0x7f) for every non-finite x.
"""

from __future__ import annotations

import torch

from moetriton.kernels.runtime.interpreter import INTERPRETER

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
TINY = 2.0**-126
NAN_CODE = 0x7F
BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_bounds(group_sizes: torch.Tensor, num_rows: int) -> list[tuple[int, int]]:
    """[(start, end)] of each group: sizes below 0 count as 0, and groups end at row M at the latest."""
    bounds, start = [], 0
    for size in group_sizes.tolist():
        end = min(start + max(int(size), 0), num_rows)
        bounds.append((start, end))
        start = end
    return bounds


def padded_rows(num_rows: int, num_groups: int) -> int:
    return BLOCK * max(_cdiv(num_rows, BLOCK) + num_groups - 1, 0)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over finite x (0 for none), as a 0-d fp32 tensor."""
    x = x.float()
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax() if x.numel() else torch.tensor(0.0)


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = torch.clamp(amax.float() / FP8_MAX[dtype], min=TINY)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def codes(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = saturate(x / scale) in `dtype` (scale broadcast over x), NaN where x is not finite."""
    finite = torch.isfinite(x.float())
    limit = FP8_MAX[dtype]
    q = torch.clamp(x.float() / scale, -limit, limit).to(dtype).view(torch.uint8).clone()
    q[~finite] = NAN_CODE
    return q.view(dtype)


def quantize_blocks(x: torch.Tensor, block_rows: int, block_cols: int, dtype: torch.dtype):
    """(q [R, C], scales [cdiv(R, block_rows), cdiv(C, block_cols)]) of x [R, C] in blocks."""
    rows, cols = x.shape
    grid = (_cdiv(rows, block_rows), _cdiv(cols, block_cols))
    padded = torch.zeros(grid[0] * block_rows, grid[1] * block_cols)
    padded[:rows, :cols] = x.float()
    blocks = padded.view(grid[0], block_rows, grid[1], block_cols)
    magnitude = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0)
    scales = scale_of(magnitude.amax(dim=(1, 3)), dtype)
    full = scales.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]
    return codes(x, full, dtype), scales


def rowwise(x: torch.Tensor, group_sizes: torch.Tensor, blockwise: bool, dtype: torch.dtype):
    """(q [S, W], scale) of the groups' rows x[:S], S = their count: blockwise [S, cdiv(W, 128)] per
    1 x 128 tile, else [1] from the amax of those rows."""
    rows = group_bounds(group_sizes, x.shape[0])[-1][1]
    inside = x[:rows]
    if blockwise:
        return quantize_blocks(inside, 1, BLOCK, dtype)
    scale = scale_of(amax(inside), dtype)
    return codes(inside, scale, dtype), scale.reshape(1)


def columnwise(x: torch.Tensor, group_sizes: torch.Tensor, blockwise: bool, dtype: torch.dtype):
    """(cols [W, P], scales, written) of x [M, W]: each group's rows transposed into whole 128-column
    blocks, in group order, zeros past its last row; scales blockwise [P / 128, W] per 128 x 1 tile of
    one group, else [1]; `written` [P / 128] marks the blocks the groups own (the rest is unspecified)."""
    num_rows, width = x.shape
    bounds = group_bounds(group_sizes, num_rows)
    padded = padded_rows(num_rows, len(bounds))
    cols = torch.zeros(width, padded, dtype=torch.uint8)
    scales = torch.zeros(padded // BLOCK, width)
    written = torch.zeros(padded // BLOCK, dtype=torch.bool)
    tensor_scale = scale_of(amax(x[: bounds[-1][1]]), dtype)
    block = 0
    for start, end in bounds:
        if end == start:
            continue
        if blockwise:
            q, group_scales = quantize_blocks(x[start:end], BLOCK, 1, dtype)
        else:
            q, group_scales = codes(x[start:end], tensor_scale, dtype), None
        blocks = _cdiv(end - start, BLOCK)
        cols[:, block * BLOCK : block * BLOCK + end - start] = q.view(torch.uint8).T
        if blockwise:
            scales[block : block + blocks] = group_scales
        written[block : block + blocks] = True
        block += blocks
    if not blockwise:
        scales = tensor_scale.reshape(1)
    return cols.view(dtype), scales, written


def weights(weight: torch.Tensor, blockwise: bool, dtype: torch.dtype):
    """(rows [E, K, N], cols [E, N, K] (the transpose), scales) of weight [E, K, N]: blockwise
    [E, cdiv(K, 128), cdiv(N, 128)] per 128 x 128 block, else [E] per expert."""
    rows, scales = [], []
    for expert in weight:
        if blockwise:
            q, scale = quantize_blocks(expert, BLOCK, BLOCK, dtype)
        else:
            scale = scale_of(amax(expert), dtype)
            q = codes(expert, scale, dtype)
        rows.append(q.view(torch.uint8))
        scales.append(scale)
    rows = torch.stack(rows)
    return rows.view(dtype), rows.transpose(1, 2).contiguous().view(dtype), torch.stack(scales)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_rows: int = 0, block_cols: int = 0):
    """q [R, C] times its scales in float64 (exact: 4 significant bits times 24): scales [1] (one for
    all of q) or [cdiv(R, block_rows), cdiv(C, block_cols)] per block."""
    if scales.numel() == 1 and not block_rows:
        return q.double() * scales.double().reshape(())
    full = scales.double().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return q.double() * full[: q.shape[0], : q.shape[1]]


def _dequantized_weight(weight: torch.Tensor, blockwise: bool, dtype: torch.dtype) -> torch.Tensor:
    """[E, K, N] float64: the weight as its FP8 copy and scales represent it."""
    rows, _, scales = weights(weight, blockwise, dtype)
    if blockwise:
        return torch.stack([dequantize(q, s, BLOCK, BLOCK) for q, s in zip(rows, scales, strict=True)])
    return torch.stack([dequantize(q, s.reshape(1)) for q, s in zip(rows, scales, strict=True)])


def _grouped(lhs, rhs_deq, group_sizes, blockwise: bool, dtype):
    """(out, error scale) of out[rows of g] = dequantized rows of lhs @ rhs_deq[g] in float64."""
    q, scale = rowwise(lhs, group_sizes, blockwise, dtype)
    deq = dequantize(q, scale, 1, BLOCK) if blockwise else dequantize(q, scale)
    out = torch.zeros(lhs.shape[0], rhs_deq.shape[2], dtype=torch.float64)
    bound = torch.zeros_like(out)
    for group, (start, end) in enumerate(group_bounds(group_sizes, lhs.shape[0])):
        out[start:end] = deq[start:end] @ rhs_deq[group]
        bound[start:end] = deq[start:end].abs() @ rhs_deq[group].abs()
    return out, bound


def forward(x, weight, group_sizes, blockwise: bool, dtype, weight_dtype):
    """(out [M, N] float64, its error scale |X| @ |W|) of out[rows of g] = X[rows of g] @ W[g] from the
    dequantized operands (X in `dtype`, W in `weight_dtype`); rows past the groups are zeros."""
    return _grouped(x, _dequantized_weight(weight, blockwise, weight_dtype), group_sizes, blockwise, dtype)


def data_gradient(grad, weight, group_sizes, blockwise: bool, dtype, weight_dtype):
    """(dX [M, K] float64, error scale) of dX[rows of g] = dY[rows of g] @ W[g]^T (dY in `dtype`)."""
    deq = _dequantized_weight(weight, blockwise, weight_dtype).transpose(1, 2)
    return _grouped(grad, deq, group_sizes, blockwise, dtype)


def weight_gradient(x, grad, group_sizes, blockwise: bool, dtype, grad_dtype):
    """(dW [E, K, N] float64, error scale) of dW[g] = X[rows of g]^T @ dY[rows of g], from the
    columnwise quantization (128-row blocks of each group, or the tensors' scales)."""
    bounds = group_bounds(group_sizes, x.shape[0])
    lhs, lhs_scales, _ = columnwise(x, group_sizes, blockwise, dtype)
    rhs, rhs_scales, _ = columnwise(grad, group_sizes, blockwise, grad_dtype)
    out = torch.zeros(len(bounds), x.shape[1], grad.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(out)
    block = 0
    for group, (start, end) in enumerate(bounds):
        blocks = _cdiv(end - start, BLOCK)
        columns = slice(block * BLOCK, (block + blocks) * BLOCK)
        if blockwise:
            a = dequantize(lhs[:, columns].T, lhs_scales[block : block + blocks], BLOCK, 1)
            b = dequantize(rhs[:, columns].T, rhs_scales[block : block + blocks], BLOCK, 1)
        else:
            a, b = dequantize(lhs[:, columns].T, lhs_scales), dequantize(rhs[:, columns].T, rhs_scales)
        out[group], bound[group] = a.T @ b, a.T.abs() @ b.abs()
        block += blocks
    return out, bound


def assert_product(
    got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, depth: int, fast_acc=False
):
    """got within fp32 accumulation error of the float64 product (a rigorous bound: exact fp8 products,
    at most D + 2 D / 128 + 8 roundings each of at most u |terms|, u = 2**-24), plus the rounding of a
    bf16 output: half an ulp compiled, a whole one interpreted (the interpreter truncates fp32 to bf16).
    NaN exactly where the product is NaN. Compiled, the tensor cores sum FP8 products with fewer bits
    (about 13 kept): an allowance of 2**-13 per term summed inside them, every term of an unsplit
    tensorwise product (`fast_acc`), one 128-deep step of the others (split accumulation and blockwise
    scaling add each step's sum into fp32)."""
    rounding = (2.0**-7 if INTERPRETER else 2.0**-8) if got.dtype == torch.bfloat16 else 0.0
    got = got.cpu().double()
    assert torch.equal(torch.isnan(got), torch.isnan(expected)), "NaN positions"
    finite = ~torch.isnan(expected)
    accumulation = 2.0**-24 * (depth + 2 * -(-depth // 128) + 8) * bound
    if not INTERPRETER:
        accumulation = accumulation + 2.0**-13 * (depth if fast_acc else min(depth, 128)) * bound
    tolerance = accumulation * (1 + rounding) + rounding * expected.abs()
    error = (got - expected).abs()
    worst = (error - tolerance)[finite].max() if finite.any() else torch.tensor(-1.0)
    assert worst <= 0, (
        f"error past the bound by {worst.item():.3g} (max error {error[finite].max().item():.3g})"
    )
