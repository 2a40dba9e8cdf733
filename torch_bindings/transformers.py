"""moetriton as a HuggingFace transformers experts implementation.

transformers (5.x) routes every MoE model whose experts class is decorated with `use_experts_implementation`
through a registry of experts functions, `ExpertsInterface`: a function `(experts, hidden_states [T, H],
top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`, picked by name with
`from_pretrained(..., experts_implementation=NAME)` or `model.set_experts_implementation(NAME)`. `register()`
adds moetriton there, after which the model keeps its own router and runs dispatch, the expert GEMMs, the
activation and combine on moetriton's kernels (and `torch._grouped_mm` where the layer uses it).

transformers is an optional dependency (the `transformers` extra): this module imports it, and
`moetriton.torch` does not import this module.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

try:
    # At import, not in the forward: torch.compile cannot trace transformers' lazy modules.
    from transformers import activations as hf_activations
    from transformers.integrations import moe as hf_moe
except ImportError as error:  # transformers < 5 has no experts registry
    raise ImportError(
        "moetriton.torch.transformers needs transformers >= 5 (its ExpertsInterface): pip install "
        "'moetriton[transformers]'"
    ) from error

from .activation import ACTIVATE
from .moe.experts import grouped_linear
from .permutation import token_combine, token_dispatch

IMPLEMENTATION = "moetriton"

# The flags use_experts_implementation sets on an experts module: the layout this function reads.
_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "num_experts")


def register(name: str = IMPLEMENTATION) -> str:
    """Registers `experts_forward` in transformers' ExpertsInterface under `name` and returns the name.

    Afterwards `AutoModelForCausalLM.from_pretrained(..., experts_implementation=name)` or
    `model.set_experts_implementation(name)` runs the model's experts on moetriton. Idempotent.

    Example:
        >>> from moetriton.torch.transformers import register
        >>> register()
        'moetriton'
    """
    hf_moe.ExpertsInterface.register(name, experts_forward)
    return name


def _fused_activation(experts: nn.Module) -> str | None:
    """The moetriton activation that equals the experts' own gate or activation exactly, or None where the
    module defines its own (GPT-OSS's clamped SwiGLU on interleaved columns), which then runs as written."""
    act = getattr(experts, "act_fn", None)
    exact_gelu = isinstance(act, hf_activations.GELUActivation) and act.act is nn.functional.gelu
    if experts.has_gate:
        # A class of its own `_apply_gate` (an interleaved or clamped gate) keeps it.
        if type(experts)._apply_gate is not getattr(hf_moe, "_default_apply_gate", None):
            return None
        if isinstance(act, (nn.SiLU, getattr(hf_activations, "SiLUActivation", nn.SiLU))):
            return "swiglu"
        return "geglu" if exact_gelu else None
    if isinstance(act, nn.ReLU):
        return "relu"
    return "gelu" if exact_gelu else None


def _check_layout(experts: nn.Module) -> None:
    missing = [flag for flag in _LAYOUT_FLAGS if not hasattr(experts, flag)]
    if missing:
        raise TypeError(
            f"moetriton's experts implementation needs an experts module decorated with transformers' "
            f"use_experts_implementation; {type(experts).__name__} has no {', '.join(missing)}"
        )
    names = ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")
    if experts.has_bias:
        names += tuple(f"{name}_bias" for name in names)
    absent = [name for name in names if not isinstance(getattr(experts, name, None), Tensor)]
    if absent:
        raise TypeError(
            f"{type(experts).__name__} declares has_gate={experts.has_gate}, has_bias={experts.has_bias} but "
            f"has no tensor {', '.join(absent)}"
        )


def experts_forward(
    experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """The experts of a transformers MoE block on moetriton's kernels: [T, H] -> [T, H].

    Args:
        experts: the model's experts module (its layout from the use_experts_implementation flags: fused
            gate_up_proj [E, 2F, H] or up_proj [E, F, H] and down_proj [E, H, F], each transposed
            ([E, H, 2F], [E, F, H]) where `is_transposed`; biases [E, 2F] / [E, H] where `has_bias`).
        hidden_states: [T, H] tokens, the weights' dtype (float32, bfloat16 or float16).
        top_k_index: [T, K] int expert ids from the model's router. Ids outside [0, E) are no expert: the
            placeholders transformers' expert parallelism gives other ranks' experts add nothing.
        top_k_weights: [T, K] routing weights, applied to the experts' outputs.

    Returns:
        [T, H] in hidden_states.dtype: sum over k of top_k_weights[t, k] * expert(top_k_index[t, k])(x[t]),
        accumulated in fp32 in slot order (bitwise reproducible). The expert GEMMs run as the MoE layer's
        (torch._grouped_mm on CUDA sm_90+ in bf16, a masked per-expert product elsewhere); the gate runs in
        moetriton's fused activation kernel where it is SwiGLU or GeGLU, else as the module defines it.
        No host sync on CUDA.

    Example:
        >>> from transformers import MixtralConfig
        >>> from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        >>> config = MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=3)
        >>> experts = MixtralExperts(config)
        >>> _ = nn.init.normal_(experts.gate_up_proj), nn.init.normal_(experts.down_proj)
        >>> out = experts_forward(experts, torch.randn(5, 8), torch.tensor([[0, 2]] * 5), torch.rand(5, 2))
        >>> out.shape
        torch.Size([5, 8])
    """
    _check_layout(experts)
    num_experts = experts.num_experts
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(
            f"expected hidden_states [T, H], top_k_index and top_k_weights [T, K]; got "
            f"{tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    in_range = (top_k_index >= 0) & (top_k_index < num_experts)
    indices = torch.where(in_range, top_k_index, -1).to(torch.int32)  # [T, K]
    rows, _, row_id_map, _, group_sizes = token_dispatch(
        hidden_states, indices=indices, num_experts=num_experts, num_out_tokens=top_k_index.numel()
    )  # rows [T * K, H], expert-major; rows past the routed ones are zero
    first, second = ("gate_up_proj", "down_proj") if experts.has_gate else ("up_proj", "down_proj")
    # grouped_linear multiplies rows @ weight[e]: [E, in, out], which the transposed layout stores.
    layout = (lambda weight: weight) if experts.is_transposed else (lambda weight: weight.transpose(1, 2))
    bias = (lambda name: getattr(experts, f"{name}_bias")) if experts.has_bias else (lambda name: None)
    hidden = grouped_linear(
        rows, group_sizes, layout(getattr(experts, first)), bias(first)
    )  # [N, 2F] | [N, F]
    activation = _fused_activation(experts)
    if activation is not None:
        act = ACTIVATE(hidden, activation)
    elif experts.has_gate:
        act = experts._apply_gate(hidden)
    else:
        act = experts.act_fn(hidden)
    out = grouped_linear(act.to(rows.dtype), group_sizes, layout(getattr(experts, second)), bias(second))
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return token_combine(out.to(hidden_states.dtype), row_id_map, top_k_weights.float())
