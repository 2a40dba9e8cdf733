"""transformers' sparse-MoE blocks computed by moetriton's MoE layers: `moe_arguments(block)` maps a block's
router recipe, experts and shared experts to moetriton.torch.moe's arguments, and the PyTorch layer and the
JAX layer (the same weights as numpy arrays) reproduce the block's eager output and every gradient in fp32.
Each block is the first MoE layer of a tiny model of tests/transformers_models.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

import moetriton.torch as mt
from moetriton.torch.transformers import moe_arguments
from tests.transformers_models import tiny_model

#: The recipes the layers express (tests/transformers_models.py's names).
RECIPES = (
    "mixtral",
    "qwen3_moe",
    "qwen3_moe-unnormalised",
    "qwen2_moe-shared",
    "olmoe",
    "deepseek_v3",
    "deepseek_v3-unnormalised-top4",
    "deepseek_v2-greedy",
    "deepseek_v2-group-greedy",
    "glm4_moe",
    "ernie4_5_moe",
)


def _close(got, expected, name: str = "", rtol: float = 1e-4) -> None:
    """Equal to fp32 rounding: the absolute tolerance scales with the tensor (random weights give outputs of
    magnitude ~100, and a value near 0 carries the rounding of its large neighbours' sums)."""
    expected = np.asarray(expected)
    atol = 1e-5 * max(float(np.abs(expected).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=rtol, atol=atol, err_msg=name)


def _block(name: str) -> torch.nn.Module:
    model = tiny_model(name)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    block.experts.config._experts_implementation = "eager"
    return block


def _inputs(seed: int = 7) -> torch.Tensor:
    return torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed))


def _hf(block, x):
    x = x.clone().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    parameters = {key: value for key, value in block.named_parameters() if value.requires_grad}
    grads = torch.autograd.grad(out.square().sum(), [x, *parameters.values()])
    return out.detach(), dict(zip(["x", *parameters], grads, strict=True))


@pytest.mark.parametrize("name", RECIPES)
def test_torch_layer_computes_the_block(name):
    block = _block(name)
    x = _inputs()
    expected, expected_grads = _hf(block, x)
    xg = x.clone().requires_grad_()
    out, _, dropped = mt.moe(xg, **moe_arguments(block))
    assert int(dropped) == 0
    parameters = {key: value for key, value in block.named_parameters() if value.requires_grad}
    grads = torch.autograd.grad(out.square().sum(), [xg, *parameters.values()], allow_unused=True)
    _close(out.detach(), expected, rtol=1e-5)
    for key, grad in zip(["x", *parameters], grads, strict=True):
        reference = expected_grads[key]
        _close(torch.zeros_like(reference) if grad is None else grad, reference, key)


@pytest.mark.parametrize("name", RECIPES)
def test_jax_layer_computes_the_block(name):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from moetriton.jax import moe as jax_moe

    block = _block(name)
    x = _inputs()
    expected, expected_grads = _hf(block, x)
    arguments = moe_arguments(block)
    arrays = {
        key: jnp.asarray(value.detach().numpy())
        for key, value in arguments.items()
        if isinstance(value, torch.Tensor)
    }
    arrays["gate"] = arrays.pop("gate_weight").T  # the JAX layer's router weight is [H, E]
    options = {key: value for key, value in arguments.items() if not isinstance(value, torch.Tensor)}
    static = {key: arrays.pop(key) for key in ("expert_bias",) if key in arrays}

    def loss(x, weights):
        out, _, _ = jax_moe(x, **weights, **static, **options)
        return jnp.sum(out**2), out

    (_, out), (grad_x, grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        jnp.asarray(x.numpy()), arrays
    )
    _close(out, expected, rtol=1e-5)
    _close(grad_x, expected_grads["x"], "x")
    _close(np.asarray(grads["gate"]).T, expected_grads["gate.weight"], "gate.weight")  # back to [E, H]
    # The experts' weights back in the block's layout ([E, H, 2F] -> [E, 2F, H], [E, F, H] -> [E, H, F]).
    _close(np.swapaxes(np.asarray(grads["gate_up"]), 1, 2), expected_grads["experts.gate_up_proj"], "gate_up")
    _close(np.swapaxes(np.asarray(grads["down"]), 1, 2), expected_grads["experts.down_proj"], "down")


def test_unsupported_blocks_name_what_is_missing():
    with pytest.raises(NotImplementedError, match="not gated SiLU experts without biases"):
        moe_arguments(_block("gpt_oss"))
    with pytest.raises(TypeError, match="has no experts and gate"):
        moe_arguments(torch.nn.Linear(4, 4))
