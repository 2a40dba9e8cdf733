"""pytest configuration for TransformerEngine's PyTorch permutation test run against moetriton.torch
(scripts/te_torch_tests.sh copies this file in as its conftest.py, beside te_pytorch.py and te_recipe.py).

TE's test imports `transformer_engine.pytorch` and `transformer_engine.common.recipe`; both are bound here,
before the test module is imported, to our stand-ins (te_pytorch: moetriton.torch's permutation functions
plus the few helpers the test needs; te_recipe), so the test runs unchanged on our surface.

TE's test puts every tensor on "cuda" (`.cuda()`, `.to(device="cuda")`, `device="cuda"`). On a machine
without CUDA, a torch function mode active while each test runs places those tensors on the CPU instead:
the values, dtypes and shapes are the test's, only the device differs, and moetriton's ops run there as
they do for any CPU tensor (the Triton kernels under TRITON_INTERPRET=1, else the pure-PyTorch reference).
On a CUDA machine nothing is remapped.
"""

from __future__ import annotations

import sys
import types

import pytest
import te_pytorch
import te_recipe
import torch
from torch.overrides import TorchFunctionMode


def _alias_transformer_engine() -> None:
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    common = types.ModuleType("transformer_engine.common")
    common.__path__ = []
    package.pytorch, package.common, common.recipe = te_pytorch, common, te_recipe
    sys.modules.update(
        {
            "transformer_engine": package,
            "transformer_engine.pytorch": te_pytorch,
            "transformer_engine.common": common,
            "transformer_engine.common.recipe": te_recipe,
        }
    )


_alias_transformer_engine()


def _on_cpu(value):
    """A "cuda" device (string or torch.device) as the CPU; any other value as it is."""
    if isinstance(value, str | torch.device) and torch.device(value).type == "cuda":
        return torch.device("cpu")
    return value


class CudaOnCpu(TorchFunctionMode):
    """Places the tensors a test asks for on CUDA on the CPU: Tensor.cuda() keeps the tensor where it is,
    and a CUDA device given to Tensor.to or as any function's `device=` becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_on_cpu(arg) for arg in args)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _on_cpu(kwargs["device"])}
        return func(*args, **kwargs)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if torch.cuda.is_available():
        yield
        return
    with CudaOnCpu():
        yield
