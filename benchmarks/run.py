"""Benchmark runner: every op, framework and named shape in one table.

    python -m benchmarks.run [--shapes mixtral,qwen3,dsv3,small,tiny] [--modules ...] [--quick] [--out DIR]

Prints ms, GB/s, % of the measured device-to-device copy bandwidth (read + write), the baseline's time and
the speedup, and TransformerEngine's H100 times where DEVELOPERS.md records them; writes results.json,
results.csv and a PNG of % of ceiling per op and shape into --out. The eager module
(benchmarks.eager_cases) adds, per op and implementation (TE's Triton kernels where importable), the host
time per call and the eager wall time per call beside the graph time; `--modules benchmarks.eager_cases`
runs it alone.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import traceback
from pathlib import Path

from moetriton.kernels.shapes import NAMED_SHAPES

# TransformerEngine's Triton kernels on the H100 (bf16, ms), as recorded in DEVELOPERS.md. TE's dispatch is
# its row-map build plus permute-with-probs; the other ops are single kernels.
TE_H100_MS = {
    ("row_map", "mixtral"): 0.09,
    ("row_map", "qwen3"): 0.17,
    ("row_map", "dsv3"): 0.23,
    ("permute", "mixtral"): 0.143,
    ("permute", "qwen3"): 0.233,
    ("permute", "dsv3"): 0.399,
    ("dispatch", "mixtral"): 0.09 + 0.143,
    ("dispatch", "qwen3"): 0.17 + 0.233,
    ("dispatch", "dsv3"): 0.23 + 0.399,
    ("combine", "mixtral"): 0.140,
    ("combine", "qwen3"): 0.217,
    ("combine", "dsv3"): 0.376,
    ("combine_bwd", "mixtral"): 0.248,
    ("combine_bwd", "qwen3"): 0.424,
    ("combine_bwd", "dsv3"): 0.819,
    ("chunk_sort", "mixtral"): 0.208,
    ("chunk_sort", "qwen3"): 0.559,
    ("chunk_sort", "dsv3"): 0.786,
}

# Implementations that are moetriton's baseline (TE's rows are reported beside it, not as a baseline).
BASELINES = ("torch-ref", "torch-eager", "jax-ref", "jax-argsort")
CASE_MODULES = (
    "benchmarks.torch_cases",
    "benchmarks.jax_cases",
    "benchmarks.router_cases",
    "benchmarks.eager_cases",
)


def _versions() -> dict:
    """Installed versions, read from package metadata: importing jax_triton would empty TRITON_CACHE_DIR."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "triton", "jax", "jaxlib", "jax-triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["impl"] == "moetriton" and r["ceiling_pct"] is not None]
    if not ours:
        return
    labels = sorted({(r["op"], r["framework"]) for r in ours})
    shapes = sorted({r["shape"] for r in ours})
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels)), 4.5))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        values = [
            next(
                (
                    r["ceiling_pct"]
                    for r in ours
                    if (r["op"], r["framework"]) == label and r["shape"] == shape
                ),
                0,
            )
            for label in labels
        ]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=shape)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(labels))], [f"{op}\n{fw}" for op, fw in labels], fontsize=8
    )
    ax.set_ylabel("% of copy bandwidth")
    ax.set_title("moetriton: achieved bandwidth / measured device copy bandwidth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(NAMED_SHAPES))
    parser.add_argument("--modules", default=",".join(CASE_MODULES))
    parser.add_argument("--quick", action="store_true", help="skip the slow baselines")
    parser.add_argument("--out", default="benchmark-results")
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
    print(f"device {device}, copy bandwidth {ceiling:.0f} GB/s (read + write), versions {_versions()}")
    results = []
    for module_name in args.modules.split(","):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            print(f"skipping {module_name}: {error}")
            continue
        for shape_name in args.shapes.split(","):
            try:
                results += module.results(NAMED_SHAPES[shape_name], args.quick)
            except Exception:  # one failing case module must not hide the others' numbers
                print(f"{module_name} {shape_name} failed:\n{traceback.format_exc()}", file=sys.stderr)
    rows = []
    for r in results:
        baseline = [
            b
            for b in results
            if (b.op, b.framework, b.shape) == (r.op, r.framework, r.shape) and b.impl in BASELINES
        ]
        te_ms = TE_H100_MS.get((r.op, r.shape))
        rows.append(
            dict(
                r.as_dict(),
                gbps=r.gbps(),
                ceiling_pct=100 * r.gbps() / ceiling,
                baseline_ms=baseline[0].ms if baseline and r.impl == "moetriton" else None,
                te_ms=te_ms if r.impl == "moetriton" else None,
            )
        )
    header = (
        f"{'op':<17}{'fw':<6}{'impl':<12}{'shape':<9}{'ms':>9}{'GB/s':>8}{'%ceil':>7}"
        f"{'base ms':>9}{'speedup':>8}{'TE ms':>7}{'host ms':>9}{'eager ms':>9}  note"
    )
    print(header)
    for row in rows:
        speedup = row["baseline_ms"] / row["ms"] if row["baseline_ms"] else None
        print(
            f"{row['op']:<17}{row['framework']:<6}{row['impl']:<12}{row['shape']:<9}{row['ms']:>9.4f}"
            f"{row['gbps']:>8.0f}{row['ceiling_pct']:>7.1f}"
            f"{row['baseline_ms'] or 0:>9.3f}{speedup or 0:>8.1f}{row['te_ms'] or 0:>7.3f}"
            f"{row['host_ms'] or 0:>9.4f}{row['eager_ms'] or 0:>9.4f}  {row['note']}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device, copy_gbps=ceiling, versions=_versions())
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, out / "bandwidth.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
