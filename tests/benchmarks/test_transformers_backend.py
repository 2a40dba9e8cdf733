"""benchmarks.transformers_backend runs its CPU smoke rows and writes one results file."""

import csv

import pytest

pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

from benchmarks import transformers_backend


def test_smoke_run_writes_every_implementation(tmp_path):
    assert transformers_backend.main(["--tiny", "--models", "mixtral", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*/transformers_backend.csv")
    rows = list(csv.DictReader(path.open()))
    assert [row["impl"] for row in rows] == list(transformers_backend.IMPLS)
    assert all(float(row["step_ms"]) > 0 for row in rows)
