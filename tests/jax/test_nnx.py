"""The Flax NNX module `MoE` against the functional layer and the Linen MoEBlock on the same weights: the
options pass through, the expert bias is no parameter, bad options are refused at construction, and on a
two-device CPU mesh the variables are created sharded and the results equal one device's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="flax is not installed")

from moetriton.jax import moe, update_expert_bias  # noqa: E402
from moetriton.jax.moe.nnx import LAYER_OPTIONS, ExpertBias, MoE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = dict(
    capacity_factor=0.75, drop_policy="probs", aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-3, z_loss_coeff=1e-3
)


def _tokens(shape=(2, 6, 16), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_equals_the_functional_layer_forward_and_gradients():
    model = MoE(16, 4, 8, 2, rngs=nnx.Rngs(0), num_shared_experts=1, shared_expert_gate=True, **OPTIONS)
    x = _tokens()
    mask = jnp.arange(12).reshape(2, 6) < 10

    def loss(module):
        out, aux_loss, _ = module(x, mask)
        return jnp.sum(out**2) + aux_loss

    grads = nnx.grad(loss)(model)
    names = ("gate", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate")
    weights = {name: getattr(model, name)[...] for name in names}

    def reference(weights):
        out, aux_loss, _ = moe(x, topk=2, token_mask=mask, **weights, **OPTIONS)
        return jnp.sum(out**2) + aux_loss

    expected_grads = jax.grad(reference)(weights)
    got = model(x, mask, return_stats=True)
    expected = moe(x, topk=2, token_mask=mask, return_stats=True, **weights, **OPTIONS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in names:
        np.testing.assert_array_equal(np.asarray(grads[name][...]), np.asarray(expected_grads[name]))


def test_same_parameters_as_the_linen_block():
    from flax import linen as nn

    from moetriton.jax.moe.flax import MoEBlock

    model = MoE(16, 4, 8, 2, rngs=nnx.Rngs(1), num_shared_experts=1, **OPTIONS)
    block = MoEBlock(num_experts=4, ffn_dim=8, topk=2, num_shared_experts=1, **OPTIONS)
    x = _tokens()
    linen_params = nn.meta.unbox(block.init(jax.random.key(0), x)["params"])
    nnx_params = {name: getattr(model, name)[...] for name in linen_params}
    for name, value in linen_params.items():  # names, shapes, dtypes
        assert (value.shape, value.dtype) == (nnx_params[name].shape, nnx_params[name].dtype), name
    got = model(x)
    expected = block.apply({"params": nnx_params}, x)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_expert_bias_is_a_variable_the_gradient_skips():
    model = MoE(16, 8, 8, 2, rngs=nnx.Rngs(2), score_function="sigmoid", use_expert_bias=True)
    assert "expert_bias" not in nnx.state(model, nnx.Param)
    assert isinstance(model.expert_bias, ExpertBias)
    x = _tokens(seed=3)
    _, _, _, stats = model(x, return_stats=True)
    model.expert_bias[...] = update_expert_bias(model.expert_bias[...], stats.routed, 10.0)
    _, _, _, after = model(x, return_stats=True)
    # The bias moved every overloaded expert down and every underloaded one up: the loads change.
    assert not np.array_equal(np.asarray(after.routed), np.asarray(stats.routed))
    expected = moe(
        x,
        model.gate[...],
        model.gate_up[...],
        model.down[...],
        topk=2,
        score_function="sigmoid",
        expert_bias=model.expert_bias[...],
        return_stats=True,
    )
    np.testing.assert_array_equal(np.asarray(expected[3].routed), np.asarray(after.routed))


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(drop_policies="probs"), TypeError, "MoE: unknown layer options ['drop_policies']"),
        (dict(x=1), TypeError, "MoE: unknown layer options ['x']"),
        (dict(drop_policy="random"), ValueError, "drop_policy: expected one of ('position', 'probs')"),
        (dict(z_loss_coeff=-1.0), ValueError, "z_loss_coeff: expected a finite number >= 0"),
        (dict(activation="tanh"), ValueError, "activation: expected one of"),
    ],
)
def test_bad_options_are_refused_at_construction(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MoE(16, 4, 8, 2, rngs=nnx.Rngs(0), **options)


def test_layer_options_are_the_functional_layers():
    assert {"score_function", "capacity_factor", "ep_axis", "data_axes", "dtype", "exchange"} <= set(
        LAYER_OPTIONS
    )
    assert not {"x", "gate", "token_mask", "return_stats", "mesh"} & set(LAYER_OPTIONS)


_MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from moetriton.jax.moe.nnx import MoE

mesh = jax.make_mesh((2,), ("ep",))
sharded = MoE(16, 4, 8, 2, rngs=nnx.Rngs(0), mesh=mesh, aux_loss_coeff=1e-2)
single = MoE(16, 4, 8, 2, rngs=nnx.Rngs(0), aux_loss_coeff=1e-2)
assert sharded.gate_up[...].sharding.spec == P("ep", None, None), sharded.gate_up[...].sharding
assert sharded.down[...].sharding.spec == P("ep", None, None), sharded.down[...].sharding
assert sharded.gate[...].sharding.spec in (P(), P(None, None)), sharded.gate[...].sharding
x = jax.random.normal(jax.random.key(1), (4, 6, 16))
for a, b in zip(jax.jit(lambda m, x: m(x))(sharded, x), single(x)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_variables_are_created_sharded_on_a_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MESH_SCRIPT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_example_trains():
    """examples/jax_moe_nnx.py: AdamW through nnx.Optimizer and the expert-bias update lower the loss."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("jax_moe_nnx", ROOT / "examples" / "jax_moe_nnx.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(steps=4)
    assert losses[-1] < losses[0], losses
