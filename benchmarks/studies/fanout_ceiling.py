"""What do dispatch's and combine's access patterns reach bare? 88-95% and 95-101% of copy (performance.md).

    python -m benchmarks.studies.fanout_ceiling [--shapes mixtral,qwen3,dsv3] [--out ROOT]

Two bare kernels per named shape: a fan-out (read token row t once, store it to K rows: dispatch's data
movement) and a gather (sum K rows into token row t: combine's), with destination rows either t * K + k
(sequential) or a random permutation of them (what routing gives), at 4, 8 and 16 warps, with no routing
work at all. Printed as µs and % of the measured copy ceiling (bytes read + written over the copy
bandwidth), the same ceiling the benchmarks divide by. Dispatch's % of ceiling is judged against the
fan-out's: a write-mostly scatter to random rows does not reach the read + write copy bandwidth
(docs/performance.md, "Ceilings"). Writes <out>/<gpu>/fanout_ceiling.csv (benchmarks.studies).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from benchmarks.common import shapes_parser, write_results
from benchmarks.studies import RESULTS_ROOT
from benchmarks.timing import copy_bandwidth_gbps, time_graph
from moetriton.kernels.rules.shapes import NAMED_SHAPES


@triton.jit
def _fan_out_kernel(tokens_ptr, rows_ptr, hidden, out_ptr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (T,): program t loads token row t [H] once and stores it to rows rows[t * K + k] of out [N, H]."""
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    values = tl.load(tokens_ptr + token.to(tl.int64) * hidden + cols, mask=cmask)
    for k in range(TOPK):
        row = tl.load(rows_ptr + token * TOPK + k).to(tl.int64)
        tl.store(out_ptr + row * hidden + cols, values, mask=cmask)


@triton.jit
def _gather_kernel(inp_ptr, rows_ptr, hidden, out_ptr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (T,): program t sums rows rows[t * K + k] of inp [N, H] in fp32 and stores token row t."""
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in range(TOPK):
        row = tl.load(rows_ptr + token * TOPK + k).to(tl.int64)
        acc += tl.load(inp_ptr + row * hidden + cols, mask=cmask).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def main(argv: list[str] | None = None) -> int:
    parser = shapes_parser(__doc__, "mixtral,qwen3,dsv3")
    parser.set_defaults(out=RESULTS_ROOT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.studies.fanout_ceiling needs a CUDA GPU; nothing to do")
        return 0
    ceiling = copy_bandwidth_gbps()
    print(f"# {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s (read + write)")
    print("shape,rows,num_warps,fan_out_us,fan_out_pct,gather_us,gather_pct")
    results = []
    for name in args.shapes.split(","):
        shape = NAMED_SHAPES[name]
        T, H, K = shape.num_tokens, shape.hidden, shape.topk
        tokens = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        permuted = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
        fanned, gathered = torch.empty_like(permuted), torch.empty_like(tokens)
        num_bytes = (T + T * K) * H * tokens.element_size()
        block_h = triton.next_power_of_2(H)
        for order in ("sequential", "random"):
            rows = torch.arange(T * K, device="cuda", dtype=torch.int32)
            if order == "random":
                rows = rows[torch.randperm(T * K, device="cuda")].contiguous()
            for warps in (4, 8, 16):
                options = dict(TOPK=K, BLOCK_H=block_h, num_warps=warps)
                calls = (
                    functools.partial(_fan_out_kernel[(T,)], tokens, rows, H, fanned, **options),
                    functools.partial(_gather_kernel[(T,)], permuted, rows, H, gathered, **options),
                )
                cells = []
                for call in calls:
                    ms = time_graph([call])
                    cells += [round(ms * 1e3, 1), round(100 * num_bytes / (ms * 1e6) / ceiling, 1)]
                print(f"{name},{order},{warps},{','.join(map(str, cells))}", flush=True)
                columns = ("fan_out_us", "fan_out_pct", "gather_us", "gather_pct")
                results.append(
                    dict(shape=name, rows=order, num_warps=warps, **dict(zip(columns, cells, strict=True)))
                    | dict(copy_gbps=round(ceiling))
                )
    print(f"wrote {write_results('fanout_ceiling', results, torch.cuda.get_device_name(), 1, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
