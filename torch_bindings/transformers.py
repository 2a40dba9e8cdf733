"""moetriton as a HuggingFace transformers experts implementation.

transformers (5.x) routes every MoE model whose experts class is decorated with `use_experts_implementation`
through a registry of experts functions, `ExpertsInterface`: a function `(experts, hidden_states [T, H],
top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`, picked by name with
`from_pretrained(..., experts_implementation=NAME)` or `model.set_experts_implementation(NAME)`. `register()`
adds moetriton there, after which the model keeps its own router and runs dispatch, the expert GEMMs, the
activation and combine on moetriton's kernels (and `torch._grouped_mm` where the layer uses it).
`moe_arguments(block)` maps a sparse-MoE block (router recipe, experts, shared experts) onto
`moetriton.torch.moe`'s arguments, and `replace_moe_blocks(model)` has every such block of a model computed by
that layer, router included, the parameters and their names kept.

transformers is an optional dependency (the `transformers` extra): this module imports it, and
`moetriton.torch` does not import this module.
"""

from __future__ import annotations

import functools

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

from moetriton.kernels.rules.activation import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT

from .activation import ACTIVATE
from .moe import moe
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


def _input_major(experts: nn.Module, name: str) -> Tensor:
    """The experts' weight `name` as [E, in, out] (rows @ weight[e]): as stored where `is_transposed`, else
    a transposed view of [E, out, in] (no copy)."""
    weight = getattr(experts, name)
    return weight if experts.is_transposed else weight.transpose(1, 2)


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
    bias = (lambda name: getattr(experts, f"{name}_bias")) if experts.has_bias else (lambda name: None)
    hidden = grouped_linear(rows, group_sizes, _input_major(experts, first), bias(first))  # [N, 2F] | [N, F]
    activation = _fused_activation(experts)
    if activation is not None:
        act = ACTIVATE(hidden, activation)
    elif experts.has_gate:
        act = experts._apply_gate(hidden)
    else:
        act = experts.act_fn(hidden)
    out = grouped_linear(act.to(rows.dtype), group_sizes, _input_major(experts, second), bias(second))
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return token_combine(out.to(hidden_states.dtype), row_id_map, top_k_weights.float())


# model type -> how its router selects and weights (in moetriton's router options), for `moe_arguments`.
_SOFTMAX_TOP_K = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_SIGMOID_GROUPED = ("deepseek_v3", "glm4_moe")
_SUPPORTED = (*_SOFTMAX_TOP_K, *_SIGMOID_GROUPED, "deepseek_v2", "ernie4_5_moe", "gpt_oss", "llama4_text")


def _groups(config) -> dict:
    """Group-limited selection's options, or none where the config has one group."""
    if getattr(config, "n_group", 1) in (None, 1):
        return {}
    return dict(num_groups=config.n_group, group_topk=config.topk_group)


def _router_options(block: nn.Module, config) -> dict:
    """moetriton's router options equal to the block's own router (see `moe_arguments`)."""
    model_type = config.model_type
    topk = config.num_experts_per_tok
    if model_type in _SOFTMAX_TOP_K:
        # Softmax over every expert, then the top K, renormalised where norm_topk_prob (Mixtral always).
        normalised = getattr(config, "norm_topk_prob", True) if model_type != "mixtral" else True
        return dict(topk=topk, score_function="softmax", use_pre_softmax=True, normalize_topk=normalised)
    if model_type in _SIGMOID_GROUPED:
        # Sigmoid scores, selection on score + correction bias among the groups of the best top-2 sums,
        # weights the selected scores (renormalised where norm_topk_prob) times the scaling factor.
        return dict(
            topk=topk,
            score_function="sigmoid",
            expert_bias=block.gate.e_score_correction_bias,
            normalize_topk=bool(config.norm_topk_prob),
            group_score="top2_sum",
            scaling_factor=float(config.routed_scaling_factor),
            **_groups(config),
        )
    if model_type == "deepseek_v2":
        # Softmax over every expert; "greedy" the top K of them, "group_limited_greedy" within the groups
        # of the largest scores; weights the softmax values times the scaling factor, not renormalised.
        grouped = config.topk_method == "group_limited_greedy"
        return dict(
            topk=topk,
            score_function="softmax",
            use_pre_softmax=True,
            normalize_topk=False,
            scaling_factor=float(config.routed_scaling_factor),
            **(dict(group_score="max", **_groups(config)) if grouped else {}),
        )
    if model_type == "ernie4_5_moe":
        # Softmax over every expert, selection on softmax + correction bias, weights the selected softmax
        # values renormalised (transformers clamps the sum at moe_norm_min, 1e-12: equal for any sum above).
        return dict(
            topk=topk,
            score_function="softmax",
            use_pre_softmax=True,
            normalize_topk=True,
            expert_bias=block.gate.moe_statics.e_score_correction_bias.reshape(-1),
        )
    raise NotImplementedError(
        f"moe_arguments: no mapping of {model_type}'s router to moetriton's (supported: "
        f"{', '.join(_SUPPORTED)})"
    )


def _shared_weights(block: nn.Module) -> dict:
    """moetriton's shared-expert weights from the block's shared MLP (and its per-token gate)."""
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if shared is None:
        return {}
    weights = dict(
        shared_gate_up=torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).t(),  # [H, 2Fs]
        shared_down=shared.down_proj.weight.t(),  # [Fs, H]
    )
    gate = getattr(block, "shared_expert_gate", None)
    if gate is not None:
        weights["shared_gate"] = gate.weight.t()  # [H, 1]
    return weights


def _gpt_oss_arguments(block: nn.Module, experts: nn.Module) -> dict:
    """GPT-OSS: logits x @ W^T + b, the top K of them, softmax over those K; experts with biases in both
    projections and the clamped SwiGLU on interleaved gate/up columns (gate the even ones, up the odd ones:
    gathered here into moetriton's [gate | up] halves, an autograd copy of the parameters)."""
    if (experts.alpha, experts.limit) != (CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT):
        raise NotImplementedError(
            f"moe_arguments: GPT-OSS's gate with alpha={experts.alpha}, limit={experts.limit}; moetriton's "
            f"clamped_swiglu has alpha={CLAMPED_SWIGLU_ALPHA}, limit={CLAMPED_SWIGLU_LIMIT}"
        )

    def halves(interleaved: Tensor) -> Tensor:  # [..., 2F] (g0, u0, g1, u1, ...) -> [..., 2F] [g | u]
        return torch.cat([interleaved[..., 0::2], interleaved[..., 1::2]], dim=-1)

    return dict(
        gate_weight=block.router.weight,  # [E, H]
        gate_bias=block.router.bias,  # [E]
        gate_up=halves(_input_major(experts, "gate_up_proj")),  # [E, H, 2F]
        down=_input_major(experts, "down_proj"),  # [E, F, H]
        gate_up_bias=halves(experts.gate_up_proj_bias),  # [E, 2F]
        down_bias=experts.down_proj_bias,  # [E, H]
        activation="clamped_swiglu",
        topk=experts.config.num_experts_per_tok,
        score_function="softmax",  # after the top-k: over the K selected logits
    )


def _llama4_arguments(block: nn.Module) -> dict:
    """Llama 4: the top K of the logits, each weight sigmoid(logit) without renormalisation, applied to the
    expert's input (topk 1, as Llama 4 routes); SwiGLU experts whose gate_up is [E, H, 2F] [gate | up]; an
    ungated shared expert."""
    experts = block.experts
    if not isinstance(experts.act_fn, (nn.SiLU, getattr(hf_activations, "SiLUActivation", nn.SiLU))):
        raise NotImplementedError(
            f"moe_arguments: Llama 4 experts with {type(experts.act_fn).__name__}, not SiLU"
        )
    return dict(
        gate_weight=block.router.weight,  # [E, H]
        gate_up=experts.gate_up_proj,  # [E, H, 2F]
        down=experts.down_proj,  # [E, F, H]
        activation="swiglu",
        topk=block.top_k,
        score_function="sigmoid",
        normalize_topk=False,
        probs_on_input=True,
        **_shared_weights(block),
    )


def moe_arguments(block: nn.Module) -> dict:
    """The keyword arguments of `moetriton.torch.moe` that compute a transformers sparse-MoE block.

    `moe(x, **moe_arguments(block))[0]` equals `block(x)` for x [B, S, H] (to fp32 rounding), gradients
    included: the router's weight, the experts' and shared experts' projections are views of the block's
    parameters (gradients reach them), the router options are the block's recipe.

    Supported: Mixtral, Qwen2-MoE (gated shared expert), Qwen3-MoE, OLMoE (softmax top-k, with or without
    renormalisation); DeepSeek-V3 and GLM-4-MoE (sigmoid, correction bias, groups scored by their top-2
    sum, with or without renormalisation, scaling, shared experts); DeepSeek-V2 (softmax, greedy or
    group-limited by the group's largest score, scaling, shared experts); ERNIE-4.5-MoE (softmax, selection
    with a correction bias, renormalised, shared experts); GPT-OSS (a router bias, softmax over the top-k
    logits, expert biases, the clamped SwiGLU on interleaved columns); Llama 4 (top-1 sigmoid weights on the
    expert's input, shared expert). Other blocks raise NotImplementedError or TypeError naming what is
    missing.

    Example:
        >>> from transformers import MixtralConfig
        >>> from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        >>> import moetriton.torch as mt
        >>> config = MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=4)
        >>> block = MixtralSparseMoeBlock(config)
        >>> out, aux_loss, dropped = mt.moe(torch.randn(1, 3, 8), **moe_arguments(block))
    """
    experts = getattr(block, "experts", None)
    router = getattr(block, "gate", None) or getattr(block, "router", None)
    if experts is None or router is None or not hasattr(router, "weight"):
        raise TypeError(f"moe_arguments: {type(block).__name__} has no experts and gate (router) modules")
    if type(block).__name__ == "Llama4TextMoe":  # experts without the experts interface's layout flags
        return _llama4_arguments(block)
    _check_layout(experts)
    if getattr(experts.config, "model_type", None) == "gpt_oss":
        return _gpt_oss_arguments(block, experts)
    if experts.has_bias or not experts.has_gate or _fused_activation(experts) != "swiglu":
        raise NotImplementedError(
            f"moe_arguments: {type(experts).__name__} is not gated SiLU experts without biases (use the "
            "experts implementation, register(), for it)"
        )
    config = experts.config
    return dict(
        gate_weight=router.weight,  # [E, H]
        gate_up=_input_major(experts, "gate_up_proj"),  # [E, H, 2F]
        down=_input_major(experts, "down_proj"),  # [E, F, H]
        activation="swiglu",
        **_router_options(block, config),
        **_shared_weights(block),
    )


#: The layer options a replaced block takes: where and how the layer runs. The losses are the model's own
#: (transformers computes its load-balancing loss from the router logits it records), so moetriton's loss
#: options, whose values the block could not return, are not among them.
BLOCK_OPTIONS = ("align_size", "capacity_factor", "drop_policy", "pipeline_chunks")


def _router_of(module: nn.Module) -> nn.Module | None:
    router = getattr(module, "gate", None) or getattr(module, "router", None)
    return router if isinstance(router, nn.Module) and hasattr(router, "weight") else None


def _block_forward(block: nn.Module, options: dict, hidden_states: Tensor):
    """A replaced block's forward: the block's own router module runs once on the tokens (transformers
    records its logits there, for `output_router_logits` and its load-balancing loss), then
    moetriton.torch.moe computes the block from its parameters; returned in the block's own convention."""
    router_outputs = _router_of(block)(hidden_states.reshape(-1, hidden_states.shape[-1]))
    out = moe(hidden_states, **moe_arguments(block), **options)[0]
    kind = type(block).__name__
    if kind == "Llama4TextMoe":  # (out [T, H], router logits)
        return out.reshape(-1, out.shape[-1]), router_outputs[1]
    if kind == "GptOssMLP":  # (out, router scores)
        return out, router_outputs[1]
    return out


def replace_moe_blocks(model: nn.Module, **options) -> list[str]:
    """Replaces the forward of every sparse-MoE block of a transformers model by one call of
    `moetriton.torch.moe` on the block's own parameters (`moe_arguments`): moetriton's fused router, dispatch,
    grouped GEMMs, activation, combine and shared experts, for the model types `moe_arguments` maps. The
    parameters and their names stay the block's (checkpoints load and save as before), and the block's
    router module still runs once per call, so `output_router_logits=True` and transformers'
    load-balancing loss work unchanged (that router call is the replacement's only extra work: one [T, E]
    product and top-k). Returns the replaced modules' names.

    Args:
        model: a transformers model (or any module holding the blocks).
        **options: the layer's BLOCK_OPTIONS (align_size, capacity_factor, drop_policy, pipeline_chunks);
            anything else is refused, as is a block `moe_arguments` does not map (naming what is missing)
            and Mixtral's router jitter noise (a random input scaling the layer does not draw).

    Example:
        >>> import transformers
        >>> config = transformers.MixtralConfig(
        ...     hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        ...     num_key_value_heads=2, vocab_size=64, num_local_experts=4,
        ... )
        >>> model = transformers.AutoModelForCausalLM.from_config(config)
        >>> replace_moe_blocks(model)
        ['model.layers.0.mlp']
    """
    unknown = sorted(set(options) - set(BLOCK_OPTIONS))
    if unknown:
        raise TypeError(f"replace_moe_blocks: unexpected options {unknown}; a block takes {BLOCK_OPTIONS}")
    replaced = []
    for name, module in model.named_modules():
        if not hasattr(module, "experts") or _router_of(module) is None:
            continue
        if getattr(module, "jitter_noise", 0):
            raise NotImplementedError(
                f"replace_moe_blocks: {name} has router_jitter_noise={module.jitter_noise} (a random scaling"
                " of its input in training that the layer does not draw)"
            )
        moe_arguments(module)  # an unmapped block is refused now, not at its first call
        module.forward = functools.partial(_block_forward, module, dict(options))
        replaced.append(name)
    if not replaced:
        raise ValueError(
            f"replace_moe_blocks: {type(model).__name__} holds no sparse-MoE block (experts and a router)"
        )
    return replaced
