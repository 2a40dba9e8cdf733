"""Checks of index values for the public JAX functions: when a call reads them, and how it reports.

The rules themselves live in moetriton.kernels (validation, router_validation) and take numbers or lists.
A call reads an array's values where that is free (numpy arrays, concrete CPU arrays outside tracing), and
with the debug switch MOETRITON_CHECK=1 on every call (a device-to-host copy). Elsewhere the kernels apply
their index rule (docs/design.md, "Index data is never trusted").
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from moetriton.kernels.rules import validation


def host_values(x) -> np.ndarray | None:
    """The values of `x` when reading them is free (a numpy array, or a concrete JAX array on CPU)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not x.is_fully_addressable:
        return None
    if any(device.platform != "cpu" for device in x.devices()):
        return None
    return np.asarray(x)


def check_values(rule: Callable[..., None], *arrays) -> None:
    """rule(*numpy arrays), which raises for index values it refuses: now, where the values are free to
    read (numpy or concrete CPU arrays); with the debug switch (validation.CHECK_VALUES, MOETRITON_CHECK=1)
    also for concrete arrays on any device, and inside jit as a debug callback, whose error stops the
    computation when it runs (raised by jax as a runtime error carrying the rule's message). Otherwise the
    kernels' index rule applies: bad entries are ignored."""
    values = [host_values(x) for x in arrays]
    if all(value is not None for value in values):
        rule(*values)
    elif validation.CHECK_VALUES:
        if any(isinstance(x, jax.core.Tracer) for x in arrays):
            jax.debug.callback(lambda *found: rule(*(np.asarray(value) for value in found)), *arrays)
        else:
            rule(*(np.asarray(x) for x in arrays))


def check_shards(num_shards: int, *sizes: tuple[str, str, int]) -> None:
    """Every (argument, what, size) must split into num_shards equal blocks."""
    validation.check_positive("num_shards", num_shards)
    for name, what, size in sizes:
        if size % num_shards:
            raise ValueError(f"{name}: expected {what} a multiple of num_shards = {num_shards}, got {size}")
