"""The runner of TransformerEngine's PyTorch permutation test (scripts/te_torch_tests.sh) and its stand-ins
(tests/te_torch), without TE's files: the script refuses clearly when they are absent, runs a small test
file of ours that imports what TE's imports through the stand-ins, and the stand-ins' own helpers agree
with an independent reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "te_torch_tests.sh"

# What TE's test file imports, as it imports it, and one small case of each kind the runner reports: a pass
# (moe_permute / moe_unpermute on "cuda" tensors against a hand-built expected result), an FP8 skip, and a
# failure (so the exit status is seen to be pytest's).
_TE_LIKE_TEST = """
import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import (
    moe_permute as te_permute,
    moe_permute_with_probs,
    moe_permute_and_pad_with_probs,
    moe_unpermute as te_unpermute,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
)
from transformer_engine.pytorch import (
    Float8Quantizer,
    Float8CurrentScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
)
from transformer_engine.pytorch import Fp8Padding, Fp8Unpadding

fp8_available, reason_for_no_fp8 = te.is_fp8_available(return_reason=True)


def test_round_trip_on_cuda_tensors():
    x = torch.arange(12.0).reshape(4, 3).cuda()
    mask = torch.tensor([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=torch.bool).cuda()
    out, row_id_map = te_permute(x, mask, num_out_tokens=4, map_type="mask")
    assert torch.equal(out, x[[0, 1, 1, 2]])
    back = te_unpermute(out, row_id_map, restore_shape=x.shape, map_type="mask")
    assert torch.equal(back, x * torch.tensor([[1.0], [2.0], [1.0], [0.0]], device=back.device))
    assert te.DType.kBFloat16 != te.DType.kFloat16 and recipe.MXFP8BlockScaling().mxfp8()


@pytest.mark.skipif(not fp8_available, reason=reason_for_no_fp8)
def test_fp8():
    Float8Quantizer()


def test_fails():
    assert te.is_fp8_available()
"""


def _run(te_tests: Path, dest: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TE_TESTS": str(te_tests), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), str(dest)], env=env, capture_output=True, text=True, timeout=600
    )


def test_runner_refuses_without_te_files(tmp_path):
    result = _run(tmp_path / "absent", tmp_path / "out")
    assert result.returncode == 2
    assert "test_permutation.py not found" in result.stderr and "fetch_te_tests.sh" in result.stderr
    assert not (tmp_path / "out" / "te_torch_junit.xml").exists()


def test_runner_runs_a_te_like_file_through_the_stand_ins(tmp_path):
    te_tests = tmp_path / "te"
    te_tests.mkdir()
    (te_tests / "test_permutation.py").write_text(_TE_LIKE_TEST)
    result = _run(te_tests, tmp_path / "out")
    log = (tmp_path / "out" / "te_torch.log").read_text()
    assert result.returncode == 1, log  # pytest's status: one test fails
    outcomes = {}
    for case in ElementTree.parse(tmp_path / "out" / "te_torch_junit.xml").iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    assert outcomes == {
        "test_round_trip_on_cuda_tensors": "passed",
        "test_fp8": "skipped",
        "test_fails": "failure",
    }, log
    assert "moetriton has no TE quantizers" in log  # the skip reason, from -rs


def _stand_in(name: str):
    spec = importlib.util.spec_from_file_location(
        f"te_torch_{name}", REPO / "tests" / "te_torch" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stand_ins_bind_moetriton_and_answer_honestly():
    import moetriton.torch as mt

    te = _stand_in("te_pytorch")
    for name in [n for n in te.__all__ if n.startswith("moe_")]:
        assert getattr(te, name) is getattr(mt, name)
    for check in (te.is_fp8_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available):
        assert check() is False and check(return_reason=True) == (False, te.NO_TE_FP8_TENSORS)
    assert te.is_bf16_available(return_reason=True) == (True, "")
    recipe = _stand_in("te_recipe")
    kinds = [
        [r.delayed(), r.float8_current_scaling(), r.float8_block_scaling(), r.mxfp8()]
        for r in (
            recipe.DelayedScaling(),
            recipe.Float8CurrentScaling(),
            recipe.Float8BlockScaling(),
            recipe.MXFP8BlockScaling(),
        )
    ]
    assert kinds == [[i == j for j in range(4)] for i in range(4)]
    with pytest.raises(pytest.skip.Exception, match="no TE quantizers"):
        te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E4M3, rowwise=True, columnwise=False)


def test_fp8_padding_stand_ins_against_explicit_rows():
    te = _stand_in("te_pytorch")
    splits = [3, 0, 5, 4]
    x = torch.randn(sum(splits), 2, requires_grad=True)
    padded, padded_splits = te.Fp8Padding(4, 4)(x, splits)
    assert padded_splits == [4, 0, 8, 4]
    zero = torch.zeros(1, 2)
    expected = torch.cat([x[0:3], zero, x[3:8], zero.expand(3, 2), x[8:12]])
    assert torch.equal(padded, expected)
    grad = torch.randn_like(padded)
    padded.backward(grad)
    assert torch.equal(x.grad, grad[[0, 1, 2, 4, 5, 6, 7, 8, 12, 13, 14, 15]])
    assert torch.equal(te.Fp8Unpadding(4, 4)(padded, splits), x)
    aligned = torch.randn(8, 2)
    assert te.Fp8Padding(2, 4)(aligned, [4, 4])[0] is aligned
    assert te.Fp8Unpadding(2, 4)(aligned, [4, 4]) is aligned
    with pytest.raises(ValueError, match="expected 2 splits"):
        te.Fp8Padding(2, 4)(aligned, [8])
    with pytest.raises(ValueError, match="align_size: required"):
        te.Fp8Unpadding(2)(aligned, [4, 4])
