"""moetriton.jax's FP8 ops against moetriton.torch's (which tests/torch/test_fp8.py checks against the
independent reference): the same inputs give bit-identical codes, scales, products, and
fp8_grouped_linear outputs and gradients (the same kernels: on CPU both interpreted, on a GPU both
compiled), under jax.jit; and the same argument errors."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moetriton.jax as mj

torch = pytest.importorskip("torch", reason="the FP8 ops' parity needs PyTorch next to JAX")
mt = pytest.importorskip("moetriton.torch")

_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RECIPES = ["tensorwise", "blockwise"]


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    generator = np.random.default_rng(seed)
    spread = 10.0 ** generator.integers(-2, 3, size=(*shape[:-1], 1))
    return (generator.standard_normal(shape) * spread).astype(np.float32)


def _both(values: np.ndarray, dtype: str = "bfloat16"):
    """(jax array, torch tensor) of the same values in `dtype`."""
    tensor = torch.from_numpy(values).to(_DEVICE).to(getattr(torch, dtype))
    return jnp.asarray(values).astype(dtype), tensor


def _assert_same(jax_array, tensor, name: str) -> None:
    """Bit-identical contents (None on both sides for an absent result)."""
    if tensor is None:
        assert jax_array is None, name
        return
    got = np.asarray(jax_array)
    expected = tensor.detach().cpu().contiguous()
    assert got.shape == tuple(expected.shape), name
    assert got.tobytes() == expected.view(torch.uint8).numpy().tobytes(), f"{name} differs"


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantizers_match_torch_bit_for_bit(recipe):
    x_jax, x_torch = _both(_values((150, 200), seed=1))
    sizes = np.array([20, 0, 110], np.int32)
    quantize = jax.jit(lambda x, s: mj.quantize(x, s, recipe, fp8_dtype=jnp.float8_e5m2, columnwise=True))
    got = quantize(x_jax, jnp.asarray(sizes))
    expected = mt.quantize(
        x_torch, torch.from_numpy(sizes).to(_DEVICE), recipe, fp8_dtype=torch.float8_e5m2, columnwise=True
    )
    # Only what the groups own is specified: rows 130 on, and the columnwise blocks past the groups', not.
    _assert_same(got[0][:130], expected[0][:130], "rows")
    blocks = -(-20 // 128) + -(-110 // 128)  # the groups' 128-row blocks of the columnwise copy
    owned = (slice(0, 130), slice(0, blocks)) if recipe == "blockwise" else (slice(None), slice(None))
    _assert_same(got[1][owned[0]], expected[1][owned[0]], "rows_scale")
    _assert_same(got[2][:, : 128 * blocks], expected[2][:, : 128 * blocks], "cols")
    _assert_same(got[3][owned[1]], expected[3][owned[1]], "cols_scale")
    w_jax, w_torch = _both(_values((2, 136, 72), seed=2), "float32")
    for got_copy, expected_copy, name in zip(
        mj.quantize_weights(w_jax, recipe, rowwise=False),
        mt.quantize_weights(w_torch, recipe, rowwise=False),
        ("rows", "cols", "scale"),
        strict=True,
    ):
        _assert_same(got_copy, expected_copy, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_products_match_torch_bit_for_bit(recipe):
    x, dy = _values((140, 200), seed=3), _values((140, 72), seed=4)
    w = _values((3, 200, 72), seed=5)
    sizes = np.array([1, 0, 129], np.int32)
    gradient = "float8_e5m2" if recipe == "tensorwise" else "float8_e4m3fn"
    jax_sizes, torch_sizes = jnp.asarray(sizes), torch.from_numpy(sizes).to(_DEVICE)

    def torch_side():
        x_rows, x_scale, x_cols, x_cols_scale = mt.quantize(_both(x)[1], torch_sizes, recipe, columnwise=True)
        dy_rows, dy_scale, dy_cols, dy_cols_scale = mt.quantize(
            _both(dy)[1], torch_sizes, recipe, fp8_dtype=getattr(torch, gradient), columnwise=True
        )
        w_rows, w_cols, w_scale = mt.quantize_weights(_both(w)[1], recipe)
        return (
            mt.grouped_matmul_fp8(x_rows, w_cols, x_scale, w_scale, torch_sizes, recipe),
            mt.grouped_matmul_fp8(
                dy_rows, w_rows, dy_scale, w_scale, torch_sizes, recipe, data_gradient=True
            ),
            mt.grouped_matmul_fp8_wgrad(
                x_cols,
                dy_cols,
                x_cols_scale,
                dy_cols_scale,
                torch_sizes,
                140,
                recipe,
                out_dtype=torch.float32,
            ),
        )

    @jax.jit
    def jax_side(x, dy, w, sizes):
        x_rows, x_scale, x_cols, x_cols_scale = mj.quantize(x, sizes, recipe, columnwise=True)
        dy_rows, dy_scale, dy_cols, dy_cols_scale = mj.quantize(
            dy, sizes, recipe, fp8_dtype=gradient, columnwise=True
        )
        w_rows, w_cols, w_scale = mj.quantize_weights(w, recipe)
        return (
            mj.grouped_matmul_fp8(x_rows, w_cols, x_scale, w_scale, sizes, recipe),
            mj.grouped_matmul_fp8(dy_rows, w_rows, dy_scale, w_scale, sizes, recipe, data_gradient=True),
            mj.grouped_matmul_fp8_wgrad(
                x_cols, dy_cols, x_cols_scale, dy_cols_scale, sizes, 140, recipe, out_dtype=jnp.float32
            ),
        )

    got = jax_side(_both(x)[0], _both(dy)[0], _both(w)[0], jax_sizes)
    for got_product, expected, name in zip(got, torch_side(), ("forward", "dgrad", "wgrad"), strict=True):
        _assert_same(got_product, expected, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_linear_and_gradients_match_torch_bit_for_bit(recipe):
    x, w, dy = _values((150, 136), seed=6), _values((2, 136, 96), seed=7), _values((150, 96), seed=8)
    sizes = np.array([60, 70], np.int32)
    x_jax, x_torch = _both(x)
    w_jax, w_torch = _both(w)
    dy_jax, dy_torch = _both(dy)
    out, vjp = jax.vjp(lambda a, b: mj.fp8_grouped_linear(a, jnp.asarray(sizes), b, recipe), x_jax, w_jax)
    grad_x, grad_w = vjp(dy_jax)
    leaf_x, leaf_w = x_torch.requires_grad_(True), w_torch.requires_grad_(True)
    expected = mt.fp8_grouped_linear(leaf_x, torch.from_numpy(sizes).to(_DEVICE), leaf_w, recipe)
    expected.backward(dy_torch)
    _assert_same(out, expected, "out")
    _assert_same(grad_x, leaf_x.grad, "grad rows")
    _assert_same(grad_w, leaf_w.grad, "grad weight")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x, s, w: mj.fp8_grouped_linear(x, s, w, "mx"), ValueError, "recipe"),
        (lambda x, s, w: mj.fp8_grouped_linear(x, s, w[:, :64], "blockwise"), ValueError, "weight"),
        (
            lambda x, s, w: mj.fp8_grouped_linear(x, s.astype(jnp.float32), w, "blockwise"),
            TypeError,
            "integers",
        ),
        (lambda x, s, w: mj.quantize(x, s, "blockwise", rowwise=False), ValueError, "copy"),
        (lambda x, s, w: mj.quantize(x, s, "blockwise", fp8_dtype=jnp.int8), ValueError, "fp8_dtype"),
        (lambda x, s, w: mj.quantize_weights(w[0], "blockwise"), ValueError, "dimensions"),
    ],
)
def test_bad_arguments_raise(call, error, match):
    x, w = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 16), jnp.bfloat16)
    with pytest.raises(error, match=match):
        call(x, jnp.array([3, 5]), w)


def test_without_kernels_the_ops_refuse():
    """On CPU without the interpreter there is no fallback: the ops say what they need (a fresh process:
    TRITON_INTERPRET is read when moetriton is imported)."""
    code = (
        "import jax.numpy as jnp, moetriton.jax as mj\n"
        "try:\n"
        "    mj.quantize(jnp.ones((4, 128), jnp.bfloat16), jnp.array([4]), 'blockwise')\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "TRITON_INTERPRET=1" in child.stdout, child.stdout + child.stderr
