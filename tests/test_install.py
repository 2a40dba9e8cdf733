"""moetriton installed as users install it: the sdist and the wheel built from the checkout, each wheel (the
one built from the checkout and the one built from the sdist) installed non-editable into a fresh virtual
environment, then used from outside the checkout.

The environment borrows the suite's torch, JAX, Flax and Triton (a .pth line naming this interpreter's
site-packages, after the environment's own) instead of installing them again: only moetriton is installed
into it, and `pip check` must find its requirements met. In it, from a folder outside the checkout, one op
of every family and both MoE layers run under the Triton interpreter against the references the wheel
ships, the README's snippets run, and the installed files must equal the tree's modules and autotune caches
byte for byte, so a module, subpackage or cache the wheel leaves out fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

from tests.strategies_router import skip_unless_interpreter_runs
from tests.test_docs import blocks

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
VERSION = PYPROJECT["project"]["version"]

# Runs inside the fresh environment, from a folder outside the checkout.
CHECK = r"""
import importlib.metadata, json, pathlib, sys

import numpy as np

import moetriton
import moetriton.jax as mj
import moetriton.torch as mt
from moetriton.jax.moe import flax as flax_module  # the Flax Linen module

site = pathlib.Path(sys.argv[1]).resolve()
for module in (moetriton, mt, mj, flax_module):
    path = pathlib.Path(module.__file__).resolve()
    assert path.is_relative_to(site), f"{module.__name__} imported from {path}, not from {site}"
assert moetriton.__version__ == importlib.metadata.version("moetriton") == sys.argv[2], moetriton.__version__

import jax
import jax.numpy as jnp
import torch

from moetriton.torch import reference, reference_router

torch.manual_seed(0)
T, H, E, K = 12, 16, 4, 2
x = torch.randn(T, H)
logits = torch.randn(T, E)

# router family: top-k and the aux loss, against the reference router
probs, routing_map = mt.fused_topk_with_score_function(logits, K)
ref_probs, ref_map = reference_router.fused_topk_with_score_function(logits, K)
torch.testing.assert_close(probs, ref_probs)
assert torch.equal(routing_map, ref_map)
routed = routing_map.sum(0)
loss = mt.fused_moe_aux_loss(probs, routed, T, E, K, 1e-2)
ref_loss = reference_router.fused_moe_aux_loss(probs, routed, T, E, K, 1e-2)
torch.testing.assert_close(loss, ref_loss)

# permutation family: dispatch and combine, against the reference
out, _, row_id_map, pad_offsets, _ = mt.token_dispatch(x, routing_map, T * K, probs=probs, align_size=4)
ref = reference.token_dispatch(x, routing_map, T * K, probs=probs, align_size=4)
assert torch.equal(out, ref[0]) and torch.equal(row_id_map, ref[2])
y = mt.token_combine(out, row_id_map, merging_probs=probs, pad_offsets=pad_offsets)
torch.testing.assert_close(y, reference.token_combine(out, row_id_map, probs, pad_offsets))

# chunk sort family
split_sizes = torch.tensor([3, 0, 5, 4])
order = torch.tensor([2, 0, 3, 1])
sorted_rows, _ = mt.sort_chunks_by_index(x, split_sizes, order)
assert torch.equal(sorted_rows, reference.sort_chunks_by_index(x, split_sizes, order)[0])

# grouped GEMM and activation families (JAX), against ragged_dot and the formula
rows = jnp.asarray(np.random.default_rng(0).standard_normal((T, H)), jnp.float32)
weights = jnp.asarray(np.random.default_rng(1).standard_normal((E, H, 2 * H)), jnp.float32)
sizes = jnp.array([3, 0, 5, 4], jnp.int32)
hidden = mj.grouped_matmul(rows, weights, sizes)
expected = jax.lax.ragged_dot(rows, weights, sizes, precision=jax.lax.Precision.HIGHEST)
np.testing.assert_allclose(hidden, expected, rtol=1e-5, atol=1e-4)
act = mj.grouped_activation(hidden, sizes, "swiglu")[:12]  # the rows of the groups (all 12 here)
np.testing.assert_allclose(act, jax.nn.silu(hidden[:, :H]) * hidden[:, H:], rtol=1e-5, atol=1e-5)

# both MoE layers, forward and backward, against the dense references
from moetriton.jax.reference_moe import moe_reference as jax_reference
from moetriton.torch.reference_moe import moe_reference as torch_reference

F = 8
gate = torch.randn(E, H) / 4
gate_up = torch.randn(E, H, 2 * F) / 4
down = torch.randn(E, F, H) / 4
layer_x = x.clone().requires_grad_()
out, aux, dropped = mt.moe(layer_x, gate, gate_up, down, topk=K, aux_loss_coeff=1e-2)
ref_out, ref_aux, _ = torch_reference(x, gate, gate_up, down, topk=K, aux_loss_coeff=1e-2)
torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
torch.testing.assert_close(aux, ref_aux)
(out.square().sum() + aux).backward()
assert layer_x.grad is not None and torch.isfinite(layer_x.grad).all()
# JAX's router weight is [H, E] (Flax's kernel layout), PyTorch's [E, H] (nn.Linear's)
arrays = [jnp.asarray(value.numpy()) for value in (x.reshape(2, T // 2, H), gate.T, gate_up, down)]
jax_out, jax_aux, _ = mj.moe(*arrays, topk=K, aux_loss_coeff=1e-2)
ref_out, ref_aux, _ = jax_reference(*arrays, topk=K, aux_loss_coeff=1e-2)
np.testing.assert_allclose(jax_out, ref_out.reshape(jax_out.shape), rtol=1e-4, atol=1e-4)
np.testing.assert_allclose(jax_aux, ref_aux, rtol=1e-5)
print(json.dumps({"ok": True}))
"""


def _checkout_files() -> list[str]:
    """The checkout's files, relative to it: tracked ones and new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _tree_files() -> dict[str, Path]:
    """What the wheel must hold: {path inside site-packages: source file}, every Python module under the
    folders package-dir maps (they do not nest) and every autotune cache."""
    expected: dict[str, Path] = {}
    for name in _checkout_files():
        path = Path(name)
        for package, folder in PACKAGE_DIR.items():
            if not path.is_relative_to(folder):
                continue
            shipped = path.suffix == ".py" or (
                package == "moetriton.autotune_cache" and path.suffix == ".json"
            )
            if shipped:
                expected["/".join([*package.split("."), *path.relative_to(folder).parts])] = ROOT / path
    return expected


def _installed_files(site: Path) -> dict[str, Path]:
    """{path inside site-packages: file} of every moetriton file the install wrote (its RECORD)."""
    (dist_info,) = site.glob("moetriton-*.dist-info")
    installed = {}
    for line in (dist_info / "RECORD").read_text().splitlines():
        path = line.rsplit(",", 2)[0]
        if path.startswith("moetriton/") and "__pycache__" not in path:
            installed[path] = site / path
    return installed


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"checkout": the wheel built from a copy of the checkout, "sdist": the wheel built from its sdist}."""
    work = tmp_path_factory.mktemp("build")
    source = work / "source"
    for name in _checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    build = [sys.executable, "-m", "build", "--no-isolation"]
    # `build` without --sdist/--wheel makes the sdist, then the wheel from the unpacked sdist.
    subprocess.run(
        [*build, "--outdir", str(work / "from_sdist"), str(source)], check=True, capture_output=True
    )
    subprocess.run(
        [*build, "--wheel", "--outdir", str(work / "from_checkout"), str(source)],
        check=True,
        capture_output=True,
    )
    (sdist,) = (work / "from_sdist").glob("moetriton-*.tar.gz")
    assert sdist.name == f"moetriton-{VERSION}.tar.gz"
    return {
        "checkout": next((work / "from_checkout").glob("moetriton-*.whl")),
        "sdist": next((work / "from_sdist").glob("moetriton-*.whl")),
    }


@pytest.mark.parametrize("built_from", ["checkout", "sdist"])
def test_wheel_installs_imports_and_runs(wheels: dict[str, Path], built_from: str, tmp_path: Path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The suite's packages after the environment's own: torch, JAX, Flax and Triton are not installed again.
    (site / "suite_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # This interpreter's pip works on the environment (--python): the environment itself holds no pip or
    # setuptools, only what moetriton needs.
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheels[built_from])], check=True)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    installed = _installed_files(site)
    expected = _tree_files()
    assert sorted(installed) == sorted(expected), (
        f"missing from the wheel: {sorted(set(expected) - set(installed))}; "
        f"not in the tree: {sorted(set(installed) - set(expected))}"
    )
    for path, source in expected.items():
        assert installed[path].read_bytes() == source.read_bytes(), f"{path} differs from {source}"

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = outside / "check.py"
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "MOETRITON_", "VIRTUAL_ENV")) and key != "TRITON_INTERPRET"
    }
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    # The README's snippets, as a user copies them (without the interpreter, as tests/test_docs.py runs them).
    for block in blocks(ROOT / "README.md"):
        if block.skip is None and not block.torchrun:
            script.write_text(block.code)
            run = subprocess.run([python, str(script)], cwd=outside, env=env, capture_output=True, text=True)
            assert run.returncode == 0, f"{block.name}: {run.stderr[-8000:]}"

    # The installed kernels, interpreted, against the installed references.
    skip_unless_interpreter_runs("the installed package's check")
    script.write_text(CHECK)
    result = subprocess.run(
        [python, str(script), str(site), VERSION],
        cwd=outside,
        env=dict(env, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"ok": True}
