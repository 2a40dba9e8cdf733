"""The expert MLP's activation between the two grouped GEMMs, on the rows of the groups only.

The expert-parallel layers size their receive buffers for the worst case (every routed slot of every peer on
one rank: twice the routed rows at EP = 2), so the first GEMM's output [M, 2F] holds sum(group_sizes) rows
of data and a tail nobody reads. An elementwise XLA or PyTorch activation streams all M rows, forward and
backward; these kernels read `group_sizes` on the device and touch the groups' rows only. Rows at and past
sum(group_sizes) (clipped to M) are not written: their values are unspecified, which is what the grouped
GEMMs' callers that skip the tail (`zero_tail=False`) can use, since those GEMMs never read them. Without
group sizes (num_groups None) every row is computed: the PyTorch layer's buffers hold exactly the
received rows, and one fused kernel per direction replaces eager PyTorch's several elementwise ones.

Activations (GATED_ACTIVATIONS of kernels/rules/activation.py says which are gated): "swiglu" silu(gate)
* up, "geglu" gelu(gate) * up and "clamped_swiglu" (GPT-OSS's: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g),
g = min(gate, 7), kernels/rules/activation.py) on [M, 2F] = [gate | up], "gelu" and "relu" on [M, F]; gelu
is the exact (erf) one. Math in fp32, results rounded once to the input dtype, as the frameworks' fp32
references do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import block_columns
from .rules.activation import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, GATED_ACTIVATIONS
from .runtime.plan import (
    DEFAULT_DEVICE,
    Buffer,
    DeviceInfo,
    Launch,
    Plan,
    Sizes,
    cached,
    cdiv,
    next_pow2,
    sized_by,
)

#: The function of every activation (the gated ones' on their gate half), as the kernels' FUNCTION constexpr;
#: clamped_swiglu's (_CLAMPED) also clamps gate and up first.
_FUNCTIONS = {"swiglu": 0, "geglu": 1, "gelu": 1, "relu": 2, "clamped_swiglu": 3}
_CLAMPED = tl.constexpr(_FUNCTIONS["clamped_swiglu"])
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_ALPHA = tl.constexpr(CLAMPED_SWIGLU_ALPHA)
_LIMIT = tl.constexpr(CLAMPED_SWIGLU_LIMIT)


@triton.jit
def _function(x, FUNCTION: tl.constexpr):
    """(f(x), f'(x)) in fp32 of FUNCTION: 0 silu, 1 exact gelu, 2 relu, 3 x * sigmoid(alpha x)."""
    if FUNCTION == 0:
        sigmoid = tl.sigmoid(x)
        return x * sigmoid, sigmoid * (1.0 + x * (1.0 - sigmoid))
    elif FUNCTION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT_HALF))
        return x * cdf, cdf + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif FUNCTION == 2:
        return tl.maximum(x, 0.0), (x > 0.0).to(tl.float32)
    else:
        scaled = x * _ALPHA
        sigmoid = tl.sigmoid(scaled)
        return x * sigmoid, sigmoid * (1.0 + scaled * (1.0 - sigmoid))


@triton.jit
def _clamp(gate, up):
    """clamped_swiglu's inputs: (min(gate, limit), clamp(up, -limit, limit) + 1) and where each passes its
    gradient, torch.clamp's rule: gate <= limit, -limit <= up <= limit (false at NaN). Selects, not
    tl.minimum / tl.maximum, so that a NaN goes through as in torch.clamp (a hardware min drops it)."""
    clamped_gate = tl.where(gate > _LIMIT, _LIMIT, gate)
    clamped_up = tl.where(up > _LIMIT, _LIMIT, tl.where(up < -_LIMIT, -_LIMIT, up))
    return clamped_gate, clamped_up + 1.0, gate <= _LIMIT, (up >= -_LIMIT) & (up <= _LIMIT)


@triton.jit
def _block(
    group_sizes_ptr,
    num_rows,
    FFN: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """This program's rows [BLOCK_ROWS] (int64) and columns [BLOCK_COLS] of [M, F], the mask of those inside
    the groups' rows (sum(group_sizes), sizes taken as >= 0, clipped to M; every row for NUM_GROUPS 0) and
    F, and whether any row is."""
    if NUM_GROUPS > 0:
        groups = tl.arange(0, GROUPS_POW2)
        sizes = tl.load(group_sizes_ptr + groups, mask=groups < NUM_GROUPS, other=0)
        # Clipped in their own dtype, summed in int64: no size or sum of sizes wraps.
        sizes = tl.minimum(tl.maximum(sizes, 0), num_rows).to(tl.int64)
        valid_rows = tl.minimum(tl.sum(sizes, axis=0), num_rows)
    else:
        valid_rows = num_rows
    first = tl.program_id(0) * BLOCK_ROWS
    rows = (first + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < valid_rows)[:, None] & (cols < FFN)[None, :]
    return rows, cols, mask, first < valid_rows


@triton.jit
def _activate_kernel(
    hidden_ptr,  # [M, W]: W = 2F ([gate | up]) where GATED, else F
    group_sizes_ptr,  # [E] integer (unused for NUM_GROUPS 0: every row)
    num_rows,  # M
    out_ptr,  # [M, F]
    FFN: tl.constexpr,  # F
    GATED: tl.constexpr,
    FUNCTION: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """out = f(gate) * up (GATED; clamped first for _CLAMPED) or f(hidden) on the groups' rows. Grid
    (cdiv(M, BLOCK_ROWS), cdiv(F, BLOCK_COLS)): program (b, c) computes columns [c*BLOCK_COLS, +BLOCK_COLS)
    of rows [b*BLOCK_ROWS, +BLOCK_ROWS) below sum(group_sizes); a block wholly past them exits."""
    rows, cols, mask, live = _block(
        group_sizes_ptr, num_rows, FFN, NUM_GROUPS, GROUPS_POW2, BLOCK_ROWS, BLOCK_COLS
    )
    if not live:
        return
    width: tl.constexpr = 2 * FFN if GATED else FFN
    hidden = hidden_ptr + rows[:, None] * width + cols[None, :]
    gate = tl.load(hidden, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(hidden + FFN, mask=mask, other=0.0).to(tl.float32)
        if FUNCTION == _CLAMPED:
            gate, up, _, _ = _clamp(gate, up)
        value, _ = _function(gate, FUNCTION)
        value *= up
    else:
        value, _ = _function(gate, FUNCTION)
    tl.store(out_ptr + rows[:, None] * FFN + cols[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activate_backward_kernel(
    hidden_ptr,  # [M, W]
    grad_ptr,  # [M, F]: the cotangent of the activation's output
    group_sizes_ptr,  # [E] integer (unused for NUM_GROUPS 0: every row)
    num_rows,  # M
    grad_hidden_ptr,  # [M, W]
    FFN: tl.constexpr,
    GATED: tl.constexpr,
    FUNCTION: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """grad_hidden = [grad * up * f'(gate) | grad * f(gate)] (GATED; for _CLAMPED of the clamped gate and
    up, each 0 where its clamp stops the gradient) or grad * f'(hidden) on the groups' rows. Grid and
    programs as `_activate_kernel`'s."""
    rows, cols, mask, live = _block(
        group_sizes_ptr, num_rows, FFN, NUM_GROUPS, GROUPS_POW2, BLOCK_ROWS, BLOCK_COLS
    )
    if not live:
        return
    width: tl.constexpr = 2 * FFN if GATED else FFN
    offsets = rows[:, None] * width + cols[None, :]
    grad = tl.load(grad_ptr + rows[:, None] * FFN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(hidden_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out_dtype = grad_hidden_ptr.dtype.element_ty
    if GATED:
        up = tl.load(hidden_ptr + offsets + FFN, mask=mask, other=0.0).to(tl.float32)
        if FUNCTION == _CLAMPED:
            gate, up, gate_passes, up_passes = _clamp(gate, up)
        value, slope = _function(gate, FUNCTION)
        grad_gate = grad * up * slope
        grad_up = grad * value
        if FUNCTION == _CLAMPED:
            # Selected last, as torch.clamp's backward does: a stopped gradient is 0 even where the product
            # is NaN (a NaN up or cotangent).
            grad_gate = tl.where(gate_passes, grad_gate, 0.0)
            grad_up = tl.where(up_passes, grad_up, 0.0)
        tl.store(grad_hidden_ptr + offsets, grad_gate.to(out_dtype), mask=mask)
        tl.store(grad_hidden_ptr + offsets + FFN, grad_up.to(out_dtype), mask=mask)
    else:
        _, slope = _function(gate, FUNCTION)
        tl.store(grad_hidden_ptr + offsets, (grad * slope).to(out_dtype), mask=mask)


def _check(activation: str, num_rows: int, width: int, num_groups: int | None, element_bytes: int) -> int:
    """F of a valid problem, else ValueError."""
    if activation not in _FUNCTIONS:
        raise ValueError(
            f"grouped_activation: activation must be one of {tuple(_FUNCTIONS)}, got {activation!r}"
        )
    gated = GATED_ACTIVATIONS[activation]
    if num_rows < 0 or width < 0 or (num_groups is not None and num_groups < 1) or (gated and width % 2):
        raise ValueError(
            f"grouped_activation: expected M >= 0 rows of width W >= 0 (even for {activation!r}) and at least"
            f" one group or None, got M={num_rows}, W={width}, E={num_groups}"
        )
    if element_bytes not in (2, 4):
        raise ValueError(f"grouped_activation: element size {element_bytes} bytes (bf16, fp16 or fp32 only)")
    return width // 2 if gated else width


def _plan(
    kernel,
    args: tuple,
    result: str,
    backward: bool,
    activation: str,
    num_rows: int,
    width: int,
    num_groups: int | None,
    element_bytes: int,
) -> Plan:
    """The plan of either kernel: `result` [M, F] (forward) or [M, W] (backward) in hidden's dtype, one
    launch of 2 rows by up to 8 KiB of each operand's columns per program (a streaming kernel: enough bytes
    in flight per program, and a grid that fills the GPU at any M)."""
    ffn = _check(activation, num_rows, width, num_groups, element_bytes)
    buffers = {result: Buffer((num_rows, width if backward else ffn), "like:hidden")}
    if num_rows == 0 or ffn == 0:
        return Plan(buffers, (), (result,))
    block_cols = block_columns(ffn, 8192 // element_bytes)
    block_rows = 2
    launch = Launch(
        kernel=kernel,
        grid=(cdiv(num_rows, block_rows), cdiv(ffn, block_cols)),
        args=(*args, num_rows),
        outputs=(result,),
        constexprs=dict(
            FFN=ffn,
            GATED=GATED_ACTIVATIONS[activation],
            FUNCTION=_FUNCTIONS[activation],
            NUM_GROUPS=num_groups or 0,
            GROUPS_POW2=next_pow2(num_groups or 1),
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        ),
        num_warps=4,
    )
    return Plan(buffers, (launch,), (result,))


#: Both plans take their sizes from hidden [M, W] and group_sizes [E].
_HIDDEN_SIZES = Sizes(
    axes=dict(num_rows=("hidden", 0), width=("hidden", 1), num_groups=("group_sizes", 0)),
    element_bytes="hidden",
)


@sized_by(_HIDDEN_SIZES)
@cached
def activation_plan(
    *,
    activation: str,
    num_rows: int,
    width: int,
    num_groups: int | None,
    element_bytes: int,
    device: DeviceInfo = DEFAULT_DEVICE,
) -> Plan:
    """The activation of the rows of the groups of hidden [M, W] (module doc).

    Inputs: "hidden" [M, W] (W = 2F for a gated activation, else F), "group_sizes" [E] integer (None
    with num_groups None: every row). Result: "out" [M, F] in the dtype of hidden (element_bytes wide);
    rows at and past sum(group_sizes) are not written.
    """
    sizes = (activation, num_rows, width, num_groups, element_bytes)
    return _plan(_activate_kernel, ("hidden", "group_sizes"), "out", False, *sizes)


@sized_by(_HIDDEN_SIZES)
@cached
def activation_backward_plan(
    *,
    activation: str,
    num_rows: int,
    width: int,
    num_groups: int | None,
    element_bytes: int,
    device: DeviceInfo = DEFAULT_DEVICE,
) -> Plan:
    """The input gradient of `activation_plan`'s activation on the groups' rows.

    Inputs: "hidden" [M, W], "grad" [M, F] (the output's cotangent, hidden's dtype), "group_sizes" [E]
    (None with num_groups None). Result: "grad_hidden" [M, W] in hidden's dtype; rows at and past
    sum(group_sizes) are not written.
    """
    sizes = (activation, num_rows, width, num_groups, element_bytes)
    return _plan(_activate_backward_kernel, ("hidden", "grad", "group_sizes"), "grad_hidden", True, *sizes)
