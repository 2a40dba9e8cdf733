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

Signature = tuple[torch.Size, torch.dtype, torch.device]
_Check = TypeVar("_Check", bound=Callable[..., Any])


def signature(tensor: torch.Tensor | None) -> Signature | None:
    """What the checks may look at: shape, dtype, device (None for an absent argument)."""
    return None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)


def describe(sig: Signature | None) -> tuple[tuple[int, ...], str] | None:
    """A signature as the framework-neutral rules take it: (shape, numpy-style dtype name)."""
    return None if sig is None else (tuple(sig[0]), str(sig[1]).removeprefix("torch."))


def same_device(**signatures: Signature | None) -> torch.device:
    """The device all present arguments share; a ValueError naming the first one that differs."""
    present = [(name, sig[2]) for name, sig in signatures.items() if sig is not None]
    first_name, device = present[0]
    for name, other in present[1:]:
        if other != device:
            raise ValueError(f"{name}: expected device {device} (as {first_name}), got {other}")
    return device


def memoised(check: _Check) -> _Check:
    """`check(**arguments)`, answered from a cache for arguments seen before (errors are not cached: a
    failing call raises every time). Called directly while torch.compile traces."""
    memo = functools.lru_cache(maxsize=1024)(check)

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


def values_readable(tensor: torch.Tensor) -> bool:
    """Value checks run where reading values is free: eager CPU tensors. On CUDA the map kernel checks
    index ranges with a device-side assertion instead, so the hot path never syncs with the host."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()
