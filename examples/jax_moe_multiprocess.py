"""The expert-parallel MoE layer (moetriton.jax.moe) under jax.distributed, one process per device.

    python examples/jax_moe_multiprocess.py                  # 2 processes on this machine
    python examples/jax_moe_multiprocess.py --processes 4 --data 2

    # many hosts: the same command on every host, each with its own --process-id
    python examples/jax_moe_multiprocess.py --coordinator HOST0:12345 --num-processes N --process-id I

Without --process-id the script starts --processes copies of itself on this machine (launch_local_group: a
free local port for the coordinator, process i given GPU i through CUDA_VISIBLE_DEVICES where there are
GPUs, every copy killed if one fails) and waits for them; benchmarks.moe_jax starts its process groups
through the same function. Each process calls jax.distributed.initialize (on CPU with the gloo
collectives), builds the (data, EP) mesh over every process's devices, draws its own batch rows and makes
the global token array from them (jax.make_array_from_process_local_data), runs the layer forward and
backward under jit with the dropless policy and with a capacity factor, gathers the results
(process_allgather) and compares them with the dense moetriton.jax.reference_moe on the gathered inputs.
Every process checks; process 0 prints the errors.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

#: Largest absolute error allowed against the fp32 dense reference.
TOLERANCE = 1e-3


def launch_local_group(command: list[str], processes: int, timeout: float) -> list[int]:
    """Runs `processes` copies of `command` (an argv) on this machine as one jax.distributed group and
    returns their exit statuses. Copy I gets `--coordinator 127.0.0.1:PORT --num-processes N --process-id I`
    (PORT free on this machine), GPU I through CUDA_VISIBLE_DEVICES where there are GPUs, and one CPU device
    otherwise (JAX_NUM_CPU_DEVICES=1, any host device count dropped from XLA_FLAGS). The first copy to fail,
    or the timeout, kills the others, since a process whose peer died waits for it in a collective for good;
    a killed copy's status is negative."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    xla_flags = " ".join(
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    )
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", XLA_FLAGS=xla_flags)
    children = [
        subprocess.Popen(
            [*command, *group, "--process-id", str(i)], env=dict(env, CUDA_VISIBLE_DEVICES=str(i))
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(child.poll() is None for child in children):
            if any(child.returncode for child in children if child.returncode is not None):
                break
            if time.monotonic() > deadline:
                print(f"process group timed out after {timeout:g} s", file=sys.stderr, flush=True)
                break
            time.sleep(0.1)
    finally:  # also on an interrupt: no copy outlives the launch
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    return [child.returncode for child in children]


def launch(processes: int, data: int, timeout: float) -> int:
    """Starts `processes` copies of this script on this machine (launch_local_group) and waits. Returns the
    exit status."""
    statuses = launch_local_group([sys.executable, __file__, "--data", str(data)], processes, timeout)
    failed = [i for i, status in enumerate(statuses) if status]
    print("ok: every process agreed with the reference" if not failed else f"FAILED: processes {failed}")
    return 1 if failed else 0


def run(coordinator: str, num_processes: int, process_id: int, data: int) -> int:
    """One process of the group: the layer on the global mesh against the dense reference. Returns the exit
    status."""
    import jax

    # Cross-process collectives on CPU (JAX 0.10's default, named for JAX versions without it); no effect
    # on GPUs, where the collectives are NCCL's.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 check against the fp32 reference

    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from moetriton.jax import moe
    from moetriton.jax.reference_moe import moe_reference

    # Devices in process order: each process's token shards are consecutive rows of the global batch.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(data, -1), ("data", "ep"))
    seq, hidden, ffn, num_experts = 4, 16, 32, 4 * mesh.shape["ep"]
    rng = np.random.default_rng(0)  # the weights: the same on every process
    gate = rng.normal(size=(hidden, num_experts)).astype(np.float32) / hidden**0.5  # [H, E]
    gate_up = rng.normal(size=(num_experts, hidden, 2 * ffn)).astype(np.float32) / hidden**0.5  # [E, H, 2F]
    down = rng.normal(size=(num_experts, ffn, hidden)).astype(np.float32) / ffn**0.5  # [E, F, H]
    # The tokens: every process draws only its own rows, 2 per local device ([B_local, S, H]).
    local_rows = 2 * jax.local_device_count()
    local_x = np.random.default_rng(1 + process_id).normal(size=(local_rows, seq, hidden)).astype(np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec(("data", "ep"))), local_x)
    experts = NamedSharding(mesh, PartitionSpec("ep"))
    arrays = (x, jax.device_put(gate, NamedSharding(mesh, PartitionSpec())))
    arrays += (jax.device_put(gate_up, experts), jax.device_put(down, experts))
    # The dense reference runs on this process's own device with every input gathered.
    full = [np.asarray(a) for a in (multihost_utils.process_allgather(x, tiled=True), gate, gate_up, down)]

    def loss_and_grads(layer):
        def scalar(*arrays):
            out, aux_loss, dropped = layer(*arrays)
            return jnp.mean(out.astype(jnp.float32) ** 2) + aux_loss, dropped

        return jax.jit(jax.value_and_grad(scalar, argnums=(0, 1, 2, 3), has_aux=True))

    worst = 0.0
    for name, policy in (("dropless", {}), ("capacity 0.5", {"capacity_factor": 0.5})):
        options = dict(topk=2, align_size=2, aux_loss_coeff=1e-2, **policy)

        def layer(*arrays, options=options):
            return moe(*arrays, mesh=mesh, ep_axis="ep", data_axes=("data",), **options)

        def reference(*arrays, options=options):
            return moe_reference(*arrays, num_shards=mesh.size, **options)

        got = multihost_utils.process_allgather(loss_and_grads(layer)(*arrays), tiled=True)
        expected = loss_and_grads(reference)(*full)
        errors = {
            what: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
            for what, a, b in zip(
                ("loss", "dropped", "grad x", "grad gate", "grad gate_up", "grad down"),
                jax.tree.leaves(got),
                jax.tree.leaves(expected),
                strict=True,
            )
        }
        worst = max(worst, *errors.values())
        if process_id == 0:
            print(
                f"{name} on mesh {dict(mesh.shape)} over {num_processes} processes ({jax.default_backend()}):"
            )
            print("  max |layer - reference|: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    jax.distributed.shutdown()
    return 0 if worst < TOLERANCE else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=2, help="processes to start on this machine")
    parser.add_argument("--data", type=int, default=1, help="size of the data axis (EP: the rest)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the local launch gives up")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
    parser.add_argument("--num-processes", type=int, help="processes in the group (all hosts)")
    parser.add_argument("--process-id", type=int, help="this process's index in the group")
    args = parser.parse_args()
    if args.process_id is None:
        return launch(args.processes, args.data, args.timeout)
    return run(args.coordinator, args.num_processes, args.process_id, args.data)


if __name__ == "__main__":
    sys.exit(main())
