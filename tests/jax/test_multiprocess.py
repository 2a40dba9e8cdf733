"""The JAX MoE layer under jax.distributed: several processes on this machine, on CPU devices (gloo
collectives) and, where there are GPUs, one GPU per process (NCCL).

Each case of tests/jax/multiprocess_checks.py runs first in one process holding every device of its mesh
(results saved), then as P processes of D devices each, one coordinator on a free local port; every
process must finish and agree with the single-process results. On CPU, without TRITON_INTERPRET the ops run
their pure-JAX references (the CPU fallback); the interpreted cases run the Triton kernels through
jax.pure_callback on every process's shards. On GPUs the compiled kernels run, and the exchange differs
between the two runs as `exchange="auto"` picks it: padded within one process, ragged across processes
(the two agree bit for bit). The examples' multi-process launch runs here too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from tests.jax._helpers import ROOT, gpu_count, run_python
from tests.jax.multiprocess_checks import CASES, RAGGED_ACROSS_PROCESSES_FLAG
from tests.strategies_router import interpreted_kernels_problem

CHECKS = "tests.jax.multiprocess_checks"

#: Seconds one group of processes (or one single-process run) may take on a 2-core machine.
TIMEOUT = 240

pytestmark = pytest.mark.skipif(
    "jax_cpu_collectives_implementation" not in jax.config.values,
    reason=f"JAX {jax.__version__} has no cross-process CPU collectives (jax_cpu_collectives_implementation)",
)


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env(local_devices: int, interpreted: bool) -> dict[str, str]:
    """A CPU-only process with `local_devices` devices, the Triton kernels interpreted or not."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(local_devices))
    env.pop("XLA_FLAGS", None)  # a host device count there would override JAX_NUM_CPU_DEVICES
    env.pop("TRITON_INTERPRET", None)
    return env | ({"TRITON_INTERPRET": "1"} if interpreted else {})


def _gpu_env(gpus: range, xla_flags: str = "") -> dict[str, str]:
    """A process that sees the GPUs `gpus` and runs the compiled kernels."""
    visible = ",".join(map(str, gpus))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for name in ("JAX_PLATFORMS", "TRITON_INTERPRET"):
        env.pop(name, None)
    return env | {"XLA_FLAGS": xla_flags}


def _launch(argv_of: list[list[str]], env_of: list[dict[str, str]], logs: Path) -> list[str]:
    """Runs `python *argv` for every argv at once (in its env of env_of) in the repository root and returns
    their outputs (written
    to logs/<i>.txt: a full pipe would block a process). When one fails or they run past TIMEOUT, every one
    still running is killed (a process whose peer died would wait for it in a collective) and the assertion
    carries every output."""
    paths = [logs / f"{i}.txt" for i in range(len(argv_of))]
    with contextlib.ExitStack() as files:
        processes = [
            subprocess.Popen(
                [sys.executable, "-X", "faulthandler", *argv],
                cwd=ROOT,
                env=env,
                stdout=(log := files.enter_context(path.open("w"))),
                stderr=log,
            )
            for argv, env, path in zip(argv_of, env_of, paths, strict=True)
        ]
        deadline = time.monotonic() + TIMEOUT
        try:
            while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
                if any(p.returncode not in (None, 0) for p in processes):
                    break
                time.sleep(0.1)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait()
    outputs = [path.read_text() for path in paths]
    report = "".join(
        f"\n--- process {i}: exit {p.returncode}\n{out[-6000:]}"
        for i, (p, out) in enumerate(zip(processes, outputs, strict=True))
    )
    assert all(p.returncode == 0 for p in processes), report
    return outputs


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(case name, interpreted) -> the folder holding the single-process results of that case's mesh; each
    mesh runs once per mode."""
    folders = {}

    def folder(name: str, interpreted: bool):
        case = CASES[name]
        key = (case.reference_name, interpreted)
        if key not in folders:
            mode = "interpreted" if interpreted else "reference"
            folders[key] = tmp_path_factory.mktemp(f"{case.reference_name}-{mode}")
            argv = ["-X", "faulthandler", "-m", CHECKS, "reference", name, str(folders[key])]
            result = run_python(argv, _env(case.processes * case.local_devices, interpreted), timeout=TIMEOUT)
            assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
        return folders[key]

    return folder


@pytest.mark.parametrize(
    "name, interpreted",
    [
        ("ep2", False),
        ("data2-ep2", False),
        ("data2-ep2-local2", False),
        ("data2-ep2-local2", True),
    ],
)
def test_processes_match_one_process(name, interpreted, references, tmp_path):
    if interpreted and (problem := interpreted_kernels_problem()):
        pytest.skip(problem)
    case = CASES[name]
    folder = references(name, interpreted)
    port = str(_free_port())
    argv_of = [
        ["-m", CHECKS, "worker", name, str(folder), str(process), port] for process in range(case.processes)
    ]
    outputs = _launch(argv_of, [_env(case.local_devices, interpreted)] * case.processes, tmp_path)
    for process, output in enumerate(outputs):
        assert f"{name} process {process}: ok" in output, output[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ep2", "ep2-ragged", "data2-ep2"])
def test_gpu_processes_match_one_process(name, tmp_path):
    """One process per GPU against one process driving all of them (the padded exchange): forward and
    gradients bit for bit, with the padded exchange and with the ragged one across processes."""
    case = CASES[name]
    if gpu_count() < case.processes:
        pytest.skip(f"{name} needs {case.processes} GPUs, found {gpu_count()}")
    argv = ["-X", "faulthandler", "-m", CHECKS, "reference", name, str(tmp_path)]
    result = run_python(argv, _gpu_env(range(case.processes)), timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    port = str(_free_port())
    argv_of = [
        ["-m", CHECKS, "worker", name, str(tmp_path), str(process), port] for process in range(case.processes)
    ]
    flags = RAGGED_ACROSS_PROCESSES_FLAG if case.exchange == "ragged" else ""
    outputs = _launch(argv_of, [_gpu_env(range(i, i + 1), flags) for i in range(case.processes)], tmp_path)
    for process, output in enumerate(outputs):
        assert f"{name} process {process}: ok" in output, output[-4000:]


def test_multiprocess_example_launches_and_matches_the_reference():
    """examples/jax_moe_multiprocess.py as documented: 2 processes on this machine, each checking the layer
    against the dense reference (the script ends its processes itself, before this timeout)."""
    argv = ["examples/jax_moe_multiprocess.py", "--timeout", str(TIMEOUT - 30)]
    result = run_python(argv, _env(1, interpreted=False), timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert "dropless on mesh {'data': 1, 'ep': 2} over 2 processes" in result.stdout, result.stdout
    assert "ok: every process agreed with the reference" in result.stdout, result.stdout
