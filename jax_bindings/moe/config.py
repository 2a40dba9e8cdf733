"""The static configuration of one MoE layer call (hashable: the jit cache key), as every part of the
layer reads it."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from moetriton.kernels.rules.expert_parallel import EPLayout, ep_layout
from moetriton.kernels.rules.moe import LayerOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(LayerOptions):
    """Static configuration of one layer call (hashable: the jit cache key): the layer's options and how
    this call runs them."""

    dtype: str
    mesh: Mesh | None
    ep_axis: str | None
    data_axes: tuple[str, ...]
    exchange: str  # "ragged" or "padded" (resolved)
    num_shards: int  # token shards: the product of the data axes' and the EP axis' sizes
    ep_size: int
    return_stats: bool = False  # the layer also returns MoEStats

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.data_axes + ((self.ep_axis,) if self.ep_axis else ())

    def layout(self, num_tokens: int, num_experts: int) -> EPLayout:
        """The exchange layout of a token shard of `num_tokens` tokens and `num_experts` experts (validating
        topk, E against the EP size, align_size and capacity_factor with the layout's messages)."""
        return ep_layout(
            num_tokens=num_tokens,
            num_experts=num_experts,
            topk=self.topk,
            ep_size=self.ep_size,
            align_size=self.align_size,
            capacity_factor=self.capacity_factor,
        )
