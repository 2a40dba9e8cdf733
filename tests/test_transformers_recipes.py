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
    "gpt_oss",
    "llama4",
)


def _close(got, expected, name: str = "", rtol: float = 1e-4) -> None:
    """Equal to fp32 rounding: the absolute tolerance scales with the tensor (random weights give outputs of
    magnitude ~100, and a value near 0 carries the rounding of its large neighbours' sums)."""
    expected = np.asarray(expected)
    atol = 1e-5 * max(float(np.abs(expected).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=rtol, atol=atol, err_msg=name)


def _block(name: str) -> torch.nn.Module:
    model = tiny_model(name)
    blocks = (getattr(layer, "mlp", None) or layer.feed_forward for layer in model.model.layers)
    block = next(block for block in blocks if hasattr(block, "experts"))
    if hasattr(block.experts, "config"):  # the experts interface's (Llama 4's experts have none)
        block.experts.config._experts_implementation = "eager"
    return block


def _inputs(seed: int = 7) -> torch.Tensor:
    return torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed))


def _hf(block, x):
    x = x.clone().requires_grad_()
    out = block(x)
    out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape)  # Llama 4's block returns [T, H]
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
    # The layer's gradients back onto the block's parameters through moe_arguments' own mapping (its
    # transposes, concatenations and de-interleaving), run backward by torch's autograd.
    grads = {key: torch.from_numpy(np.array(value)) for key, value in grads.items()}
    grads["gate_weight"] = grads.pop("gate").T
    mapped = [key for key in grads if arguments[key].requires_grad]
    parameters = {key: value for key, value in block.named_parameters() if value.requires_grad}
    on_parameters = torch.autograd.grad(
        [arguments[key] for key in mapped],
        list(parameters.values()),
        grad_outputs=[grads[key] for key in mapped],
        allow_unused=True,
    )
    for key, grad in zip(parameters, on_parameters, strict=True):
        reference = expected_grads[key]
        _close(torch.zeros_like(reference) if grad is None else grad, reference, key)


def test_unsupported_blocks_name_what_is_missing():
    block = _block("gpt_oss")
    block.experts.limit = 5.0
    with pytest.raises(NotImplementedError, match=r"GPT-OSS.s gate with alpha=1\.702, limit=5\.0"):
        moe_arguments(block)
    with pytest.raises(TypeError, match="has no experts and gate"):
        moe_arguments(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe-shared", "deepseek_v3", "gpt_oss", "llama4"])
def test_replaced_blocks_compute_the_model(name):
    """replace_moe_blocks on a 2-layer model: the logits, the loss with transformers' own load-balancing
    loss (output_router_logits), the router logits it returns and every parameter gradient equal the eager
    model's to fp32 rounding; the parameter names are the model's."""
    import copy

    from moetriton.torch.transformers import replace_moe_blocks

    model = tiny_model(name)
    eager = copy.deepcopy(model)
    names = [key for key, _ in model.named_parameters()]
    replaced = replace_moe_blocks(model)
    assert len(replaced) == 2 and [key for key, _ in model.named_parameters()] == names

    def not_called(*args, **kwargs):
        raise AssertionError("a replaced block ran transformers' experts")

    for key in replaced:  # the replacement computes the experts itself
        model.get_submodule(key).experts.forward = not_called
    tokens = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    results = []
    for network in (model, eager):
        output = network(tokens, labels=tokens, output_router_logits=True)
        output.loss.backward()
        grads = {key: value.grad for key, value in network.named_parameters() if value.requires_grad}
        results.append((output, grads))
    (got, got_grads), (expected, expected_grads) = results
    _close(got.logits.detach(), expected.logits.detach(), "logits")
    _close(got.loss.detach(), expected.loss.detach(), "loss")
    for what in ("aux_loss", "router_logits"):
        mine, theirs = getattr(got, what, None), getattr(expected, what, None)
        assert (mine is None) == (theirs is None), what
        if theirs is not None:
            mine, theirs = (torch.stack(list(v)) if isinstance(v, tuple) else v for v in (mine, theirs))
            _close(mine.detach(), theirs.detach(), what)
    for key, reference in expected_grads.items():
        grad = got_grads[key]
        _close(torch.zeros_like(reference) if grad is None else grad, reference, key)


def test_replacement_refuses_what_it_cannot_compute():
    from moetriton.torch.transformers import replace_moe_blocks

    with pytest.raises(TypeError, match=r"unexpected options \['aux_loss_coeff'\]"):
        replace_moe_blocks(tiny_model("mixtral"), aux_loss_coeff=0.01)
    with pytest.raises(ValueError, match="holds no sparse-MoE block"):
        replace_moe_blocks(torch.nn.Linear(4, 4))
    model = tiny_model("mixtral")
    model.model.layers[0].mlp.jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match=r"router_jitter_noise=0\.1"):
        replace_moe_blocks(model)
