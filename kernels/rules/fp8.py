"""The FP8 recipes and their rules, written once: formats, the scale rule's constants, block sizes, the
columnwise copies' padded width, and the argument rules of the FP8 ops (quantize, the FP8 grouped GEMMs,
fp8_grouped_linear), shared by the kernels' plans and both bindings.

Scale rule (every recipe, block and tensor alike): x ~ q * s with s the fp32 dequantization scale.
  amax = max |x| over the block's finite values
  s    = 1 where amax == 0 (an all-zero block: its q are exact zeros), else max(amax / FP8_MAX, SCALE_FLOOR)
  q    = saturate(x / s) to [-FP8_MAX, FP8_MAX], rounded to nearest even
Non-finite values (NaN, +-inf) do not enter their block's amax and are quantized to NaN (NAN_CODE in both
formats): the step stays detectable while every scale stays finite and positive.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.plan import cdiv
from .validation import require_array

#: The largest finite value of each FP8 format (numpy-style dtype names).
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: The smallest normal fp32 number, 2**-126: the floor of every scale, so x / s never overflows.
SCALE_FLOOR = 1.1754943508222875e-38
#: The code every non-finite input becomes: NaN in e4m3fn (which has no infinity) and in e5m2.
NAN_CODE = 0x7F
#: Length of a quantization block along the contraction, side of a weight block, and the groups' padding
#: in the columnwise copies.
BLOCK = 128
#: Output dtypes of the FP8 GEMMs, and the input dtypes the quantizers take.
FP8_OUT_DTYPES = ("bfloat16", "float32")
FP8_INPUT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Recipe:
    """An FP8 recipe: whether scales are per block (else per tensor / expert), and the format of the
    forward operands (activations and weights) and of the output gradient."""

    blockwise: bool
    forward_dtype: str
    gradient_dtype: str


RECIPES = {
    # Current scaling, one scale per tensor (per expert for weights), in the HYBRID format: e4m3 forward,
    # e5m2 for the output gradient's wider range.
    "tensorwise": Recipe(blockwise=False, forward_dtype="float8_e4m3fn", gradient_dtype="float8_e5m2"),
    # Fine-grained scaling: 1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights, e4m3
    # for every operand (the scales absorb the range).
    "blockwise": Recipe(blockwise=True, forward_dtype="float8_e4m3fn", gradient_dtype="float8_e4m3fn"),
}


def padded_rows(num_rows: int, num_groups: int) -> int:
    """P, the width of a columnwise copy of [M, W] rows in E groups: every group's rows padded to whole
    128-row blocks fit in cdiv(M, 128) + E - 1 blocks (clipped sizes sum to at most M)."""
    return BLOCK * max(cdiv(num_rows, BLOCK) + num_groups - 1, 0)


def recipe_of(op: str, recipe: str) -> Recipe:
    """The recipe named `recipe`; ValueError naming the op for any other name."""
    if recipe not in RECIPES:
        raise ValueError(f"{op}: recipe must be one of {tuple(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe]


def check_plan_sizes(op: str, num_groups: int, **sizes: int) -> None:
    """Sizes >= 0 and at least one group, else ValueError."""
    if min(sizes.values(), default=0) < 0 or num_groups < 1:
        shown = ", ".join(f"{name}={value}" for name, value in sizes.items())
        raise ValueError(f"{op}: sizes must be >= 0 with at least one group, got {shown}, E={num_groups}")


def check_plan_dtypes(
    op: str, element_bytes: int | None = None, fp8_dtype: str | None = None, out_dtype: str | None = None
) -> None:
    """The input element size (2 or 4 bytes), fp8 format and output dtype a plan is asked for, else
    ValueError."""
    if element_bytes is not None and element_bytes not in (2, 4):
        raise ValueError(f"{op}: element size {element_bytes} bytes (bf16, fp16 or fp32 inputs only)")
    if fp8_dtype is not None and fp8_dtype not in FP8_MAX:
        raise ValueError(f"{op}: fp8_dtype must be one of {tuple(FP8_MAX)}, got {fp8_dtype!r}")
    if out_dtype is not None and out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be one of {FP8_OUT_DTYPES}, got {out_dtype!r}")


Array = tuple[tuple[int, ...], str]


def _integers(op: str, name: str, array: Array, shape: tuple[int, ...]) -> None:
    if tuple(array[0]) != shape:
        raise ValueError(f"{op}: {name} must be {shape}, got {tuple(array[0])}")
    if not array[1].startswith(("int", "uint")):
        raise TypeError(f"{op}: {name} must be integers, got {array[1]}")


def _floats(op: str, name: str, array: Array, rank: int, dtypes: tuple[str, ...]) -> tuple[int, ...]:
    require_array(name, array)
    shape, dtype = tuple(array[0]), array[1]
    if len(shape) != rank:
        raise ValueError(f"{op}: {name} must have {rank} dimensions, got shape {shape}")
    if dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be one of {dtypes}, got {dtype}")
    return shape


def check_quantize(*, inp: Array, group_sizes: Array, recipe: str, fp8_dtype: str) -> None:
    """quantize's arguments: inp [M, W] bf16 / fp16 / fp32, group_sizes [E] integers (E >= 1), a recipe and
    an fp8 format by name. ValueError for shapes and names, TypeError for dtypes."""
    recipe_of("quantize", recipe)
    check_plan_dtypes("quantize", fp8_dtype=fp8_dtype)
    _floats("quantize", "inp", inp, 2, FP8_INPUT_DTYPES)
    require_array("group_sizes", group_sizes)
    if len(group_sizes[0]) != 1 or group_sizes[0][0] < 1:
        raise ValueError(f"quantize: group_sizes must be [E] with E >= 1, got {tuple(group_sizes[0])}")
    _integers("quantize", "group_sizes", group_sizes, tuple(group_sizes[0]))


def check_quantize_weights(*, weight: Array, recipe: str, fp8_dtype: str) -> None:
    """quantize_weights' arguments: weight [E, K, N] bf16 / fp16 / fp32 with E >= 1, a recipe and an fp8
    format by name."""
    recipe_of("quantize_weights", recipe)
    check_plan_dtypes("quantize_weights", fp8_dtype=fp8_dtype)
    shape = _floats("quantize_weights", "weight", weight, 3, FP8_INPUT_DTYPES)
    if shape[0] < 1:
        raise ValueError(f"quantize_weights: weight needs at least one expert, got shape {shape}")


def _scale_shape(op: str, name: str, array: Array, shape: tuple[int, ...]) -> None:
    require_array(name, array)
    if tuple(array[0]) != shape or array[1] != "float32":
        raise ValueError(f"{op}: {name} must be float32 {shape}, got {array[1]} {tuple(array[0])}")


def _fp8(op: str, name: str, array: Array, rank: int) -> tuple[int, ...]:
    return _floats(op, name, array, rank, tuple(FP8_MAX))


def check_fp8_grouped_matmul(
    *,
    lhs: Array,
    rhs: Array,
    lhs_scale: Array,
    rhs_scale: Array,
    group_sizes: Array,
    recipe: str,
    data_gradient: bool,
    out_dtype: str,
) -> None:
    """grouped_matmul_fp8's forward / data-gradient operands: lhs [M, D] fp8, rhs [E, C, D] fp8 (D the
    contraction, contiguous), group_sizes [E] integers, scales of the recipe's layout (blockwise: lhs
    [M, cdiv(D, 128)], rhs the weight's [E, cdiv(K, 128), cdiv(N, 128)], with K = D in the forward and
    K = C in the data gradient; tensorwise: [1] and [E]), out_dtype bfloat16 or float32."""
    op = "grouped_matmul_fp8"
    spec = recipe_of(op, recipe)
    check_plan_dtypes(op, out_dtype=out_dtype)
    (rows, depth), (experts, cols, rhs_depth) = _fp8(op, "lhs", lhs, 2), _fp8(op, "rhs", rhs, 3)
    if rhs_depth != depth or experts < 1:
        raise ValueError(f"{op}: expected lhs [M, D] and rhs [E, C, D] with E >= 1, got {lhs[0]}, {rhs[0]}")
    _integers(op, "group_sizes", group_sizes, (experts,))
    if spec.blockwise:
        weight_depth, weight_cols = (cols, depth) if data_gradient else (depth, cols)
        _scale_shape(op, "lhs_scale", lhs_scale, (rows, cdiv(depth, BLOCK)))
        weight_blocks = (experts, cdiv(weight_depth, BLOCK), cdiv(weight_cols, BLOCK))
        _scale_shape(op, "rhs_scale", rhs_scale, weight_blocks)
    else:
        _scale_shape(op, "lhs_scale", lhs_scale, (1,))
        _scale_shape(op, "rhs_scale", rhs_scale, (experts,))


def check_fp8_grouped_matmul_wgrad(
    *,
    lhs: Array,
    grad: Array,
    lhs_scale: Array,
    grad_scale: Array,
    group_sizes: Array,
    num_rows: int,
    recipe: str,
    out_dtype: str,
) -> None:
    """grouped_matmul_fp8's weight-gradient operands: the columnwise copies lhs [K, P] and grad [N, P] fp8
    of M rows (P = padded_rows(M, E)), their scales (blockwise [P / 128, K] and [P / 128, N], tensorwise
    [1]), group_sizes [E] integers, out_dtype bfloat16 or float32."""
    op = "grouped_matmul_fp8"
    spec = recipe_of(op, recipe)
    check_plan_dtypes(op, out_dtype=out_dtype)
    (depth, width), (cols, grad_width) = _fp8(op, "lhs", lhs, 2), _fp8(op, "grad", grad, 2)
    require_array("group_sizes", group_sizes)
    if len(group_sizes[0]) != 1 or group_sizes[0][0] < 1:
        raise ValueError(f"{op}: group_sizes must be [E] with E >= 1, got {tuple(group_sizes[0])}")
    _integers(op, "group_sizes", group_sizes, tuple(group_sizes[0]))
    padded = padded_rows(num_rows, group_sizes[0][0]) if num_rows >= 0 else -1
    if width != padded or grad_width != padded:
        raise ValueError(
            f"{op}: the columnwise copies of {num_rows} rows in {group_sizes[0][0]} groups are {padded} "
            f"wide; got lhs {tuple(lhs[0])} and grad {tuple(grad[0])}"
        )
    if spec.blockwise:
        _scale_shape(op, "lhs_scale", lhs_scale, (padded // BLOCK, depth))
        _scale_shape(op, "grad_scale", grad_scale, (padded // BLOCK, cols))
    else:
        _scale_shape(op, "lhs_scale", lhs_scale, (1,))
        _scale_shape(op, "grad_scale", grad_scale, (1,))


def check_fp8_grouped_linear(*, rows: Array, group_sizes: Array, weight: Array, recipe: str) -> None:
    """fp8_grouped_linear's arguments: rows [M, K] and weight [E, K, N] of one of bf16 / fp16 / fp32,
    group_sizes [E] integers, a recipe by name."""
    op = "fp8_grouped_linear"
    recipe_of(op, recipe)
    (_, depth) = _floats(op, "rows", rows, 2, FP8_INPUT_DTYPES)
    experts, weight_depth, _ = _floats(op, "weight", weight, 3, FP8_INPUT_DTYPES)
    if weight_depth != depth or experts < 1:
        shapes = f"{tuple(rows[0])}, {tuple(weight[0])}"
        raise ValueError(f"{op}: expected rows [M, K] and weight [E, K, N] with E >= 1, got {shapes}")
    if rows[1] != weight[1]:
        raise TypeError(f"{op}: rows and weight must share a dtype, got {rows[1]} and {weight[1]}")
    require_array("group_sizes", group_sizes)
    _integers(op, "group_sizes", group_sizes, (experts,))
