"""moetriton.jax.grouped_matmul against a float64 numpy loop over the groups: forward, both gradients, the
rows past the groups, clipped sizes, empty groups, every config of both kernels, jit determinism, errors.
On CPU the kernels run under the Triton interpreter (the conftest sets it), on a GPU compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetriton import kernels
from moetriton.jax import grouped_matmul
from moetriton.jax.executor import run_plan, uses_kernels

# Relative to the largest reference magnitude: 16-bit outputs carry ~3 significant digits.
_TOLERANCE = {"float32": 1e-5, "bfloat16": 2**-7, "float16": 2**-10}


def _problem(rows: int, depth: int, cols: int, sizes: list[int], dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), depth, cols)) / max(depth, 1) ** 0.5, dtype)
    grad = jnp.asarray(rng.standard_normal((rows, cols)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), grad


def _reference(lhs, rhs, sizes, grad):
    """(out, grad_lhs, grad_rhs) in float64 from the (rounded) inputs: one plain matmul per group, groups
    clipped to the rows present, rows past them zero."""
    lhs, rhs, grad = (np.asarray(a, np.float64) for a in (lhs, rhs, grad))
    out, grad_lhs, grad_rhs = np.zeros(grad.shape), np.zeros(lhs.shape), np.zeros(rhs.shape)
    start = 0
    for group, size in enumerate(np.asarray(sizes)):
        end = min(start + max(int(size), 0), lhs.shape[0])
        rows = slice(start, end)
        out[rows] = lhs[rows] @ rhs[group]
        grad_lhs[rows] = grad[rows] @ rhs[group].T
        grad_rhs[group] = lhs[rows].T @ grad[rows]
        start = end
    return out, grad_lhs, grad_rhs


def _assert_close(got, expected, what: str) -> None:
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    scale = max(float(np.abs(expected).max(initial=0.0)), 1.0)
    tolerance = _TOLERANCE[np.dtype(got.dtype).name] * scale
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=0, atol=tolerance, err_msg=what)


def _check(lhs, rhs, sizes, grad, function=grouped_matmul) -> None:
    out, vjp = jax.vjp(lambda a, b: function(a, b, sizes), lhs, rhs)
    grad_lhs, grad_rhs = vjp(grad)
    expected = _reference(lhs, rhs, sizes, grad)
    assert out.dtype == lhs.dtype and grad_lhs.dtype == lhs.dtype and grad_rhs.dtype == rhs.dtype
    for name, got, want in zip(
        ("out", "grad_lhs", "grad_rhs"), (out, grad_lhs, grad_rhs), expected, strict=True
    ):
        _assert_close(got, want, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    ("rows", "depth", "cols", "sizes"),
    [
        (50, 24, 40, [10, 0, 23, 7]),  # empty group, rows past the groups, N and K not block multiples
        (70, 16, 16, [70, 0, 0]),  # trailing empty groups (zero weight gradients)
        (33, 40, 72, [0]),  # no rows in any group: everything zero
        (20, 8, 8, [15, 30]),  # sizes past the rows present: clipped, nothing read out of bounds
        (130, 32, 24, [1, 64, 65]),  # groups straddling 64-row tiles
    ],
)
def test_matches_the_per_group_reference(rows, depth, cols, sizes, dtype):
    _check(*_problem(rows, depth, cols, sizes, dtype))


@pytest.mark.parametrize(("rows", "depth", "cols"), [(0, 8, 8), (6, 0, 8), (6, 8, 0)])
def test_empty_dimensions(rows, depth, cols):
    _check(*_problem(rows, depth, cols, [rows // 2, rows - rows // 2], "bfloat16"))


def test_negative_sizes_count_as_empty():
    lhs, rhs, _, grad = _problem(12, 8, 8, [0, 0, 0], "float32")
    sizes = jnp.asarray([4, -3, 5], jnp.int32)
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes), lhs, rhs)
    expected = _reference(lhs, rhs, jnp.asarray([4, 0, 5]), grad)
    for name, got, want in zip(("out", "grad_lhs", "grad_rhs"), (out, *vjp(grad)), expected, strict=True):
        _assert_close(got, want, name)


def test_narrow_integer_sizes_and_jit_determinism():
    lhs, rhs, sizes, grad = _problem(40, 16, 24, [9, 0, 31], "bfloat16", seed=3)

    @jax.jit
    def step(a, b, s):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, s), a, b)
        return (out, *vjp(grad))

    first = step(lhs, rhs, sizes.astype(jnp.int16))
    second = step(lhs, rhs, sizes)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for name, got, want in zip(
        ("out", "grad_lhs", "grad_rhs"), first, _reference(lhs, rhs, sizes, grad), strict=True
    ):
        _assert_close(got, want, name)


def _permuted_reference(lhs, rhs, sizes, grad, lhs_rows, out_rows):
    """(out, grad_lhs, grad_rhs) of out[out_rows] = product(lhs[lhs_rows]) from the plain reference, the
    permutations applied to numpy copies (None: rows in order)."""
    rows = np.arange(lhs.shape[0])
    lhs_rows = rows if lhs_rows is None else np.asarray(lhs_rows)
    out_rows = rows if out_rows is None else np.asarray(out_rows)
    lhs64 = np.asarray(lhs, np.float64)[lhs_rows]
    out, grad_lhs, grad_rhs = _reference(lhs64, rhs, sizes, np.asarray(grad, np.float64)[out_rows])
    placed_out, placed_grad = np.empty_like(out), np.empty_like(grad_lhs)
    placed_out[out_rows] = out
    placed_grad[lhs_rows] = grad_lhs
    return placed_out, placed_grad, grad_rhs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("sides", ["lhs", "out", "both"])
@pytest.mark.parametrize(
    ("rows", "depth", "cols", "sizes"),
    [
        (50, 24, 40, [10, 0, 23, 7]),  # rows past the groups: zeros, written through out_rows
        (130, 32, 24, [1, 64, 65]),  # groups straddling 64-row tiles
        (20, 8, 8, [15, 30]),  # sizes past the rows present
    ],
)
def test_row_permutations(rows, depth, cols, sizes, dtype, sides):
    lhs, rhs, group_sizes, grad = _problem(rows, depth, cols, sizes, dtype, seed=11)
    rng = np.random.default_rng(rows)
    lhs_rows = jnp.asarray(rng.permutation(rows), jnp.int32) if sides in ("lhs", "both") else None
    out_rows = jnp.asarray(rng.permutation(rows), jnp.int32) if sides in ("out", "both") else None

    def product(a, b):
        return grouped_matmul(a, b, group_sizes, lhs_rows=lhs_rows, out_rows=out_rows)

    out, vjp = jax.jit(lambda a, b: jax.vjp(product, a, b))(lhs, rhs)
    expected = _permuted_reference(lhs, rhs, group_sizes, grad, lhs_rows, out_rows)
    for name, got, want in zip(("out", "grad_lhs", "grad_rhs"), (out, *vjp(grad)), expected, strict=True):
        _assert_close(got, want, f"{name}, {sides}")


@pytest.mark.parametrize("sides", ["none", "lhs", "out", "both"])
def test_zero_tail_off_keeps_every_row_of_the_groups(sides):
    """zero_tail=False (the MoE layer's): the product's rows of the groups, the input gradient of the lhs
    rows they read and the weight gradient are those of the default; rows past the groups are
    unspecified, so they are not compared."""
    rows, sizes = 90, [20, 0, 33]
    lhs, rhs, group_sizes, grad = _problem(rows, 24, 40, sizes, "bfloat16", seed=13)
    rng = np.random.default_rng(5)
    lhs_rows = jnp.asarray(rng.permutation(rows), jnp.int32) if sides in ("lhs", "both") else None
    out_rows = jnp.asarray(rng.permutation(rows), jnp.int32) if sides in ("out", "both") else None

    def product(a, b):
        return grouped_matmul(a, b, group_sizes, lhs_rows=lhs_rows, out_rows=out_rows, zero_tail=False)

    out, vjp = jax.jit(lambda a, b: jax.vjp(product, a, b))(lhs, rhs)
    grad_lhs, grad_rhs = vjp(grad)
    expected_out, expected_grad_lhs, expected_grad_rhs = _permuted_reference(
        lhs, rhs, group_sizes, grad, lhs_rows, out_rows
    )
    in_groups = np.arange(sum(sizes))
    written = in_groups if out_rows is None else np.asarray(out_rows)[in_groups]
    read = in_groups if lhs_rows is None else np.asarray(lhs_rows)[in_groups]
    _assert_close(np.asarray(out)[written], expected_out[written], "out")
    _assert_close(np.asarray(grad_lhs)[read], expected_grad_lhs[read], "grad_lhs")
    _assert_close(grad_rhs, expected_grad_rhs, "grad_rhs")


def test_row_permutations_take_narrow_integers_and_stay_in_bounds():
    """int16 permutations are accepted; out-of-range entries are clipped (wrong rows, never a fault), in
    the product and in the weight gradient's gathers."""
    lhs, rhs, sizes, grad = _problem(24, 8, 16, [10, 14], "float32", seed=12)
    order = np.random.default_rng(3).permutation(24)
    got = grouped_matmul(lhs, rhs, sizes, lhs_rows=jnp.asarray(order, jnp.int16))
    _assert_close(got, _permuted_reference(lhs, rhs, sizes, grad, order, None)[0], "int16 lhs_rows")
    wild = jnp.asarray(np.where(order == 0, 1000, order), jnp.int32)  # entry 1000 reads row 23
    clipped = np.where(order == 0, 23, order)
    if uses_kernels():
        got = grouped_matmul(lhs, rhs, sizes, lhs_rows=wild)
        _assert_close(got, _permuted_reference(lhs, rhs, sizes, grad, clipped, None)[0], "clipped")
        # The weight gradient's gathers of the permuted operands clip the same way.
        for side, rows in (("lhs_rows", (clipped, None)), ("out_rows", (None, clipped))):
            _, vjp = jax.vjp(lambda b, side=side: grouped_matmul(lhs, b, sizes, **{side: wild}), rhs)
            want = _permuted_reference(lhs, rhs, sizes, grad, *rows)[2]
            _assert_close(vjp(grad)[0], want, f"clipped {side}: weight gradient")


def _unique_tiles(space) -> list[dict]:
    """Configs that differ in tiles (warps and stages change no result under the interpreter)."""
    configs = space.configs()
    if uses_kernels() and jax.default_backend() == "cpu":
        tiles = {
            tuple((k, v) for k, v in c.items() if k not in ("num_warps", "num_stages")): c for c in configs
        }
        configs = list(tiles.values())
    return configs


@pytest.mark.skipif(
    not uses_kernels(), reason="configs only exist for the kernels (GPU or TRITON_INTERPRET=1)"
)
@pytest.mark.parametrize("config", _unique_tiles(kernels.SEARCH_SPACES["grouped_matmul"]), ids=str)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_every_forward_config(config, transpose_rhs):
    lhs, rhs, sizes, _ = _problem(150, 40, 72, [70, 0, 65], "bfloat16", seed=5)
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2).copy()  # [E, N, K]: the kernel reads it transposed
    gemm = dict(num_rows=150, depth=40, num_cols=72, num_groups=3, element_bytes=2)
    plan = kernels.grouped_matmul_plan(**gemm, transpose_rhs=transpose_rhs, config=config)
    (out,) = run_plan(plan, dict(lhs=lhs, rhs=rhs, group_sizes=sizes, lhs_rows=None, out_rows=None))
    weights = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    _assert_close(out, _reference(lhs, weights, sizes, jnp.zeros((150, 72)))[0], str(config))


@pytest.mark.skipif(
    not uses_kernels(), reason="configs only exist for the kernels (GPU or TRITON_INTERPRET=1)"
)
@pytest.mark.parametrize("config", _unique_tiles(kernels.SEARCH_SPACES["grouped_matmul_wgrad"]), ids=str)
def test_every_wgrad_config(config):
    lhs, rhs, sizes, grad = _problem(150, 72, 136, [70, 0, 65], "bfloat16", seed=6)
    plan = kernels.grouped_matmul_wgrad_plan(
        num_rows=150, depth=72, num_cols=136, num_groups=3, element_bytes=2, config=config
    )
    (out,) = run_plan(plan, dict(lhs=lhs, grad=grad, group_sizes=sizes))
    _assert_close(out, _reference(lhs, rhs, sizes, grad)[2], str(config))


def test_agrees_with_ragged_dot():
    """The public semantics are ragged_dot's (sizes summing to at most M)."""
    lhs, rhs, sizes, grad = _problem(48, 16, 32, [5, 20, 0, 11], "float32", seed=8)
    _check(lhs, rhs, sizes, grad)
    expected = jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(grouped_matmul(lhs, rhs, sizes)), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "sizes_shape", "dtypes", "error", "match"),
    [
        ((4, 8), (2, 8), (2,), ("bfloat16", "bfloat16", "int32"), ValueError, "expected lhs"),
        ((4, 8), (2, 6, 3), (2,), ("bfloat16", "bfloat16", "int32"), ValueError, "disagree"),
        ((4, 8), (2, 8, 3), (3,), ("bfloat16", "bfloat16", "int32"), ValueError, "disagree"),
        ((4, 8), (0, 8, 3), (0,), ("bfloat16", "bfloat16", "int32"), ValueError, "at least one group"),
        ((4, 8), (2, 8, 3), (2,), ("bfloat16", "float32", "int32"), TypeError, "share"),
        ((4, 8), (2, 8, 3), (2,), ("int32", "int32", "int32"), TypeError, "share"),
        ((4, 8), (2, 8, 3), (2,), ("bfloat16", "bfloat16", "float32"), TypeError, "integers"),
    ],
)
def test_bad_arguments_raise(lhs_shape, rhs_shape, sizes_shape, dtypes, error, match):
    lhs, rhs, sizes = (
        jnp.zeros(s, d) for s, d in zip((lhs_shape, rhs_shape, sizes_shape), dtypes, strict=True)
    )
    with pytest.raises(error, match=match):
        grouped_matmul(lhs, rhs, sizes)


@pytest.mark.parametrize("side", ["lhs_rows", "out_rows"])
@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        (jnp.arange(3, dtype=jnp.int32), ValueError, r"must be \[M\] = \(4,\)"),
        (jnp.zeros((4, 1), jnp.int32), ValueError, r"must be \[M\]"),
        (jnp.arange(4, dtype=jnp.float32), TypeError, "must be integers"),
    ],
)
def test_bad_row_permutations_raise(side, rows, error, match):
    lhs, rhs, sizes = jnp.zeros((4, 8)), jnp.zeros((2, 8, 3)), jnp.asarray([2, 2])
    with pytest.raises(error, match=match):
        grouped_matmul(lhs, rhs, sizes, **{side: rows})
