"""The expert-parallel MoE layer for JAX (`moe`), one module per job: `layer` (the layer, its arguments and
the sequence of steps), `routing` (router, token mask, drop policy), `statistics` (losses, dropped count,
loads), `balancing` (the expert-bias update), `experts` (the grouped MLP, the shared experts), `exchange`
(which exchange a call runs, the exchange around the experts), the exchanges `all_to_all` (dropless:
ragged or padded) and `capacity` (fixed slabs), `config` (a call's static configuration), `flax`
(the Flax Linen module `MoEBlock`) and `nnx` (the Flax NNX module `MoE`), each imported only on its own
(`from moetriton.jax.moe.flax import MoEBlock`). See docs/moe.md."""

from moetriton.kernels.rules.moe import MoEStats

from .all_to_all import dropless_forward, dropless_reverse, exchange_sizes
from .balancing import update_expert_bias
from .config import MoEConfig
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
