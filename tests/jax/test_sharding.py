"""Sharded execution on CPU meshes of 2, 4 and 8 devices (1-D and 2-D, Shardy on and off).

Each scenario runs in its own subprocess (tests/jax/sharding_checks.py) with
--xla_force_host_platform_device_count=8, so the flag never reaches the JAX of this test process. Inside a
partitioned computation the CPU runs the reference (JAX cannot keep host callbacks alive inside
custom_partitioning); the checks compare against the unsharded op, which runs the kernels.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jax.sharding_checks import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sharded_ops_run_per_shard(scenario):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "tests.jax.sharding_checks", scenario],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{scenario}: ok" in result.stdout
