"""Without the Triton interpreter, CPU arrays run the pure-JAX reference inside the ops: forward, gradients,
jit and vmap. Runs in a subprocess (`python -m tests.jax.test_router_fallback`) because TRITON_INTERPRET is
read when moetriton is imported."""

from __future__ import annotations

from ..strategies_router import run_test_module


def test_cpu_fallback_without_interpreter():
    stdout = run_test_module(
        "tests.jax.test_router_fallback", drop=("TRITON_INTERPRET",), JAX_PLATFORMS="cpu"
    )
    assert "fallback checks passed" in stdout


def _main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moetriton.jax import reference_router as reference
    from moetriton.jax import router
    from moetriton.kernels import INTERPRETER

    assert not INTERPRETER
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((2, 3, 12)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(12), jnp.float32)
    kwargs = dict(num_groups=3, group_topk=2, score_function="sigmoid", expert_bias=bias, return_indices=True)

    def both(fn):
        return [fn(module) for module in (router, reference)]

    for ours, theirs in zip(
        *both(lambda m: m.fused_topk_with_score_function(logits, 4, **kwargs)), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(
        *both(
            lambda m: jax.grad(lambda x: m.fused_topk_with_score_function(x, 4, **kwargs)[0][..., :5].sum())(
                logits
            )
        ),
        rtol=1e-6,
        atol=1e-7,
    )
    np.testing.assert_allclose(
        *both(
            lambda m: jax.jit(
                jax.vmap(lambda x: m.fused_compute_score_for_moe_aux_loss(x, 3, "sqrtsoftplus")[1])
            )(logits)
        ),
        rtol=1e-6,
    )
    probs = jnp.asarray(rng.random((7, 12)), jnp.float32)
    np.testing.assert_allclose(
        *both(
            lambda m: jax.grad(lambda p: m.fused_moe_aux_loss(p, jnp.arange(12), jnp.asarray(7), 12, 4, 0.1))(
                probs
            )
        ),
        rtol=1e-6,
    )
    print("fallback checks passed")


if __name__ == "__main__":
    _main()
