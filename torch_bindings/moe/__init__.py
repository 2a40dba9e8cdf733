"""The expert-parallel MoE layer for PyTorch (`MoELayer`, `moe`), one module per job: `layer` (the layer, its
arguments and the sequence of steps), `routing` (router, token mask, drop policy, token chunks),
`statistics` (losses, dropped count, loads), `balancing` (the expert-bias update), `experts` (the grouped
and batched MLP, the shared experts), `exchange` (the exchange contract, the layer's dispatch, which
exchange a call runs), the exchanges `all_to_all` (dropless), `peer` (GPUs of one host) and `capacity`
(fixed slabs), and `collectives`. See docs/moe.md."""

from moetriton.kernels.rules.moe import MoEStats

from .._stages import STAGES
from .balancing import update_expert_bias
from .collectives import HOSTS_VARIABLE, all_to_all_rows, group_hosts
from .exchange import choose_exchange, exchange_for, peer_exchange_available
from .experts import expert_mlp, grouped_mm_supported
from .layer import ACTIVATIONS, EXCHANGES, MoELayer, moe

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
    "peer_exchange_available",
    "update_expert_bias",
]
