"""Argument rules of the expert activation (grouped_activation), shared by the bindings, and the activations
themselves: which are gated decides every shape the MoE layers give their expert weights."""

from __future__ import annotations

from .grouped_gemm import GROUPED_MATMUL_DTYPES
from .validation import fail, require_array

#: Expert activations by name: True for a gated one (the fused gate_up weight holds [gate | up], 2F columns),
#: False for a plain one (F columns). Each framework implements the functions; the shapes are decided here.
GATED_ACTIVATIONS = {"swiglu": True, "geglu": True, "clamped_swiglu": True, "gelu": False, "relu": False}

#: "clamped_swiglu", GPT-OSS's gated activation (its experts' swiglu_alpha and swiglu_limit; transformers
#: stores gate and up interleaved in columns, de-interleave them once into [gate | up]):
#: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). The gradient is
#: PyTorch autograd's of that formula with torch.clamp: gate's passes where gate <= limit, up's where
#: -limit <= up <= limit (the limit itself included), both 0 elsewhere. A NaN goes through its clamp (a NaN
#: output); its own gradient is 0, the other half's is NaN unless that half is clamped.
CLAMPED_SWIGLU_ALPHA = 1.702
CLAMPED_SWIGLU_LIMIT = 7.0


def check_grouped_activation(
    *, hidden: tuple[tuple[int, ...], str], group_sizes: tuple[tuple[int, ...], str], activation: str
) -> None:
    """Validates grouped_activation's arguments: an activation of GATED_ACTIVATIONS, hidden [M, W] in
    bfloat16 / float16 / float32 (W even for a gated activation), group_sizes [E] integers. ValueError."""
    if activation not in GATED_ACTIVATIONS:
        fail("activation", f"expected one of {tuple(GATED_ACTIVATIONS)}, got {activation!r}")
    require_array("hidden", hidden)
    require_array("group_sizes", group_sizes)
    (hidden_shape, hidden_dtype), (sizes_shape, sizes_dtype) = hidden, group_sizes
    if len(hidden_shape) != 2 or len(sizes_shape) != 1:
        raise ValueError(
            "grouped_activation: expected hidden [M, W] and group_sizes [E], got shapes"
            f" {tuple(hidden_shape)} and {tuple(sizes_shape)}"
        )
    if hidden_dtype not in GROUPED_MATMUL_DTYPES:
        fail("hidden", f"expected bfloat16, float16 or float32, got {hidden_dtype}")
    if not sizes_dtype.startswith(("int", "uint")):
        fail("group_sizes", f"expected an integer dtype, got {sizes_dtype}")
    if GATED_ACTIVATIONS[activation] and hidden_shape[1] % 2:
        fail("hidden", f"expected an even width 2F for {activation!r}, got {hidden_shape[1]}")
