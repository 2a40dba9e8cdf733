"""Hostile and unlucky input for the MoE layers' options, both frameworks in one process
(tests/strategies_moe_hostile.py draws the cases; the expert-parallel runs are in tests/torch/test_moe.py,
gloo EP 2, and tests/jax/moe_checks.py, a 2-device CPU mesh).

* Every bad argument is refused by both layers before anything runs, with the same exception type and a
  message that starts with the argument's name (the same message where the rule is shared; the kind of
  array each framework expects is its own), and where docs/moe.md's argument table says the frameworks
  differ, each does what the table says.
* Every hostile call gives the documented result: the dense reference's forward, losses, counts and
  gradients (the reference implements the non-finite rule of moetriton.kernels.rules.moe.NON_FINITE), the
  same in both frameworks, with exact zeros for padding and for the experts no slot reaches, finite outputs
  for the finite tokens, and (dropless and drop_policy="probs") the finite tokens' outputs unchanged by the
  broken ones.
* token_dispatch with num_out_tokens below the routed count drops the slots past the buffer, the same in
  both frameworks and their references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import moetriton.jax as mj
from tests.strategies_moe_hostile import (
    ARRAYS,
    CORRUPTIONS,
    DIFFERENT,
    EXPERTS,
    REFUSED,
    HostileCall,
    base_arrays,
    check_invariants,
    hostile_calls,
    record,
    same_results,
)

torch = pytest.importorskip("torch", reason="the family runs both frameworks")
mt = pytest.importorskip("moetriton.torch")
from moetriton.torch.reference_moe import moe_reference  # noqa: E402
from tests.torch._moe_helpers import hostile_results  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VALID = dict(topk=2)
#: The differentiable arrays, in the order the results list their gradients.
WEIGHTS = ("x", "gate", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate")


def _torch(value, name: str):
    """A numpy argument as the PyTorch layer takes it (gate as [E, H]); anything else as it is."""
    if not isinstance(value, np.ndarray):
        return value
    tensor = torch.from_numpy(np.ascontiguousarray(value)).to(DEVICE)
    return tensor.t().contiguous() if name == "gate" and tensor.dim() == 2 else tensor


def _split(call: dict) -> tuple[dict, dict]:
    """(arrays, options) of a call given as one dict."""
    arrays = {name: value for name, value in call.items() if name in ARRAYS}
    return arrays, {name: value for name, value in call.items() if name not in ARRAYS}


def _run(framework: str, arrays: dict, options: dict):
    """The layer's results; arrays by the JAX layer's names."""
    if framework == "torch":
        named = {name: _torch(value, name) for name, value in arrays.items()}
        named["gate_weight"] = named.pop("gate")
        positional = [named.pop(name) for name in ("x", "gate_weight", "gate_up", "down")]
        return mt.moe(*positional, **named, **options)
    converted = {name: jnp.asarray(v) if isinstance(v, np.ndarray) else v for name, v in arrays.items()}
    return mj.moe(**converted, **options)


def _error(framework: str, call: dict) -> Exception | None:
    try:
        _run(framework, *_split(call))
    except (TypeError, ValueError) as error:
        return error
    return None


@pytest.mark.parametrize("case", list(REFUSED))
def test_both_layers_refuse_bad_arguments_naming_them(case):
    refusal = REFUSED[case]
    call = {**base_arrays(), **VALID, **refusal.change}
    errors = {framework: _error(framework, call) for framework in ("torch", "jax")}
    for framework, error in errors.items():
        assert isinstance(error, refusal.error), (framework, case, error)
        assert str(error).startswith(f"{refusal.named(framework)}:"), (framework, case, error)
    if refusal.error is ValueError and not refusal.own_words:  # a shared rule: the same words
        assert str(errors["torch"]) == str(errors["jax"]), errors


@pytest.mark.parametrize("case", list(DIFFERENT))
def test_the_frameworks_differ_where_the_argument_table_says(case):
    change, *outcomes = DIFFERENT[case]
    call = {**base_arrays(), **VALID, **change}
    for framework, outcome in zip(("torch", "jax"), outcomes, strict=True):
        error = _error(framework, call)
        if outcome is None:
            assert error is None, (framework, case, error)
        else:
            assert isinstance(error, outcome[0]) and str(error).startswith(f"{outcome[1]}:"), (
                framework,
                error,
            )


# The family -------------------------------------------------------------------------------------------


def _cotangent(call: HostileCall) -> np.ndarray:
    return np.random.default_rng(7).normal(size=call.arrays["x"].shape).astype(np.float32)


def _jax_results(call: HostileCall) -> dict:
    present = {name: jnp.asarray(value) for name, value in call.arrays.items() if value is not None}
    names = [name for name in WEIGHTS if name in present]
    rest = {name: value for name, value in present.items() if name not in names}
    cotangent = jnp.asarray(_cotangent(call))

    def loss(*weights):
        results = mj.moe(
            **dict(zip(names, weights, strict=True)), **rest, **dict(call.options, return_stats=True)
        )
        return jnp.sum(results[0] * cotangent) + results[1], results

    (_, (out, aux_loss, dropped, stats)), grads = jax.value_and_grad(
        loss, argnums=tuple(range(len(names))), has_aux=True
    )(*(present[name] for name in names))
    return record(out, aux_loss, dropped, stats._asdict(), dict(zip(names, grads, strict=True)))


#: Examples per corruption: an eighth of the profile's count (the ci profile: 3, so 30 calls in all), so
#: that every corruption is drawn whatever the profile.
_PER_CORRUPTION = settings(max_examples=max(1, settings.default.max_examples // 8))


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_hostile_calls_give_the_documented_result_in_both_frameworks(corruption):
    @_PER_CORRUPTION
    @given(call=hostile_calls(corruptions=(corruption,)))
    def check(call):
        _check_hostile_call(call)

    check()


def _check_hostile_call(call: HostileCall) -> None:
    torch_results = hostile_results(call, mt.moe, _cotangent(call))
    expected = hostile_results(call, moe_reference, _cotangent(call))
    same_results(torch_results, expected, call, f"PyTorch vs reference, {call.corruption} {call.options}")
    check_invariants(call, torch_results)
    same_results(_jax_results(call), torch_results, call, f"JAX vs PyTorch, {call.corruption} {call.options}")
    dropless_or_probs = call.options["capacity_factor"] is None or call.options.get("drop_policy") == "probs"
    if call.broken.any() and dropless_or_probs:
        # The broken tokens take no finite slot's place: the others' outputs are those of the call with the
        # broken tokens masked out.
        masked = hostile_results(call.masking(call.broken), mt.moe, _cotangent(call))
        others = call.valid & ~call.broken
        np.testing.assert_array_equal(torch_results["out"][others], masked["out"][others])


# num_out_tokens below the routed count -------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 1, 5, 11])
def test_dispatch_with_fewer_rows_than_routed_slots_drops_the_rest(budget):
    """token_dispatch's num_out_tokens below the routed count (12 slots here): rows past the buffer are
    dropped (row -1, nothing written, weight 0 in combine), the same in both frameworks and both
    references; combine gives each token the sum of its kept slots."""
    from moetriton.jax import reference as jax_reference
    from moetriton.torch import reference as torch_reference

    rng = np.random.default_rng(budget)
    tokens = rng.normal(size=(6, 5)).astype(np.float32)
    indices = np.argsort(rng.random((6, EXPERTS)), axis=1)[:, :2].astype(np.int32)
    weights = rng.random((6, 2)).astype(np.float32)
    results = {}
    for name, api, convert in (
        ("torch", mt, lambda a: torch.from_numpy(a)),
        ("torch reference", torch_reference, lambda a: torch.from_numpy(a)),
        ("jax", mj, jnp.asarray),
        ("jax reference", jax_reference, jnp.asarray),
    ):
        out, _, row_map, _, counts = api.token_dispatch(
            convert(tokens), None, budget, indices=convert(indices), num_experts=EXPERTS
        )
        combined = api.token_combine(out, row_map, convert(weights))
        results[name] = [np.asarray(value) for value in (out, row_map, combined, counts)]
    for name, (out, row_map, combined, _) in results.items():
        assert out.shape == (budget, 5), (name, out.shape)
        rows = row_map[:, :2]
        kept = rows >= 0
        assert kept.sum() == min(budget, 12) and (rows[kept] < budget).all(), (name, row_map)
        expected = np.zeros_like(tokens)
        slots = row_map[:, 2:4]
        for token, slot_list in enumerate(slots):
            for k, slot in enumerate(slot_list):
                if kept[token, k]:
                    expected[token] += weights[token, slot] * tokens[token]
        np.testing.assert_allclose(combined, expected, rtol=1e-6, atol=1e-6, err_msg=name)
        for other in results.values():
            for mine, theirs in zip((out, row_map), other[:2], strict=True):
                np.testing.assert_array_equal(mine, theirs, err_msg=name)
