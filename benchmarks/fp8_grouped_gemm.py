"""FP8 grouped GEMMs (moetriton.kernels.grouped_gemm.fp8, through moetriton.torch's FP8 ops) at the MoE layer
shapes, beside the bf16 grouped GEMM and a dense FP8 GEMM of the same run.

    python -m benchmarks.fp8_grouped_gemm [--shapes mixtral,qwen3,dsv3] [--recipes tensorwise,blockwise]
                                          [--out ROOT]
    python -m benchmarks.fp8_grouped_gemm --tiny --out /tmp/results   # every path, tiny (CPU: interpreted)

For every layer shape (rows = T x K routed slots split evenly over E experts) and each of its two GEMMs
(gate_up: K = H, N = 2F; down: K = F, N = H), per recipe: the quantization of the rows (rowwise and
columnwise), of the output gradient and of the weights (both copies), in ms and GB/s of bytes read and
written; the three products (forward, data gradient, weight gradient with bf16 output) in ms and TFLOP/s
(2 M K N per GEMM); beside them our bf16 grouped GEMM's forward, a dense FP8 GEMM (torch._scaled_mm,
tensorwise scales) and a dense bf16 GEMM of M x K x N, all timed in the same run. GPU timings are
CUDA-graph replays (benchmarks.timing.time_graph). --tiny runs a tiny shape, on the GPU or, without one, on
CPU under the Triton interpreter (host wall-clock times), with no dense baselines: a check that every path
runs. Writes
<out>/<machine>/fp8_grouped_gemm.csv (benchmarks.common).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from moetriton.kernels.rules.fp8 import RECIPES
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES, MoELayerShape

from .common import shapes_parser, write_results

#: The --tiny shape: two experts, K and N not multiples of 128.
TINY = MoELayerShape(name="tiny", num_tokens=96, hidden=200, ffn=72, num_experts=2, topk=2)


def _timer(gpu: bool):
    """ms per call of a list of calls: CUDA-graph replays on a GPU, host wall-clock on CPU."""
    if gpu:
        from .timing import time_graph

        return lambda calls: time_graph(calls, replays=10)

    def wall(calls) -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3 / len(calls)

    return wall


def _dense_fp8_ms(timer, rows: int, depth: int, num_cols: int) -> float:
    """ms of a dense [M, K] x [K, N] e4m3 GEMM with tensorwise scales (cuBLAS through torch._scaled_mm)."""
    lhs = torch.randn(rows, depth, device="cuda").to(torch.float8_e4m3fn)
    rhs = torch.randn(num_cols, depth, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return timer([lambda: torch._scaled_mm(lhs, rhs, one, one, out_dtype=torch.bfloat16)])


def _dense_bf16_ms(timer, rows: int, depth: int, num_cols: int) -> float:
    """ms of a dense [M, K] x [K, N] bf16 GEMM (cuBLAS through torch.matmul): the bf16 tensor cores' rate
    on these sizes, beside which the FP8 ones read."""
    lhs = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(depth, num_cols, device="cuda", dtype=torch.bfloat16)
    return timer([lambda: lhs @ rhs])


def _bf16_forward_ms(timer, rows, weights, sizes) -> float:
    from moetriton import kernels
    from moetriton.torch.executor import device_info, run_plan

    plan = kernels.grouped_matmul_plan(
        num_rows=rows.shape[0], depth=rows.shape[1], num_cols=weights.shape[2],
        num_groups=weights.shape[0], element_bytes=2, device=device_info(rows.device),
    )  # fmt: skip
    inputs = dict(lhs=rows, rhs=weights, group_sizes=sizes, lhs_rows=None, out_rows=None)
    return timer([lambda: run_plan(plan, inputs, rows.device)])


def _projection(mt, timer, recipe: str, operands: dict, gpu: bool) -> dict:
    """Times of one projection's quantizations and products under `recipe`."""
    spec = RECIPES[recipe]
    rows, grad, weights, sizes = (operands[name] for name in ("rows", "grad", "weights", "group_sizes"))
    num_rows = rows.shape[0]
    gradient_format = getattr(torch, spec.gradient_dtype)
    x = mt.quantize(rows, sizes, recipe, rowwise=True, columnwise=True)
    dy = mt.quantize(grad, sizes, recipe, fp8_dtype=gradient_format, rowwise=True, columnwise=True)
    w = mt.quantize_weights(weights, recipe)
    calls = dict(
        quantize_rows=lambda: mt.quantize(rows, sizes, recipe, rowwise=True, columnwise=True),
        quantize_grad=lambda: mt.quantize(grad, sizes, recipe, fp8_dtype=gradient_format, columnwise=True),
        quantize_weights=lambda: mt.quantize_weights(weights, recipe),
        forward=lambda: mt.grouped_matmul_fp8(x[0], w[1], x[1], w[2], sizes, recipe),
        dgrad=lambda: mt.grouped_matmul_fp8(dy[0], w[0], dy[1], w[2], sizes, recipe, data_gradient=True),
        wgrad=lambda: mt.grouped_matmul_fp8_wgrad(x[2], dy[2], x[3], dy[3], sizes, num_rows, recipe),
    )
    times = {name: timer([call]) for name, call in calls.items()}
    moved = dict(
        # bytes read (bf16) and written (two fp8 copies, the columnwise one padded), scales left out
        quantize_rows=rows.numel() * 2 + x[0].numel() + x[2].numel(),
        quantize_grad=grad.numel() * 2 + dy[0].numel() + dy[2].numel(),
        quantize_weights=weights.numel() * 2 + w[0].numel() + w[1].numel(),
    )
    flops = 2 * num_rows * rows.shape[1] * grad.shape[1]
    result = {}
    for name, ms in times.items():
        result[f"{name}_ms"] = round(ms, 4)
        if name in moved:
            result[f"{name}_gbps"] = round(moved[name] / ms / 1e6, 1)
        else:
            result[f"{name}_tflops"] = round(flops / ms / 1e9, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = shapes_parser(__doc__, ",".join(MOE_LAYER_SHAPES))
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny shape (on the GPU if there is one, else interpreted)"
    )
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and not args.tiny:
        print("benchmarks.fp8_grouped_gemm needs a GPU (or --tiny)", file=sys.stderr)
        return 1
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("--tiny without a GPU runs the kernels interpreted: set TRITON_INTERPRET=1", file=sys.stderr)
        return 1
    import moetriton.torch as mt

    device = torch.device("cuda" if gpu else "cpu")
    timer = _timer(gpu)
    generator = torch.Generator(device).manual_seed(0)
    shapes = (
        {"tiny": TINY} if args.tiny else {name: MOE_LAYER_SHAPES[name] for name in args.shapes.split(",")}
    )
    results = []
    for name, shape in shapes.items():
        num_rows = shape.num_tokens * shape.topk
        for gemm, depth, num_cols in (
            ("gate_up", shape.hidden, 2 * shape.ffn),
            ("down", shape.ffn, shape.hidden),
        ):

            def normal(*dims):
                return torch.randn(*dims, device=device, generator=generator).to(torch.bfloat16)

            sizes = torch.full((shape.num_experts,), num_rows // shape.num_experts, dtype=torch.int32)
            sizes[: num_rows % shape.num_experts] += 1
            operands = dict(
                rows=normal(num_rows, depth),
                grad=normal(num_rows, num_cols),
                weights=normal(shape.num_experts, depth, num_cols) * depth**-0.5,
                group_sizes=sizes.to(device),
            )
            flops = 2 * num_rows * depth * num_cols
            problem = dict(shape=name, gemm=gemm, rows=num_rows, depth=depth, num_cols=num_cols)
            problem["groups"] = shape.num_experts
            baselines = {}
            if gpu and not args.tiny:  # cuBLAS's FP8 GEMM needs dimensions in multiples of 16
                bf16_ms = _bf16_forward_ms(
                    timer, operands["rows"], operands["weights"], operands["group_sizes"]
                )
                dense_ms = _dense_fp8_ms(timer, num_rows, depth, num_cols)
                dense_bf16_ms = _dense_bf16_ms(timer, num_rows, depth, num_cols)
                baselines = dict(
                    bf16_forward_tflops=round(flops / bf16_ms / 1e9, 2),
                    dense_fp8_tflops=round(flops / dense_ms / 1e9, 2),
                    dense_bf16_tflops=round(flops / dense_bf16_ms / 1e9, 2),
                )
            for recipe in args.recipes.split(","):
                row = dict(
                    problem, recipe=recipe, **_projection(mt, timer, recipe, operands, gpu), **baselines
                )
                results.append(row)
                print(
                    f"{name:<8} {gemm:<8} {recipe:<10} forward {row['forward_tflops']:8.2f} dgrad "
                    f"{row['dgrad_tflops']:8.2f} wgrad {row['wgrad_tflops']:8.2f} TFLOP/s"
                    + (f"  (bf16 {baselines['bf16_forward_tflops']}, dense fp8 "
                       f"{baselines['dense_fp8_tflops']}, dense bf16 {baselines['dense_bf16_tflops']})"
                       if baselines else ""),
                    flush=True,
                )  # fmt: skip
            del operands
            if gpu:
                torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"wrote {write_results('fp8_grouped_gemm', results, device_name, 1, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
