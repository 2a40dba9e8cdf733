"""moetriton.jax beyond the properties: jit / grad / vmap, argument errors, execution targets, plan
variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moetriton.jax as mj
from moetriton import kernels
from moetriton.jax import executor, reference
from tests.jax._helpers import assert_reduced, assert_same

RNG = np.random.default_rng(7)


def _problem(num_tokens=6, hidden=5, num_experts=4, topk=2, kind="indices"):
    x = jnp.asarray(RNG.integers(-7, 8, (num_tokens, hidden)).astype(np.float32))
    ids = np.argsort(RNG.random((num_tokens, num_experts)), axis=1)[:, :topk].astype(np.int32)
    if kind == "indices":
        routing = dict(indices=jnp.asarray(ids), num_experts=num_experts)
        slots = topk
    else:
        mask = np.zeros((num_tokens, num_experts), bool)
        np.put_along_axis(mask, ids, True, axis=1)
        routing = dict(routing_map=jnp.asarray(mask))
        slots = num_experts
    p = jnp.asarray(RNG.random((num_tokens, slots), dtype=np.float32))
    return x, routing, p


# jit, grad, vmap -----------------------------------------------------------------------------------------


def test_jit_with_static_sizes_equals_eager():
    x, routing, p = _problem(kind="mask")
    jitted = jax.jit(mj.token_dispatch, static_argnames=("num_out_tokens", "align_size"))
    got = jitted(x, routing["routing_map"], num_out_tokens=12, probs=p, align_size=4)
    expected = mj.token_dispatch(x, routing["routing_map"], 12, p, 4)
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e, "jit vs eager")


def test_value_and_grad_of_a_moe_layer():
    x, routing, p = _problem()
    weights = jnp.asarray(RNG.standard_normal((4, 5, 5), dtype=np.float32))

    def layer(x, p, weights, api):
        out, permuted_probs, row_id_map, pad_offsets, counts = api.token_dispatch(
            x, None, 12, p, 2, **routing
        )
        expert_of_row = jnp.repeat(jnp.arange(4), counts, total_repeat_length=out.shape[0])
        hidden = jnp.einsum("nh,nhk->nk", out, weights[expert_of_row]) * permuted_probs[:, None]
        return jnp.sum(api.token_combine(hidden, row_id_map, p, pad_offsets) ** 2)

    value, grads = jax.jit(jax.value_and_grad(layer, argnums=(0, 1, 2)), static_argnums=3)(x, p, weights, mj)
    value_ref, grads_ref = jax.value_and_grad(layer, argnums=(0, 1, 2))(x, p, weights, reference)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for got, expected in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["mask", "indices"])
def test_vmap_equals_a_loop_over_the_batch(kind):
    problems = [_problem(kind=kind) for _ in range(3)]
    xs = jnp.stack([x for x, _, _ in problems])
    ps = jnp.stack([p for _, _, p in problems])
    name = "routing_map" if kind == "mask" else "indices"
    routings = jnp.stack([r[name] for _, r, _ in problems])
    extra = {} if kind == "mask" else {"num_experts": 4}

    def pipeline(x, routing, p):
        out, pp, row_id_map, pad_offsets, counts = mj.token_dispatch(
            x, num_out_tokens=12, probs=p, align_size=4, **{name: routing}, **extra
        )
        back = mj.token_combine(out * 2, row_id_map, p, pad_offsets)
        return out, pp, row_id_map, pad_offsets, counts, back

    batched = jax.jit(jax.vmap(pipeline))(xs, routings, ps)
    for i in range(3):
        single = pipeline(xs[i], routings[i], ps[i])
        for name_, b, s in zip(("output", "probs", "map", "pad", "counts"), batched, single, strict=False):
            assert_same(b[i], s, name_)
        assert_reduced(batched[5][i], single[5], "combine")


def test_vmap_with_an_unbatched_routing_and_of_gradients():
    x, routing, p = _problem()
    xs = jnp.stack([x, -x, 2 * x])

    def loss(x, p):
        out, pp, row_id_map, _, _ = mj.token_dispatch(x, None, 12, p, **routing)
        return jnp.sum(mj.token_combine(out * pp[:, None], row_id_map, p) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(xs, p)
    for i in range(3):
        single = jax.grad(loss, argnums=(0, 1))(xs[i], p)
        for got, expected in zip(grads, single, strict=True):
            np.testing.assert_allclose(got[i], expected, rtol=1e-5, atol=1e-5)


def test_nested_vmap_of_chunk_sort():
    rows = jnp.arange(2 * 3 * 6 * 2, dtype=jnp.float32).reshape(2, 3, 6, 2)
    sizes = jnp.array([2, 3, 1], jnp.int32)
    order = jnp.array([2, 0, 1], jnp.int32)
    sort = jax.vmap(jax.vmap(lambda r: mj.sort_chunks_by_index(r, sizes, order)))
    out, dst = jax.jit(sort)(rows)
    expected_out, expected_dst = reference.sort_chunks_by_index(rows[1, 2], sizes, order)
    assert_same(out[1, 2], expected_out, "output")
    assert_same(dst[1, 2], expected_dst, "row_id_map")


# argument errors -----------------------------------------------------------------------------------------


def _dispatch_call(**changes):
    x, routing, p = _problem(kind="mask")
    args = dict(inp=x, routing_map=routing["routing_map"], num_out_tokens=12, probs=p)
    args.update(changes)
    return lambda: mj.token_dispatch(**args)


def _index_call(ids, num_experts):
    return _dispatch_call(routing_map=None, indices=ids, num_experts=num_experts, probs=None)


def _sort_call(sizes, order, **kwargs):
    return lambda: mj.sort_chunks_by_index(_ROWS, jnp.array(sizes), jnp.array(order), **kwargs)


# Value rules (id ranges, split sizes) run where reading values is free: CPU arrays. On a GPU, device arrays
# are documented as unchecked (numpy inputs are still checked, see the np.asarray case).
_ON_CPU = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="device arrays are read only with MOETRITON_CHECK=1 (test_index_safety.py)",
)


def _cpu_only(call, argument):
    return pytest.param(call, argument, marks=_ON_CPU)


_IDS = jnp.zeros((6, 2), jnp.int32)
_MAP = jnp.zeros((6, 6), jnp.int32)  # S = 2
_ROWS = jnp.zeros((6, 5), jnp.float32)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (_dispatch_call(inp=jnp.zeros(6)), "inp"),
        (_dispatch_call(inp=jnp.zeros((6, 5), jnp.int32)), "inp"),
        (_dispatch_call(routing_map=jnp.zeros((5, 4), bool)), "routing_map"),
        (_dispatch_call(routing_map=None), "routing_map / indices"),
        (_dispatch_call(indices=_IDS), "routing_map / indices"),
        (_index_call(_IDS, None), "num_experts"),
        (_index_call(_IDS.astype(jnp.float32), 4), "indices"),
        _cpu_only(_index_call(_IDS.at[0, 0].set(4), 4), "indices"),
        _cpu_only(_index_call(_IDS.at[0, 0].set(-2), 4), "indices"),
        (_index_call(np.asarray(_IDS.at[5, 1].set(9)), 4), "indices"),
        (_dispatch_call(num_out_tokens=None), "num_out_tokens"),
        (_dispatch_call(num_out_tokens=jnp.int32(12)), "num_out_tokens"),
        (_dispatch_call(num_out_tokens=-1), "num_out_tokens"),
        (_dispatch_call(align_size=0), "align_size"),
        (_dispatch_call(probs=jnp.zeros((6, 2))), "probs"),
        (_dispatch_call(scales=jnp.zeros((5, 2))), "scales"),
        (_dispatch_call(num_shards=0), "num_shards"),
        (_dispatch_call(num_shards=4), "inp"),
        (_dispatch_call(num_shards=3, num_out_tokens=10), "num_out_tokens"),
        (lambda: mj.token_combine(_ROWS.astype(jnp.float8_e4m3fn), _MAP), "inp"),
        (lambda: mj.token_combine(_ROWS, _MAP.astype(jnp.float32)), "row_id_map"),
        (lambda: mj.token_combine(_ROWS, _MAP[:, :0]), "row_id_map"),
        (lambda: mj.token_combine(_ROWS, _MAP, jnp.zeros((6, 3))), "merging_probs"),
        (lambda: mj.token_combine(_ROWS, _MAP, None, jnp.zeros((2, 2), jnp.int32)), "pad_offsets"),
        (lambda: mj.token_combine(_ROWS[:5], _MAP, num_shards=2), "inp"),
        (lambda: mj.sort_chunks_by_index(_ROWS, jnp.array([1.0, 2.0]), jnp.array([1, 0])), "split_sizes"),
        (lambda: mj.sort_chunks_by_index(_ROWS, jnp.array([1, 2]), jnp.array([1, 0, 2])), "sorted_indices"),
        _cpu_only(
            lambda: mj.sort_chunks_by_index(_ROWS, jnp.array([1, -1]), jnp.array([1, 0])), "split_sizes"
        ),
        _cpu_only(
            lambda: mj.sort_chunks_by_index(_ROWS, jnp.array([4, 3]), jnp.array([1, 0])), "split_sizes"
        ),
        _cpu_only(
            lambda: mj.sort_chunks_by_index(_ROWS, jnp.array([1, 2]), jnp.array([1, 1])), "sorted_indices"
        ),
        (lambda: mj.sort_chunks_by_index(_ROWS, jnp.array([1, 2]), jnp.array([1, 0]), jnp.zeros(5)), "probs"),
        _cpu_only(_sort_call([1, 4], [0, 0], num_shards=2), "split_sizes"),
        (_sort_call([1, 2, 3], [0, 1, 2], num_shards=2), "split_sizes"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        call()


def test_traced_ids_out_of_range_are_not_checked_and_count_as_no_expert():
    ids = jnp.array([[0, 7], [1, -3], [2, 1]], jnp.int32)
    x = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    got = jax.jit(lambda x, ids: mj.token_dispatch(x, None, 6, indices=ids, num_experts=3))(x, ids)
    valid = jnp.where((ids >= 0) & (ids < 3), ids, -1)
    expected = mj.token_dispatch(x, None, 6, indices=valid, num_experts=3)
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e, "out-of-range ids")


# execution targets ---------------------------------------------------------------------------------------


def _uses_callback(f, *args) -> bool:
    return "pure_callback" in str(jax.make_jaxpr(f)(*args))


@pytest.mark.skipif(executor.on_gpu(), reason="checks the CPU targets (interpreter, reference); GPU compiles")
def test_cpu_runs_the_interpreter_or_else_the_reference(monkeypatch):
    x, routing, p = _problem()

    def pipeline(x, p):
        out, _, row_id_map, _, _ = mj.token_dispatch(x, None, 12, p, **routing)
        return out, mj.token_combine(out, row_id_map, p)

    assert _uses_callback(pipeline, x, p) == kernels.INTERPRETER
    interpreted = jax.jit(pipeline)(x, p)
    monkeypatch.setattr(executor, "INTERPRETER", False)
    jax.clear_caches()  # traces are cached: the ones made with the interpreter on must go
    try:
        assert not _uses_callback(pipeline, x, p)
        fallback = jax.jit(pipeline)(x, p)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # and so must the reference traces, before other tests reuse them
    assert_same(fallback[0], interpreted[0], "dispatch")
    assert_reduced(fallback[1], interpreted[1], "combine")


@pytest.mark.gpu
@pytest.mark.skipif(not executor.on_gpu(), reason="checks the compiled jax-triton path, which needs a GPU")
def test_gpu_lowers_to_triton_calls_without_host_callbacks():
    x, routing, p = _problem()
    hlo = jax.jit(lambda x, p: mj.token_dispatch(x, None, 12, p, **routing)).lower(x, p).as_text()
    assert "triton_kernel_call" in hlo
    assert "callback" not in hlo


# plan variants -------------------------------------------------------------------------------------------


def _launch_of(plan: kernels.Plan, name: str) -> kernels.Launch:
    return next(launch for launch in plan.launches if launch.kernel.__name__ == name)


_VARIANTS = {
    # name: (num_tokens, hidden, num_experts, topk, kind, align_size)
    "hidden split over programs": (3, 4100, 3, 2, "indices", None),
    # Compiled plans may take 128-token blocks from the autotune cache; the interpreter's use 16.
    "many token blocks": (600 if executor.on_gpu() else 130, 3, 5, 2, "indices", 8),
    "experts tiled past 256": (3, 4, 300, 3, "mask", None),
    "mask with padding": (9, 6, 5, 5, "mask", 4),
    "no tokens": (0, 4, 3, 2, "mask", 2),
}


def _variant_holds(name: str, plan: kernels.Plan, hidden: int, num_experts: int) -> bool:
    """The plan really takes the branch the variant is named after."""
    if name == "hidden split over programs":
        return _launch_of(plan, "_dispatch_kernel").constexprs["BLOCK_H"] < hidden
    if name == "many token blocks":
        return _launch_of(plan, "_count_experts_kernel").grid[0] > 1
    if name == "experts tiled past 256":
        return _launch_of(plan, "_count_experts_kernel").constexprs["TILE_S"] < num_experts
    if name == "mask with padding":
        return _launch_of(plan, "_dispatch_kernel").constexprs["PADDED"]
    # No tokens: no count launch, and a dispatch launch of fill programs only.
    return (
        all(launch.kernel.fn.__name__ != "_count_experts_kernel" for launch in plan.launches)
        and _launch_of(plan, "_dispatch_kernel").grid[0]
        == _launch_of(plan, "_dispatch_kernel").constexprs["NUM_FILL"]
    )


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_plan_variants_forward_and_backward(variant):
    num_tokens, hidden, num_experts, topk, kind, align_size = _VARIANTS[variant]
    x, routing, p = _problem(num_tokens, hidden, num_experts, topk, kind)
    is_mask = kind == "mask"
    plan = kernels.dispatch_plan(
        num_tokens=num_tokens,
        hidden=hidden,
        num_slots=p.shape[1],
        num_experts=num_experts,
        is_mask=is_mask,
        num_out_tokens=num_tokens * topk,
        align_size=align_size,
        element_bytes=4,
        has_probs=True,
        scale_cols=None,
        device=executor.device_info(),
    )
    assert _variant_holds(variant, plan, hidden, num_experts)

    def pipeline(api, x, p):
        out, pp, row_id_map, pad_offsets, counts = api.token_dispatch(
            x, num_out_tokens=num_tokens * topk, probs=p, align_size=align_size, **routing
        )
        # Weighted and unweighted combine: both backward plans run under jax.grad below.
        weighted = api.token_combine(out, row_id_map, p, pad_offsets)
        back = weighted + api.token_combine(out, row_id_map, None, pad_offsets)
        return (out, pp, row_id_map, pad_offsets, counts), back

    got, back = jax.jit(lambda x, p: pipeline(mj, x, p))(x, p)
    expected, back_ref = jax.jit(lambda x, p: pipeline(reference, x, p))(x, p)
    for name, g, e in zip(("output", "probs", "map", "pad", "counts"), got, expected, strict=True):
        assert_same(g, e, name)
    assert_reduced(back, back_ref, "combine")
    grads = jax.jit(jax.grad(lambda x, p: jnp.sum(pipeline(mj, x, p)[1]), argnums=(0, 1)))(x, p)
    grads_ref = jax.grad(lambda x, p: jnp.sum(pipeline(reference, x, p)[1]), argnums=(0, 1))(x, p)
    for got_grad, expected_grad in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got_grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_chunk_sort_with_the_hidden_axis_split_over_programs():
    rows = jnp.asarray(RNG.standard_normal((7, 2100), dtype=np.float32))
    sizes, order = jnp.array([3, 0, 4], jnp.int32), jnp.array([1, 2, 0], jnp.int32)
    device = executor.device_info()
    plan = kernels.sort_chunks_plan(
        num_rows=7, hidden=2100, num_splits=3, element_bytes=4, has_probs=False, backward=False, device=device
    )
    assert plan.launches[0].grid[1] > 1
    got = jax.jit(mj.sort_chunks_by_index)(rows, sizes, order)
    expected = reference.sort_chunks_by_index(rows, sizes, order)
    for name, g, e in zip(("output", "map"), got, expected, strict=True):
        assert_same(g, e, name)
    grad = jax.jit(jax.grad(lambda r: jnp.sum(mj.sort_chunks_by_index(r, sizes, order)[0] * rows)))(rows)
    assert_same(grad, rows[np.asarray(got[1])], "gradient")


def test_compiled_path_skips_launches_of_no_program(monkeypatch):
    """A zero grid (an empty batch) never reaches jax-triton, whose CUDA launch would refuse it; the launch
    after it still runs, and an output no launch wrote comes back as zeros. jax-triton is faked: the
    compiled path is otherwise GPU-only."""
    calls = []

    class FakeJaxTriton:
        @staticmethod
        def triton_call(*args, kernel, out_shape, grid, **options):
            calls.append(grid)
            return [jnp.full(spec.shape, 7, spec.dtype) for spec in out_shape]

    monkeypatch.setattr(executor, "_jax_triton", lambda: FakeJaxTriton)
    buffers = dict(
        empty=kernels.Buffer((0, 4), "float32"),
        counts=kernels.Buffer((3,), "int32", zero=True),
        out=kernels.Buffer((2,), "int32"),
    )
    launches = (
        kernels.Launch(None, (0,), ("x",), ("empty", "counts")),
        kernels.Launch(None, (2, 1), ("x",), ("out",)),
    )
    plan = kernels.Plan(buffers, launches, ("empty", "counts", "out"))
    empty, counts, out = executor._run_triton(plan, dict(x=jnp.zeros((0, 4))))
    assert calls == [(2, 1)]
    assert empty.shape == (0, 4)
    np.testing.assert_array_equal(np.asarray(counts), np.zeros(3, np.int32))
    np.testing.assert_array_equal(np.asarray(out), np.full(2, 7, np.int32))
