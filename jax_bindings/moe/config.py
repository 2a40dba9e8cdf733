"""The static configuration of one MoE layer call (hashable: the jit cache key), as every part of the
layer reads it."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static configuration of one layer call (hashable: the jit cache key)."""

    topk: int
    score_function: str
    use_pre_softmax: bool
    num_groups: int | None
    group_topk: int | None
    scaling_factor: float | None
    aux_loss_coeff: float
    align_size: int | None
    capacity_factor: float | None
    activation: str
    dtype: str
    mesh: Mesh | None
    ep_axis: str | None
    data_axes: tuple[str, ...]
    exchange: str  # "ragged" or "padded" (resolved)
    num_shards: int  # token shards: the product of the data axes' and the EP axis' sizes
    ep_size: int

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.data_axes + ((self.ep_axis,) if self.ep_axis else ())
