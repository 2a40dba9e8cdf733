"""The helpers of TransformerEngine's tests/jax/utils.py that its permutation and router tests use, written
for moetriton's runner of those tests (scripts/te_jax_tests.sh): parameters by test level, tolerances by
dtype, device counts."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

#: TE's variable naming the test level whose parameter lists run ("L0" smoke, "L2" full).
LEVEL_VARIABLE = "NVTE_JAX_UNITTEST_LEVEL"


def is_devices_enough(required: int) -> bool:
    return len(jax.devices()) >= required


def is_devices_equal(required: int) -> bool:
    return len(jax.devices()) == required


def _name(value) -> str:
    if isinstance(value, tuple | list):
        return "_".join(_name(v) for v in value)
    if isinstance(value, type(jnp.float32)):  # jnp scalar types, named by their dtype as TE does
        return str(value.dtype)
    return str(value)


def pytest_parametrize_wrapper(param_name: str, param_values):
    """pytest.mark.parametrize with TE's ids ("<name>_<value>") for one parameter; a dict of test levels
    gives the list of the level in NVTE_JAX_UNITTEST_LEVEL (default L0)."""
    if isinstance(param_values, dict):
        level = os.environ.get(LEVEL_VARIABLE, "L0")
        if level not in param_values:
            raise ValueError(f"{LEVEL_VARIABLE}={level}: this test defines levels {sorted(param_values)}")
        param_values = param_values[level]
    if "," not in param_name:
        param_values = [
            value
            if isinstance(value, type(pytest.param(0)))
            else pytest.param(value, id=f"{param_name}_{_name(value)}")
            for value in param_values
        ]
    return pytest.mark.parametrize(param_name, param_values)


def dtype_tols(dtype) -> dict[str, float]:
    """TE's tolerances: exact for integers; for floats rtol = eps^(2/3) and atol = max(ulp(1), rtol)."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return {"rtol": 0.0, "atol": 0.0}
    finfo = jnp.finfo(dtype)
    relaxed = math.pow(float(finfo.eps), 2 / 3)
    one = np.array(1.0, dtype)
    ulp = float(
        max(np.nextafter(one, np.array(np.inf, dtype)) - one, one - np.nextafter(one, np.array(0, dtype)))
    )
    return {"rtol": relaxed, "atol": max(ulp, relaxed)}


def assert_allclose(actual, desired, rtol=None, atol=None, dtype=None, **kwargs) -> None:
    """np.testing.assert_allclose in fp32 with TE's per-dtype tolerances (dtype defaults to actual's)."""
    if dtype is None:
        dtype = jnp.float32 if isinstance(actual, float) else actual.dtype
    tols = dtype_tols(dtype)
    tols.update({key: value for key, value in (("rtol", rtol), ("atol", atol)) if value is not None})
    as_fp32 = lambda x: x if isinstance(x, float) else np.asarray(jnp.asarray(x).astype(jnp.float32))
    np.testing.assert_allclose(as_fp32(actual), as_fp32(desired), **tols, **kwargs)
