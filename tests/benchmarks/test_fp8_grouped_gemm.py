"""benchmarks.fp8_grouped_gemm --tiny: every quantization and product of both recipes runs (interpreted on
CPU, compiled on a GPU) and the results file has one row per projection and recipe, every time a positive
number."""

import csv

from benchmarks import fp8_grouped_gemm


def test_tiny_run_writes_every_row(tmp_path):
    assert fp8_grouped_gemm.main(["--tiny", "--out", str(tmp_path)]) == 0
    (results,) = tmp_path.glob("*/fp8_grouped_gemm.csv")  # the device's folder
    rows = list(csv.DictReader(results.open()))
    assert [(row["gemm"], row["recipe"]) for row in rows] == [
        (gemm, recipe) for gemm in ("gate_up", "down") for recipe in ("tensorwise", "blockwise")
    ]
    for row in rows:
        times = [name for name in row if name.endswith("_ms")]
        assert len(times) == 6 and all(float(row[name]) > 0 for name in times), row
