"""FP8 grouped GEMMs in PyTorch: the quantizers (moetriton::quantize, moetriton::quantize_weights), the FP8
products (moetriton::grouped_matmul_fp8, moetriton::grouped_matmul_fp8_wgrad) and the differentiable
projection built on them, fp8_grouped_linear (moetriton::fp8_grouped_linear, whose backward runs the data
and weight gradients in FP8 too). See _op.py for how an op is defined once for eager mode and
torch.compile.

Recipes, formats, the scale and non-finite rules and the layouts are moetriton.kernels.rules.fp8's and
docs/fp8.md's. The ops read no device values (group sizes, amaxes and scales stay on the device), so they
are CUDA-graph safe. They run their launch plans on CUDA (compiled) or on CPU under TRITON_INTERPRET=1;
there is no reference fallback (FP8 products exist to use FP8 tensor cores), so elsewhere they raise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton import kernels
from moetriton.kernels.rules import fp8 as rules

from ._checks import Signature, described, memoised, same_device, signature
from ._op import Op, PlanBinding, trailing

_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _no_reference(*args):
    raise RuntimeError(
        "moetriton FP8 ops run their Triton kernels only: on CUDA, or on CPU with TRITON_INTERPRET=1 set "
        "before moetriton is imported"
    )


def _fp8_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _format(fp8_dtype: torch.dtype | None, op: str, recipe: str) -> str:
    """The fp8 format asked for by name, or the recipe's forward format."""
    return _fp8_name(fp8_dtype) if fp8_dtype is not None else rules.recipe_of(op, recipe).forward_dtype


_QUANTIZE = PlanBinding(
    kernels.quantize_plan,
    lambda inp, group_sizes, recipe, fp8_dtype, rowwise, columnwise: dict(inp=inp, group_sizes=group_sizes),
    trailing("recipe", "fp8_dtype", "rowwise", "columnwise"),
    _no_reference,
)


def _quantize(
    inp: Tensor, group_sizes: Tensor, recipe: str, fp8_dtype: str, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rows, rows_scale, cols, cols_scale): quantize_plan's results."""
    return _QUANTIZE.run(inp, group_sizes, recipe, fp8_dtype, rowwise, columnwise)


QUANTIZE = Op("quantize", _quantize, _QUANTIZE.fake)

_QUANTIZE_WEIGHTS = PlanBinding(
    kernels.quantize_weights_plan,
    lambda weight, recipe, fp8_dtype, rowwise, columnwise: dict(weight=weight),
    trailing("recipe", "fp8_dtype", "rowwise", "columnwise"),
    _no_reference,
)


def _quantize_weights(
    weight: Tensor, recipe: str, fp8_dtype: str, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, cols, scale): quantize_weights_plan's results."""
    return _QUANTIZE_WEIGHTS.run(weight, recipe, fp8_dtype, rowwise, columnwise)


QUANTIZE_WEIGHTS = Op("quantize_weights", _quantize_weights, _QUANTIZE_WEIGHTS.fake)

_MATMUL = PlanBinding(
    kernels.fp8_grouped_matmul_plan,
    lambda lhs, rhs, lhs_scale, rhs_scale, group_sizes, recipe, data_gradient, out_dtype, split: dict(
        lhs=lhs, rhs=rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale, group_sizes=group_sizes
    ),
    trailing("recipe", "data_gradient", "out_dtype", "split_accumulator"),
    _no_reference,
    first=True,
)


def _matmul(
    lhs: Tensor,
    rhs: Tensor,
    lhs_scale: Tensor,
    rhs_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    data_gradient: bool,
    out_dtype: str,
    split: bool,
) -> Tensor:
    """[M, C]: fp8_grouped_matmul_plan's product."""
    return _MATMUL.run(lhs, rhs, lhs_scale, rhs_scale, group_sizes, recipe, data_gradient, out_dtype, split)


MATMUL = Op("grouped_matmul_fp8", _matmul, _MATMUL.fake)

_WGRAD = PlanBinding(
    kernels.fp8_grouped_matmul_wgrad_plan,
    lambda lhs, grad, lhs_scale, grad_scale, group_sizes, num_rows, recipe, out_dtype, split: dict(
        lhs=lhs, grad=grad, lhs_scale=lhs_scale, grad_scale=grad_scale, group_sizes=group_sizes
    ),
    trailing("num_rows", "recipe", "out_dtype", "split_accumulator"),
    _no_reference,
    first=True,
)


def _wgrad(
    lhs: Tensor,
    grad: Tensor,
    lhs_scale: Tensor,
    grad_scale: Tensor,
    group_sizes: Tensor,
    num_rows: int,
    recipe: str,
    out_dtype: str,
    split: bool,
) -> Tensor:
    """[E, K, N]: fp8_grouped_matmul_wgrad_plan's product."""
    return _WGRAD.run(lhs, grad, lhs_scale, grad_scale, group_sizes, num_rows, recipe, out_dtype, split)


WGRAD = Op("grouped_matmul_fp8_wgrad", _wgrad, _WGRAD.fake)


# the differentiable projection ---------------------------------------------------------------------------


def _out_dtype(dtype: torch.dtype) -> str:
    """The FP8 products' output dtype for inputs of `dtype`: fp32 for fp32, else bf16."""
    return "float32" if dtype == torch.float32 else "bfloat16"


def _linear(
    rows: Tensor, group_sizes: Tensor, weight: Tensor, recipe: str, save: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out [M, N], then where `save` the copies the backward reads: the columnwise copy of the rows and
    its scale, the weight's rowwise copy and its scale; size-0 stand-ins otherwise)."""
    spec = rules.RECIPES[recipe]
    fp8 = spec.forward_dtype
    x_rows, x_scale, x_cols, x_cols_scale = QUANTIZE(rows, group_sizes, recipe, fp8, True, save)
    w_rows, w_cols, w_scale = QUANTIZE_WEIGHTS(weight, recipe, fp8, save, True)
    out = MATMUL(x_rows, w_cols, x_scale, w_scale, group_sizes, recipe, False, _out_dtype(rows.dtype), False)
    if out.dtype != rows.dtype:
        out = out.to(rows.dtype)
    if not save:
        empty = rows.new_empty(0)
        return out, empty, empty, empty, empty
    return out, x_cols, x_cols_scale, w_rows, w_scale


def _linear_setup(ctx, inputs, output):
    rows, group_sizes, weight, ctx.recipe, _ = inputs
    _, x_cols, x_cols_scale, w_rows, w_scale = output
    ctx.num_rows, ctx.rows_dtype, ctx.weight_dtype = rows.shape[0], rows.dtype, weight.dtype
    ctx.save_for_backward(group_sizes, x_cols, x_cols_scale, w_rows, w_scale)


def _linear_backward(ctx, grad, *unused):
    if grad is None:
        return None, None, None, None, None
    group_sizes, x_cols, x_cols_scale, w_rows, w_scale = ctx.saved_tensors
    recipe = ctx.recipe
    fp8 = rules.RECIPES[recipe].gradient_dtype
    need_rows, _, need_weight = ctx.needs_input_grad[:3]
    dy_rows, dy_scale, dy_cols, dy_cols_scale = QUANTIZE(
        grad.contiguous(), group_sizes, recipe, fp8, need_rows, need_weight or not need_rows
    )
    grad_rows = grad_weight = None
    if need_rows:
        grad_rows = MATMUL(
            dy_rows, w_rows, dy_scale, w_scale, group_sizes, recipe, True, _out_dtype(ctx.rows_dtype), True
        ).to(ctx.rows_dtype)
    if need_weight:
        grad_weight = WGRAD(
            x_cols, dy_cols, x_cols_scale, dy_cols_scale, group_sizes, ctx.num_rows, recipe,
            _out_dtype(ctx.weight_dtype), True,
        ).to(ctx.weight_dtype)  # fmt: skip
    return grad_rows, None, grad_weight, None, None


def _linear_fake(rows, group_sizes, weight, recipe, save):
    spec = rules.RECIPES[recipe]
    num_rows, depth = rows.shape
    experts, _, num_cols = weight.shape
    out = rows.new_empty((num_rows, num_cols))
    if not save:
        empty = rows.new_empty(0)
        return out, empty, empty, empty, empty
    padded = rules.padded_rows(num_rows, experts)
    fp8 = _DTYPES[spec.forward_dtype]
    if spec.blockwise:
        cols_scale = (padded // rules.BLOCK, depth)
        weight_scale = (experts, -(-depth // rules.BLOCK), -(-num_cols // rules.BLOCK))
    else:
        cols_scale, weight_scale = (1,), (experts,)
    return (
        out,
        rows.new_empty((depth, padded), dtype=fp8),
        rows.new_empty(cols_scale, dtype=torch.float32),
        rows.new_empty(tuple(weight.shape), dtype=fp8),
        rows.new_empty(weight_scale, dtype=torch.float32),
    )


LINEAR = Op("fp8_grouped_linear", _linear, _linear_fake, setup=_linear_setup, backward=_linear_backward)


# public functions ----------------------------------------------------------------------------------------


@memoised
def _check_quantize(recipe: str, fp8_dtype: str, **tensors: Signature | None) -> None:
    rules.check_quantize(**described(**tensors), recipe=recipe, fp8_dtype=fp8_dtype)
    same_device(**tensors)


@memoised
def _check_quantize_weights(recipe: str, fp8_dtype: str, **tensors: Signature | None) -> None:
    rules.check_quantize_weights(**described(**tensors), recipe=recipe, fp8_dtype=fp8_dtype)


def quantize(
    inp: Tensor,
    group_sizes: Tensor,
    recipe: str,
    *,
    fp8_dtype: torch.dtype | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The FP8 copies of the groups' rows of an activation or gradient, as the FP8 grouped GEMMs read them.

    Args:
        inp: [M, W] bfloat16, float16 or float32 rows, grouped (group g is the size_g rows after group
            g - 1's). Rows past sum(group_sizes) are not read.
        group_sizes: [E] integers on inp's device; negative sizes count as 0, sizes are clipped to the rows
            present (never a read or write out of bounds).
        recipe: "tensorwise" (one scale from the amax of the groups' rows) or "blockwise" (one per 1 x 128
            tile along W of the rowwise copy, per 128 x 1 tile of one group of the columnwise copy).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2 (default: the recipe's forward format).
        rowwise / columnwise: which copies to write (at least one).

    Returns:
        (rows [M, W] fp8, rows_scale float32 (blockwise [M, cdiv(W, 128)], tensorwise [1]), cols [W, P] fp8
        (the transposed copy, each group padded with zeros to whole 128-row blocks, P =
        moetriton.kernels.rules.fp8.padded_rows(M, E)), cols_scale float32 (blockwise [P / 128, W],
        tensorwise [1])); a copy not asked for and its scale are None. Dequantized, x ~ q * scale. Rows
        past the groups (and columnwise blocks past the groups') are left unspecified.

    Example:
        >>> x = torch.randn(6, 128, dtype=torch.bfloat16)
        >>> rows, scale, _, _ = quantize(x, torch.tensor([2, 4]), "blockwise")
        >>> rows.dtype, tuple(scale.shape)
        (torch.float8_e4m3fn, (6, 1))
    """
    name = (
        _fp8_name(fp8_dtype) if fp8_dtype is not None else rules.recipe_of("quantize", recipe).forward_dtype
    )
    _check_quantize(recipe=recipe, fp8_dtype=name, inp=signature(inp), group_sizes=signature(group_sizes))
    return QUANTIZE(inp, group_sizes, recipe, name, bool(rowwise), bool(columnwise))


def quantize_weights(
    weight: Tensor,
    recipe: str,
    *,
    fp8_dtype: torch.dtype | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """The FP8 copies of expert weights, as the FP8 grouped GEMMs read them.

    Args:
        weight: [E, K, N] bfloat16, float16 or float32.
        recipe: "tensorwise" (one scale per expert) or "blockwise" (one per 128 x 128 block).
        fp8_dtype: torch.float8_e4m3fn (default) or torch.float8_e5m2.
        rowwise / columnwise: which copies to write (at least one).

    Returns:
        (rows [E, K, N] fp8 (the data gradient's operand), cols [E, N, K] fp8 (the transposed copy, the
        forward's operand), scale float32 (blockwise [E, cdiv(K, 128), cdiv(N, 128)], shared by both
        copies; tensorwise [E])); a copy not asked for is None.

    Example:
        >>> w = torch.randn(2, 128, 64, dtype=torch.bfloat16)
        >>> rows, cols, scale = quantize_weights(w, "tensorwise")
        >>> tuple(cols.shape), tuple(scale.shape)
        ((2, 64, 128), (2,))
    """
    name = (
        _fp8_name(fp8_dtype) if fp8_dtype is not None else rules.recipe_of("quantize", recipe).forward_dtype
    )
    _check_quantize_weights(recipe=recipe, fp8_dtype=name, weight=signature(weight))
    return QUANTIZE_WEIGHTS(weight, recipe, name, bool(rowwise), bool(columnwise))


@memoised
def _check_matmul(recipe: str, data_gradient: bool, out_dtype: str, **tensors: Signature | None) -> None:
    rules.check_fp8_grouped_matmul(
        **described(**tensors), recipe=recipe, data_gradient=data_gradient, out_dtype=out_dtype
    )
    same_device(**tensors)


@memoised
def _check_wgrad(recipe: str, num_rows: int, out_dtype: str, **tensors: Signature | None) -> None:
    rules.check_fp8_grouped_matmul_wgrad(
        **described(**tensors), num_rows=num_rows, recipe=recipe, out_dtype=out_dtype
    )
    same_device(**tensors)


def grouped_matmul_fp8(
    lhs: Tensor,
    rhs: Tensor,
    lhs_scale: Tensor,
    rhs_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    *,
    data_gradient: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    split_accumulator: bool | None = None,
) -> Tensor:
    """The FP8 grouped GEMM of the forward or the data gradient: out[rows of g] = lhs[rows of g] @ rhs[g]^T
    from dequantized operands, accumulated in fp32. Both operands are K-major (the contraction D last).

    Args:
        lhs: [M, D] fp8, the rowwise copy from `quantize` (X in the forward, dY in the data gradient).
        rhs: [E, C, D] fp8, the weight's copy from `quantize_weights`: `cols` [E, N, K] in the forward,
            `rows` [E, K, N] with `data_gradient`.
        lhs_scale, rhs_scale: their float32 scales, as `quantize` / `quantize_weights` returned them.
        group_sizes: [E] integers, as quantized with (clipped as `quantize` clips them).
        recipe: the recipe the operands were quantized with.
        data_gradient: rhs is the weight's rowwise copy (its block scales read transposed).
        out_dtype: torch.bfloat16 or torch.float32.
        split_accumulator: tensorwise only: add the tensor cores' partial sums into fp32 every 128-deep
            step (default: off in the forward, on in the data gradient); blockwise always does.

    Returns:
        [M, C] in out_dtype; rows past sum(group_sizes) are zeros.

    Example:
        >>> x, w = torch.randn(6, 128, dtype=torch.bfloat16), torch.randn(2, 128, 64, dtype=torch.bfloat16)
        >>> sizes = torch.tensor([2, 4])
        >>> rows, x_scale, _, _ = quantize(x, sizes, "blockwise")
        >>> _, cols, w_scale = quantize_weights(w, "blockwise", rowwise=False)
        >>> grouped_matmul_fp8(rows, cols, x_scale, w_scale, sizes, "blockwise").shape
        torch.Size([6, 64])
    """
    name = _fp8_name(out_dtype)
    _check_matmul(
        recipe=recipe, data_gradient=bool(data_gradient), out_dtype=name,
        lhs=signature(lhs), rhs=signature(rhs), lhs_scale=signature(lhs_scale),
        rhs_scale=signature(rhs_scale), group_sizes=signature(group_sizes),
    )  # fmt: skip
    split = bool(data_gradient if split_accumulator is None else split_accumulator)
    return MATMUL(lhs, rhs, lhs_scale, rhs_scale, group_sizes, recipe, bool(data_gradient), name, split)


def grouped_matmul_fp8_wgrad(
    lhs: Tensor,
    grad: Tensor,
    lhs_scale: Tensor,
    grad_scale: Tensor,
    group_sizes: Tensor,
    num_rows: int,
    recipe: str,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    split_accumulator: bool = True,
) -> Tensor:
    """The FP8 grouped GEMM of the weight gradient: out[g] = X[rows of g]^T @ dY[rows of g], from the
    columnwise copies of X [M, K] and dY [M, N].

    Args:
        lhs: [K, P] fp8, X's columnwise copy (`quantize(..., columnwise=True)`), P = padded_rows(M, E).
        grad: [N, P] fp8, dY's columnwise copy.
        lhs_scale, grad_scale: their float32 columnwise scales.
        group_sizes: [E] integers, as quantized with.
        num_rows: M, the rows both copies were quantized from.
        recipe: the recipe they were quantized with.
        out_dtype: torch.bfloat16 (default; at small groups this GEMM is bound by its output's bytes) or
            torch.float32.
        split_accumulator: tensorwise only, as in grouped_matmul_fp8 (default on).

    Returns:
        [E, K, N] in out_dtype; an empty group's gradient is zeros.

    Example:
        >>> x, dy = torch.randn(6, 128, dtype=torch.bfloat16), torch.randn(6, 64, dtype=torch.bfloat16)
        >>> sizes = torch.tensor([2, 4])
        >>> _, _, x_cols, x_scale = quantize(x, sizes, "blockwise", rowwise=False, columnwise=True)
        >>> _, _, dy_cols, dy_scale = quantize(dy, sizes, "blockwise", rowwise=False, columnwise=True)
        >>> grouped_matmul_fp8_wgrad(x_cols, dy_cols, x_scale, dy_scale, sizes, 6, "blockwise").shape
        torch.Size([2, 128, 64])
    """
    name = _fp8_name(out_dtype)
    _check_wgrad(
        recipe=recipe, num_rows=int(num_rows), out_dtype=name,
        lhs=signature(lhs), grad=signature(grad), lhs_scale=signature(lhs_scale),
        grad_scale=signature(grad_scale), group_sizes=signature(group_sizes),
    )  # fmt: skip
    return WGRAD(
        lhs, grad, lhs_scale, grad_scale, group_sizes, int(num_rows), recipe, name, bool(split_accumulator)
    )


@memoised
def _check_linear(recipe: str, **tensors: Signature | None) -> None:
    rules.check_fp8_grouped_linear(**described(**tensors), recipe=recipe)
    same_device(**tensors)


def fp8_grouped_linear(rows: Tensor, group_sizes: Tensor, weight: Tensor, recipe: str) -> Tensor:
    """A differentiable grouped projection in FP8: out[rows of g] = rows[rows of g] @ weight[g], with rows
    and weight quantized by `recipe`, the product in FP8, and in the backward the output gradient quantized
    (e5m2 under tensorwise, e4m3 under blockwise) and both gradients computed by FP8 products.

    Args:
        rows: [M, K] bfloat16, float16 or float32, grouped by expert.
        group_sizes: [E] integers on rows' device (clipped as `quantize` clips them).
        weight: [E, K, N], rows' dtype.
        recipe: "tensorwise" or "blockwise" (moetriton.kernels.rules.fp8.RECIPES).

    Returns:
        [M, N] in rows' dtype (computed in bf16, fp32 for fp32 rows); rows past sum(group_sizes) are zeros.
        Gradients: rows' and weight's dtypes (same rule); rows past the groups get zero gradient.

    Example:
        >>> x = torch.randn(6, 128, dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
        >>> out = fp8_grouped_linear(x, torch.tensor([2, 4]), w, "tensorwise")
        >>> out.sum().backward()
        >>> x.grad.shape, w.grad.shape
        (torch.Size([6, 128]), torch.Size([2, 128, 64]))
    """
    _check_linear(
        recipe=recipe, rows=signature(rows), group_sizes=signature(group_sizes), weight=signature(weight)
    )
    save = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    return LINEAR(rows.contiguous(), group_sizes, weight.contiguous(), recipe, save)[0]
