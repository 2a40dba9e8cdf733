"""Train a tiny HuggingFace transformers MoE model with moetriton as its experts implementation.

    python examples/transformers_moe.py             # Mixtral-shaped, a few AdamW steps
    python examples/transformers_moe.py --model qwen3_moe

The model is built from a local config (no download). `register()` adds "moetriton" to transformers'
ExpertsInterface; `experts_implementation="moetriton"` then runs every MoE block's experts (dispatch, the
expert GEMMs, the activation, combine) on moetriton while the model keeps its own router and losses. The same
steps with transformers' eager experts run beside them and the losses are printed side by side.
On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set here before the import).
"""

from __future__ import annotations

import argparse
import os

import torch

CONFIGS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
}


def train(
    model_type: str, implementation: str, steps: int, device: str, batch: tuple[int, int]
) -> list[float]:
    """Losses of `steps` AdamW steps of a 2-layer model with the given experts implementation on one
    batch of [batch_size, sequence] random tokens."""
    import transformers

    from moetriton.torch.transformers import register

    register()
    config = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        router_aux_loss_coef=0.01,
        **CONFIGS[model_type],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(3, config.vocab_size, batch, generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(tokens, labels=tokens, output_router_logits=True).loss  # includes the balancing loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(
    model_type: str = "mixtral", steps: int = 5, batch: tuple[int, int] = (4, 32)
) -> dict[str, list[float]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    losses = {name: train(model_type, name, steps, device, batch) for name in ("eager", "moetriton")}
    for step, (eager, ours) in enumerate(zip(losses["eager"], losses["moetriton"], strict=True)):
        print(f"step {step}: loss eager {eager:.5f}  moetriton {ours:.5f}")
    return losses


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(CONFIGS), default="mixtral")
    parser.add_argument("--steps", type=int, default=5)
    arguments = parser.parse_args()
    main(arguments.model, arguments.steps)
