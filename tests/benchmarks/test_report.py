"""benchmarks.report: the tables and the plots of docs/performance.md come from the committed results files.

The plots are regenerated from benchmarks/results and compared with docs/plots by name (never by pixels):
the same files, each a PNG that matplotlib wrote, and every one shown in docs/performance.md. The tables
print from the same files without matplotlib.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.common import RESULTS_ROOT

ROOT = Path(__file__).resolve().parents[2]
PLOTS = ROOT / "docs" / "plots"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after the signature, the chunk length and type)."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path.name} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_the_plots_regenerate_from_the_results_files(tmp_path: Path, capsys):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    assert report.main(["--plots", str(tmp_path)]) == 0
    written = sorted(path.name for path in tmp_path.iterdir())
    machines_with_ops = sorted(f"ops_{path.parent.name}.png" for path in RESULTS_ROOT.glob("*/eager.csv"))
    assert written == sorted([*machines_with_ops, "layer_step.png"])
    assert written == sorted(path.name for path in PLOTS.glob("*.png")), (
        "docs/plots differs from what `python -m benchmarks.report --plots docs/plots` writes: rerun it"
    )
    for name in written:
        width, height = _png_size(tmp_path / name)
        assert width > 500 and height > 300, (name, width, height)
    assert capsys.readouterr().out.count("wrote ") == len(written)


def test_performance_md_shows_every_plot():
    text = (ROOT / "docs" / "performance.md").read_text()
    shown = set(re.findall(r"!\[[^\]]*\]\(plots/([^)]+\.png)\)", text))
    assert shown == {path.name for path in PLOTS.glob("*.png")}


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_plots_of_partial_results(tmp_path: Path):
    """A machine whose eager file has no TE rows gets no op plot; a layer row that ran out of memory, one of
    another variant and a machine with no layer file leave the layer plot to the rest."""
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench extra)")
    head = dict(device="GPU X", gpus="1", date="2026-01-01", commit="0", torch="2.13", triton="3.9", jax="")
    _write(
        tmp_path / "results" / "GPU_X" / "eager.csv",
        [head | dict(op="e:dispatch", framework="torch", impl="moetriton", shape="tiny", ms="0.01")],
    )
    layer = [
        head | dict(impl="moetriton", variant="plain", shape="mixtral", ep="1", step_ms="50.0", error=""),
        head | dict(impl="moetriton", variant="shared", shape="mixtral", ep="1", step_ms="70.0", error=""),
        head | dict(impl="megatron", variant="plain", shape="dsv3", ep="1", step_ms="", error="no memory"),
    ]
    _write(tmp_path / "results" / "GPU_X" / "moe_torch.csv", layer)
    (tmp_path / "results" / "GPU_Y").mkdir()
    written = report.plots(tmp_path / "results", tmp_path / "plots")
    assert [path.name for path in written] == ["layer_step.png"]
    steps = report._layer_steps(layer, "torch")
    assert steps == {("PyTorch MoELayer", "mixtral"): 50.0, ("Megatron-style", "dsv3"): "out of memory"}


def test_the_tables_print_without_matplotlib():
    code = (
        "import sys\n"
        "from benchmarks import report\n"
        "report.main(['--tables', 'eager,moe,gemm,jax,router,scaling'])\n"
        "assert 'matplotlib' not in sys.modules, 'the tables imported matplotlib'\n"
    )
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| op (baseline) |" in result.stdout and "Weak scaling" in result.stdout
