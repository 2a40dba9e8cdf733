"""A toy MoE layer in JAX on moetriton: router -> token_dispatch -> per-expert matmul -> token_combine.

    python examples/jax_moe.py            # GPU: a mid-size layer; CPU: small shapes, kernels interpreted
    python examples/jax_moe.py --small    # small shapes everywhere

Runs the layer forward and backward (jax.value_and_grad under jax.jit), checks the loss and every gradient
against the same layer built on moetriton.jax.reference, and prints timings. Expert blocks are padded to a
multiple of `align` rows, as a grouped GEMM wants; `jax.lax.ragged_dot` is the grouped GEMM here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

# Without a GPU the kernels run under the Triton interpreter, which must be chosen before moetriton loads.
if jax.default_backend() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moetriton.jax as mj
from moetriton.jax import reference


def moe_layer(api, x, router, w_in, w_out, *, topk: int, align: int):
    """x [T, H] -> [T, H]: softmax top-k routing, each expert a two-layer MLP, outputs merged by the router
    weights. `api` is moetriton.jax or moetriton.jax.reference (same signatures)."""
    num_experts = router.shape[1]
    scores, ids = jax.lax.top_k(x @ router, topk)
    weights = jax.nn.softmax(scores, axis=-1)
    out, _, row_id_map, pad_offsets, rows_per_expert = api.token_dispatch(
        x, None, x.shape[0] * topk, None, align, indices=ids.astype(jnp.int32), num_experts=num_experts
    )
    # Pad rows are zero and sit inside their expert's group, so the grouped matmuls leave them zero.
    hidden = jax.nn.gelu(jax.lax.ragged_dot(out, w_in, rows_per_expert))
    expert_out = jax.lax.ragged_dot(hidden, w_out, rows_per_expert)
    return api.token_combine(expert_out, row_id_map, weights, pad_offsets)


def _loss(api, params, x, topk, align):
    return jnp.mean(moe_layer(api, x, *params, topk=topk, align=align) ** 2)


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _relative_error(got, expected) -> float:
    got, expected = jnp.asarray(got, jnp.float32), jnp.asarray(expected, jnp.float32)
    return float(jnp.linalg.norm(got - expected) / jnp.maximum(jnp.linalg.norm(expected), 1e-30))


def main(small: bool) -> dict[str, float]:
    """Builds the layer, checks it against the reference, prints timings; returns the relative errors of
    the output, the loss and each gradient (keys "output", "loss", "grad x", ...)."""
    on_gpu = jax.default_backend() != "cpu"
    if small or not on_gpu:
        tokens, hidden, ffn, num_experts, topk, align, repeats = 64, 32, 48, 4, 2, 4, 3
        dtype = jnp.float32
    else:
        tokens, hidden, ffn, num_experts, topk, align, repeats = 8192, 1024, 2048, 8, 2, 128, 20
        dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, hidden), dtype)
    params = (
        jax.random.normal(keys[1], (hidden, num_experts), dtype) / hidden**0.5,
        jax.random.normal(keys[2], (num_experts, hidden, ffn), dtype) / hidden**0.5,
        jax.random.normal(keys[3], (num_experts, ffn, hidden), dtype) / ffn**0.5,
    )
    if on_gpu:
        target = "GPU (compiled Triton)"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        target = "CPU (Triton interpreter)"
    else:
        target = "CPU (pure-JAX reference)"
    sizes = f"T={tokens} H={hidden} F={ffn} E={num_experts} K={topk} align={align}"
    print(f"{target}: {sizes} {jnp.dtype(dtype).name}")

    steps = {}
    for name, api in (("moetriton", mj), ("reference", reference)):
        forward = jax.jit(lambda params, x, api=api: moe_layer(api, x, *params, topk=topk, align=align))
        loss = lambda params, x, api=api: _loss(api, params, x, topk, align)
        steps[name] = (forward, jax.jit(jax.value_and_grad(loss, (0, 1))))

    (output, (loss, (grads, grad_x))), (output_ref, (loss_ref, (grads_ref, grad_x_ref))) = (
        (forward(params, x), step(params, x)) for forward, step in steps.values()
    )
    errors = {"output": _relative_error(output, output_ref), "loss": _relative_error(loss, loss_ref)}
    errors["grad x"] = _relative_error(grad_x, grad_x_ref)
    for name, got, expected in zip(("grad router", "grad w_in", "grad w_out"), grads, grads_ref, strict=True):
        errors[name] = _relative_error(got, expected)
    print("relative error against the reference (||got - ref|| / ||ref||):")
    for name, error in errors.items():
        print(f"  {name:<12}{error:.2e}")

    print(f"median ms over {repeats} runs:")
    for name, (forward, step) in steps.items():
        forward_ms = _median_ms(forward, params, x, repeats=repeats)
        step_ms = _median_ms(step, params, x, repeats=repeats)
        print(f"  {name:<10} forward {forward_ms:9.3f}   forward + backward {step_ms:9.3f}")
    return errors


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="small shapes even on a GPU")
    main(parser.parse_args().small)
