"""The index rule (docs/design.md, "Index data is never trusted") through moetriton.jax's public functions,
inside jax.jit (where no value can be checked on the host) and with x64 ids: hostile row maps, expert ids,
split sizes and orders (tests/strategies_hostile.py) give what the JAX reference computes under the same
rule, forward and gradient, and with the kernels interpreted on CPU every buffer they write lies inside
guard zones that must come back untouched. Then the host checks, the debug switch and wrong argument
kinds. The PyTorch executor's file of the same name runs every kernel family at the plan level."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moetriton.jax as mj
from moetriton.jax import executor, reference
from moetriton.kernels import INTERPRETER
from moetriton.kernels.rules import validation
from tests.strategies_hostile import ids_problems, is_partition, row_map_problems, row_owners, split_problems

SENTINEL = 0xA5
MARGIN_BYTES = 256


class _Guards:
    """Interpreted plans' buffers inside sentinel margins (through executor.host_buffer)."""

    def __init__(self) -> None:
        self.zones: list[tuple[np.ndarray, int, int]] = []

    def allocate(self, shape, dtype, zero: bool) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.full(2 * MARGIN_BYTES + nbytes, SENTINEL, np.uint8)
        middle = raw[MARGIN_BYTES : MARGIN_BYTES + nbytes].view(dtype).reshape(shape)
        if zero:
            middle[...] = 0
        self.zones.append((raw, MARGIN_BYTES, nbytes))
        return middle

    def check(self) -> None:
        for raw, margin, nbytes in self.zones:
            assert (raw[:margin] == SENTINEL).all(), "written before a buffer"
            assert (raw[margin + nbytes :] == SENTINEL).all(), "written past a buffer"


@contextlib.contextmanager
def guarded():
    """Guard zones where the kernels are interpreted (on a GPU the GPU check's compute-sanitizer run
    watches the compiled kernels instead); checked on leaving."""
    zones = _Guards()
    with pytest.MonkeyPatch.context() as patch:
        if INTERPRETER:
            patch.setattr(executor, "host_buffer", zones.allocate)
        yield
    zones.check()


@given(problem=ids_problems())
@guarded()
def test_jitted_dispatch_reads_ids_in_their_own_dtype(problem):
    """With x64, int64 ids 2**32 and 2**32 + 2 are no expert (not experts 0 and 2); nor is any id outside
    [0, E). Under jit nothing is checked on the host, so this is the kernels' rule."""
    num_out = problem.ids.size

    def dispatch(x, ids, probs):
        return mj.token_dispatch(x, None, num_out, probs, 2, indices=ids, num_experts=problem.num_experts)

    with jax.enable_x64(True):
        args = (jnp.asarray(problem.tokens), jnp.asarray(problem.ids), jnp.asarray(problem.probs))
        got = jax.jit(dispatch)(*args)
        expected = reference.token_dispatch(
            args[0], None, num_out, args[2], 2, indices=args[1], num_experts=problem.num_experts
        )
    for name, value, want in zip(
        ("output", "probs", "row_id_map", "pad_offsets", "counts"), got, expected, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=name)


@given(problem=row_map_problems(), weighted=st.booleans(), padded=st.booleans())
@guarded()
def test_jitted_combine_and_its_gradient_follow_only_live_entries(problem, weighted, padded):
    """Forward: what the reference gives under the rule. Gradient (jit of grad, the path that used to
    abort the process): the merging weights' gradient is the derivative of that forward, and every row
    one live entry names gets its token's gradient (times its weight)."""
    rows, row_map = jnp.asarray(problem.rows), jnp.asarray(problem.row_map)
    weights = jnp.asarray(problem.weights) if weighted else None
    pad_offsets = jnp.zeros(1, jnp.int32) if padded else None
    grad = jnp.asarray(problem.grad)

    # The map is a jit argument: traced, so no host check sees its values (a closed-over concrete map
    # would be checked, and refused).
    def loss(combine, rows, weights, row_map):
        return jnp.sum(combine(rows, row_map, weights, pad_offsets) * grad)

    got = jax.jit(lambda r, w, m: mj.token_combine(r, m, w, pad_offsets))(rows, weights, row_map)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(reference.combine(rows, row_map, weights)), 1e-6, 1e-6
    )
    argnums = (0, 1) if weighted else 0
    gradient = jax.jit(jax.grad(lambda r, w, m: loss(mj.token_combine, r, w, m), argnums=argnums))
    got_grads = gradient(rows, weights, row_map)
    want_grads = jax.grad(lambda r, w: loss(reference.token_combine, r, w, row_map), argnums=argnums)(
        rows, weights
    )
    got_rows, want_rows = (got_grads[0], want_grads[0]) if weighted else (got_grads, want_grads)
    if weighted:
        np.testing.assert_allclose(np.asarray(got_grads[1]), np.asarray(want_grads[1]), 1e-5, 1e-5)
    _, named = row_owners(problem)
    end = min(max(int(problem.row_map[0, -1]), 0), problem.num_rows)
    for row in range(problem.num_rows):
        if named[row] == 1 and (padded or row < end):
            np.testing.assert_allclose(np.asarray(got_rows[row]), np.asarray(want_rows[row]), 1e-6, 1e-6)
        elif named[row] == 0 and (padded or row >= end):
            assert not np.asarray(got_rows[row]).any()


@given(problem=split_problems())
@guarded()
def test_jitted_sort_chunks_moves_nothing_for_a_description_that_is_not_a_partition(problem):
    """Sizes that overrun the rows (also past int32 with x64), negative sizes, repeated or missing chunks in
    the order: zero rows, probs and gradient, map -1; a partition sorts as usual."""
    with jax.enable_x64(True):
        args = tuple(
            jnp.asarray(value) for value in (problem.rows, problem.sizes, problem.order, problem.probs)
        )
        got = jax.jit(mj.sort_chunks_by_index)(*args)
        expected = reference.sort_chunks_by_index(*args)
        # Sizes and order are jit arguments: traced, so no host check sees their values.
        squares = jax.grad(
            lambda rows, sizes, order: jnp.sum(mj.sort_chunks_by_index(rows, sizes, order)[0] ** 2)
        )
        grad = jax.jit(squares)(*args[:3])
    for value, want in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want))
    if not is_partition(problem.sizes, problem.order, problem.num_rows):
        assert not np.asarray(got[0]).any() and (np.asarray(got[1]) == -1).all()
        assert not np.asarray(grad).any()
    else:
        np.testing.assert_array_equal(np.asarray(grad), 2 * problem.rows)


@pytest.mark.parametrize("switch", [False, True], ids=["default", "MOETRITON_CHECK"])
def test_host_checks_and_argument_kinds(monkeypatch, switch):
    """Values are read where that is free (CPU arrays), and with the debug switch on any device."""
    if not switch and jax.default_backend() != "cpu":
        pytest.skip("device arrays are read only with MOETRITON_CHECK=1")
    monkeypatch.setattr(validation, "CHECK_VALUES", switch)
    x = jnp.ones((32, 4))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 4, (32, 2)), jnp.int32)
    _, _, row_map, _, _ = mj.token_dispatch(x, None, 64, indices=ids, num_experts=4)
    with pytest.raises(ValueError, match=r"row_id_map: expected listed rows in \[-1, 4\)"):
        mj.token_combine(jnp.ones((4, 4)), row_map)
    with pytest.raises(ValueError, match="split_sizes"):
        mj.sort_chunks_by_index(jnp.ones((5, 2)), jnp.array([4, 5]), jnp.array([0, 1]))
    with pytest.raises(TypeError, match=r"inp: expected a jax.Array, got builtins.list"):
        mj.token_combine([[1.0, 2.0]], row_map)
    with pytest.raises(TypeError, match="total_num_tokens: expected an int, got float"):
        mj.fused_moe_aux_loss(jnp.full((4, 2), 0.5), jnp.array([4, 4]), 4.0, 2, 1, 1.0)


def test_debug_switch_checks_inside_jit(monkeypatch):
    """MOETRITON_CHECK=1: inside jit the values are checked by a callback whose error stops the call."""
    x = jnp.ones((32, 4))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 4, (32, 2)), jnp.int32)
    _, _, row_map, _, _ = mj.token_dispatch(x, None, 64, indices=ids, num_experts=4)
    expected = reference.combine(jnp.ones((4, 4)), row_map)
    unchecked = jax.jit(lambda rows, row_map: mj.token_combine(rows, row_map))(jnp.ones((4, 4)), row_map)
    np.testing.assert_array_equal(np.asarray(unchecked), np.asarray(expected))
    monkeypatch.setattr(validation, "CHECK_VALUES", True)
    with pytest.raises(Exception, match="row_id_map: expected listed rows"):
        jax.block_until_ready(jax.jit(lambda r, m: mj.token_combine(r, m))(jnp.ones((4, 4)), row_map))
    with pytest.raises(Exception, match="indices: expected expert ids"):
        jax.block_until_ready(
            jax.jit(lambda x, ids: mj.token_dispatch(x, None, 64, indices=ids, num_experts=4))(x, ids + 4)
        )
