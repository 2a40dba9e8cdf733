"""Benchmark runner of the ops: every op, framework and named shape on one GPU, in one table.

    python -m benchmarks.run [--shapes mixtral,qwen3,dsv3,small,tiny] [--modules ...] [--quick] [--out ROOT]

Run from the repository root with moetriton installed. Prints, per op, framework, implementation and
shape: ms (CUDA-graph replay for PyTorch, the steady-state GPU span for JAX; benchmarks.timing), GB/s of
the op's ideal bytes, % of the device-to-device copy bandwidth measured in the same run (read + write), and
the baseline's time and the speedup; the eager module adds the host time per call and the eager wall time
per call. Each case module's rows go to its own results file, <ROOT>/<gpu>/<name>.csv (benchmarks.common),
ROOT benchmarks/results by default; names: torch (benchmarks.torch_cases), jax (jax_cases), router
(router_cases: the named shapes' E and K), eager (eager_cases: host, eager and graph time beside
TransformerEngine's Triton kernels where importable, and eager torch for the router). `--modules
benchmarks.eager_cases` runs one module and rewrites only its file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from moetriton.kernels.rules.shapes import NAMED_SHAPES

from .common import add_out_option, versions, write_results

# Implementations that are moetriton's baseline (TE's rows are reported beside it, not as a baseline).
BASELINES = ("torch-ref", "torch-eager", "jax-ref", "jax-argsort")
CASE_MODULES = (
    "benchmarks.torch_cases",
    "benchmarks.jax_cases",
    "benchmarks.router_cases",
    "benchmarks.eager_cases",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(NAMED_SHAPES))
    parser.add_argument("--modules", default=",".join(CASE_MODULES))
    parser.add_argument("--quick", action="store_true", help="skip the slow baselines")
    add_out_option(parser)
    args = parser.parse_args(argv)

    # JAX benchmarks share the GPU with PyTorch's: no up-front grab of 75% of its memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    from .timing import copy_bandwidth_gbps

    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU; nothing to do")
        return 0
    ceiling = copy_bandwidth_gbps()
    device = torch.cuda.get_device_name()
    print(f"device {device}, copy bandwidth {ceiling:.0f} GB/s (read + write), versions {versions()}")
    print(
        f"{'op':<17}{'fw':<6}{'impl':<12}{'shape':<9}{'ms':>9}{'GB/s':>8}{'%ceil':>7}"
        f"{'base ms':>9}{'speedup':>8}{'host ms':>9}{'eager ms':>9}  note"
    )
    for module_name in args.modules.split(","):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            print(f"skipping {module_name}: {error}")
            continue
        results = []
        for shape_name in args.shapes.split(","):
            try:
                results += module.results(NAMED_SHAPES[shape_name], args.quick)
            except Exception:  # one failing case module must not hide the others' numbers
                print(f"{module_name} {shape_name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        rows = _rows(results, ceiling)
        for row in rows:
            speedup = row["baseline_ms"] / row["ms"] if row["baseline_ms"] else None
            print(
                f"{row['op']:<17}{row['framework']:<6}{row['impl']:<12}{row['shape']:<9}{row['ms']:>9.4f}"
                f"{row['gbps']:>8.0f}{row['ceiling_pct']:>7.1f}"
                f"{row['baseline_ms'] or 0:>9.3f}{speedup or 0:>8.1f}"
                f"{row['host_ms'] or 0:>9.4f}{row['eager_ms'] or 0:>9.4f}  {row['note']}"
            )
        if rows:
            name = module_name.rsplit(".", 1)[-1].removesuffix("_cases")
            print(f"wrote {write_results(name, rows, device, 1, args.out)}")
    return 0


def _rows(results: list, ceiling: float) -> list[dict]:
    """Result rows with GB/s, % of the copy ceiling and, for moetriton, the baseline's time."""
    rows = []
    for r in results:
        baseline = [
            b
            for b in results
            if (b.op, b.framework, b.shape) == (r.op, r.framework, r.shape) and b.impl in BASELINES
        ]
        rows.append(
            dict(
                r.as_dict(),
                gbps=r.gbps(),
                ceiling_pct=100 * r.gbps() / ceiling,
                copy_gbps=ceiling,
                baseline_ms=baseline[0].ms if baseline and r.impl == "moetriton" else None,
            )
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
