"""The expert-parallel MoE layer for JAX (`moe`; its Flax module is moetriton.jax.flax), one module per
part: `layer` (the layer, its arguments, losses and statistics), `balancing` (the expert-bias update),
`exchange` (the EP row exchanges), `experts` (the grouped MLP) and `config` (a call's static configuration).
See docs/moe.md."""

from moetriton.kernels.rules.moe import MoEStats

from .balancing import update_expert_bias
from .config import MoEConfig
from .exchange import dropless_forward, dropless_reverse, exchange_sizes
from .layer import ACTIVATIONS, EXCHANGES, moe

__all__ = [
    "ACTIVATIONS",
    "EXCHANGES",
    "MoEConfig",
    "MoEStats",
    "dropless_forward",
    "dropless_reverse",
    "exchange_sizes",
    "moe",
    "update_expert_bias",
]
