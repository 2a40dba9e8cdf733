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

    python -m benchmarks.report --plots docs/plots [--root benchmarks/results]

writes the headline comparisons as PNG plots instead (matplotlib, the `bench` extra): for every machine
folder with eager.csv, ops_<machine>.png (each op's graph GPU time against TransformerEngine's, per named
shape), and layer_step.png (the MoE layer step of both frameworks against the Megatron-style and
MaxText-style baselines, one panel per machine folder with moe_torch.csv or moe_jax.csv). docs/plots holds
the committed ones, which docs/performance.md shows.
"""

from __future__ import annotations

import argparse
import csv
import statistics
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
    """One row per implementation (with its layer variant unless plain) and shape: step ms, routing share,
    GEMM TFLOP/s, exchange rates."""
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
        variant = row.get("variant") or "plain"
        impl = row["impl"] if variant == "plain" else f"{row['impl']} ({variant})"
        out.append(f"| {impl} | {row['shape']} | {row['ep']} | {step} | {routing} | {tflops} | {a2a} |")
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


# The implementations of the layer-step plot, in the order of its bars: (framework, impl) -> label.
LAYER_IMPLS = {
    ("torch", "moetriton"): "PyTorch MoELayer",
    ("torch", "moetriton_a2a"): "PyTorch, exchange='all_to_all'",
    ("torch", "megatron"): "Megatron-style",
    ("jax", "moetriton"): "JAX moe",
    ("jax", "maxtext"): "MaxText-style",
}
LAYER_SHAPES = ("mixtral", "dsv3")
LAYER_FILES = ("moe_torch.csv", "moe_jax.csv")


def _versions(row: dict) -> str:
    return f"torch {row['torch']}, Triton {row['triton']}" + (f", JAX {row['jax']}" if row.get("jax") else "")


def _figure(width: float, height: float):
    """A matplotlib Figure drawn by the Agg canvas: no pyplot, no display, no global state."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, metadata={"Software": None})
    return path


def _legend(figure, labels: list[str], colours: list[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=colour, label=label) for label, colour in zip(labels, colours, strict=True)]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)


def plot_ops(rows: list[dict], path: Path) -> Path | None:
    """Graph GPU time of each op against TE's (te-triton; te-autograd for forward + backward), moetriton /
    TE per named shape, from one eager.csv; None when no op has both sides."""
    times = {
        (row["op"].removeprefix("e:"), row["impl"], row["shape"]): float(row["ms"])
        for row in rows
        if row["framework"] == "torch" and row["ms"]
    }
    ratios = {
        (op, shape): times[op, "moetriton", shape] / times[op, base, shape]
        for op, base in EAGER_OPS
        for shape in SHAPES
        if base.startswith("te-") and (op, "moetriton", shape) in times and (op, base, shape) in times
    }
    if not ratios:
        return None
    ops = [(op, base) for op, base in EAGER_OPS if any((op, shape) in ratios for shape in SHAPES)]
    shapes = [shape for shape in SHAPES if any((op, shape) in ratios for op, _ in ops)]
    figure = _figure(10, 4.2)
    axes = figure.subplots()
    width = 0.8 / len(shapes)
    for index, shape in enumerate(shapes):
        places = [number + (index - (len(shapes) - 1) / 2) * width for number in range(len(ops))]
        values = [ratios.get((op, shape), float("nan")) for op, _ in ops]
        axes.bar(places, values, width, color=f"C{index}")
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(ops)), [f"{op}\n({base})" for op, base in ops], fontsize=8)
    axes.set_ylabel("moetriton / TE, graph GPU time")
    axes.grid(axis="y", alpha=0.3)
    device = f"{rows[0]['device']}, {rows[0]['date']}, {_versions(rows[0])}"
    figure.suptitle(f"Each op against TransformerEngine's kernels (below 1: moetriton faster)\n{device}")
    _legend(figure, shapes, [f"C{index}" for index in range(len(shapes))])
    return _save(figure, path)


def _layer_steps(rows: list[dict], framework: str) -> dict[tuple[str, str], float | str]:
    """{(label, shape): median step ms, or why there is none} of a layer file's plain one-process rows."""
    steps: dict[tuple[str, str], list[float]] = {}
    failed: dict[tuple[str, str], str] = {}
    for row in rows:
        label = LAYER_IMPLS.get((framework, row["impl"]))
        plain = (row.get("variant") or "plain") == "plain" and (row.get("processes") or "1") == "1"
        if label is None or not plain:
            continue
        if row.get("step_ms"):
            steps.setdefault((label, row["shape"]), []).append(float(row["step_ms"]))
        elif error := (row.get("error") or row.get("note") or ""):
            failed[label, row["shape"]] = "out of memory" if "memory" in error.lower() else "failed"
    medians = {key: statistics.median(values) for key, values in steps.items()}
    return failed | medians


def plot_layer(machines: list[tuple[list[dict], list[dict]]], path: Path) -> Path | None:
    """The layer step (forward + backward) of every implementation per shape, one panel per machine:
    `machines` lists (moe_torch.csv rows, moe_jax.csv rows) per machine. None with nothing to plot."""
    panels = []
    for torch_rows, jax_rows in machines:
        steps = _layer_steps(torch_rows, "torch") | _layer_steps(jax_rows, "jax")
        if not steps:
            continue
        first = (torch_rows or jax_rows)[0]
        gpus = int(first.get("gpus") or 1)
        device = f"{gpus}x {first['device']}" if gpus > 1 else first["device"]
        dates = " / ".join(dict.fromkeys(rows[0]["date"] for rows in (torch_rows, jax_rows) if rows))
        versions = " / ".join(dict.fromkeys(_versions(rows[0]) for rows in (torch_rows, jax_rows) if rows))
        panels.append((f"{device}, EP = {first['ep']}, {dates}\n{versions}", steps))
    if not panels:
        return None
    columns = min(3, len(panels))
    lines = -(-len(panels) // columns)
    figure = _figure(4.6 * columns, 3.4 * lines + 0.8)
    grid = figure.subplots(lines, columns, squeeze=False)
    colours = {label: f"C{index}" for index, label in enumerate(LAYER_IMPLS.values())}
    for axes, (title, steps) in zip(grid.flat, panels, strict=False):
        labels = [label for label in LAYER_IMPLS.values() if any(key[0] == label for key in steps)]
        width = 0.8 / len(labels)
        for index, label in enumerate(labels):
            for number, shape in enumerate(LAYER_SHAPES):
                place = number + (index - (len(labels) - 1) / 2) * width
                step = steps.get((label, shape))
                if isinstance(step, str):
                    axes.text(place, 1, step, rotation=90, ha="center", va="bottom", fontsize=7)
                elif step is not None:
                    axes.bar(place, step, width, color=colours[label])
                    axes.text(place, step, f"{step:.1f}", ha="center", va="bottom", fontsize=6)
        axes.set_xticks(range(len(LAYER_SHAPES)), LAYER_SHAPES)
        axes.set_xlim(-0.5, len(LAYER_SHAPES) - 0.5)
        axes.set_ylabel("step ms")
        axes.set_title(title, fontsize=8)
        axes.grid(axis="y", alpha=0.3)
    for axes in list(grid.flat)[len(panels) :]:
        axes.set_visible(False)
    figure.suptitle("The MoE layer step, forward + backward, against the baselines (bf16, dropless)")
    shown = [label for label in LAYER_IMPLS.values() if any(key[0] == label for _, s in panels for key in s)]
    _legend(figure, shown, [colours[label] for label in shown])
    return _save(figure, path)


def _gpu_count(machine: str) -> int:
    """The GPU count of a machine folder's name (`2x_NVIDIA_H200`: 2; `NVIDIA_H200`: 1)."""
    head = machine.split("_", 1)[0]
    return int(head[:-1]) if head.endswith("x") and head[:-1].isdigit() else 1


def plots(root: Path, out: Path) -> list[Path]:
    """Every plot the results under `root` give, written into `out`: ops_<machine>.png per machine folder
    with eager.csv, and layer_step.png (machines by GPU count). Returns the paths written."""
    machines = sorted(path for path in root.iterdir() if path.is_dir())
    written = [
        plot_ops(_read(machine / "eager.csv"), out / f"ops_{machine.name}.png")
        for machine in machines
        if (machine / "eager.csv").is_file()
    ]
    layer = [
        tuple(_read(machine / name) if (machine / name).is_file() else [] for name in LAYER_FILES)
        for machine in sorted(machines, key=lambda path: (_gpu_count(path.name), path.name))
    ]
    written.append(plot_layer(layer, out / "layer_step.png"))
    return [path for path in written if path is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=RESULTS_ROOT)
    parser.add_argument("--tables", default="eager,moe,gemm,jax,router")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write the plots into DIR, not the tables")
    args = parser.parse_args(argv)
    if args.plots is not None:
        for path in plots(args.root, args.plots):
            print(f"wrote {path}")
        return 0
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
