"""Grouped-GEMM kernels (moetriton.kernels.grouped_gemm) at the MoE layer shapes, beside torch._grouped_mm.

    python -m benchmarks.grouped_gemm [--shapes mixtral,dsv3] [--sweep] [--out ROOT]

For every layer shape (rows = T x K routed slots split over E experts, balanced, one extra row on the first
experts where they do not divide) and each of its two GEMMs (gate_up: K = H, N = 2F; down: K = F, N = H),
the three products of a training step: forward (rows @ W[g]), input gradient (grad @ W[g]^T) and weight
gradient (rows[g]^T @ grad[g]). Our kernels run through the PyTorch executor (the same compiled kernels the
JAX binding launches through jax-triton), timed in CUDA graphs (benchmarks.timing.time_graph); TFLOP/s =
2 M K N / time, beside the rate of a dense bf16 cuBLAS matmul measured in the same run (dense_pct) and
torch._grouped_mm (CUTLASS) on the same operands.
"permuted" times our kernels again with rows read and written through a random row permutation, as the
expert-parallel JAX layer runs them (gate_up reads its rows permuted, down writes them permuted; each
gradient takes the forward's permutations as the layer's VJP does, the weight gradient after gathering the
permuted operand with one copy, included in its time). --sweep also times every config of a
short candidate list and prints the best (heuristic input).
Writes <out>/<gpu>/grouped_gemm.csv (benchmarks.common). GPU only.
"""

from __future__ import annotations

import sys

import torch

from moetriton import kernels
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES
from moetriton.torch.executor import device_info, run_plan

from .common import shapes_parser, write_results
from .timing import DENSE_GEMM_SIZE, dense_gemm_tflops, time_graph


def _sweep(*tiles: tuple[int, int, int, int, int]) -> list[dict[str, int]]:
    """Configs from (block_m, block_n, block_k, num_warps, num_stages) tuples."""
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    return [dict(zip(names, tile, strict=True)) for tile in tiles]


FORWARD_SWEEP = _sweep(
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (64, 256, 64, 8, 4),
    (64, 128, 64, 4, 4),
    (128, 256, 32, 8, 4),
)
WGRAD_SWEEP = _sweep(
    (64, 128, 128, 8, 3),
    (64, 256, 128, 8, 3),
    (64, 128, 128, 8, 4),
    (32, 256, 128, 8, 4),
    (64, 128, 64, 4, 4),
    (32, 128, 128, 4, 4),
)


def _group_sizes(rows: int, groups: int, device) -> torch.Tensor:
    sizes = torch.full((groups,), rows // groups, dtype=torch.int32)
    sizes[: rows % groups] += 1
    return sizes.to(device)


def _ours(
    kind: str,
    operands: dict,
    sizes: dict,
    config: dict | None,
    device,
    lhs_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> float:
    """Time of one of our products; lhs_rows / out_rows: the forward's row permutations (None: rows in
    order), which each gradient takes as the VJP of grouped_matmul does (the weight gradient's plan gathers
    the permuted operand with one copy, timed with it)."""
    if kind == "wgrad":
        plan = kernels.grouped_matmul_wgrad_plan(
            **sizes,
            gather_lhs=lhs_rows is not None,
            gather_grad=out_rows is not None,
            device=device_info(device),
            config=config,
        )
        inputs = dict(
            lhs=operands["rows"],
            grad=operands["grad"],
            group_sizes=operands["group_sizes"],
            lhs_rows=lhs_rows,
            out_rows=out_rows,
        )
        return time_graph([lambda: run_plan(plan, inputs, device)], replays=10)
    transpose = kind == "dgrad"
    dims = dict(sizes, depth=sizes["num_cols"], num_cols=sizes["depth"]) if transpose else sizes
    if transpose:
        lhs_rows, out_rows = out_rows, lhs_rows
    plan = kernels.grouped_matmul_plan(
        **dims,
        transpose_rhs=transpose,
        gather_lhs=lhs_rows is not None,
        scatter_out=out_rows is not None,
        device=device_info(device),
        config=config,
    )
    lhs = operands["grad"] if transpose else operands["rows"]
    inputs = dict(
        lhs=lhs,
        rhs=operands["weights"],
        group_sizes=operands["group_sizes"],
        lhs_rows=lhs_rows,
        out_rows=out_rows,
    )
    return time_graph([lambda: run_plan(plan, inputs, device)], replays=10)


def _cutlass(kind: str, operands: dict) -> float:
    offsets = operands["group_sizes"].cumsum(0, dtype=torch.int32)
    rows, weights, grad = operands["rows"], operands["weights"], operands["grad"]
    calls = {
        "forward": lambda: torch._grouped_mm(rows, weights, offs=offsets),
        "dgrad": lambda: torch._grouped_mm(grad, weights.transpose(1, 2), offs=offsets),
        "wgrad": lambda: torch._grouped_mm(rows.t(), grad, offs=offsets),
    }
    return time_graph([calls[kind]], replays=10)


def main(argv: list[str] | None = None) -> int:
    parser = shapes_parser(__doc__, ",".join(MOE_LAYER_SHAPES))
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.grouped_gemm needs a GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    dense = dense_gemm_tflops()
    print(f"dense bf16 GEMM ({DENSE_GEMM_SIZE}^3, cuBLAS): {dense:.0f} TFLOP/s")
    results = []
    print(
        f"{'shape':<8} {'gemm':<8} {'kind':<8} {'M':>6} {'K':>6} {'N':>6} {'E':>4}  ours ms  TFLOP/s  %dense"
        "  permuted ms  TFLOP/s  cutlass ms  TFLOP/s  best sweep config"
    )
    for name in args.shapes.split(","):
        shape = MOE_LAYER_SHAPES[name]
        rows = shape.num_tokens * shape.topk
        width = 2 * shape.ffn
        for gemm, depth, num_cols in (("gate_up", shape.hidden, width), ("down", shape.ffn, shape.hidden)):

            def normal(*dims):
                return torch.randn(*dims, device=device, generator=generator, dtype=torch.bfloat16)

            operands = dict(
                rows=normal(rows, depth),
                weights=normal(shape.num_experts, depth, num_cols) * depth**-0.5,
                grad=normal(rows, num_cols),
                group_sizes=_group_sizes(rows, shape.num_experts, device),
            )
            order = torch.randperm(rows, device=device, generator=generator).to(torch.int32)
            permutation = dict(lhs_rows=order) if gemm == "gate_up" else dict(out_rows=order)
            sizes = dict(
                num_rows=rows, depth=depth, num_cols=num_cols, num_groups=shape.num_experts, element_bytes=2
            )
            problem = dict(rows=rows, depth=depth, num_cols=num_cols, groups=shape.num_experts)
            for kind in ("forward", "dgrad", "wgrad"):
                flops = 2 * rows * depth * num_cols
                ms = _ours(kind, operands, sizes, None, device)
                permuted_ms = _ours(kind, operands, sizes, None, device, **permutation)
                try:
                    cutlass_ms = _cutlass(kind, operands)
                except (RuntimeError, AttributeError) as error:  # no _grouped_mm, or a layout it refuses
                    print(f"  torch._grouped_mm {kind}: {type(error).__name__}: {error}"[:160])
                    cutlass_ms = float("nan")
                best = ""
                if args.sweep:
                    sweep = WGRAD_SWEEP if kind == "wgrad" else FORWARD_SWEEP
                    timed = []
                    for config in sweep:
                        try:
                            timed.append((_ours(kind, operands, sizes, config, device), config))
                        except Exception as error:  # a config that does not fit is reported, not fatal
                            print(f"  {config}: {type(error).__name__}: {error}"[:160])
                    best_ms, best_config = min(timed, key=lambda item: item[0])
                    best = f"{best_ms:.3f} ms {flops / best_ms / 1e9:.0f} TFLOP/s {best_config}"
                tflops = flops / ms / 1e9
                row = dict(
                    shape=name,
                    gemm=gemm,
                    kind=kind,
                    **problem,
                    ms=round(ms, 4),
                    tflops=round(tflops, 1),
                    dense_pct=round(100 * tflops / dense, 1),
                    permuted_ms=round(permuted_ms, 4),
                    permuted_tflops=round(flops / permuted_ms / 1e9, 1),
                    cutlass_ms=round(cutlass_ms, 4),
                    cutlass_tflops=round(flops / cutlass_ms / 1e9, 1),
                    best_sweep=best,
                )
                results.append(row)
                print(
                    f"{name:<8} {gemm:<8} {kind:<8} {rows:>6} {depth:>6} {num_cols:>6} {shape.num_experts:>4}"
                    f"  {ms:7.3f}  {tflops:7.0f}  {row['dense_pct']:5.1f}  {permuted_ms:11.3f}"
                    f"  {row['permuted_tflops']:7.0f}  {cutlass_ms:10.3f}"
                    f"  {row['cutlass_tflops']:7.0f}  {best}",
                    flush=True,
                )
            del operands
            torch.cuda.empty_cache()
    print(f"wrote {write_results('grouped_gemm', results, torch.cuda.get_device_name(), 1, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
