"""Train the MoE layer as a Flax NNX module for a few steps (moetriton.jax.moe.nnx.MoE).

    python examples/jax_moe_nnx.py

A toy regression: the module maps random tokens to a fixed random linear function of them; AdamW through
`nnx.Optimizer` updates the parameters, and aux-loss-free balancing (DeepSeek-V3) updates the expert bias
from the step's routed counts, outside the gradient. Prints the loss per step. On CPU the kernels run under
the Triton interpreter (TRITON_INTERPRET=1 is set here before moetriton is imported).
"""

from __future__ import annotations

import os


def main(steps: int = 5, seed: int = 0) -> list[float]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from moetriton.jax import update_expert_bias
    from moetriton.jax.moe.nnx import MoE

    hidden = 32
    model = MoE(
        hidden,
        num_experts=8,
        ffn_dim=16,
        topk=2,
        rngs=nnx.Rngs(seed),
        score_function="sigmoid",
        use_expert_bias=True,
        aux_loss_coeff=1e-2,
    )
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(seed + 1), (4, 16, hidden))
    target = x @ jax.random.normal(jax.random.key(seed + 2), (hidden, hidden)) / hidden**0.5

    @nnx.jit
    def train_step(model, optimizer, x, target):
        def loss_fn(model):
            out, aux_loss, _, stats = model(x, return_stats=True)
            return jnp.mean((out - target) ** 2) + aux_loss, stats

        (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        model.expert_bias[...] = update_expert_bias(model.expert_bias[...], stats.routed, 1e-3)
        return loss

    losses = []
    for step in range(steps):
        losses.append(float(train_step(model, optimizer, x, target)))
        print(f"step {step}: loss {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    import jax  # before moetriton: the interpreter's switch is read when moetriton's kernels are imported

    if jax.default_backend() != "gpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
