"""Aux-loss-free load balancing (DeepSeek-V3): the expert bias nudged towards the experts that received
fewer slots than the mean, from a step's routed counts, on the device."""

from __future__ import annotations

from torch import Tensor

from moetriton.kernels.rules.moe import bias_update_direction, check_bias_counts_value, check_bias_update

from .._checks import describe, signature, values_checked


def update_expert_bias(expert_bias: Tensor, routed: Tensor, update_rate: float) -> Tensor:
    """expert_bias + update_rate * sign(mean(routed) - routed), in fp32: experts below the mean load gain
    bias (are chosen more often), those above lose it (sign(0) = 0). The sign is exact for every count (an
    integer comparison, moetriton.kernels.rules.moe.bias_update_direction: no count is rounded to a float).
    No host sync.

    Args:
        expert_bias: [E] float32/bfloat16/float16, the router's selection bias (sigmoid / sqrtsoftplus
            scores).
        routed: [E] integer counts (int8 ... int64, uint8 ... uint32; a float dtype raises ValueError: a
            float count may already be rounded, as bf16 holds 257 as 256), the slots routed to each expert in
            the step, over every rank whose tokens share the bias (`MoEStats.routed` is already that), on
            expert_bias's device. Counts are >= 0: a negative one raises ValueError where its value is read
            for free (CPU tensors; any device with MOETRITON_CHECK=1); on a GPU without the switch it is
            not read, and the update is still the exact sign of mean - count.
        update_rate: a finite Python float >= 0 (DeepSeek-V3: 1e-3).

    Returns:
        [E] float32, the new bias (the inputs are untouched; `MoELayer.update_expert_bias` updates its buffer
        in place).

    Example:
        >>> update_expert_bias(torch.zeros(4), torch.tensor([1, 2, 3, 6]), 0.5).tolist()
        [0.5, 0.5, 0.0, -0.5]
    """
    for name, value in (("expert_bias", expert_bias), ("routed", routed)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    check_bias_update(
        expert_bias=describe(signature(expert_bias)),
        routed=describe(signature(routed)),
        update_rate=update_rate,
    )
    if routed.device != expert_bias.device:
        raise ValueError(
            f"routed: expected device {expert_bias.device} (as expert_bias), got {routed.device}"
        )
    if routed.numel() and values_checked(routed):
        check_bias_counts_value(int(routed.min()))
    direction = bias_update_direction(routed.long())  # int64: every count dtype fits exactly
    return expert_bias.float() + update_rate * direction
