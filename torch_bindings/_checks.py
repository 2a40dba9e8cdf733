"""Argument checks of the public PyTorch functions, paid once per call signature.

The rules themselves live in moetriton.kernels (validation, router_validation) and see arrays as (shape,
dtype name). Here a tensor is described by its signature (shape, dtype, device), a public function's checks
take signatures and plain arguments only, and `memoised` runs them once per distinct signature: a repeated
call (every step of a training loop) costs a dictionary lookup. While torch.compile traces, sizes may be
symbolic, and the checks run directly each time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from moetriton.kernels.rules import validation

Signature = tuple[torch.Size, torch.dtype, torch.device]
_Check = TypeVar("_Check", bound=Callable[..., Any])


def signature(tensor: torch.Tensor | None) -> Signature | None:
    """What the checks may look at: shape, dtype, device (None for an absent argument). Anything but a
    tensor gets validation.not_an_array's description (shape None), for which the rules raise TypeError."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return (*validation.not_an_array(tensor, "a torch.Tensor"), None)
    return (tensor.shape, tensor.dtype, tensor.device)


def describe(sig: Signature | None) -> tuple[tuple[int, ...], str] | None:
    """A signature as the framework-neutral rules take it: (shape, numpy-style dtype name)."""
    if sig is None or sig[0] is None:
        return None if sig is None else (None, sig[1])
    return (tuple(sig[0]), str(sig[1]).removeprefix("torch."))


def described(**sigs: Signature | None) -> dict[str, tuple[tuple[int, ...], str] | None]:
    """Every signature `describe`d, by name: the array arguments of a rule."""
    return {name: describe(sig) for name, sig in sigs.items()}


def same_device(**signatures: Signature | None) -> torch.device:
    """The device all present arguments share; a ValueError naming the first one that differs (TypeError
    for one that is not a tensor)."""
    for name, sig in signatures.items():
        validation.require_array(name, describe(sig))
    present = [(name, sig[2]) for name, sig in signatures.items() if sig is not None]
    first_name, device = present[0]
    for name, other in present[1:]:
        if other != device:
            raise ValueError(f"{name}: expected device {device} (as {first_name}), got {other}")
    return device


def memoised(check: _Check) -> _Check:
    """`check(**arguments)`, answered from a cache for arguments seen before (errors are not cached: a
    failing call raises every time). Called directly while torch.compile traces.

    The cache tells arguments of different types apart (`typed`): Python holds True == 1 == 1.0 with one
    hash, and a check that refuses one of them must refuse it whatever was called before. The signatures'
    contents (sizes, dtypes, devices) cannot collide across types, so the arguments' own types suffice."""
    memo = functools.lru_cache(maxsize=1024, typed=True)(check)

    @functools.wraps(check)
    def run(**arguments):
        if torch.compiler.is_compiling():
            return check(**arguments)
        try:
            hash(tuple(arguments.values()))
        except TypeError:  # an unhashable argument: the rules will name it
            return check(**arguments)
        return memo(**arguments)

    return run  # type: ignore[return-value]


def values_checked(tensor: torch.Tensor) -> bool:
    """Whether a call reads `tensor`'s index values to check them: where reading is free (eager CPU
    tensors), and with the debug switch (validation.CHECK_VALUES, MOETRITON_CHECK=1) on any device, a sync,
    except while a CUDA graph is captured. torch.compile traces never read values; there, and on the GPU
    without the switch, the kernels' index rule applies (bad entries are ignored)."""
    if torch.compiler.is_compiling():
        return False
    if tensor.device.type == "cpu":
        return True
    return validation.CHECK_VALUES and not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def extremes(*parts: torch.Tensor) -> list[tuple[int, int]]:
    """(min, max) of each non-empty tensor, read from the device in one copy."""
    stacked = torch.stack([value for part in parts for value in torch.aminmax(part.long())])
    values = stacked.tolist()
    return list(zip(values[::2], values[1::2], strict=True))
