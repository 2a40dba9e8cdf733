"""moetriton as a transformers experts implementation, against transformers' own eager experts.

Each model is a 2-layer *ForCausalLM built from a tiny local config (no download), with every parameter
drawn at random so biases, gates and norms all matter. The same model runs with
`experts_implementation="eager"` (transformers' per-expert loop, the reference) and "moetriton": logits,
the loss with the load-balancing loss, and every parameter gradient agree to fp32 rounding. A few optimizer
steps track eager. The experts function alone is checked on placeholder ids, bf16, strided inputs and the
layouts no model here uses.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

from moetriton.torch.transformers import IMPLEMENTATION, experts_forward, register  # noqa: E402
from tests.transformers_models import MODELS, tiny_model  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register()


def _step(model: torch.nn.Module, implementation: str, ids: torch.Tensor) -> tuple:
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    grads = {
        name: parameter.grad.clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }
    return out.logits.detach(), out.loss.detach(), getattr(out, "aux_loss", None), grads


@pytest.mark.parametrize("name", MODELS)
def test_causal_lm_matches_eager_experts(name):
    model = tiny_model(name)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, loss, aux, grads = _step(model, "eager", ids)
    our_logits, our_loss, our_aux, our_grads = _step(model, IMPLEMENTATION, ids)
    torch.testing.assert_close(our_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_loss, loss, rtol=1e-6, atol=1e-6)
    if aux is not None:
        torch.testing.assert_close(our_aux, aux)
    assert our_grads.keys() == grads.keys()
    experts_grads = [key for key in grads if ".experts." in key]
    assert experts_grads, "the model has no experts parameters"
    for key in grads:
        torch.testing.assert_close(our_grads[key], grads[key], rtol=1e-4, atol=1e-5, msg=key)


def test_training_steps_track_eager():
    losses = {}
    for implementation in ("eager", IMPLEMENTATION):
        model = tiny_model("mixtral", seed=3)
        model.set_experts_implementation(implementation)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(4))
        losses[implementation] = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = model(ids, labels=ids, output_router_logits=True).loss
            loss.backward()
            optimizer.step()
            losses[implementation].append(loss.item())
    assert losses["eager"][-1] < losses["eager"][0]
    torch.testing.assert_close(
        torch.tensor(losses[IMPLEMENTATION]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-5
    )


def _experts(name: str = "mixtral") -> torch.nn.Module:
    model = tiny_model(name)
    return next(module for module in model.modules() if type(module).__name__.endswith("Experts"))


def test_placeholder_ids_are_no_expert():
    """Ids outside [0, E) (transformers' expert parallelism gives other ranks' experts such ids, weight 0) add
    nothing: the result equals eager with those slots sent to expert 0 at weight 0."""
    experts = _experts()
    num_experts = experts.num_experts
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randn(6, 32, generator=generator)
    index = torch.tensor([[0, num_experts], [num_experts + 5, 1], [-1, 3], [2, 2**30], [3, 1], [1, 0]])
    weights = torch.rand(6, 2, generator=generator)
    placeholder = (index < 0) | (index >= num_experts)
    reference_weights = torch.where(placeholder, 0.0, weights)
    experts.config._experts_implementation = "eager"
    expected = experts(tokens, torch.where(placeholder, 0, index), reference_weights)
    # fp32 sums of outputs of magnitude ~10 in another order: the absolute tolerance scales with them
    atol = 1e-6 * float(expected.abs().max())
    torch.testing.assert_close(
        experts_forward(experts, tokens, index, weights), expected, rtol=1e-5, atol=atol
    )


def test_bf16_and_strided_inputs():
    experts = _experts("gpt_oss").bfloat16()
    base = torch.randn(8, 64).bfloat16()
    tokens = base[:, ::2]  # [8, 32], column stride 2
    index = torch.randint(0, experts.num_experts, (8, 2), generator=torch.Generator().manual_seed(2))
    weights = torch.rand(8, 2).bfloat16()
    experts.config._experts_implementation = "eager"
    expected = experts(tokens.contiguous(), index, weights)
    ours = experts_forward(experts, tokens, index.t().contiguous().t(), weights)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_ungated_experts():
    """has_gate=False experts (up_proj and an activation, as NemotronH's): the up projection and act_fn."""
    config = transformers.AutoConfig.for_model(
        "nemotron_h",
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        mlp_hidden_act="relu2",
    )
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    experts = NemotronHExperts(config)
    assert not experts.has_gate
    torch.manual_seed(5)
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter, 0.0, 0.3)
    tokens = torch.randn(7, 32, requires_grad=True)
    index = torch.randint(0, 4, (7, 2), generator=torch.Generator().manual_seed(6))
    weights = torch.rand(7, 2)
    experts.config._experts_implementation = "eager"
    expected = experts(tokens, index, weights)
    (grad_expected,) = torch.autograd.grad(expected.square().sum(), tokens)
    ours = experts_forward(experts, tokens, index, weights)
    (grad_ours,) = torch.autograd.grad(ours.square().sum(), tokens)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_ours, grad_expected, rtol=1e-4, atol=1e-5)


def test_traces_without_graph_breaks():
    experts = _experts()
    compiled = torch.compile(experts_forward, fullgraph=True, backend="aot_eager")
    tokens = torch.randn(5, 32)
    index = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 9]])
    weights = torch.rand(5, 2)
    torch.testing.assert_close(
        compiled(experts, tokens, index, weights), experts_forward(experts, tokens, index, weights)
    )


def test_modules_without_the_layout_are_refused():
    with pytest.raises(TypeError, match="use_experts_implementation; Linear has no has_gate"):
        experts_forward(
            torch.nn.Linear(4, 4), torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
        )
    experts = _experts()
    experts.has_bias = True
    with pytest.raises(TypeError, match="has no tensor gate_up_proj_bias, down_proj_bias"):
        experts_forward(experts, torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    experts.has_bias = False
    with pytest.raises(ValueError, match=r"top_k_index and top_k_weights \[T, K\]"):
        experts_forward(experts, torch.randn(2, 32), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 1))


def test_example_trains_like_eager():
    """examples/transformers_moe.py: the loss falls and moetriton's steps track eager's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "transformers_moe.py"
    spec = importlib.util.spec_from_file_location("transformers_moe_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main("qwen3_moe", steps=3, batch=(2, 8))
    assert losses["eager"][-1] < losses["eager"][0]
    torch.testing.assert_close(
        torch.tensor(losses["moetriton"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-5
    )
