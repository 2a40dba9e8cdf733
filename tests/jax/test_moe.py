"""The expert-parallel MoE layer (moetriton.jax.moe, the Flax MoEBlock) against its dense reference.

Mesh checks run in subprocesses (tests/jax/moe_checks.py) with 8 host CPU devices: the flag must reach JAX
before it starts, and never reaches this process's JAX. There the exchange is the padded all_to_all fallback
(XLA:CPU has no ragged all-to-all). The kernels run under the Triton interpreter in this process and in the
checks of INTERPRETED; the interpreter serialises every shard's launches (about a second per shard and
layer call), so the other CPU mesh checks run the ops' pure-JAX reference, the CPU fallback without the
interpreter: they test the layer's exchange, sorts, GEMMs and gradients on up to 8 devices. On a machine with
GPUs the same checks run compiled kernels on as many GPUs as they need, with the exchange "auto" picks there
(padded on one host), and the exchanges check compares the ragged all-to-all with the padded one.
Single-device checks (no mesh) and argument errors run in this process.
"""

import csv
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings

from moetriton.jax.moe import moe
from moetriton.jax.moe.layer import resolve_exchange
from tests.jax._helpers import gpu_count, run_python
from tests.jax.moe_checks import CHECKS, DEVICES, check_against_reference, fixed_problem
from tests.strategies_moe import moe_problems, with_shared_experts

INTERPRETED = {"mesh-1x1", "mesh-1x2", "overflow", "errors"}


def _run_check(name: str, env: dict) -> None:
    # -X faulthandler: a crash shows its stack
    result = run_python(["-X", "faulthandler", "-m", "tests.jax.moe_checks", name], env, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{name}: ok" in result.stdout


@pytest.mark.parametrize("name", sorted(set(CHECKS) - {"exchanges"}))
def test_moe_on_cpu_devices(name):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    if name not in INTERPRETED:
        env.pop("TRITON_INTERPRET", None)
    _run_check(name, env)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(CHECKS) - {"exchanges"}))
def test_moe_on_gpus(name):
    if gpu_count() < DEVICES[name]:
        pytest.skip(f"MoE check {name} needs {DEVICES[name]} GPUs, found {gpu_count()}")
    _run_check(name, dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))


@pytest.mark.gpu
def test_ragged_exchange_on_gpus():
    """The ragged all-to-all path exists only on GPUs (XLA:CPU lacks ragged-all-to-all)."""
    if gpu_count() < 2:
        pytest.skip("the ragged all-to-all exchange needs 2 GPUs (XLA:CPU has no ragged-all-to-all)")
    _run_check("exchanges", dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))


@settings(max_examples=2)
@given(moe_problems())
def test_one_device_without_mesh_matches_reference(problem):
    assume(problem.topk > 1 and problem.seq > 1)  # skip the simplest problem, which Hypothesis draws first
    for align_size, capacity_factor in ((None, None), (2, 0.25)):
        variant = dataclasses.replace(problem, align_size=align_size, capacity_factor=capacity_factor)
        with jax.default_matmul_precision("highest"):  # no TF32 on GPU: routing must match the reference
            check_against_reference(variant, None)


def test_bf16_compute_matches_fp32_reference():
    problem = fixed_problem(1, 1, routing="empty_ranks", topk=2, align_size=4)
    with jax.default_matmul_precision("highest"):
        check_against_reference(problem, None, dtype="bfloat16")


@pytest.mark.parametrize(
    ("gate", "activation", "capacity_factor"),
    [(False, "swiglu", None), (True, "gelu", None), (True, "swiglu", 0.5), (False, "relu", 0.5)],
)
def test_shared_experts_on_one_device_match_reference(gate, activation, capacity_factor):
    """Forward, aux loss, dropped count and every gradient, the shared weights' included."""
    problem = fixed_problem(1, 1, routing="rank0", topk=2, align_size=2, capacity_factor=capacity_factor)
    with jax.default_matmul_precision("highest"):
        check_against_reference(with_shared_experts(problem, gate=gate, activation=activation), None)


def test_zero_shared_experts_leave_the_routed_output_bitwise():
    """The shared output is added in fp32: shared experts that output zeros change no bit of the layer."""
    arguments = _args(gate=jnp.asarray(np.random.default_rng(1).normal(size=(8, 4)), jnp.float32))
    arguments["gate_up"] = jnp.ones_like(arguments["gate_up"])
    arguments["down"] = jnp.ones_like(arguments["down"])
    routed = moe(**arguments)
    shared = moe(
        **arguments,
        shared_gate_up=jnp.ones((8, 16)),
        shared_down=jnp.zeros((8, 8)),
        shared_gate=jnp.ones((8, 1)),
    )
    for got, expected in zip(shared, routed, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_flax_block_refuses_bad_shared_expert_options():
    from moetriton.jax.flax import MoEBlock

    x = jnp.zeros((2, 3, 8))
    for options, message in (
        (dict(num_shared_experts=-1), "num_shared_experts: expected an int >= 0, got -1"),
        (dict(shared_expert_gate=True), "shared_expert_gate: expected False without shared experts"),
    ):
        block = MoEBlock(num_experts=4, ffn_dim=4, topk=2, **options)
        with pytest.raises(ValueError, match=re.escape(message)):
            block.init(jax.random.key(0), x)


def _args(**change):
    rng = np.random.default_rng(0)
    hidden, ffn, experts = 8, 4, 4
    arguments = dict(
        x=jnp.asarray(rng.normal(size=(2, 3, hidden)), jnp.float32),
        gate=jnp.zeros((hidden, experts)),
        gate_up=jnp.zeros((experts, hidden, 2 * ffn)),
        down=jnp.zeros((experts, ffn, hidden)),
        topk=2,
    )
    arguments.update(change)
    return arguments


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=jnp.zeros((6, 8))), "x: expected rank 3 [B, S, H]"),
        (dict(x=jnp.zeros((2, 3, 8), jnp.int32)), "x: expected a floating dtype"),
        (dict(gate=jnp.zeros((7, 4))), "x: expected [..., H] with H = 7 (as gate [H, E])"),
        (dict(gate_up=jnp.zeros((4, 8, 7))), "gate_up: expected [n, H, 2F] = [4, 8, 8]"),
        (dict(gate_up=jnp.zeros((3, 8, 8))), "gate_up: expected [n, H, 2F] = [4, 8, 8] (n = 4 experts held"),
        (dict(down=jnp.zeros((4, 8, 8))), "gate_up: expected [n, H, 2F] = [4, 8, 16]"),
        (dict(activation="relu"), "gate_up: expected [n, H, F] = [4, 8, 4]"),
        (dict(topk=5), "topk: expected <= num_experts = 4"),
        (dict(topk=0), "topk: expected an int >= 1"),
        (dict(capacity_factor=0.0), "capacity_factor: expected a finite number > 0"),
        (dict(capacity_factor=-1.0), "capacity_factor: expected a finite number > 0"),
        (dict(capacity_factor="full"), "capacity_factor: expected None (dropless) or a number > 0"),
        (dict(align_size=0), "align_size: expected None or an int >= 1"),
        (dict(activation="tanh"), "activation: expected one of"),
        (dict(score_function="softplus"), "score_function: expected one of"),
        (dict(expert_bias=jnp.zeros(4)), "expert_bias: only supported with score_function 'sigmoid'"),
        (dict(expert_bias=jnp.zeros(3), score_function="sigmoid"), "expert_bias: expected [E] = [4]"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff: expected a finite number >= 0"),
        (dict(exchange="nccl"), "exchange: expected one of"),
        (dict(data_axes=("data",)), "data_axes: expected () without a mesh"),
        (dict(shared_down=jnp.zeros((6, 8))), "shared_gate_up: expected an array: shared_gate_up and"),
        (
            dict(shared_gate_up=jnp.zeros((8, 12)), shared_down=jnp.zeros((6, 7))),
            "shared_down: expected [Fs, H] with H = 8, got shape [6, 7]",
        ),
        (
            dict(shared_gate_up=jnp.zeros((8, 6)), shared_down=jnp.zeros((6, 8))),
            "shared_gate_up: expected [H, 2Fs] = [8, 12] (Fs = 6 from shared_down), got [8, 6]",
        ),
        (dict(shared_gate=jnp.zeros((8, 1))), "shared_gate: expected None without shared_gate_up"),
        (
            dict(shared_gate_up=jnp.zeros((8, 12), jnp.int32), shared_down=jnp.zeros((6, 8))),
            "shared_gate_up: expected a floating dtype",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        moe(**_args(**change))


def test_exchange_names_resolve_to_the_two_exchanges():
    assert [resolve_exchange(name) for name in ("auto", "padded", "ragged", "all_to_all")] == [
        "padded",
        "padded",
        "ragged",
        "ragged",
    ]


def test_importing_moetriton_jax_does_not_import_flax():
    code = "import sys, moetriton.jax; assert 'flax' not in sys.modules; import moetriton.jax.flax"
    result = run_python(["-c", code], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_ep_example_runs_and_matches_reference():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = run_python(["examples/jax_moe_ep.py", "--small"], env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok"), result.stdout[-4000:]


@pytest.mark.parametrize("limit, expect_error", [(300, False), (0.5, True)], ids=["in-time", "overrun"])
def test_benchmark_isolated_rows(tmp_path, limit, expect_error):
    """benchmarks/moe_jax.py --isolate: each row in a child process; a row that overruns its limit is an
    error row and the run goes on (a hung collective cannot stall the rest)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    argv = ["--tiny", "--steps", "1", "--shapes", "mixtral", "--ep", "1", "--impl", "moetriton"]
    result = run_python(
        ["-m", "benchmarks.moe_jax", *argv, "--isolate", str(limit), "--out", str(tmp_path)], env
    )
    with next(tmp_path.glob("*/moe_jax.csv")).open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 1 and rows[0]["impl"] == "moetriton", result.stdout[-4000:] + result.stderr[-4000:]
    if expect_error:
        assert result.returncode == 1 and rows[0]["error"].startswith("timed out after 0.5 s"), rows
    else:
        assert result.returncode == 0 and not rows[0]["error"] and float(rows[0]["step_ms"]) > 0, rows


@pytest.mark.parametrize("timeout, expect_rows", [(240, True), (2, False)], ids=["in-time", "overrun"])
def test_benchmark_process_group(tmp_path, timeout, expect_rows):
    """benchmarks/moe_jax.py --processes 2: two processes of one CPU device each (gloo) measure the layer at
    EP = 2 and process 0 writes the rows, marked processes = 2; a group past its time limit is killed and
    the exit status is 1."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    argv = ["--processes", "2", "--tiny", "--steps", "1", "--shapes", "mixtral", "--timeout", str(timeout)]
    result = run_python(["-m", "benchmarks.moe_jax", *argv, "--out", str(tmp_path)], env, timeout=300)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    with next(tmp_path.glob("*/moe_jax.csv")).open() as file:
        rows = list(csv.DictReader(file))
    if not expect_rows:
        assert result.returncode == 1 and not rows and "exit statuses" in result.stdout, output
        return
    assert result.returncode == 0 and [row["impl"] for row in rows] == ["moetriton", "maxtext"], output
    for row in rows:
        assert (row["ep"], row["processes"], row["error"]) == ("2", "2", ""), row
        assert float(row["step_ms"]) > 0 and float(row["gemm_tflops"]) > 0, row
    assert rows[0]["stage_method"] == "per-stage jitted fwd+bwd timings", rows[0]
    assert float(rows[0]["routing_share"]) > 0 and float(rows[0]["a2a_moved_ratio"]) >= 1, rows[0]
