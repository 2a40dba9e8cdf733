"""The expert-parallel MoE layer (moetriton.jax.moe) on a device mesh, checked against the dense reference.

    python examples/jax_moe_ep.py            # GPUs: EP over all of them; CPU: 8 host devices, data 2 x EP 4
    python examples/jax_moe_ep.py --small    # small shapes anywhere

Without a GPU the script gives the CPU 8 host devices (XLA_FLAGS, set before JAX starts). On one host the
layer exchanges tokens with a padded all_to_all (XLA:CPU has no ragged all-to-all, and XLA's GPU one is
slower on one host); across processes it uses jax.lax.ragged_all_to_all. It runs the layer forward and
backward under jax.jit with the dropless policy and with a capacity factor, compares the output, aux loss,
dropped count and every gradient with moetriton.jax.reference_moe, runs the Flax MoEBlock once, and prints
the errors and step times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Host devices for a CPU mesh; the flag only concerns the CPU platform, so it is harmless on GPU machines.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from moetriton.jax import moe
from moetriton.jax.reference_moe import moe_reference


def make_mesh() -> Mesh:
    """All GPUs on the EP axis; on CPU, 8 host devices as data 2 x EP 4."""
    devices = jax.devices()
    if jax.default_backend() == "gpu":
        return Mesh(np.array(devices).reshape(1, len(devices)), ("data", "ep"))
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "ep"))


def make_params(key, *, batch: int, seq: int, hidden: int, ffn: int, num_experts: int):
    keys = jax.random.split(key, 4)
    x = jax.random.normal(keys[0], (batch, seq, hidden), jnp.float32)  # [B, S, H]
    gate = jax.random.normal(keys[1], (hidden, num_experts)) / hidden**0.5  # [H, E]
    gate_up = jax.random.normal(keys[2], (num_experts, hidden, 2 * ffn)) / hidden**0.5  # [E, H, 2F]
    down = jax.random.normal(keys[3], (num_experts, ffn, hidden)) / ffn**0.5  # [E, F, H]
    return x, gate, gate_up, down


def check(mesh: Mesh, arrays, options: dict) -> dict[str, float]:
    """Runs the layer and the reference forward and backward; returns the largest absolute errors."""
    shards = mesh.size

    def layer(x, gate, gate_up, down):
        return moe(x, gate, gate_up, down, mesh=mesh, ep_axis="ep", data_axes=("data",), **options)

    def reference(x, gate, gate_up, down):
        return moe_reference(x, gate, gate_up, down, num_shards=shards, **options)

    def loss(function):
        def scalar(*arrays):
            out, aux_loss, dropped = function(*arrays)
            return jnp.mean(out.astype(jnp.float32) ** 2) + aux_loss, dropped

        return jax.jit(jax.value_and_grad(scalar, argnums=(0, 1, 2, 3), has_aux=True))

    step = loss(layer)
    (value, dropped), grads = jax.block_until_ready(step(*arrays))
    start = time.perf_counter()
    jax.block_until_ready(step(*arrays))
    seconds = time.perf_counter() - start
    (expected, expected_dropped), expected_grads = loss(reference)(*arrays)
    errors = {
        "loss": abs(float(value) - float(expected)),
        "dropped": abs(int(dropped) - int(expected_dropped)),
    }
    for name, got, want in zip(("x", "gate", "gate_up", "down"), grads, expected_grads, strict=True):
        errors[f"grad {name}"] = float(jnp.max(jnp.abs(got - want)))
    print(f"  step (forward + backward) {seconds * 1e3:.1f} ms, dropped slots {int(dropped)}")
    return errors


def run(small: bool = False) -> dict[str, dict[str, float]]:
    """Checks the layer on the mesh under both capacity policies and runs the Flax block once; returns the
    largest errors of each policy."""
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 check against the fp32 reference
    mesh = make_mesh()
    on_gpu = jax.default_backend() == "gpu"
    big = on_gpu and not small
    sizes = (
        dict(seq=256, hidden=1024, ffn=2048, num_experts=16)
        if big
        else dict(seq=4, hidden=16, ffn=32, num_experts=8)
    )
    arrays = make_params(jax.random.key(0), batch=2 * mesh.size, **sizes)
    print(
        f"mesh {dict(mesh.shape)} on {jax.default_backend()}, x {arrays[0].shape}, E {sizes['num_experts']}"
    )
    results = {}
    # DeepSeek-V3-style routing: sigmoid scores, group-limited top-k, a selection bias, the sequence-wise
    # balance loss and the z-loss (docs/moe.md, "Training-recipe options").
    dsv3_style = dict(
        score_function="sigmoid",
        num_groups=4,
        group_topk=2,
        expert_bias=jnp.linspace(-0.1, 0.1, sizes["num_experts"]),
        seq_aux_loss_coeff=1e-3,
        z_loss_coeff=1e-3,
    )
    for name, policy in (
        ("dropless", {}),
        ("capacity 0.5", {"capacity_factor": 0.5}),
        ("dsv3-style, capacity 1.0, probs", dict(dsv3_style, capacity_factor=1.0, drop_policy="probs")),
    ):
        print(f"{name}:")
        options = dict(topk=2, align_size=8 if big else 2, aux_loss_coeff=1e-2, **policy)
        results[name] = check(mesh, arrays, options)
        print("  max |layer - reference|: " + ", ".join(f"{k} {v:.2e}" for k, v in results[name].items()))

    from moetriton.jax.moe.flax import MoEBlock, init_sharded

    block = MoEBlock(
        num_experts=sizes["num_experts"], ffn_dim=sizes["ffn"], topk=2, mesh=mesh, data_axes=("data",)
    )
    variables = init_sharded(block, jax.random.key(1), arrays[0], mesh=mesh)
    out, _, _ = jax.jit(block.apply)(variables, arrays[0])
    spec = variables["params"]["gate_up"].value.sharding.spec
    print(f"flax MoEBlock: out {out.shape}, gate_up [E, H, 2F] sharded {spec}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="small shapes even on GPUs")
    results = run(small=parser.parse_args().small)
    worst = max(max(errors.values()) for errors in results.values())
    print("ok" if worst < 1e-3 else f"MISMATCH: largest error {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
