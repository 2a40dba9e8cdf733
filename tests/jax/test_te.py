"""moetriton.jax.te, the TransformerEngine-compatible JAX surface, against references written from TE's
specification (docs/te_migration.md, "JAX"): TE's row map layout and padding, per-shard semantics on a CPU
mesh (run in a subprocess with 4 host devices: `python -m tests.jax.test_te SCENARIO`), the router's enums,
formats and argument errors, and hostile TE row maps given to token_combine (the index rule, inside guard
zones when the kernels are interpreted)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetriton.jax import router, te
from tests.jax._helpers import run_python
from tests.jax.test_index_safety import guarded

NUM_TOKENS, HIDDEN, NUM_EXPERTS, TOPK = 8, 4, 4, 2


# references ----------------------------------------------------------------------------------------------


def _mask(rng, num_tokens=NUM_TOKENS, num_experts=NUM_EXPERTS, topk=TOPK) -> np.ndarray:
    """int32 [T, E] with `topk` experts per token, one token routed nowhere."""
    mask = np.zeros((num_tokens, num_experts), np.int32)
    for token in range(1, num_tokens):
        mask[token, rng.choice(num_experts, topk, replace=False)] = 1
    return mask


def te_dispatch_reference(x, mask, probs, num_out_tokens, align_size):
    """TE's token_dispatch from its specification: rows expert-major, token order within an expert; a
    token's row_id_map lists its rows (before padding) descending, then their experts, then the count."""
    num_tokens, num_experts = mask.shape
    counts = mask.sum(0)
    aligned = counts if align_size is None else -(-counts // align_size) * align_size
    pad_offsets = np.cumsum(aligned) - aligned - (np.cumsum(counts) - counts)
    if align_size is None:
        num_rows = num_out_tokens
    else:
        num_rows = (num_out_tokens + num_experts * (align_size - 1)) // align_size * align_size
    output = np.zeros((num_rows, x.shape[1]), x.dtype)
    permuted_probs = np.zeros(num_rows, np.float32)
    row_id_map = np.full((num_tokens, 2 * num_experts + 1), -1, np.int32)
    taken = np.cumsum(counts) - counts  # next unpadded row of every expert
    for token in range(num_tokens):
        experts = np.flatnonzero(mask[token])
        rows = taken[experts].copy()
        taken[experts] += 1
        for expert, row in zip(experts, rows, strict=True):
            output[row + pad_offsets[expert]] = x[token]
            if probs is not None:
                permuted_probs[row + pad_offsets[expert]] = probs[token, expert]
        row_id_map[token, : len(rows)] = rows[::-1]
        row_id_map[token, num_experts : num_experts + len(rows)] = experts[::-1]
        row_id_map[token, -1] = len(rows)
    return output, permuted_probs, row_id_map, pad_offsets, aligned


def te_combine_reference(inp, row_id_map, weights, pad_offsets):
    """TE's token_combine with the rule for maps not to be trusted: the first clamp(count, 0, E) entries,
    each adding weight * inp[row + pad offset] unless its expert is outside [0, E), its row or offset is
    beyond 2**30 - 1 in magnitude, or the padded row is outside the buffer. fp64 sums."""
    num_tokens, columns = row_id_map.shape
    num_experts = (columns - 1) // 2
    bound = 2**30 - 1
    out = np.zeros((num_tokens, inp.shape[1]))
    for token in range(num_tokens):
        for slot in range(int(np.clip(row_id_map[token, -1], 0, num_experts))):
            row, expert = int(row_id_map[token, slot]), int(row_id_map[token, num_experts + slot])
            if not 0 <= expert < num_experts or abs(row) > bound:
                continue
            if pad_offsets is not None:
                if abs(int(pad_offsets[expert])) > bound:
                    continue
                row += int(pad_offsets[expert])
            if 0 <= row < inp.shape[0]:
                out[token] += (1.0 if weights is None else float(weights[token, expert])) * inp[row]
    return out


def _inputs(seed=0, num_tokens=NUM_TOKENS):
    rng = np.random.default_rng(seed)
    mask = _mask(rng, num_tokens)
    x = rng.integers(-7, 8, (num_tokens, HIDDEN)).astype(np.float32)
    probs = rng.uniform(0.1, 1.0, mask.shape).astype(np.float32)
    return mask, x, probs


# dispatch / combine --------------------------------------------------------------------------------------


def test_row_map_of_te_worked_example():
    mask = jnp.array([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]], jnp.int32)
    _, _, row_id_map, pad_offsets, counts = te.token_dispatch(jnp.ones((5, 2)), mask, 7)
    unused = -1
    expected = [
        [3, 0, unused, 1, 0, unused, 2],
        [5, 1, unused, 2, 0, unused, 2],
        [6, unused, unused, 2, unused, unused, 1],
        [4, 2, unused, 1, 0, unused, 2],
        [unused] * 6 + [0],
    ]
    assert row_id_map.dtype == jnp.int32 and row_id_map.tolist() == expected
    assert pad_offsets is None and counts.tolist() == [3, 2, 2]


@pytest.mark.parametrize("align_size", [None, 4])
@pytest.mark.parametrize("with_probs", [True, False])
def test_dispatch_matches_te_reference(align_size, with_probs):
    mask, x, probs = _inputs()
    num_out_tokens = int(mask.sum())
    out, permuted_probs, row_id_map, pad_offsets, counts = jax.jit(
        lambda x, mask, probs: te.token_dispatch(x, mask, num_out_tokens, probs, align_size)
    )(x, mask, probs if with_probs else None)
    ref = te_dispatch_reference(x, mask, probs, num_out_tokens, align_size)
    np.testing.assert_array_equal(out, ref[0])
    np.testing.assert_array_equal(row_id_map, ref[2])
    np.testing.assert_array_equal(counts, ref[4])
    if with_probs:
        np.testing.assert_array_equal(permuted_probs, ref[1])
    else:
        assert permuted_probs is None
    if align_size is None:
        assert pad_offsets is None
    else:
        np.testing.assert_array_equal(pad_offsets, ref[3])
        assert all(count % align_size == 0 for count in counts.tolist())


@pytest.mark.parametrize("align_size", [None, 4])
def test_combine_and_gradients_match_te_reference(align_size):
    mask, x, probs = _inputs(1)
    num_out_tokens = int(mask.sum())
    out, _, row_id_map, pad_offsets, _ = te.token_dispatch(x, mask, num_out_tokens, align_size=align_size)
    expert_out = out * 2 + 1  # pad rows become nonzero: combine must not read them
    merging = (probs * mask).astype(np.float32)
    combined = te.token_combine(expert_out, row_id_map, merging, pad_offsets)
    expected = te_combine_reference(np.asarray(expert_out), np.asarray(row_id_map), merging, pad_offsets)
    np.testing.assert_allclose(combined, expected, rtol=1e-6)
    assert te.token_combine(expert_out, row_id_map).shape == (NUM_TOKENS, HIDDEN)

    # Gradients of the TE surface against jax.grad of the same layer written with gathers.
    rows = np.asarray(row_id_map)
    ref_pad = np.zeros(NUM_EXPERTS, np.int32) if pad_offsets is None else np.asarray(pad_offsets)

    def reference_layer(x, probs, merging):
        tokens, slots = np.nonzero(rows[:, :NUM_EXPERTS] >= 0)
        experts = rows[tokens, NUM_EXPERTS + slots]
        dest = rows[tokens, slots] + ref_pad[experts]
        buffer = jnp.zeros(out.shape).at[dest].set(x[tokens] * probs[tokens, experts][:, None])
        return (
            jnp.zeros((NUM_TOKENS, HIDDEN)).at[tokens].add(merging[tokens, experts][:, None] * buffer[dest])
        )

    def te_layer(x, probs, merging):
        out, permuted_probs, row_id_map, pad_offsets, _ = te.token_dispatch(
            x, mask, num_out_tokens, probs, align_size
        )
        return te.token_combine(out * permuted_probs[:, None], row_id_map, merging, pad_offsets)

    loss = lambda layer: lambda *args: jnp.sum(jnp.sin(layer(*args)))
    got = jax.jit(jax.grad(loss(te_layer), argnums=(0, 1, 2)))(x, probs, merging)
    want = jax.grad(loss(reference_layer), argnums=(0, 1, 2))(x, probs, merging)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g * (w != 0) if g.shape == mask.shape else g, w, rtol=1e-5, atol=1e-6)


def test_padded_buffer_has_te_worst_case_shape_and_zero_padding():
    mask, x, _ = _inputs(2)
    num_out_tokens, align_size = int(mask.sum()), 8
    out, _, _, _, counts = te.token_dispatch(x, mask, num_out_tokens, align_size=align_size)
    worst = (num_out_tokens + NUM_EXPERTS * (align_size - 1)) // align_size * align_size
    assert out.shape == (worst, HIDDEN)
    starts = np.cumsum(counts) - counts
    used = np.zeros(worst, bool)
    for start, count in zip(starts, mask.sum(0), strict=True):
        used[start : start + count] = True
    assert (np.asarray(out)[~used] == 0).all()


def test_three_dim_inputs_flatten_into_tokens():
    mask, x, probs = _inputs(3)
    flat = te.token_dispatch(x, mask, int(mask.sum()), probs)
    batched = te.token_dispatch(x.reshape(2, 4, HIDDEN), mask.reshape(2, 4, -1), int(mask.sum()), probs)
    assert flat[3] is batched[3] is None
    for a, b in zip(flat[:3] + flat[4:], batched[:3] + batched[4:], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda x, m: te.token_dispatch(x, m, 0), "num_out_tokens"),
        (lambda x, m: te.token_dispatch(x, m, 4.0), "num_out_tokens"),
        (lambda x, m: te.token_combine(x, jnp.zeros((8, 4), jnp.int32)), "row_id_map"),
        (lambda x, m: te.token_combine(x, jnp.zeros((8, 9), jnp.int32), jnp.ones((7, 4))), "merging_probs"),
        (
            lambda x, m: te.token_combine(x, jnp.zeros((8, 9), jnp.int32), None, jnp.zeros(3, jnp.int32)),
            "pad",
        ),
    ],
)
def test_argument_errors_name_the_argument(call, error):
    mask, x, _ = _inputs()
    with pytest.raises(ValueError, match=error):
        call(jnp.asarray(x), jnp.asarray(mask))


def test_sort_chunks_by_index_is_te_s():
    x = jnp.arange(6.0)[:, None]
    out, row_id_map = te.sort_chunks_by_index(x, jnp.array([2, 3, 1]), jnp.array([2, 0, 1]))
    assert out[:, 0].tolist() == [5.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert row_id_map.tolist() == [1, 2, 3, 4, 5, 0]


# hostile row maps ----------------------------------------------------------------------------------------


def _hostile_map(rng, num_rows):
    """A TE-layout map mixing valid entries with rows and experts out of range on both sides, int32
    extremes, and counts below 0 and above E."""
    extremes = np.array([-(2**31), -1, num_rows, num_rows + 1, 2**31 - 1, 2**30, -(2**30)], np.int64)
    row_id_map = rng.integers(0, num_rows, (NUM_TOKENS, 2 * NUM_EXPERTS + 1))
    row_id_map[:, NUM_EXPERTS:-1] = rng.integers(0, NUM_EXPERTS, (NUM_TOKENS, NUM_EXPERTS))
    hostile = rng.random(row_id_map.shape) < 0.35
    row_id_map[hostile] = rng.choice(extremes, hostile.sum())
    row_id_map[:, -1] = rng.choice([-3, 0, 1, NUM_EXPERTS, NUM_EXPERTS + 2, 2**31 - 1], NUM_TOKENS)
    return row_id_map.astype(np.int32)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("padded", [False, True])
@guarded()
def test_hostile_row_maps_add_nothing_outside_the_buffer(seed, padded):
    rng = np.random.default_rng(seed)
    num_rows = 10
    inp = rng.standard_normal((num_rows, HIDDEN)).astype(np.float32)
    row_id_map = _hostile_map(rng, num_rows)
    weights = rng.random((NUM_TOKENS, NUM_EXPERTS)).astype(np.float32)
    pad_offsets = None
    if padded:
        pad_offsets = rng.choice(np.array([0, 1, 3, -2, 2**30, 2**31 - 1, -(2**31)], np.int64), NUM_EXPERTS)
        pad_offsets = pad_offsets.astype(np.int32)
    combine = jax.jit(lambda inp, row_id_map, weights, pad: te.token_combine(inp, row_id_map, weights, pad))
    got = combine(inp, row_id_map, weights, pad_offsets)
    np.testing.assert_allclose(got, te_combine_reference(inp, row_id_map, weights, pad_offsets), rtol=1e-5)
    # The gradient reaches exactly the rows the reference reads (a row two entries name gets one of their
    # gradients, docs/design.md), and nothing else.
    grad = jax.jit(jax.grad(lambda inp: jnp.sum(combine(inp, row_id_map, None, pad_offsets))))(inp)
    read = te_combine_reference(np.eye(num_rows), row_id_map, None, pad_offsets).sum(0)
    np.testing.assert_array_equal(np.asarray(grad)[:, 0] != 0, read > 0)


# router --------------------------------------------------------------------------------------------------


def test_enums_have_te_members_and_values():
    assert {m.name: m.value for m in te.ScoreFunction} == {"SIGMOID": 0, "SOFTMAX": 1}
    assert {m.name: m.value for m in te.RoutingMapFormat} == {"BYTEMAP": 0, "BITMAP_U8": 1}


def _logits(num_tokens=6, num_experts=10):
    return jnp.asarray(
        np.random.default_rng(0).permutation(num_tokens * num_experts).reshape(num_tokens, -1) * 0.1
    )


@pytest.mark.parametrize("score_function", ["softmax", "SIGMOID", te.ScoreFunction.SOFTMAX])
@pytest.mark.parametrize("routing_map_format", [te.RoutingMapFormat.BITMAP_U8, "bitmap_u8", 1])
def test_bitmap_is_the_lsb_first_packing_of_the_bytemap(score_function, routing_map_format):
    logits = _logits()
    probs, bytemap = te.fused_topk_with_score_function(logits, 3, score_function=score_function)
    bit_probs, bitmap = te.fused_topk_with_score_function(
        logits, 3, score_function=score_function, routing_map_format=routing_map_format
    )
    assert bytemap.dtype == jnp.bool_ and bitmap.dtype == jnp.uint8 and bitmap.shape == (6, 2)
    np.testing.assert_array_equal(bitmap, np.packbits(np.asarray(bytemap), axis=-1, bitorder="little"))
    np.testing.assert_array_equal(probs, bit_probs)


def test_topk_maps_te_defaults_onto_the_native_router():
    logits = _logits()
    got = te.fused_topk_with_score_function(logits, 4, False, -1, -1, 2, "sigmoid", jnp.linspace(0, 0.3, 10))
    want = router.fused_topk_with_score_function(
        logits, 4, False, None, None, 2.0, "sigmoid", jnp.linspace(0, 0.3, 10)
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    grouped = te.fused_topk_with_score_function(logits, 4, num_groups=2, group_topk=1)
    np.testing.assert_array_equal(
        grouped[1], router.fused_topk_with_score_function(logits, 4, False, 2, 1)[1]
    )


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_scores_are_dense_scores_in_the_logits_dtype(score_function):
    logits = _logits().astype(jnp.bfloat16)
    scores, routing_map = te.fused_topk_with_score_function(
        logits, 3, True, 2, 1, 3.0, score_function, None, compute_aux_scores=True
    )
    want_map, want_scores = router.fused_compute_score_for_moe_aux_loss(logits, 3, score_function)
    assert scores.dtype == jnp.bfloat16
    np.testing.assert_array_equal(scores, want_scores.astype(jnp.bfloat16))
    np.testing.assert_array_equal(routing_map, want_map)


def test_aux_loss_uses_te_s_token_and_expert_counts():
    probs = jnp.asarray(np.random.default_rng(1).random((5, 4)), jnp.float32)
    counts = jnp.array([3, 1, 4, 2])
    loss = te.fused_moe_aux_loss(probs, counts, topk=2, coeff=0.5)
    np.testing.assert_allclose(loss, 4 * 0.5 / (2 * 25) * float(probs.sum(0) @ counts), rtol=1e-6)
    grad = jax.grad(lambda p: te.fused_moe_aux_loss(p, counts, 2, 0.5))(probs)
    np.testing.assert_allclose(grad, np.broadcast_to(4 * 0.5 / 50 * np.asarray(counts), (5, 4)), rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"scaling_factor": jnp.float32(1.5)}, TypeError),
        ({"expert_bias": jnp.zeros(10)}, ValueError),  # with softmax
        ({"score_function": "sqrtsoftplus"}, ValueError),
        ({"score_function": 1}, ValueError),
        ({"routing_map_format": 2}, ValueError),
        ({"routing_map_format": "bitmap"}, ValueError),
    ],
)
def test_router_argument_errors_are_te_s(kwargs, error):
    with pytest.raises(error):
        te.fused_topk_with_score_function(_logits(), 2, **kwargs)


# per-shard semantics (subprocess with 4 host devices) ----------------------------------------------------

#: name -> (mesh shape, mesh axes, mesh axes of the token axis, align_size); "-explicit": the mesh's axes
#: are jax.make_mesh's default Explicit ones, where the arrays' types carry their shardings (else Auto)
SCENARIOS = {
    "dp2": ((2,), ("dp",), ("dp",), None),
    "dp2-tp2-padded": ((2, 2), ("dp", "tp"), ("dp",), 4),
    "dp2-tp2-padded-explicit": ((2, 2), ("dp", "tp"), ("dp",), 4),
    "dp4-padded": ((4,), ("dp",), ("dp",), 4),
    "tp2-replicated": ((2,), ("tp",), (), 4),
}


def check_scenario(name: str) -> None:
    """Dispatch -> combine under jax.jit with the tokens sharded: every token shard is dispatched on its
    own into its block of the output (num_out_tokens // shards rows each, per-shard padding aligned), the
    row map's rows are local, counts and pad offsets are TE's (whole routing map), gradients per shard."""
    mesh_shape, axes, token_axes, align_size = SCENARIOS[name]
    if name.endswith("-explicit"):
        mesh = jax.make_mesh(mesh_shape, axes)
        assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}, mesh.axis_types
    else:
        mesh = jax.make_mesh(mesh_shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    shards = int(np.prod([mesh.shape[a] for a in token_axes]))
    num_tokens = 16
    mask, x, probs = _inputs(5, num_tokens)
    local_out = num_tokens * TOPK // shards
    if align_size is None:
        num_out_tokens, local_rows = num_tokens * TOPK, local_out
    else:  # TE's sizing: each shard's worst case, times the shards
        local_rows = (local_out + NUM_EXPERTS * (align_size - 1)) // align_size * align_size
        num_out_tokens = local_rows * shards
    spec = jax.sharding.PartitionSpec(token_axes or None)
    x, mask, probs = (jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in (x, mask, probs))

    @jax.jit
    def dispatch(x, mask, probs):
        return te.token_dispatch(x, mask, num_out_tokens, probs, align_size)

    out, permuted_probs, row_id_map, pad_offsets, counts = dispatch(x, mask, probs)
    rows = out.shape[0] // shards
    if token_axes:
        assert out.sharding.spec[0] == row_id_map.sharding.spec[0] == token_axes[0], out.sharding
    blocks = np.split(np.arange(num_tokens), shards)
    for shard, tokens in enumerate(blocks):
        # A shard's padded layout is aligned within its block; TE's row map excludes the whole map's padding.
        ref = te_dispatch_reference(
            np.asarray(x)[tokens], np.asarray(mask)[tokens], np.asarray(probs)[tokens], local_out, align_size
        )
        block = slice(shard * rows, (shard + 1) * rows)
        np.testing.assert_array_equal(np.asarray(out)[block][: len(ref[0])], ref[0])
        assert (np.asarray(out)[block][len(ref[0]) :] == 0).all()
        np.testing.assert_array_equal(np.asarray(permuted_probs)[block][: len(ref[1])], ref[1])
        te_map = np.asarray(row_id_map)[tokens]
        if align_size is None:
            np.testing.assert_array_equal(te_map, ref[2])
        else:
            listed = ref[2][:, :NUM_EXPERTS] >= 0
            experts = np.where(listed, ref[2][:, NUM_EXPERTS:-1], 0)
            padded_rows = ref[2][:, :NUM_EXPERTS] + ref[3][experts]
            global_rows = te_map[:, :NUM_EXPERTS] + np.asarray(pad_offsets)[experts]
            np.testing.assert_array_equal(
                np.where(listed, global_rows, -1), np.where(listed, padded_rows, -1)
            )
            np.testing.assert_array_equal(te_map[:, NUM_EXPERTS:], ref[2][:, NUM_EXPERTS:])
    whole = te_dispatch_reference(np.asarray(x), np.asarray(mask), None, num_tokens * TOPK, align_size)
    np.testing.assert_array_equal(counts, whole[4])
    if align_size is not None:
        np.testing.assert_array_equal(pad_offsets, whole[3])

    merging = jnp.asarray(
        np.asarray(mask) / np.maximum(np.asarray(mask).sum(1, keepdims=True), 1), jnp.float32
    )

    def roundtrip(x, mask, merging):
        out, _, row_id_map, pad_offsets, _ = te.token_dispatch(x, mask, num_out_tokens, None, align_size)
        return te.token_combine(out, row_id_map, merging, pad_offsets)

    program = jax.jit(roundtrip).lower(x, mask, merging).compile().as_text()
    assert not any(c in program for c in ("all-gather", "all-to-all", "collective-permute")), "tokens moved"
    np.testing.assert_allclose(
        jax.jit(roundtrip)(x, mask, merging),
        np.asarray(x) * (np.asarray(mask).sum(1) > 0)[:, None],
        rtol=1e-6,
    )
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(roundtrip(*a) ** 2)))(x, mask, merging)
    np.testing.assert_allclose(grad, 2 * np.asarray(x) * (np.asarray(mask).sum(1) > 0)[:, None], rtol=1e-6)
    print(f"{name}: ok")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_per_shard_semantics_on_a_cpu_mesh(scenario):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    result = run_python(["-m", "tests.jax.test_te", scenario], env)
    assert result.returncode == 0 and f"{scenario}: ok" in result.stdout, result.stdout + result.stderr


if __name__ == "__main__":
    check_scenario(sys.argv[1])
