"""Import boundaries: moetriton.jax never imports torch; moetriton.kernels imports neither framework and
touches no GPU. Each check runs in a fresh interpreter, so nothing this test process imported counts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .strategies_router import skip_unless_interpreter_runs

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, interpret: bool) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.parametrize("interpret", [False, True], ids=["reference-or-gpu", "interpreter"])
def test_moetriton_jax_imports_no_torch_and_runs_where_torch_cannot_be_imported(interpret):
    """Importing moetriton.jax loads no torch; its ops then run with `import torch` failing, as where torch is
    not installed (Triton itself may import torch when it can, so "not in sys.modules" after running ops
    would test Triton, not us)."""
    if interpret:
        skip_unless_interpreter_runs("the import check")
    _run(
        """
import sys
import jax.numpy as jnp
import moetriton.jax as mj
assert "torch" not in sys.modules, "import moetriton.jax imported torch"
import importlib.abc
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"{name} is blocked: moetriton.jax must run without torch")
sys.meta_path.insert(0, NoTorch())  # from here on `import torch` fails, as where torch is not installed
x = jnp.ones((4, 8))
mask = jnp.array([[1, 1, 0], [1, 0, 1], [0, 0, 1], [0, 0, 0]], dtype=bool)
out, _, row_id_map, _, _ = mj.token_dispatch(x, mask, num_out_tokens=5)
combined = mj.token_combine(out, row_id_map)
assert combined[:, 0].tolist() == [2.0, 2.0, 1.0, 0.0], combined[:, 0]
""",
        interpret,
    )


@pytest.mark.parametrize("interpret", [False, True], ids=["compiled", "interpreter"])
def test_moetriton_kernels_imports_no_framework_and_touches_no_gpu(interpret):
    _run(
        """
import sys
from pathlib import Path
import moetriton.kernels
for name in ("torch", "jax"):
    assert name not in sys.modules, f"import moetriton.kernels imported {name}"
config = sys.modules["triton.runtime.driver"].driver
assert getattr(config, "_active", None) is None and getattr(config, "_default", None) is None, (
    "import moetriton.kernels started a Triton driver"
)
maps = Path("/proc/self/maps")
if maps.exists():
    loaded = maps.read_text()
    for library in ("libcuda.so", "libamdhip64.so"):
        assert library not in loaded, f"import moetriton.kernels loaded {library}"
""",
        interpret,
    )
