"""Sharded execution on CPU meshes of 2, 4 and 8 devices (1-D and 2-D, Shardy on and off), and on GPUs.

Each scenario runs in its own subprocess (tests/jax/sharding_checks.py). On CPU the subprocess gets
--xla_force_host_platform_device_count=8, so the flag never reaches the JAX of this test process; inside a
partitioned computation the CPU runs the reference (JAX cannot keep host callbacks alive inside
custom_partitioning), and the checks compare against the unsharded op, which runs the kernels. On a machine
with several GPUs the same scenarios run the compiled kernels inside the partitioned computation.
"""

import os

import numpy as np
import pytest

from tests.jax._helpers import gpu_count, run_python
from tests.jax.sharding_checks import SCENARIOS


def _run(scenario: str, env: dict) -> None:
    result = run_python(["-m", "tests.jax.sharding_checks", scenario], env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{scenario}: ok" in result.stdout


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sharded_ops_run_per_shard_on_cpu_devices(scenario):
    flags = "--xla_force_host_platform_device_count=8"
    _run(scenario, dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sharded_ops_run_per_shard_on_gpus(scenario):
    needed = int(np.prod(SCENARIOS[scenario].mesh_shape))
    if gpu_count() < needed:
        pytest.skip(f"partitioned kernels on GPUs: scenario {scenario} needs {needed} GPUs")
    # This process's JAX may already hold most of the GPU memory; the subprocess allocates on demand.
    _run(scenario, dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
