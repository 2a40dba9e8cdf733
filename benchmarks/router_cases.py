"""Router benchmarks: fused top-k forward and backward, moetriton beside the framework references.

    python -m benchmarks.router_cases [--quick] [--out ROOT]   # every case in CASES: router_grid.csv
    (benchmarks.run calls `results(shape)` per named shape: the cases with that shape's E and K)

Cases (bf16 logits): T in {4096, 16384} x (E, K) in {(8, 2), (64, 4), (128, 8), (256, 8) DeepSeek-V3 style
(sigmoid, expert bias, 8 groups, top-4 groups, scaling 2.5), (2048, 16)}; the others use softmax after
the top-k; (128, 8) and the DeepSeek-V3 case also with the routing map bit-packed (routing_map_format
"bitmap", name suffix "-bitmap": the forward writes and the backward reads ceil(E / 8) bytes per token).
Timed: "topk_fwd" (probs + routing map from logits) and "topk_bwd" (grad_logits from grad_probs).

PyTorch: medians over CUDA-graph replays (benchmarks.timing.time_graph), each call on its own input set; the
reference's backward goes through autograd and is timed eagerly when it cannot be captured. JAX:
benchmarks.timing.time_jax (R calls on R distinct input sets in one jit, median GPU span per call, read with
CUPTI; the note adds the synced host wall time). Bytes: every
input read once and every output written once (logits, bias, probs, bool map or bitmap; for the backward
grad_probs, logits, map and grad_logits). Imports cleanly without a GPU and then returns no results.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from moetriton.kernels.rules.shapes import MoEShape

from .common import Result, add_out_option, write_results
from .timing import input_sets, time_eager, time_graph, time_jax

#: RouterCase's fields that are keyword arguments of fused_topk_with_score_function (the bias is an array).
SCORING = ("num_groups", "group_topk", "scaling_factor", "score_function", "routing_map_format")


@dataclass(frozen=True)
class RouterCase:
    num_tokens: int
    num_experts: int
    topk: int
    score_function: str = "softmax"
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    bias: bool = False
    routing_map_format: str = "bytemap"

    @property
    def name(self) -> str:
        groups = f"-G{self.num_groups}" if self.num_groups else ""
        packed = "-bitmap" if self.routing_map_format == "bitmap" else ""
        return f"T{self.num_tokens}-E{self.num_experts}-K{self.topk}{groups}{packed}"

    def kwargs(self) -> dict:
        """The top-k router's scoring keywords (SCORING) of this case."""
        return {name: getattr(self, name) for name in SCORING}

    def bytes(self, backward: bool) -> int:
        cells = self.num_tokens * self.num_experts
        packed = self.routing_map_format == "bitmap"
        map_bytes = self.num_tokens * ((self.num_experts + 7) // 8) if packed else cells
        if backward:  # grad_probs, logits, map -> grad_logits
            return cells * (2 + 2 + 2) + map_bytes
        return (
            cells * (2 + 2) + map_bytes + (self.num_experts * 4 if self.bias else 0)
        )  # logits -> probs, map


DSV3 = dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, bias=True)
CASES = [
    RouterCase(
        tokens, experts, topk, **(DSV3 if experts == 256 else {}), routing_map_format=routing_map_format
    )
    for tokens in (4096, 16384)
    for experts, topk in ((8, 2), (64, 4), (128, 8), (256, 8), (2048, 16))
    for routing_map_format in (("bytemap", "bitmap") if experts in (128, 256) else ("bytemap",))
]


def cases_for(shape_or_case: MoEShape | RouterCase) -> list[RouterCase]:
    """A case as given, or for a named shape the cases with its number of experts and top-k."""
    if isinstance(shape_or_case, RouterCase):
        return [shape_or_case]
    return [
        case
        for case in CASES
        if (case.num_experts, case.topk) == (shape_or_case.num_experts, shape_or_case.topk)
    ]


def results(shape_or_case: MoEShape | RouterCase, quick: bool = False) -> list[Result]:
    if not torch.cuda.is_available():
        return []
    out: list[Result] = []
    for case in cases_for(shape_or_case):
        out += _torch_results(case, quick)
        out += _jax_results(case, quick)
    return out


# PyTorch ------------------------------------------------------------------------------------------------


def _torch_sets(case: RouterCase) -> list[dict]:
    from moetriton.torch.router import fused_topk_with_score_function

    generator = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(input_sets(case.bytes(backward=True))):
        logits = torch.randn(
            case.num_tokens, case.num_experts, device="cuda", dtype=torch.bfloat16, generator=generator
        )
        bias = torch.randn(case.num_experts, device="cuda", generator=generator) if case.bias else None
        probs, routing_map = fused_topk_with_score_function(
            logits, case.topk, **case.kwargs(), expert_bias=bias
        )
        grad = torch.randn(probs.shape, device="cuda", dtype=probs.dtype, generator=generator)
        sets.append(dict(logits=logits, bias=bias, routing_map=routing_map, grad=grad))
    return sets


def _torch_results(case: RouterCase, quick: bool) -> list[Result]:
    from moetriton.torch import reference_router as reference
    from moetriton.torch.router import fused_topk_with_score_function

    sets = _torch_sets(case)
    kwargs = case.kwargs()
    scale = case.scaling_factor or 1.0

    def forward(topk):
        return [lambda s=s: topk(s["logits"], case.topk, **kwargs, expert_bias=s["bias"]) for s in sets]

    backward = [
        lambda s=s: torch.ops.moetriton.router_topk_backward(
            s["grad"],
            s["logits"],
            s["routing_map"],
            case.topk,
            False,
            scale,
            case.score_function,
            case.routing_map_format,
            None,
        )
        for s in sets
    ]
    out = [
        Result(
            "topk_fwd",
            "torch",
            "moetriton",
            case.name,
            time_graph(forward(fused_topk_with_score_function)),
            case.bytes(False),
            "CUDA graph",
        ),
        Result(
            "topk_bwd", "torch", "moetriton", case.name, time_graph(backward), case.bytes(True), "CUDA graph"
        ),
    ]
    if quick:
        return out
    ms = time_graph(forward(reference.fused_topk_with_score_function))
    out.append(Result("topk_fwd", "torch", "torch-ref", case.name, ms, case.bytes(False), "CUDA graph"))
    # Autograd runs the backward on the forward's stream, which a capture cannot follow: time it eagerly.
    autograd = []
    for s in sets:
        logits = s["logits"].detach().requires_grad_(True)
        probs, _ = reference.fused_topk_with_score_function(
            logits, case.topk, **kwargs, expert_bias=s["bias"]
        )
        autograd.append(
            lambda probs=probs, logits=logits, grad=s["grad"]: torch.autograd.grad(
                probs, logits, grad, retain_graph=True
            )
        )
    ms = time_eager(autograd)
    out.append(Result("topk_bwd", "torch", "torch-ref", case.name, ms, case.bytes(True), "eager (autograd)"))
    return out


# JAX ------------------------------------------------------------------------------------------------------


def _jax_on_gpu() -> bool:
    try:
        import jax

        return jax.default_backend() in ("gpu", "cuda")
    except ImportError:
        return False


def _jax_results(case: RouterCase, quick: bool) -> list[Result]:
    if not _jax_on_gpu():
        return []
    import jax
    import jax.numpy as jnp

    from moetriton.jax import reference_router as reference
    from moetriton.jax.router import fused_topk_with_score_function

    keys = jax.random.split(jax.random.key(0), input_sets(case.bytes(backward=True)))
    shape = (case.num_tokens, case.num_experts)
    bias = jax.random.normal(keys[0], (case.num_experts,)) if case.bias else None
    logits = [jax.random.normal(key, shape, jnp.bfloat16) for key in keys]
    grads = [jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(keys[-1], len(keys))]
    kwargs = dict(case.kwargs(), expert_bias=bias)
    out = []
    impls = [("moetriton", fused_topk_with_score_function)]
    if not quick:
        impls.append(("jax-ref", reference.fused_topk_with_score_function))
    for impl, topk in impls:
        timing = time_jax(lambda x, topk=topk: topk(x, case.topk, **kwargs), [(x,) for x in logits])
        note = f"R calls in one jit; cold {timing.cold_ms:.4f} ms, wall {timing.wall_ms:.4f} ms synced"
        out.append(Result("topk_fwd", "jax", impl, case.name, timing.device_ms, case.bytes(False), note))
        vjps = [jax.vjp(lambda x, topk=topk: topk(x, case.topk, **kwargs)[0], x)[1] for x in logits]
        timing = time_jax(lambda vjp, grad: vjp(grad), list(zip(vjps, grads, strict=True)))
        note = f"R calls in one jit; cold {timing.cold_ms:.4f} ms, wall {timing.wall_ms:.4f} ms synced"
        out.append(Result("topk_bwd", "jax", impl, case.name, timing.device_ms, case.bytes(True), note))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="skip the references")
    add_out_option(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU; nothing to do")
        return 0
    rows = [r for case in CASES for r in results(case, args.quick)]
    print(f"{'op':<10}{'fw':<6}{'impl':<11}{'case':<20}{'ms':>9}{'GB/s':>8}{'vs ref':>8}  note")
    for r in rows:
        same = [
            b for b in rows if (b.op, b.framework, b.shape) == (r.op, r.framework, r.shape) and b is not r
        ]
        speedup = same[0].ms / r.ms if same and r.impl == "moetriton" else 0.0
        print(
            f"{r.op:<10}{r.framework:<6}{r.impl:<11}{r.shape:<20}{r.ms:>9.4f}{r.gbps():>8.0f}{speedup:>8.1f}"
            f"  {r.note}"
        )
    grid = [dict(r.as_dict(), gbps=r.gbps()) for r in rows]
    print(f"wrote {write_results('router_grid', grid, torch.cuda.get_device_name(), 1, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
