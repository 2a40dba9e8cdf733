"""Named MoE shapes, shared by benchmarks, the autotuner and tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    """T tokens of hidden size H routed to top-K of E experts."""

    name: str
    num_tokens: int
    hidden: int
    num_experts: int
    topk: int


NAMED_SHAPES: dict[str, MoEShape] = {
    shape.name: shape
    for shape in (
        MoEShape("mixtral", 16384, 4096, 8, 2),
        MoEShape("qwen3", 16384, 2048, 128, 8),
        MoEShape("dsv3", 8192, 7168, 256, 8),
        MoEShape("small", 4096, 1024, 64, 4),
        # Host-bound: kernels take a few microseconds, so the host path of a call decides its eager time.
        MoEShape("tiny", 512, 1024, 64, 4),
    )
}


@dataclass(frozen=True)
class MoELayerShape:
    """One MoE layer: T tokens per GPU of hidden size H, E experts of FFN size F (SwiGLU: fused gate+up
    [E, H, 2F], down [E, F, H]), top-K routing with the given score function and group limit."""

    name: str
    num_tokens: int
    hidden: int
    ffn: int
    num_experts: int
    topk: int
    score_function: str = "softmax"
    num_groups: int | None = None
    group_topk: int | None = None


#: Layer benchmarks: token counts per GPU that give a Hopper GPU enough GEMM work to measure the layer.
MOE_LAYER_SHAPES: dict[str, MoELayerShape] = {
    shape.name: shape
    for shape in (
        MoELayerShape("mixtral", 16384, 4096, 14336, 8, 2),
        MoELayerShape("qwen3", 16384, 2048, 768, 128, 8),
        MoELayerShape("dsv3", 8192, 7168, 2048, 256, 8, "sigmoid", 8, 4),
    )
}
