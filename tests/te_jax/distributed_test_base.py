"""The mesh configurations of TransformerEngine's tests/jax/distributed_test_base.py that its distributed
permutation and router tests use (generate_configs), with a stand-in for TE's MeshResource."""

from __future__ import annotations

import dataclasses

import pytest
from utils import is_devices_enough


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """The mesh axis names TE assigns to each parallelism (None: not used)."""

    dp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None


def generate_configs() -> list:
    """(device_count, mesh_shape, mesh_axes, mesh_resource) of TE's meshes this machine has devices for:
    dp2 x fsdp2 x tp2, dp2 x tp2, dp2, tp2 (tokens replicated)."""
    configs = []
    if is_devices_enough(8):
        resource = MeshResource(dp_resource="dp", fsdp_resource="fsdp", tpsp_resource="tpsp")
        configs.append(pytest.param(8, (2, 2, 2), ("dp", "fsdp", "tpsp"), resource, id="n8_dp2_fsdp2_tp2"))
    if is_devices_enough(4):
        resource = MeshResource(dp_resource="dp", tpsp_resource="tpsp")
        configs.append(pytest.param(4, (2, 2), ("dp", "tpsp"), resource, id="n4_dp2_tp2"))
    if is_devices_enough(2):
        configs.append(pytest.param(2, (2,), ("dp",), MeshResource(dp_resource="dp"), id="n2_dp2_tp1"))
        configs.append(pytest.param(2, (2,), ("tpsp",), MeshResource(tpsp_resource="tpsp"), id="n2_dp1_tp2"))
    return configs
