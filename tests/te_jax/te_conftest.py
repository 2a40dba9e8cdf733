"""pytest configuration for TransformerEngine's JAX permutation and router tests run against
moetriton.jax.te (scripts/te_jax_tests.sh copies this file in as their conftest.py).

TE's tests import `transformer_engine.jax.permutation` and `transformer_engine.jax.router`; both names are
bound here to moetriton.jax.te before any test module is imported, so the tests run unchanged on our
surface. Their `triton` marker (tests that need TE's Triton kernels) is registered and always runs.
"""

from __future__ import annotations

import sys
import types

import moetriton.jax.te as te_surface


def _alias_transformer_engine() -> None:
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    jax_package = types.ModuleType("transformer_engine.jax")
    jax_package.__path__ = []
    package.jax = jax_package
    jax_package.permutation = jax_package.router = te_surface
    sys.modules.update(
        {
            "transformer_engine": package,
            "transformer_engine.jax": jax_package,
            "transformer_engine.jax.permutation": te_surface,
            "transformer_engine.jax.router": te_surface,
        }
    )


_alias_transformer_engine()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "triton: TE's marker for tests of its Triton-backed ops (always run here)"
    )
