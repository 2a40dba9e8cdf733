"""FP8 grouped GEMMs for JAX: the quantizers, the FP8 products and the differentiable projection
fp8_grouped_linear (a custom_vjp whose backward runs the data and weight gradients in FP8 too), with the
names, arguments and results of moetriton.torch's.

Recipes, formats, the scale and non-finite rules and the layouts are moetriton.kernels.rules.fp8's and
docs/fp8.md's. Group sizes, amaxes and scales stay on the device (any values work under jit). The kernels
run through jax-triton on a GPU (imported on first use) or interpreted under TRITON_INTERPRET=1; there is no
fallback (FP8 products exist to use FP8 tensor cores), so elsewhere the ops raise. One device's operands per
call (inside shard_map for sharded operands). Never imports torch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moetriton import kernels
from moetriton.kernels.rules import fp8 as rules

from .executor import describe, dtype_name, run_builder, uses_kernels


def _require_kernels() -> None:
    if not uses_kernels():
        raise RuntimeError(
            "moetriton FP8 ops run their Triton kernels only: on a GPU, or on CPU with TRITON_INTERPRET=1 "
            "set before moetriton is imported"
        )


def _format(fp8_dtype, op: str, recipe: str) -> str:
    """The fp8 format asked for by name, or the recipe's forward format."""
    return dtype_name(fp8_dtype) if fp8_dtype is not None else rules.recipe_of(op, recipe).forward_dtype


def _quantize(inp, group_sizes, recipe: str, fp8: str, rowwise: bool, columnwise: bool) -> tuple:
    results = run_builder(
        kernels.quantize_plan,
        dict(inp=inp, group_sizes=group_sizes),
        recipe=recipe,
        fp8_dtype=fp8,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    rows, rows_scale, cols, cols_scale = results.values()
    return (rows, rows_scale) if rowwise else (None, None), (cols, cols_scale) if columnwise else (None, None)


def _quantize_weights(weight, recipe: str, fp8: str, rowwise: bool, columnwise: bool) -> tuple:
    options = dict(recipe=recipe, fp8_dtype=fp8, rowwise=rowwise, columnwise=columnwise)
    rows, cols, scale = run_builder(kernels.quantize_weights_plan, dict(weight=weight), **options).values()
    return rows if rowwise else None, cols if columnwise else None, scale


def _matmul(lhs, rhs, lhs_scale, rhs_scale, group_sizes, recipe, data_gradient, out_dtype, split):
    inputs = dict(lhs=lhs, rhs=rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale, group_sizes=group_sizes)
    options = dict(recipe=recipe, data_gradient=data_gradient, out_dtype=out_dtype, split_accumulator=split)
    (out,) = run_builder(kernels.fp8_grouped_matmul_plan, inputs, **options).values()
    return out


def _wgrad(lhs, grad, lhs_scale, grad_scale, group_sizes, num_rows, recipe, out_dtype, split):
    inputs = dict(lhs=lhs, grad=grad, lhs_scale=lhs_scale, grad_scale=grad_scale, group_sizes=group_sizes)
    options = dict(num_rows=num_rows, recipe=recipe, out_dtype=out_dtype, split_accumulator=split)
    (out,) = run_builder(kernels.fp8_grouped_matmul_wgrad_plan, inputs, **options).values()
    return out


def _out_dtype(dtype) -> str:
    """The FP8 products' output dtype for inputs of `dtype`: fp32 for fp32, else bf16."""
    return "float32" if jnp.dtype(dtype) == jnp.float32 else "bfloat16"


def _linear_forward(rows, group_sizes, weight, recipe: str, save: bool):
    fp8 = rules.RECIPES[recipe].forward_dtype
    (x_rows, x_scale), x_cols = _quantize(rows, group_sizes, recipe, fp8, True, save)
    w_rows, w_cols, w_scale = _quantize_weights(weight, recipe, fp8, save, True)
    out = _matmul(x_rows, w_cols, x_scale, w_scale, group_sizes, recipe, False, _out_dtype(rows.dtype), False)
    return out.astype(rows.dtype), (x_cols, w_rows, w_scale)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear(rows, group_sizes, weight, recipe: str):
    return _linear_forward(rows, group_sizes, weight, recipe, False)[0]


def _linear_fwd(rows, group_sizes, weight, recipe):
    out, ((x_cols, x_cols_scale), w_rows, w_scale) = _linear_forward(rows, group_sizes, weight, recipe, True)
    return out, (group_sizes, x_cols, x_cols_scale, w_rows, w_scale)


def _linear_bwd(recipe, residuals, grad):
    # grad is [M, N] in the output's dtype, which is rows' and weight's (fp8_grouped_linear checks).
    group_sizes, x_cols, x_cols_scale, w_rows, w_scale = residuals
    dtype, out_dtype = grad.dtype, _out_dtype(grad.dtype)
    fp8 = rules.RECIPES[recipe].gradient_dtype
    (dy_rows, dy_scale), (dy_cols, dy_cols_scale) = _quantize(grad, group_sizes, recipe, fp8, True, True)
    grad_rows = _matmul(dy_rows, w_rows, dy_scale, w_scale, group_sizes, recipe, True, out_dtype, True)
    grad_weight = _wgrad(
        x_cols, dy_cols, x_cols_scale, dy_cols_scale, group_sizes, grad.shape[0], recipe, out_dtype, True
    )
    return grad_rows.astype(dtype), None, grad_weight.astype(dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


def quantize(
    inp: jax.Array,
    group_sizes: jax.Array,
    recipe: str,
    *,
    fp8_dtype=None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> tuple:
    """The FP8 copies of the groups' rows of an activation or gradient (moetriton.torch.quantize's
    arguments and results).

    Args:
        inp: [M, W] bfloat16, float16 or float32 rows, grouped; rows past sum(group_sizes) are not read.
        group_sizes: [E] integers (negative counts as 0, clipped to the rows present).
        recipe: "tensorwise" or "blockwise".
        fp8_dtype: jnp.float8_e4m3fn or jnp.float8_e5m2 (default: the recipe's forward format).
        rowwise / columnwise: which copies to write (at least one).

    Returns:
        (rows [M, W], rows_scale (blockwise [M, cdiv(W, 128)], tensorwise [1]), cols [W, P] (transposed,
        each group zero-padded to whole 128-row blocks, P = padded_rows(M, E)), cols_scale (blockwise
        [P / 128, W], tensorwise [1])); a copy not asked for and its scale are None.

    Example:
        >>> x = jnp.ones((6, 128), jnp.bfloat16)
        >>> rows, scale, _, _ = quantize(x, jnp.array([2, 4]), "blockwise")
        >>> rows.dtype, scale.shape
        (dtype(float8_e4m3fn), (6, 1))
    """
    fp8 = _format(fp8_dtype, "quantize", recipe)
    rules.check_quantize(inp=describe(inp), group_sizes=describe(group_sizes), recipe=recipe, fp8_dtype=fp8)
    _require_kernels()
    (rows, rows_scale), (cols, cols_scale) = _quantize(
        inp, group_sizes.astype(jnp.int32), recipe, fp8, bool(rowwise), bool(columnwise)
    )
    return rows, rows_scale, cols, cols_scale


def quantize_weights(
    weight: jax.Array, recipe: str, *, fp8_dtype=None, rowwise: bool = True, columnwise: bool = True
) -> tuple:
    """The FP8 copies of expert weights [E, K, N] (moetriton.torch.quantize_weights' arguments and results):
    (rows [E, K, N], cols [E, N, K], scale (blockwise [E, cdiv(K, 128), cdiv(N, 128)], tensorwise [E])),
    a copy not asked for None.

    Example:
        >>> rows, cols, scale = quantize_weights(jnp.ones((2, 128, 64), jnp.bfloat16), "tensorwise")
        >>> cols.shape, scale.shape
        ((2, 64, 128), (2,))
    """
    fp8 = _format(fp8_dtype, "quantize_weights", recipe)
    rules.check_quantize_weights(weight=describe(weight), recipe=recipe, fp8_dtype=fp8)
    _require_kernels()
    return _quantize_weights(weight, recipe, fp8, bool(rowwise), bool(columnwise))


def grouped_matmul_fp8(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_scale: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    recipe: str,
    *,
    data_gradient: bool = False,
    out_dtype=jnp.bfloat16,
    split_accumulator: bool | None = None,
) -> jax.Array:
    """The FP8 grouped GEMM of the forward or the data gradient, out[rows of g] = lhs[rows of g] @
    rhs[g]^T from dequantized operands (moetriton.torch.grouped_matmul_fp8's arguments and results):
    lhs [M, D] fp8 rowwise copy, rhs [E, C, D] fp8 (the weight's cols copy in the forward, its rows copy
    with `data_gradient`), their scales, group_sizes [E]. Returns [M, C] in out_dtype (bfloat16 or
    float32), rows past the groups zero.

    Example:
        >>> x, w = jnp.ones((6, 128), jnp.bfloat16), jnp.ones((2, 128, 64), jnp.bfloat16)
        >>> sizes = jnp.array([2, 4])
        >>> rows, x_scale, _, _ = quantize(x, sizes, "blockwise")
        >>> _, cols, w_scale = quantize_weights(w, "blockwise", rowwise=False)
        >>> grouped_matmul_fp8(rows, cols, x_scale, w_scale, sizes, "blockwise").shape
        (6, 64)
    """
    out = dtype_name(out_dtype)
    rules.check_fp8_grouped_matmul(
        lhs=describe(lhs), rhs=describe(rhs), lhs_scale=describe(lhs_scale), rhs_scale=describe(rhs_scale),
        group_sizes=describe(group_sizes), recipe=recipe, data_gradient=bool(data_gradient), out_dtype=out,
    )  # fmt: skip
    _require_kernels()
    split = bool(data_gradient if split_accumulator is None else split_accumulator)
    sizes = group_sizes.astype(jnp.int32)
    return _matmul(lhs, rhs, lhs_scale, rhs_scale, sizes, recipe, bool(data_gradient), out, split)


def grouped_matmul_fp8_wgrad(
    lhs: jax.Array,
    grad: jax.Array,
    lhs_scale: jax.Array,
    grad_scale: jax.Array,
    group_sizes: jax.Array,
    num_rows: int,
    recipe: str,
    *,
    out_dtype=jnp.bfloat16,
    split_accumulator: bool = True,
) -> jax.Array:
    """The FP8 weight gradient out[g] = X[rows of g]^T @ dY[rows of g] from the columnwise copies of X
    [M, K] and dY [M, N] (moetriton.torch.grouped_matmul_fp8_wgrad's arguments and results): lhs [K, P],
    grad [N, P], their columnwise scales, group_sizes [E], num_rows M. Returns [E, K, N] in out_dtype
    (bfloat16 by default, or float32); an empty group's gradient is zero.

    Example:
        >>> x, dy = jnp.ones((6, 128), jnp.bfloat16), jnp.ones((6, 64), jnp.bfloat16)
        >>> sizes = jnp.array([2, 4])
        >>> _, _, x_cols, x_scale = quantize(x, sizes, "blockwise", rowwise=False, columnwise=True)
        >>> _, _, dy_cols, dy_scale = quantize(dy, sizes, "blockwise", rowwise=False, columnwise=True)
        >>> grouped_matmul_fp8_wgrad(x_cols, dy_cols, x_scale, dy_scale, sizes, 6, "blockwise").shape
        (2, 128, 64)
    """
    out = dtype_name(out_dtype)
    rules.check_fp8_grouped_matmul_wgrad(
        lhs=describe(lhs), grad=describe(grad), lhs_scale=describe(lhs_scale),
        grad_scale=describe(grad_scale), group_sizes=describe(group_sizes), num_rows=int(num_rows),
        recipe=recipe, out_dtype=out,
    )  # fmt: skip
    _require_kernels()
    sizes = group_sizes.astype(jnp.int32)
    split = bool(split_accumulator)
    return _wgrad(lhs, grad, lhs_scale, grad_scale, sizes, int(num_rows), recipe, out, split)


def fp8_grouped_linear(rows: jax.Array, group_sizes: jax.Array, weight: jax.Array, recipe: str) -> jax.Array:
    """A differentiable grouped projection in FP8 (moetriton.torch.fp8_grouped_linear's arguments and
    results): out[rows of g] = rows[rows of g] @ weight[g] with rows and weight quantized by `recipe`, the
    product in FP8, and in the VJP the output gradient quantized (e5m2 under tensorwise, e4m3 under
    blockwise) and both gradients computed by FP8 products.

    Args:
        rows: [M, K] bfloat16, float16 or float32, grouped by expert.
        group_sizes: [E] integers (clipped as `quantize` clips them); no gradient.
        weight: [E, K, N], rows' dtype.
        recipe: "tensorwise" or "blockwise".

    Returns:
        [M, N] in rows' dtype (computed in bf16, fp32 for fp32 rows); rows past sum(group_sizes) are zero.

    Example:
        >>> x, w = jnp.ones((6, 128), jnp.bfloat16), jnp.ones((2, 128, 64), jnp.bfloat16)
        >>> loss = lambda x, w: fp8_grouped_linear(x, jnp.array([2, 4]), w, "tensorwise").sum()
        >>> [g.shape for g in jax.grad(loss, argnums=(0, 1))(x, w)]
        [(6, 128), (2, 128, 64)]
    """
    rules.check_fp8_grouped_linear(
        rows=describe(rows), group_sizes=describe(group_sizes), weight=describe(weight), recipe=recipe
    )
    _require_kernels()
    return _linear(rows, group_sizes.astype(jnp.int32), weight, recipe)
