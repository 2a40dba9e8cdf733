"""Token-sharded router ops on an 8-device CPU mesh: outputs and gradients equal the unsharded ops, stay
sharded without gathering the logits, and the aux loss is the GLOBAL loss.

The checks run in a subprocess (`python -m tests.jax.test_router_sharded`): XLA_FLAGS must be set before
jax is imported, and other test modules in this process may have imported it already. The unsharded calls
run the interpreted kernels; inside the partitioned computation CPU devices run the reference (see
moetriton.jax.router), so the comparison also checks kernels against reference under sharding.
"""

from __future__ import annotations

from ..strategies_router import run_test_module, skip_unless_interpreter_runs


def test_sharded_router_matches_unsharded():
    skip_unless_interpreter_runs("the sharded router check")
    stdout = run_test_module(
        "tests.jax.test_router_sharded",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        TRITON_INTERPRET="1",
    )
    assert "sharded router checks passed" in stdout


def _main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moetriton.jax.router import (
        fused_compute_score_for_moe_aux_loss,
        fused_moe_aux_loss,
        fused_topk_with_score_function,
    )

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((8, 4, 24)), jnp.float32)  # [B, S, E]
    bias = jnp.asarray(0.3 * rng.standard_normal(24), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal(logits.shape), jnp.float32)
    kwargs = dict(num_groups=6, group_topk=3, scaling_factor=2.5, score_function="sigmoid", expert_bias=bias)

    def close(a, b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    def shards(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    def token_axes(array):
        return array.sharding.spec[0] if array.sharding.spec else None

    for spec in (P("data"), P(("data", "model"))):
        sharded = shards(logits, spec)

        def topk(x):
            probs, routing_map, indices = fused_topk_with_score_function(x, 6, return_indices=True, **kwargs)
            return (
                probs,
                routing_map,
                indices,
                jax.grad(lambda y: (fused_topk_with_score_function(y, 6, **kwargs)[0] * cotangent).sum())(x),
            )

        compiled = jax.jit(topk).lower(sharded).compile()
        assert "all-gather" not in compiled.as_text(), "token-sharded logits must not be gathered"
        outs = compiled(sharded)
        expected = topk(logits)
        np.testing.assert_array_equal(outs[1], expected[1])
        np.testing.assert_array_equal(outs[2], expected[2])
        close(outs[0], expected[0])
        close(outs[3], expected[3])
        assert all(token_axes(out) == spec[0] for out in outs), [out.sharding for out in outs]

        def scores(x):
            routing_map, values = fused_compute_score_for_moe_aux_loss(x, 5, "sqrtsoftplus")
            return (
                routing_map,
                values,
                jax.grad(
                    lambda y: (
                        fused_compute_score_for_moe_aux_loss(y, 5, "sqrtsoftplus")[1] * cotangent
                    ).sum()
                )(x),
            )

        outs = jax.jit(scores)(sharded)
        expected = scores(logits)
        np.testing.assert_array_equal(outs[0], expected[0])
        close(outs[1], expected[1])
        close(outs[2], expected[2])
        assert token_axes(outs[1]) == spec[0]

    probs = jnp.asarray(rng.random((64, 24)), jnp.float32)
    counts = jnp.asarray(rng.integers(0, 40, 24), jnp.int32)
    for spec in (P("data"), P(("data", "model")), P()):
        sharded = shards(probs, spec)
        for total in (64, jnp.asarray(64, jnp.int32)):

            def loss(p, total=total):
                return fused_moe_aux_loss(p, counts, total, 24, 6, 0.01)

            value, grad = jax.jit(jax.value_and_grad(loss))(sharded)
            expected_value, expected_grad = jax.value_and_grad(loss)(probs)
            close(value, expected_value)
            close(grad, expected_grad)
            assert token_axes(grad) == (spec[0] if spec else None), grad.sharding
    print("sharded router checks passed")


if __name__ == "__main__":
    _main()
