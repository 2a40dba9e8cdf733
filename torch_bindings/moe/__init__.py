"""The expert-parallel MoE layer for PyTorch (`MoELayer`, `moe`), one module per part: `layer` (the layer and
its arguments), `statistics` (losses and loads), `balancing` (the expert-bias update), `experts` (the
grouped MLP), `collectives`, and the row exchanges `all_to_all`, `peer` (GPUs of one host) and `capacity`
(fixed slabs). See docs/moe.md."""

from moetriton.kernels.rules.moe import MoEStats

from .._stages import STAGES
from .balancing import update_expert_bias
from .collectives import HOSTS_VARIABLE, all_to_all_rows, group_hosts
from .experts import expert_mlp, grouped_mm_supported
from .layer import ACTIVATIONS, EXCHANGES, MoELayer, moe
from .peer import choose_exchange, exchange_for

__all__ = [
    "ACTIVATIONS",
    "EXCHANGES",
    "HOSTS_VARIABLE",
    "STAGES",
    "MoELayer",
    "MoEStats",
    "all_to_all_rows",
    "choose_exchange",
    "exchange_for",
    "expert_mlp",
    "group_hosts",
    "grouped_mm_supported",
    "moe",
    "update_expert_bias",
]
