"""moetriton.jax and moetriton.torch run the same kernels: the same inputs give bit-identical outputs and
gradients (on CPU both through the Triton interpreter, on GPU both compiled)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moetriton.jax as mj
from moetriton.kernels.rules import moe as layer_rules
from tests.strategies import FLOAT_DTYPES, chunk_problems, numpy_dtype, routing_problems

torch = pytest.importorskip("torch", reason="parity needs PyTorch next to JAX")
mt = pytest.importorskip("moetriton.torch")

_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_BITS = {1: (np.uint8, torch.uint8), 2: (np.uint16, torch.int16), 4: (np.uint32, torch.int32)}


def _torch(values: np.ndarray, dtype: str | None = None) -> "torch.Tensor":
    tensor = torch.from_numpy(np.ascontiguousarray(values)).to(_DEVICE)
    return tensor if dtype is None else tensor.to(_TORCH_DTYPES[dtype])


def _jax(values: np.ndarray, dtype: str | None = None) -> jax.Array:
    return jnp.asarray(values if dtype is None else values.astype(numpy_dtype(dtype)))


def _same(from_jax, from_torch, what: str) -> None:
    assert (from_jax is None) == (from_torch is None), what
    if from_jax is None:
        return
    array = np.asarray(from_jax)
    numpy_bits, torch_bits = _BITS[array.dtype.itemsize]
    expected = from_torch.detach().cpu().contiguous().view(torch_bits).numpy().view(numpy_bits)
    assert array.shape == expected.shape, (what, array.shape, expected.shape)
    np.testing.assert_array_equal(array.view(numpy_bits), expected, err_msg=what)


def _routing(problem, convert):
    routing = convert(problem.routing)
    if problem.kind == "mask":
        return routing, {}
    return None, {"indices": routing, "num_experts": problem.num_experts}


@settings(max_examples=15)
@given(routing_problems(), st.booleans())
def test_dispatch_is_bitwise_identical(problem, with_scales):
    results = []
    for convert, api in ((_jax, mj), (_torch, mt)):
        routing_map, kwargs = _routing(problem, convert)
        if with_scales:
            kwargs["scales"] = convert(np.arange(problem.num_tokens * 2, dtype=np.float32).reshape(-1, 2))
        results.append(
            api.token_dispatch(
                convert(problem.tokens, problem.dtype),
                routing_map,
                problem.num_out_tokens,
                convert(problem.probs),
                problem.align_size,
                **kwargs,
            )
        )
    names = ("output", "permuted_probs", "row_id_map", "pad_offsets", "tokens_per_expert", "scales")
    for name, from_jax, from_torch in zip(names, *results, strict=False):
        _same(from_jax, from_torch, name)


@settings(max_examples=15)
@given(routing_problems(dtypes=FLOAT_DTYPES))
def test_combine_and_all_gradients_are_bitwise_identical(problem):
    cotangent = np.linspace(-2, 2, problem.num_tokens * problem.hidden, dtype=np.float32)
    cotangent = cotangent.reshape(problem.num_tokens, problem.hidden)
    weights = problem.probs[::-1].copy()

    routing_map, kwargs = _routing(problem, _jax)

    def forward(x, p, w):
        out, permuted_probs, row_id_map, pad_offsets, _ = mj.token_dispatch(
            x, routing_map, problem.num_out_tokens, p, problem.align_size, **kwargs
        )
        return mj.token_combine(out * 2, row_id_map, w, pad_offsets), permuted_probs

    x, p, w = _jax(problem.tokens, problem.dtype), _jax(problem.probs), _jax(weights)
    (combined, permuted_probs), vjp = jax.vjp(forward, x, p, w)
    probs_cotangent = np.arange(permuted_probs.shape[0], dtype=np.float32)
    jax_grads = vjp((_jax(cotangent, problem.dtype), _jax(probs_cotangent)))

    routing_map, kwargs = _routing(problem, _torch)
    x = _torch(problem.tokens, problem.dtype).requires_grad_()
    p, w = _torch(problem.probs).requires_grad_(), _torch(weights).requires_grad_()
    out, torch_probs, row_id_map, pad_offsets, _ = mt.token_dispatch(
        x, routing_map, problem.num_out_tokens, p, problem.align_size, **kwargs
    )
    torch_combined = mt.token_combine(out * 2, row_id_map, w, pad_offsets)
    torch_grads = torch.autograd.grad(
        (torch_combined, torch_probs),
        (x, p, w),
        (_torch(cotangent, problem.dtype), _torch(probs_cotangent)),
        allow_unused=True,
    )

    _same(combined, torch_combined, "combine")
    for name, from_jax, from_torch, primal in zip(
        ("inp", "probs", "merging_probs"), jax_grads, torch_grads, (x, p, w), strict=True
    ):
        # PyTorch leaves the gradient of an input no output depends on (nothing routed) as None.
        _same(from_jax, torch.zeros_like(primal) if from_torch is None else from_torch, f"grad {name}")


@settings(max_examples=15)
@given(chunk_problems(), st.booleans())
def test_chunk_sort_and_its_gradient_are_bitwise_identical(problem, with_probs):
    args = lambda convert: (
        convert(problem.rows, problem.dtype),
        convert(problem.split_sizes.astype(np.int32)),
        convert(problem.sorted_indices.astype(np.int32)),
        convert(problem.probs) if with_probs else None,
    )
    from_jax = mj.sort_chunks_by_index(*args(_jax))
    from_torch = mt.sort_chunks_by_index(*args(_torch))
    assert len(from_jax) == len(from_torch) == 2 + with_probs
    for name, a, b in zip(("output", "row_id_map", "permuted_probs"), from_jax, from_torch, strict=False):
        _same(a, b, name)
    if problem.dtype not in FLOAT_DTYPES:
        return
    cotangent = np.linspace(-1, 1, problem.rows.size, dtype=np.float32).reshape(problem.rows.shape)
    _, vjp = jax.vjp(lambda x: mj.sort_chunks_by_index(x, *args(_jax)[1:3])[0], args(_jax)[0])
    x = args(_torch)[0].requires_grad_()
    (torch_grad,) = torch.autograd.grad(
        mt.sort_chunks_by_index(x, *args(_torch)[1:3])[0], x, _torch(cotangent, problem.dtype)
    )
    _same(vjp(_jax(cotangent, problem.dtype))[0], torch_grad, "grad inp")


@pytest.mark.parametrize(
    "recipe",
    [
        dict(
            score_function="sigmoid", num_groups=4, group_topk=2, group_score="top2_sum", normalize_topk=False
        ),
        dict(score_function="sigmoid", topk=1, normalize_topk=True, bias=True, scaling_factor=2.5),
        dict(score_function="softmax", use_pre_softmax=True, normalize_topk=True, bias=True),
        dict(score_function="softmax", use_pre_softmax=True, num_groups=4, group_topk=2, group_score="max"),
    ],
    ids=["deepseek_v3", "sigmoid_k1", "ernie", "group_max"],
)
def test_router_recipes_are_bitwise_identical(recipe):
    """Renormalisation, group scores and the softmax bias: probs, map, indices and logits gradient."""
    recipe = dict(recipe)
    topk, with_bias = recipe.pop("topk", 4), recipe.pop("bias", False)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((6, 12)).astype(np.float32)
    bias = rng.standard_normal(12).astype(np.float32)
    cotangent = np.linspace(-1, 1, 6 * 12, dtype=np.float32).reshape(6, 12)

    def route(api, convert, x):
        expert_bias = convert(bias) if with_bias else None
        return api.fused_topk_with_score_function(
            x, topk, expert_bias=expert_bias, return_indices=True, **recipe
        )

    from_jax = route(mj, _jax, _jax(logits))
    x = _torch(logits).requires_grad_()
    from_torch = route(mt, _torch, x)
    for name, a, b in zip(("probs", "routing_map", "indices"), from_jax, from_torch, strict=True):
        _same(a, b, name)
    jax_grad = jax.grad(lambda x: (route(mj, _jax, x)[0] * _jax(cotangent)).sum())(_jax(logits))
    (torch_grad,) = torch.autograd.grad((from_torch[0] * _torch(cotangent)).sum(), x)
    _same(jax_grad, torch_grad, "grad logits")


@pytest.mark.parametrize(("num_experts", "groups"), [(12, (2, 2)), (5, (None, None))])
def test_bitmap_router_and_dispatch_are_bitwise_identical(num_experts, groups):
    """The router's bitmap, its probs and logits gradient (the backward reads the bits), and a dispatch from
    the bitmap with its token and probs gradients."""
    logits = np.random.default_rng(num_experts).standard_normal((6, num_experts)).astype(np.float32)
    tokens = np.linspace(-1, 1, 6 * 8, dtype=np.float32).reshape(6, 8)
    cotangent = np.linspace(-1, 1, 6 * num_experts, dtype=np.float32).reshape(6, num_experts)
    options = dict(num_groups=groups[0], group_topk=groups[1], score_function="sigmoid")

    def route_and_dispatch(api, x, t):
        probs, bitmap = api.fused_topk_with_score_function(x, 4, routing_map_format="bitmap", **options)
        out, permuted_probs, row_id_map, _, counts = api.token_dispatch(
            t, bitmap, 24, probs, 4, num_experts=num_experts, routing_map_format="bitmap"
        )
        return probs, bitmap, out, permuted_probs, row_id_map, counts

    from_jax = route_and_dispatch(mj, _jax(logits), _jax(tokens))
    x, t = _torch(logits).requires_grad_(), _torch(tokens).requires_grad_()
    from_torch = route_and_dispatch(mt, x, t)
    names = ("probs", "bitmap", "output", "permuted_probs", "row_id_map", "tokens_per_expert")
    for name, a, b in zip(names, from_jax, from_torch, strict=True):
        _same(a, b, name)

    def loss(results, weights):
        probs, _, out, permuted_probs = results[:4]
        return (probs * weights).sum() + (out**2).sum() + (permuted_probs**2).sum()

    jax_grads = jax.grad(lambda x, t: loss(route_and_dispatch(mj, x, t), _jax(cotangent)), argnums=(0, 1))(
        _jax(logits), _jax(tokens)
    )
    torch_grads = torch.autograd.grad(loss(from_torch, _torch(cotangent)), (x, t))
    for name, a, b in zip(("grad logits", "grad tokens"), jax_grads, torch_grads, strict=True):
        _same(a, b, name)


# The MoE layers share their rules (moetriton.kernels.rules.moe): the same bad argument, the same error.

_H, _E, _F = 8, 4, 6
_LAYER_CASES = {
    "activation": dict(activation="tanh"),
    "score function": dict(score_function="relu"),
    "negative aux coefficient": dict(aux_loss_coeff=-1.0),
    "non-finite aux coefficient": dict(aux_loss_coeff=float("inf")),
    "aux coefficient of the wrong kind": dict(aux_loss_coeff="0.1"),
    "expert bias with softmax": dict(expert_bias=np.zeros(_E, np.float32)),
    "expert bias shape": dict(score_function="sigmoid", expert_bias=np.zeros(_E + 1, np.float32)),
    "gate_up shape": dict(gate_up=np.zeros((_E, _H, 2 * _F + 1), np.float32)),
    "down shape": dict(down=np.zeros((_E, _F, _H + 1), np.float32)),
    "non-gated gate_up": dict(activation="gelu"),
    "shared_down alone": dict(shared_down=np.zeros((_F, _H), np.float32)),
    "shared_gate_up alone": dict(shared_gate_up=np.zeros((_H, 2 * _F), np.float32)),
    "shared_down shape": dict(
        shared_gate_up=np.zeros((_H, 2 * _F), np.float32), shared_down=np.zeros((_F, _H + 1), np.float32)
    ),
    "shared_gate_up width": dict(
        shared_gate_up=np.zeros((_H, _F), np.float32), shared_down=np.zeros((_F, _H), np.float32)
    ),
    "shared_gate shape": dict(
        shared_gate_up=np.zeros((_H, 2 * _F), np.float32),
        shared_down=np.zeros((_F, _H), np.float32),
        shared_gate=np.zeros((1, _H), np.float32),
    ),
    "shared_gate alone": dict(shared_gate=np.zeros((_H, 1), np.float32)),
    "gate_bias shape": dict(gate_bias=np.zeros((_E, 1), np.float32)),
    "gate_up_bias width": dict(gate_up_bias=np.zeros((_E, _F), np.float32)),
    "down_bias shape": dict(down_bias=np.zeros((_E - 1, _H), np.float32)),
    "probs_on_input with topk 2": dict(probs_on_input=True),
    "probs_on_input not a bool": dict(probs_on_input=1, topk=1),
    "fp8 recipe": dict(fp8="e4m3"),
}


def _layer_error(framework: str, case: dict) -> Exception:
    """The error of one layer call with `case` overriding valid arguments (one device, all E experts)."""
    arrays = dict(
        x=np.zeros((2, 3, _H), np.float32),
        gate=np.zeros((_H, _E), np.float32),
        gate_up=np.zeros((_E, _H, 2 * _F), np.float32),
        down=np.zeros((_E, _F, _H), np.float32),
        expert_bias=None,
        **dict.fromkeys(layer_rules.SHARED_WEIGHTS),
        **dict.fromkeys(layer_rules.BIASES),
    )
    options = dict(topk=2, score_function="softmax", aux_loss_coeff=0.0, activation="swiglu")
    for name, value in case.items():
        (arrays if name in arrays else options)[name] = value
    optional = {name: arrays.pop(name) for name in list(arrays)[4:]}
    try:
        if framework == "torch":
            x, gate, gate_up, down = (_torch(value) for value in arrays.values())
            optional = {name: None if value is None else _torch(value) for name, value in optional.items()}
            mt.moe(x, gate.t(), gate_up, down, **optional, **options)
        else:
            optional = {name: None if value is None else _jax(value) for name, value in optional.items()}
            mj.moe(*map(_jax, arrays.values()), **optional, **options)
    except (TypeError, ValueError) as error:
        return error
    raise AssertionError(f"{framework}: no error for {case}")


@pytest.mark.parametrize("case", list(_LAYER_CASES))
def test_layers_refuse_the_same_arguments_with_the_same_error(case):
    torch_error = _layer_error("torch", _LAYER_CASES[case])
    jax_error = _layer_error("jax", _LAYER_CASES[case])
    assert type(torch_error) is type(jax_error) and str(torch_error) == str(jax_error), (
        torch_error,
        jax_error,
    )


def test_layers_name_their_exchanges_from_one_vocabulary():
    import importlib

    from moetriton.kernels.rules import moe as layer_rules

    torch_names = importlib.import_module("moetriton.torch.moe").EXCHANGES
    jax_names = importlib.import_module("moetriton.jax.moe").EXCHANGES
    assert set(torch_names) | set(jax_names) <= set(layer_rules.EXCHANGES)
    assert {"auto", "all_to_all"} <= set(torch_names) & set(jax_names)


@pytest.mark.parametrize(
    ("gate", "activation", "recipe", "biases"),
    [
        (True, "swiglu", False, False),
        (False, "gelu", False, False),
        (True, "swiglu", True, False),
        (False, "clamped_swiglu", True, True),
    ],
)
def test_layers_with_shared_experts_agree(gate, activation, recipe, biases):
    """The two layers with shared experts on the same inputs (with `recipe`: a padding mask, all three losses
    and the probs drop policy too; with `biases`: GPT-OSS's router and projection biases): outputs, aux
    loss, dropped count, every MoEStats field and every gradient (the shared weights' and biases' included)
    agree to fp32 rounding (their GEMMs differ: PyTorch's and XLA's); the counts exactly."""
    from tests.strategies_moe import MoEProblem, with_biases, with_recipe_options, with_shared_experts

    rng = np.random.default_rng(3)
    problem = MoEProblem(
        **dict(batch=2, seq=3, hidden=_H, ffn=_F, num_experts=_E, topk=2, score_function="softmax"),
        **dict.fromkeys(("num_groups", "group_topk", "align_size", "expert_bias")),
        capacity_factor=1.0,
        routing="random",
        x=rng.normal(size=(2, 3, _H)).astype(np.float32),
        gate=rng.normal(0, _H**-0.5, (_H, _E)).astype(np.float32),
        gate_up=rng.normal(0, _H**-0.5, (_E, _H, 2 * _F)).astype(np.float32),
        down=rng.normal(0, _F**-0.5, (_E, _F, _H)).astype(np.float32),
    )
    problem = with_shared_experts(problem, gate=gate, activation=activation)
    if recipe:
        problem = with_recipe_options(problem)
    if biases:
        problem = with_biases(problem)
    cotangent = rng.normal(size=problem.x.shape).astype(np.float32)
    arrays = dict(x=problem.x, gate=problem.gate, gate_up=problem.gate_up, down=problem.down)
    arrays.update(problem.shared_weights)
    arrays.update(problem.biases)
    options = problem.layer_options(aux_loss_coeff=1e-2)
    mask = problem.token_mask

    def jax_loss(x, gate, gate_up, down, *weights):
        named = dict(zip(list(arrays)[4:], weights, strict=True))
        token_mask = None if mask is None else _jax(mask)
        out, aux_loss, dropped, stats = mj.moe(
            x, gate, gate_up, down, **named, **options, token_mask=token_mask, return_stats=True
        )
        return jnp.sum(out * cotangent) + aux_loss, (out, aux_loss, dropped, stats)

    (_, jax_results), jax_grads = jax.value_and_grad(
        jax_loss, argnums=tuple(range(len(arrays))), has_aux=True
    )(*map(_jax, arrays.values()))
    leaves = {name: _torch(value).requires_grad_() for name, value in arrays.items()}
    named = {name: leaves[name] for name in list(arrays)[4:]}
    token_mask = None if mask is None else _torch(mask)
    out, aux_loss, dropped, stats = mt.moe(
        leaves["x"],
        leaves["gate"].t(),
        leaves["gate_up"],
        leaves["down"],
        **named,
        **options,
        token_mask=token_mask,
        return_stats=True,
    )
    ((out * _torch(cotangent)).sum() + aux_loss).backward()
    jax_out, jax_aux, jax_dropped, jax_stats = jax_results
    np.testing.assert_allclose(np.asarray(jax_out), out.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax_aux), aux_loss.detach().cpu().numpy(), rtol=1e-5)
    assert int(jax_dropped) == int(dropped)
    for name, value in stats._asdict().items():
        theirs = np.asarray(getattr(jax_stats, name))
        if value.dtype == torch.int32:
            np.testing.assert_array_equal(theirs, value.cpu().numpy(), err_msg=name)
        else:
            np.testing.assert_allclose(
                theirs, value.detach().cpu().numpy(), rtol=1e-5, atol=1e-7, err_msg=name
            )
    for name, grad in zip(arrays, jax_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(grad), leaves[name].grad.cpu().numpy(), rtol=1e-5, atol=1e-5, err_msg=name
        )


def _layer_results(framework: str, arrays: dict, options: dict, mask=None):
    """(out, aux_loss, dropped, MoEStats) of one layer call, as numpy."""
    if framework == "torch":
        x, gate, gate_up, down = (_torch(arrays[name]) for name in ("x", "gate", "gate_up", "down"))
        token_mask = None if mask is None else _torch(mask)
        results = mt.moe(x, gate.t(), gate_up, down, token_mask=token_mask, return_stats=True, **options)
        out, aux_loss, dropped, stats = (
            value if isinstance(value, tuple) else value.detach().cpu().numpy() for value in results
        )
        return out, aux_loss, dropped, [value.detach().cpu().numpy() for value in stats]
    token_mask = None if mask is None else _jax(mask)
    results = mj.moe(*map(_jax, arrays.values()), token_mask=token_mask, return_stats=True, **options)
    return (*(np.asarray(value) for value in results[:3]), [np.asarray(value) for value in results[3]])


@pytest.mark.parametrize(
    ("capacity_factor", "drop_policy"), [(None, "position"), (0.5, "position"), (0.5, "probs")]
)
@pytest.mark.parametrize("fill", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_layers_agree_on_non_finite_tokens(capacity_factor, drop_policy, fill, score_function):
    """Tokens whose values are NaN or infinite (so are their logits and weights), under each drop policy
    (moetriton.kernels.rules.moe.NON_FINITE): both layers give the same outputs (non-finite exactly where
    the other's are), losses, dropped count and counts. Dropless and under the probs policy (NaN weights
    rank below every number) the finite tokens' outputs are those of the layer with the broken tokens
    masked out; under the position policy the broken tokens keep their places."""
    rng = np.random.default_rng(5)
    arrays = dict(
        x=rng.normal(size=(2, 4, _H)).astype(np.float32),
        gate=rng.normal(0, 0.5, (_H, _E)).astype(np.float32),
        gate_up=rng.normal(0, _H**-0.5, (_E, _H, 2 * _F)).astype(np.float32),
        down=rng.normal(0, _F**-0.5, (_E, _F, _H)).astype(np.float32),
    )
    broken = np.zeros((2, 4), bool)
    broken[0, 1] = broken[1, 0] = True  # early tokens: they would take places first
    arrays["x"][broken] = fill
    options = dict(topk=2, score_function=score_function, capacity_factor=capacity_factor)
    options.update(drop_policy=drop_policy, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    got = {framework: _layer_results(framework, arrays, options) for framework in ("torch", "jax")}
    (out, aux_loss, dropped, stats), (jax_out, jax_aux, jax_dropped, jax_stats) = got["torch"], got["jax"]
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(jax_out))
    np.testing.assert_allclose(jax_out, out, rtol=1e-5, atol=1e-6)  # NaN where the other has NaN
    assert np.isnan(aux_loss) and np.isnan(jax_aux) and int(dropped) == int(jax_dropped)
    for name, mine, theirs in zip(layer_rules.MoEStats._fields, stats, jax_stats, strict=True):
        if not name.endswith("loss"):
            np.testing.assert_array_equal(mine, theirs, err_msg=name)
    assert np.isfinite(out[~broken]).all()
    masked = _layer_results("torch", arrays, options, mask=~broken)[0]
    if drop_policy == "probs" or capacity_factor is None:
        np.testing.assert_array_equal(out[~broken], masked[~broken])
    if drop_policy == "probs":  # at this capacity every broken slot is dropped: zero rows
        assert not out[broken].any()


@pytest.mark.parametrize("drop_policy", ["position", "probs"])
def test_capacity_counts_padded_tokens_in_both_layers(drop_policy):
    """C follows from T with the padding counted (a static size: docs/moe.md, "Padding"), while padded tokens
    take none of its places: with half the tokens padding, every expert keeps min(routed, C(T)) of the real
    tokens' slots, the same counts in both layers, where C(unmasked T) would keep fewer."""
    from moetriton.kernels.rules.expert_parallel import ep_layout

    rng = np.random.default_rng(2)
    arrays = dict(
        x=np.abs(rng.normal(size=(2, 8, _H))).astype(np.float32),
        gate=rng.normal(0, 0.3, (_H, _E)).astype(np.float32),
        gate_up=rng.normal(0, _H**-0.5, (_E, _H, 2 * _F)).astype(np.float32),
        down=rng.normal(0, _F**-0.5, (_E, _F, _H)).astype(np.float32),
    )
    arrays["gate"][:, 0] += 1.0  # expert 0 overflows
    mask = np.zeros((2, 8), bool)
    mask[:, ::2] = True  # half the tokens are padding
    options = dict(topk=2, capacity_factor=1.0, drop_policy=drop_policy)
    capacity = ep_layout(num_tokens=16, num_experts=_E, topk=2, ep_size=1, capacity_factor=1.0).capacity
    fewer = ep_layout(num_tokens=8, num_experts=_E, topk=2, ep_size=1, capacity_factor=1.0).capacity
    counts = [_layer_results(framework, arrays, options, mask=mask)[3] for framework in ("torch", "jax")]
    for stats in counts:
        routed, kept = stats[3], stats[4]  # MoEStats order: the three losses, routed, kept, ...
        np.testing.assert_array_equal(kept, np.minimum(routed, capacity))
        assert routed.sum() == 2 * mask.sum() and kept.max() > fewer, (routed, kept, capacity, fewer)
    np.testing.assert_array_equal(counts[0][4], counts[1][4])


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_layers_replay_the_same_hostile_ids_alike(capacity_factor):
    """Router replay in both layers with ids out of range, negative and repeated within a token (each
    selects nothing): outputs, aux loss, dropped count and every gradient agree to fp32 rounding."""
    rng = np.random.default_rng(5)
    arrays = dict(
        x=rng.normal(size=(2, 3, _H)).astype(np.float32),
        gate=rng.normal(0, _H**-0.5, (_H, _E)).astype(np.float32),
        gate_up=rng.normal(0, _H**-0.5, (_E, _H, 2 * _F)).astype(np.float32),
        down=rng.normal(0, _F**-0.5, (_E, _F, _H)).astype(np.float32),
    )
    ids = rng.integers(-3, _E + 3, size=(2, 3, 2)).astype(np.int32)
    ids[0, 0] = [1, 1]  # a repeat
    cotangent = rng.normal(size=arrays["x"].shape).astype(np.float32)
    options = dict(topk=2, score_function="sigmoid", aux_loss_coeff=1e-2, capacity_factor=capacity_factor)

    def jax_loss(x, gate, gate_up, down):
        out, aux_loss, dropped = mj.moe(x, gate, gate_up, down, **options, routing_indices=_jax(ids))
        return jnp.sum(out * cotangent) + aux_loss, (out, aux_loss, dropped)

    (_, (jax_out, jax_aux, jax_dropped)), jax_grads = jax.value_and_grad(
        jax_loss, argnums=(0, 1, 2, 3), has_aux=True
    )(*map(_jax, arrays.values()))
    leaves = {name: _torch(value).requires_grad_() for name, value in arrays.items()}
    out, aux_loss, dropped = mt.moe(
        leaves["x"],
        leaves["gate"].t(),
        leaves["gate_up"],
        leaves["down"],
        **options,
        routing_indices=_torch(ids),
    )
    ((out * _torch(cotangent)).sum() + aux_loss).backward()
    np.testing.assert_allclose(np.asarray(jax_out), out.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax_aux), aux_loss.detach().cpu().numpy(), rtol=1e-5)
    assert int(jax_dropped) == int(dropped)
    for name, grad in zip(arrays, jax_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(grad), leaves[name].grad.cpu().numpy(), rtol=1e-5, atol=1e-5, err_msg=name
        )
