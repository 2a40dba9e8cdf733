"""Markdown tables of the recorded results (benchmarks/results), as docs/performance.md and docs/moe.md show
them.

    python -m benchmarks.report [--root benchmarks/results] [--tables eager,moe,gemm,jax,router,scaling]

Prints, for every machine folder that has the file a table needs: the eager benchmark (eager.csv) as three
tables, graph GPU time, eager wall time and host time per call, moetriton against TransformerEngine's
Triton kernels (te-triton; te-autograd for the forward + backward rows) and eager torch for the router;
the MoE layer steps (moe_torch.csv, moe_jax.csv); the grouped GEMMs (grouped_gemm.csv); the JAX ops
(jax.csv); the router grid (router_grid.csv); the weak scaling of the layer step over the EP sizes
of one run (every moe_torch.csv and moe_jax.csv under the root). Each table is headed by its device, date
and versions. Reads CSVs only: runs anywhere.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from .common import RESULTS_ROOT

SHAPES = ("mixtral", "qwen3", "dsv3", "small", "tiny")
EAGER_OPS = (
    ("dispatch", "te-triton"),
    ("dispatch_bwd", "te-triton"),
    ("dispatch_fwd_bwd", "te-autograd"),
    ("combine", "te-triton"),
    ("combine_bwd", "te-triton"),
    ("combine_fwd_bwd", "te-autograd"),
    ("chunk_sort", "te-triton"),
    ("router_topk", "torch-eager"),
    ("router_fwd_bwd", "torch-eager"),
)


def _read(path: Path) -> list[dict]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def _heading(rows: list[dict], what: str) -> str:
    row = rows[0]
    versions = f"torch {row['torch']}, Triton {row['triton']}"
    if row.get("jax"):
        versions += f", JAX {row['jax']}"
    gpus = int(row.get("gpus") or 1)
    device = f"{gpus}x {row['device']}" if gpus > 1 else row["device"]
    return f"{what}: {device}, {row['date']}, {versions}, commit {row['commit']}"


def eager(rows: list[dict]) -> str:
    """Graph, eager and host µs per call of the PyTorch calls: moetriton / baseline (ratio)."""
    index = {
        (row["op"].removeprefix("e:"), row["impl"], row["shape"]): row
        for row in rows
        if row["framework"] == "torch"
    }
    if not any(impl == "moetriton" for _, impl, _ in index):
        return ""
    out = [_heading(rows, "Eager benchmark (benchmarks.eager_cases)"), ""]
    for title, column, scale in (
        ("graph GPU µs per call (% of the copy ceiling): moetriton / baseline (ratio)", "ms", 1e3),
        ("eager wall µs per call, 200 calls, one sync: moetriton / baseline (ratio)", "eager_ms", 1e3),
        ("host µs to issue one call: moetriton / baseline (ratio)", "host_ms", 1e3),
    ):
        out += [f"**{title}**", "", "| op (baseline) | " + " | ".join(SHAPES) + " |", "|---" * 6 + "|"]
        for op, baseline in EAGER_OPS:
            cells = []
            for shape in SHAPES:
                ours, theirs = index.get((op, "moetriton", shape)), index.get((op, baseline, shape))
                if not ours or not theirs or not ours[column] or not theirs[column]:
                    cells.append("-")
                    continue
                a, b = float(ours[column]) * scale, float(theirs[column]) * scale
                ceiling = f" ({float(ours['ceiling_pct']):.0f}%)" if column == "ms" else ""
                cells.append(f"{a:.1f}{ceiling} / {b:.1f} ({a / b:.2f})")
            out.append(f"| {op} ({baseline}) | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def moe(rows: list[dict], framework: str) -> str:
    """One row per implementation and shape: step ms, routing share, GEMM TFLOP/s, exchange rates."""
    out = [_heading(rows, f"MoE layer step, {framework} (benchmarks.moe_{framework})"), ""]
    out += [
        "| impl | shape | EP | step ms | routing share | GEMM TFLOP/s | all-to-all / plain GB/s |",
        "|---" * 7 + "|",
    ]
    for row in rows:
        if framework == "torch":
            routing, tflops = row.get("routing_share_pct"), row.get("gemm_tflops")
            routing = f"{float(routing):.1f}%" if routing else "-"
            a2a = (
                f"{float(row['a2a_gbps']):.0f} / {float(row['plain_a2a_gbps']):.0f}"
                if row.get("a2a_gbps") and row.get("plain_a2a_gbps")
                else "-"
            )
        else:
            routing = f"{100 * float(row['routing_share']):.1f}%" if row.get("routing_share") else "-"
            tflops = row.get("gemm_tflops")
            a2a = (
                f"{float(row['a2a_gbps']):.0f} / {float(row['plain_a2a_gbps']):.0f}"
                if row.get("a2a_gbps")
                else "-"
            )
        step = (
            f"{float(row['step_ms']):.2f}"
            if row.get("step_ms")
            else ("out of memory" if "memory" in (row.get("error") or row.get("note") or "").lower() else "-")
        )
        tflops = f"{float(tflops):.0f}" if tflops else "-"
        out.append(
            f"| {row['impl']} | {row['shape']} | {row['ep']} | {step} | {routing} | {tflops} | {a2a} |"
        )
    return "\n".join(out) + "\n"


def scaling(rows: list[dict]) -> str:
    """Weak scaling of the layer step: every EP measured in one run (same device and commit; the tokens per
    GPU stay fixed), efficiency = step at EP = 1 / step at EP = N, with the exchange's share of the step
    (none of it overlapped), the routing share and the exchange rate against a plain all-to-all."""
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("step_ms"):
            runs.setdefault((row["device"], row["commit"], row["date"]), []).append(row)
    out = []
    for run_rows in runs.values():
        if len({row["ep"] for row in run_rows}) < 2:
            continue
        widest = max(run_rows, key=lambda row: int(row.get("gpus") or 1))
        out += [_heading([widest], "Weak scaling of the MoE layer step (benchmarks.moe_torch, moe_jax)"), ""]
        out += [
            "| framework | impl | shape | EP | step ms | efficiency | exchange share | routing share "
            "| all-to-all / plain GB/s | staging MiB |",
            "|---" * 10 + "|",
        ]
        single = {
            (row["framework"], row["impl"], row["shape"]): float(row["step_ms"])
            for row in run_rows
            if row["ep"] == "1"
        }
        for row in sorted(run_rows, key=lambda r: (r["framework"], r["shape"], r["impl"], int(r["ep"]))):
            step = float(row["step_ms"])
            base = single.get((row["framework"], row["impl"], row["shape"]))
            efficiency = f"{100 * base / step:.1f}%" if base else "-"
            if row["framework"] == "torch":
                exchange = row.get("all_to_all_share_pct")
                routing = row.get("routing_share_pct")
            else:
                exchange = row.get("all_to_all_share") and 100 * float(row["all_to_all_share"])
                routing = row.get("routing_share") and 100 * float(row["routing_share"])
            exchange = f"{float(exchange):.1f}%" if exchange not in (None, "") and row["ep"] != "1" else "-"
            routing = f"{float(routing):.1f}%" if routing not in (None, "") else "-"
            rate = (
                f"{float(row['a2a_gbps']):.0f} / {float(row['plain_a2a_gbps']):.0f}"
                if row.get("a2a_gbps") and row.get("plain_a2a_gbps")
                else "-"
            )
            out.append(
                f"| {row['framework']} | {row['impl']} | {row['shape']} | {row['ep']} | {step:.2f} | "
                f"{efficiency} | {exchange} | {routing} | {rate} | {row.get('staging_mib') or '-'} |"
            )
        out.append("")
    return "\n".join(out)


def gemm(rows: list[dict]) -> str:
    out = [_heading(rows, "Grouped GEMM (benchmarks.grouped_gemm), TFLOP/s"), ""]
    out += ["| shape | GEMM | product | moetriton | torch._grouped_mm |", "|---" * 5 + "|"]
    for row in rows:
        out.append(
            f"| {row['shape']} | {row['gemm']} | {row['kind']} | {float(row['tflops']):.0f} "
            f"| {float(row['cutlass_tflops']):.0f} |"
        )
    return "\n".join(out) + "\n"


def jax_ops(rows: list[dict]) -> str:
    index = {(row["op"], row["impl"], row["shape"]): row for row in rows}
    ops = sorted({row["op"] for row in rows if row["impl"] == "moetriton"})
    out = [
        _heading(rows, "JAX ops (benchmarks.jax_cases), steady-state GPU µs per call: moetriton / baseline")
    ]
    out += ["", "| op | " + " | ".join(SHAPES[:4]) + " |", "|---" * 5 + "|"]
    for op in ops:
        cells = []
        for shape in SHAPES[:4]:
            ours = index.get((op, "moetriton", shape))
            base = next(
                (index[key] for key in index if key[0] == op and key[2] == shape and key[1] != "moetriton"),
                None,
            )
            if not ours:
                cells.append("-")
                continue
            cell = f"{float(ours['ms']) * 1e3:.1f}"
            cells.append(cell + (f" / {float(base['ms']) * 1e3:.1f}" if base else ""))
        out.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def router(rows: list[dict]) -> str:
    index = {(row["op"], row["framework"], row["impl"], row["case"]): float(row["ms"]) * 1e3 for row in rows}
    cases = list(dict.fromkeys(row["case"] for row in rows))
    out = [_heading(rows, "Router (benchmarks.router_cases), µs: moetriton / reference")]
    out += ["", "| case | torch fwd | torch bwd | jax fwd | jax bwd |", "|---" * 5 + "|"]
    for case in cases:
        cells = []
        for framework in ("torch", "jax"):
            for op in ("topk_fwd", "topk_bwd"):
                ours = index.get((op, framework, "moetriton", case))
                ref = next(
                    (
                        v
                        for (o, f, i, c), v in index.items()
                        if (o, f, c) == (op, framework, case) and i != "moetriton"
                    ),
                    None,
                )
                cells.append("-" if ours is None else f"{ours:.1f}" + (f" / {ref:.1f}" if ref else ""))
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=RESULTS_ROOT)
    parser.add_argument("--tables", default="eager,moe,gemm,jax,router")
    args = parser.parse_args(argv)
    wanted = set(args.tables.split(","))
    if "scaling" in wanted:
        layer_rows = [
            {**row, "framework": path.stem.removeprefix("moe_")}
            for pattern in ("moe_torch.csv", "moe_jax.csv")
            for path in sorted(args.root.glob(f"*/{pattern}"))
            for row in _read(path)
        ]
        print(scaling(layer_rows))
    for machine in sorted(path for path in args.root.iterdir() if path.is_dir()):
        for name, table, render in (
            ("eager.csv", "eager", eager),
            ("moe_torch.csv", "moe", lambda rows: moe(rows, "torch")),
            ("moe_jax.csv", "moe", lambda rows: moe(rows, "jax")),
            ("grouped_gemm.csv", "gemm", gemm),
            ("jax.csv", "jax", jax_ops),
            ("router_grid.csv", "router", router),
        ):
            path = machine / name
            if table in wanted and path.is_file() and (rows := _read(path)):
                print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
