"""The MoE layer's stages as profiler ranges, shared by the layer and its peer exchange."""

from __future__ import annotations

import torch

#: Stages of a layer call, each a torch.profiler.record_function range "moe.<stage>" (the benchmark
#: attributes backward work to the stage whose forward ops it differentiates, or to the stage ranges the
#: backward itself opens, as the peer exchange's do). exchange_sizes: the
#: dropless layer's per-expert count exchange and its copy to the host (kept apart from all_to_all, the
#: row exchanges, whose bandwidth the benchmark reports).
STAGES = (
    "router",
    "dispatch",
    "exchange_sizes",
    "all_to_all",
    "chunk_sort",
    "grouped_gemm",
    "activation",
    "combine",
)


def stage(name: str) -> torch.profiler.record_function:
    """The profiler range of one stage (a few host microseconds; ignored by torch.compile)."""
    return torch.profiler.record_function(f"moe.{name}")
