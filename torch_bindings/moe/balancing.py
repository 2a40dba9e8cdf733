"""Aux-loss-free load balancing (DeepSeek-V3): the expert bias nudged towards the experts that received
fewer slots than the mean, from a step's routed counts, on the device."""

from __future__ import annotations

import torch
from torch import Tensor

from moetriton.kernels.rules.moe import check_coefficient


def update_expert_bias(expert_bias: Tensor, routed: Tensor, update_rate: float) -> Tensor:
    """expert_bias + update_rate * sign(mean(routed) - routed), in fp32: experts below the mean load gain
    bias (are chosen more often), those above lose it (sign(0) = 0). No host sync.

    Args:
        expert_bias: [E] float, the router's selection bias (sigmoid / sqrtsoftplus scores).
        routed: [E] integer or float, slots routed to each expert in the step, over every rank whose tokens
            share the bias (`MoEStats.routed` is already that), on expert_bias's device.
        update_rate: a finite Python float >= 0 (DeepSeek-V3: 1e-3).

    Returns:
        [E] float32, the new bias (the inputs are untouched; `MoELayer.update_expert_bias` updates its buffer
        in place).

    Example:
        >>> update_expert_bias(torch.zeros(4), torch.tensor([1, 2, 3, 6]), 0.5).tolist()
        [0.5, 0.5, 0.0, -0.5]
    """
    check_coefficient("update_rate", update_rate)
    if expert_bias.dim() != 1 or not expert_bias.is_floating_point():
        shape = list(expert_bias.shape)
        raise ValueError(f"expert_bias: expected a float [E], got {expert_bias.dtype} {shape}")
    if list(routed.shape) != list(expert_bias.shape):
        raise ValueError(f"routed: expected [E] = {list(expert_bias.shape)}, got {list(routed.shape)}")
    load = routed.float()
    return expert_bias.float() + update_rate * torch.sign(load.mean() - load)
