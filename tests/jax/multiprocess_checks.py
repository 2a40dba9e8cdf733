"""The expert-parallel MoE layer under jax.distributed: N processes on one machine, CPU devices (gloo) or
one GPU each (NCCL).

A case is a (data, EP) mesh laid over P processes with D devices each (P * D = data * EP). The same
case runs twice and the results must agree bit for bit (but for SUMMED_OVER_TOKEN_SHARDS on more than two
token shards):

    python -m tests.jax.multiprocess_checks reference CASE DIR
        one process with P * D devices (JAX_NUM_CPU_DEVICES, or CUDA_VISIBLE_DEVICES): the layer against
        the dense reference (moe_checks's tolerances), its results saved to DIR/mesh-<data>x<EP>.npz;
    python -m tests.jax.multiprocess_checks worker CASE DIR PROCESS_ID PORT
        one of the P processes (jax.distributed.initialize at 127.0.0.1:PORT, D devices): the layer on the
        global mesh, fed global arrays built from this process's numpy copy of the inputs, its results
        gathered from every process and compared with the saved ones; then, where the case says so, the
        Flax MoEBlock initialised on the global mesh against the functional layer; prints
        "CASE process I: ok".

Both runs lay the devices out on the mesh in the same positions, place the inputs with the same shardings
and run the same jitted program (forward, aux loss, dropped count and every gradient, dropless and with a
capacity that overflows); only the collectives differ (XLA:CPU's in-process ones against gloo's TCP ones;
on GPUs the padded exchange of one process against the ragged one across processes). On CPU the layer
takes the padded exchange (XLA:CPU has no ragged all-to-all). tests/jax/test_multiprocess.py
launches both runs.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tests.jax._helpers import assert_reduced, assert_same
from tests.jax.moe_checks import check_against_reference, fixed_problem, layer_and_reference, step
from tests.strategies_moe import MoEProblem


@dataclasses.dataclass(frozen=True)
class Case:
    """A (data, ep) mesh over `processes` processes of `local_devices` CPU devices each; every EP group
    spans the processes (a process's devices lie along the data axis)."""

    data: int
    ep: int
    processes: int
    local_devices: int
    with_flax_block: bool = False
    #: The layer's exchange in the processes (the single-process run takes "auto", the padded one).
    exchange: str = "auto"

    @property
    def reference_name(self) -> str:
        """The single-process run's name: cases of one mesh layout share it."""
        return f"mesh-{self.data}x{self.ep}"

    def mesh(self) -> Mesh:
        """The mesh over the global devices, in the same positions with one process or many: devices sorted
        by (process, device id), EP groups across processes."""
        devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        return Mesh(devices.reshape(self.ep, self.data).T, ("data", "ep"))


CASES = {
    # Two processes, one device each: the EP exchange between processes.
    "ep2": Case(data=1, ep=2, processes=2, local_devices=1),
    # Four processes, one device each: data 2 x EP 2, both axes between processes.
    "data2-ep2": Case(data=2, ep=2, processes=4, local_devices=1),
    # Two processes of two devices: each EP group spans both processes, the data axis inside each; and the
    # Flax block (one case: its compiles are the slowest part of a case).
    "data2-ep2-local2": Case(data=2, ep=2, processes=2, local_devices=2, with_flax_block=True),
    # GPUs only (XLA:CPU has no ragged all-to-all): two processes exchanging through ragged_all_to_all.
    "ep2-ragged": Case(data=1, ep=2, processes=2, local_devices=1, exchange="ragged"),
}

#: What XLA needs to run jax.lax.ragged_all_to_all between GPUs of different processes (jaxlib 0.11).
RAGGED_ACROSS_PROCESSES_FLAG = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"

#: Results that are fp32 sums over every token shard, all-reduced in the forward pass (the aux loss) or by
#: JAX's transpose of the replicated router weights (its gradient): gloo and XLA:CPU's in-process
#: all-reduce add more than two shards' values in different orders, so these agree only to fp32 rounding.
#: A sum of two values does not depend on the order: EP = 2 alone is bit for bit throughout.
SUMMED_OVER_TOKEN_SHARDS = {"aux_loss", "grad_gate"}

#: The layer options of each variant: dropless (aligned) and a capacity small enough to drop slots.
VARIANTS = {"dropless": dict(align_size=2), "capacity": dict(align_size=2, capacity_factor=0.5)}


def problem_of(case: Case, variant: str) -> MoEProblem:
    """Every token on EP rank 0's experts: the dropless worst case, and overflow under the capacity."""
    problem = fixed_problem(case.data, case.ep, routing="rank0", topk=2, align_size=None)
    return dataclasses.replace(problem, **VARIANTS[variant])


def placed_inputs(problem: MoEProblem, mesh: Mesh) -> tuple[jax.Array, ...]:
    """(x, gate, gate_up, down) as global arrays in the layer's shardings: tokens over (data, ep) on the
    batch axis, experts over ep, the router replicated. Each process builds its own shards from its copy of
    the numpy inputs (make_array_from_callback asks only for the shards of this process's devices)."""
    specs = (PartitionSpec(("data", "ep")), PartitionSpec(), PartitionSpec("ep"), PartitionSpec("ep"))
    arrays = (problem.x, problem.gate, problem.gate_up, problem.down)
    return tuple(
        jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec), lambda index, a=array: a[index])
        for array, spec in zip(arrays, specs, strict=True)
    )


def layer_results(problem: MoEProblem, mesh: Mesh, exchange: str = "auto") -> dict[str, jax.Array]:
    """out, aux loss, dropped count and the gradients of x, gate, gate_up and down (of loss = <out,
    cotangent> + aux loss, the cotangent of moe_checks.check_against_reference)."""
    layer, _ = layer_and_reference(problem, mesh, exchange=exchange)
    cotangent = np.random.default_rng(1).normal(size=problem.x.shape).astype(np.float32)
    (_, forward), grads = step(layer, cotangent)(*placed_inputs(problem, mesh))
    names = ("out", "aux_loss", "dropped", "grad_x", "grad_gate", "grad_gate_up", "grad_down")
    return dict(zip(names, (*forward, *grads), strict=True))


def run_reference(case: Case, directory: Path) -> None:
    """One process with all the case's devices: checks the layer against the dense reference and saves its
    results to directory / "<case>.npz" (keys "<variant>/<result>")."""
    mesh = case.mesh()
    saved = {}
    for variant in VARIANTS:
        problem = problem_of(case, variant)
        check_against_reference(problem, mesh)
        for name, value in layer_results(problem, mesh).items():
            saved[f"{variant}/{name}"] = np.asarray(value)
    assert saved["capacity/dropped"] > 0, "the capacity variant must drop slots"
    np.savez(directory / f"{case.reference_name}.npz", **saved)


def run_worker(case: Case, directory: Path, process_id: int, port: int) -> None:
    """One of the case's processes: the layer on the global mesh, every process's results gathered
    (process_allgather) and compared with the single-process results."""
    # Cross-process collectives on CPU: gloo is JAX 0.10's default, named so that a JAX with another
    # default uses it too.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=case.processes, process_id=process_id
    )
    assert jax.process_count() == case.processes and jax.local_device_count() == case.local_devices
    expected = np.load(directory / f"{case.reference_name}.npz")
    mesh = case.mesh()
    for variant in VARIANTS:
        results = layer_results(problem_of(case, variant), mesh, case.exchange)
        gathered = multihost_utils.process_allgather(results, tiled=True)
        for name, value in gathered.items():
            got, want, what = np.asarray(value), expected[f"{variant}/{name}"], f"{variant} {name}"
            if name in SUMMED_OVER_TOKEN_SHARDS and mesh.size > 2:
                assert_reduced(got, want, what)
            else:
                assert_same(got, want, what)
    if case.with_flax_block:
        check_flax_block(case, mesh)
    jax.distributed.shutdown()


def check_flax_block(case: Case, mesh: Mesh) -> None:
    """The Flax MoEBlock initialised straight into its shardings on the global mesh (init_sharded) gives
    the functional layer's results on its parameters, bit for bit."""
    from flax import linen as nn

    from moetriton.jax.moe import moe
    from moetriton.jax.moe.flax import MoEBlock, init_sharded

    problem = problem_of(case, "dropless")
    x = placed_inputs(problem, mesh)[0]
    options = dict(topk=2, align_size=2, aux_loss_coeff=1e-2, mesh=mesh, ep_axis="ep", data_axes=("data",))
    block = MoEBlock(num_experts=problem.num_experts, ffn_dim=problem.ffn, **options)
    variables = init_sharded(block, jax.random.key(0), x, mesh=mesh)
    params = nn.meta.unbox(variables["params"])
    got = jax.jit(block.apply)(variables, x)
    expected = moe(x, params["gate"], params["gate_up"], params["down"], **options)
    for name, a, b in zip(("out", "aux_loss", "dropped"), got, expected, strict=True):
        a, b = multihost_utils.process_allgather((a, b), tiled=True)
        assert_same(np.asarray(a), np.asarray(b), f"flax MoEBlock {name}")


if __name__ == "__main__":
    # Exact fp32 matmuls: the routing must not flip between the layer and the dense reference.
    jax.config.update("jax_default_matmul_precision", "highest")
    mode, name, out_dir = sys.argv[1:4]
    if mode == "reference":
        run_reference(CASES[name], Path(out_dir))
        print(f"{name} reference: ok")
    else:
        process, coordinator_port = int(sys.argv[4]), int(sys.argv[5])
        run_worker(CASES[name], Path(out_dir), process, coordinator_port)
        print(f"{name} process {process}: ok")
