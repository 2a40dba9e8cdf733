"""The expert-parallel MoE layer for PyTorch (`MoELayer`, `moe`), one module per part: `layer` (the layer,
its arguments and statistics), `experts` (the grouped MLP), `collectives`, and the row exchanges
`all_to_all`, `peer` (GPUs of one host) and `capacity` (fixed slabs). See docs/moe.md."""

from .._stages import STAGES
from .collectives import all_to_all_rows
from .experts import expert_mlp, grouped_mm_supported
from .layer import ACTIVATIONS, EXCHANGES, MoELayer, moe

__all__ = [
    "ACTIVATIONS",
    "EXCHANGES",
    "STAGES",
    "MoELayer",
    "all_to_all_rows",
    "expert_mlp",
    "grouped_mm_supported",
    "moe",
]
