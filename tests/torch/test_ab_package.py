"""benchmarks.ab_package: this checkout against a copy of its last commit, in one process, with the fewest
calls (on CPU under the Triton interpreter, which conftest sets), with the kernels run and stubbed out."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.strategies_router import interpreted_kernels_problem

ROOT = Path(__file__).resolve().parents[2]
#: The ops the A/B must cover, at least.
OPS = {"dispatch", "dispatch_bwd", "combine", "combine_bwd", "chunk_sort", "router_topk", "router_fwd_bwd"}


@pytest.mark.parametrize(
    "stub, package_root",
    [(False, True), (True, True), (True, False)],
    ids=["kernels", "stubbed", "stubbed-baseline-without-package-root"],
)
def test_ab_package_times_both_versions_of_every_op(tmp_path, stub, package_root):
    """package_root=False: a baseline from before moetriton/__init__.py existed, whose folder of links must
    not lose to the checkout's regular package in the working directory."""
    # The stubbed host path runs on CPU tensors under the interpreter, on a GPU machine too.
    env = dict(os.environ, TRITON_INTERPRET="1") if stub else os.environ
    if stub and (problem := interpreted_kernels_problem()):
        pytest.skip(problem)
    archive = subprocess.run(
        ["git", "archive", "HEAD"],
        cwd=ROOT,
        capture_output=True,
    )
    if archive.returncode:
        pytest.skip(f"no git checkout to take a baseline from: {archive.stderr.decode()[:200]}")
    baseline = tmp_path / "baseline"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(baseline, filter="data")
    if not package_root:
        (baseline / "moetriton" / "__init__.py").unlink()
    out = tmp_path / "ab.csv"
    command = [sys.executable, "-m", "benchmarks.ab_package", str(baseline), "--shapes", "16x32x8x2"]
    command += ["--rounds", "1", "--smoke", "--out", str(out)] + (["--stub-kernels"] if stub else [])
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    ops = [row["op"] for row in rows]
    assert len(ops) == len(set(ops)) and set(ops) >= OPS, ops
    for row in rows:
        assert row["kernels"] == ("stubbed" if stub else "run"), row
        for column in ("baseline_host_us", "candidate_host_us", "baseline_eager_us", "candidate_eager_us"):
            assert float(row[column]) > 0, (column, row)
        # Each version's moetriton.torch came from its own checkout.
        assert Path(row["baseline_torch_file"]).is_relative_to(baseline.resolve()), row
        assert Path(row["candidate_torch_file"]) == ROOT / "torch_bindings" / "__init__.py", row
    assert "# baseline: moetriton.torch from " + str(baseline.resolve()) in result.stdout
