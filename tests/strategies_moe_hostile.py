"""Hostile and unlucky input for the MoE layers' options (framework-neutral: numpy arrays plus options in the
JAX layer's layouts: gate [H, E], every expert's weights), shared by the one-process family
(tests/test_moe_hostile.py, both frameworks) and the expert-parallel ones (gloo EP 2, a 2-device CPU mesh).

Two kinds of case:

* `REFUSED`: a valid small call with one argument or option broken (out of range, the wrong type or dtype,
  the wrong shape, alone and combined with the other options), which every layer must refuse before it
  runs anything (before any collective), with the same exception type and a message that starts with the
  argument's name; `DIFFERENT` lists the cases where docs/moe.md's argument table says the frameworks
  differ, and what each does.
* `hostile_calls()`: a valid call with every option drawn on or off (token_mask, drop_policy, the three
  losses, return_stats, an expert bias, normalize_topk, group-limited selection under each group_score,
  shared experts, pipeline_chunks, capacity, balance_counts, a router replay of hostile ids) and one
  data corruption: non-finite or huge tokens, NaN padding, a NaN router column, no tokens, every token
  masked, overflowing capacity, exact ties. Its result is the documented one: the dense reference's (which
  implements moetriton.kernels.rules.moe.NON_FINITE), with the invariants `check_invariants` names;
  `same_results` compares two runs' results (numpy) as the family does.

Shapes stay tiny: the kernels run under the Triton interpreter on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

HIDDEN, FFN, EXPERTS = 8, 4, 4

#: Array arguments of the layers (the JAX layer's names and layouts), in call order after the four
#: required ones.
ARRAYS = (
    "x",
    "gate",
    "gate_up",
    "down",
    "expert_bias",
    "token_mask",
    "shared_gate_up",
    "shared_down",
    "shared_gate",
    "routing_indices",
)


def base_arrays(batch: int = 2, seq: int = 3, seed: int = 0) -> dict[str, np.ndarray | None]:
    """A valid call's arrays: x [B, S, H] fp32, gate [H, E], gate_up [E, H, 2F], down [E, F, H]."""
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.normal(size=(batch, seq, HIDDEN)).astype(np.float32),
        gate=rng.normal(0, 0.5, (HIDDEN, EXPERTS)).astype(np.float32),
        gate_up=rng.normal(0, HIDDEN**-0.5, (EXPERTS, HIDDEN, 2 * FFN)).astype(np.float32),
        down=rng.normal(0, FFN**-0.5, (EXPERTS, FFN, HIDDEN)).astype(np.float32),
    )


def shared_arrays(gate: bool, seed: int = 1) -> dict[str, np.ndarray]:
    """One shared expert of width F, with the per-token gate or not."""
    rng = np.random.default_rng(seed)
    arrays = dict(
        shared_gate_up=rng.normal(0, HIDDEN**-0.5, (HIDDEN, 2 * FFN)).astype(np.float32),
        shared_down=rng.normal(0, FFN**-0.5, (FFN, HIDDEN)).astype(np.float32),
    )
    if gate:
        arrays["shared_gate"] = rng.normal(0, HIDDEN**-0.5, (HIDDEN, 1)).astype(np.float32)
    return arrays


@dataclass(frozen=True)
class Refusal:
    """A bad call: `change` overrides the valid call's arrays and options; the layer raises `error` whose
    message starts with "`argument`:" (a pair: PyTorch's name, JAX's, where the argument table names it
    differently), in the same words in both unless `own_words` (a vocabulary or name that differs)."""

    change: dict
    error: type
    argument: str | tuple[str, str]
    own_words: bool = False

    def named(self, framework: str) -> str:
        """The argument's name in `framework` ("torch" or "jax")."""
        if isinstance(self.argument, str):
            return self.argument
        return self.argument[0 if framework == "torch" else 1]


_MASK = np.ones((2, 3), bool)
_SHARED = shared_arrays(gate=False)
_BIAS = dict(score_function="sigmoid", expert_bias=np.zeros(EXPERTS, np.float32))
_CAPACITY = dict(capacity_factor=1.0)

#: name -> Refusal; every option alone and with the others it combines with.
REFUSED = {
    # token_mask
    "token_mask shape": Refusal(dict(token_mask=np.ones((2, 4), bool)), ValueError, "token_mask"),
    "token_mask flat": Refusal(dict(token_mask=np.ones(6, bool)), ValueError, "token_mask"),
    "token_mask float": Refusal(dict(token_mask=np.ones((2, 3), np.float32)), ValueError, "token_mask"),
    "token_mask int": Refusal(dict(token_mask=np.ones((2, 3), np.int32)), ValueError, "token_mask"),
    "token_mask list": Refusal(dict(token_mask=[[True] * 3] * 2), TypeError, "token_mask"),
    "token_mask with capacity": Refusal(
        dict(token_mask=np.ones((3, 2), bool), **_CAPACITY), ValueError, "token_mask"
    ),
    # drop_policy
    "drop_policy name": Refusal(dict(drop_policy="random", **_CAPACITY), ValueError, "drop_policy"),
    "drop_policy None": Refusal(dict(drop_policy=None), ValueError, "drop_policy"),
    "drop_policy dropless": Refusal(dict(drop_policy="largest"), ValueError, "drop_policy"),
    # the losses
    **{
        f"{name} {what}": Refusal({name: value}, error, name)
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff")
        for what, value, error in (
            ("negative", -0.1, ValueError),
            ("nan", float("nan"), ValueError),
            ("inf", float("inf"), ValueError),
            ("str", "0.1", TypeError),
            ("bool", True, TypeError),
            ("array", np.float32(0.1), TypeError),
        )
    },
    "seq_aux_loss_coeff with mask": Refusal(
        dict(seq_aux_loss_coeff=-1.0, token_mask=_MASK), ValueError, "seq_aux_loss_coeff"
    ),
    # return_stats
    "return_stats str": Refusal(dict(return_stats="yes"), TypeError, "return_stats"),
    "return_stats int": Refusal(dict(return_stats=1), TypeError, "return_stats"),
    "return_stats None": Refusal(dict(return_stats=None), TypeError, "return_stats"),
    # balance_counts
    "balance_counts": Refusal(dict(balance_counts="bias"), ValueError, "balance_counts"),
    # the expert bias
    "expert_bias with softmax": Refusal(
        dict(expert_bias=np.zeros(EXPERTS, np.float32)), ValueError, "expert_bias"
    ),
    "expert_bias shape": Refusal(
        dict(_BIAS, expert_bias=np.zeros(EXPERTS + 1, np.float32)), ValueError, "expert_bias"
    ),
    "expert_bias int": Refusal(
        dict(_BIAS, expert_bias=np.zeros(EXPERTS, np.int32)), ValueError, "expert_bias"
    ),
    "expert_bias 2-D": Refusal(
        dict(_BIAS, expert_bias=np.zeros((1, EXPERTS), np.float32)), ValueError, "expert_bias"
    ),
    # shared experts
    "shared_down alone": Refusal(dict(shared_down=_SHARED["shared_down"]), ValueError, "shared_gate_up"),
    "shared_gate_up alone": Refusal(
        dict(shared_gate_up=_SHARED["shared_gate_up"]), ValueError, "shared_down"
    ),
    "shared_gate alone": Refusal(
        dict(shared_gate=np.zeros((HIDDEN, 1), np.float32)), ValueError, "shared_gate"
    ),
    "shared_gate_up width": Refusal(
        dict(_SHARED, shared_gate_up=_SHARED["shared_gate_up"][:, :-1]), ValueError, "shared_gate_up"
    ),
    "shared_down hidden": Refusal(
        dict(_SHARED, shared_down=_SHARED["shared_down"][:, :-1]), ValueError, "shared_down"
    ),
    "shared_gate shape": Refusal(
        dict(_SHARED, shared_gate=np.zeros((1, HIDDEN), np.float32)), ValueError, "shared_gate"
    ),
    "shared int dtype": Refusal(
        dict(_SHARED, shared_down=_SHARED["shared_down"].astype(np.int32)), ValueError, "shared_down"
    ),
    "shared with a non-gated activation": Refusal(dict(_SHARED, activation="gelu"), ValueError, "gate_up"),
    "shared_down list": Refusal(
        dict(_SHARED, shared_down=_SHARED["shared_down"].tolist()), TypeError, "shared_down"
    ),
    # pipeline_chunks
    "pipeline_chunks zero": Refusal(dict(pipeline_chunks=0), ValueError, "pipeline_chunks"),
    "pipeline_chunks negative": Refusal(dict(pipeline_chunks=-2), ValueError, "pipeline_chunks"),
    "pipeline_chunks bool": Refusal(dict(pipeline_chunks=True), ValueError, "pipeline_chunks"),
    "pipeline_chunks float": Refusal(dict(pipeline_chunks=2.0), ValueError, "pipeline_chunks"),
    "pipeline_chunks with capacity": Refusal(
        dict(pipeline_chunks=2, **_CAPACITY), ValueError, "pipeline_chunks"
    ),
    # capacity, alignment, router
    "capacity_factor zero": Refusal(dict(capacity_factor=0.0), ValueError, "capacity_factor"),
    "capacity_factor nan": Refusal(dict(capacity_factor=float("nan")), ValueError, "capacity_factor"),
    "capacity_factor inf": Refusal(dict(capacity_factor=float("inf")), ValueError, "capacity_factor"),
    "capacity_factor str": Refusal(dict(capacity_factor="1"), ValueError, "capacity_factor"),
    "align_size zero": Refusal(dict(align_size=0), ValueError, "align_size"),
    "align_size float": Refusal(dict(align_size=2.0), ValueError, "align_size"),
    "topk zero": Refusal(dict(topk=0), ValueError, "topk"),
    "topk past E": Refusal(dict(topk=EXPERTS + 1), ValueError, "topk"),
    "topk float": Refusal(dict(topk=2.0), ValueError, "topk"),
    "num_groups alone": Refusal(dict(_BIAS, num_groups=2), ValueError, "num_groups / group_topk"),
    "group_topk past num_groups": Refusal(dict(_BIAS, num_groups=2, group_topk=3), ValueError, "group_topk"),
    "scaling_factor nan": Refusal(dict(scaling_factor=float("nan")), ValueError, "scaling_factor"),
    "scaling_factor str": Refusal(dict(scaling_factor="2"), TypeError, "scaling_factor"),
    "use_pre_softmax int": Refusal(dict(use_pre_softmax=1), TypeError, "use_pre_softmax"),
    "normalize_topk int": Refusal(dict(normalize_topk=1), TypeError, "normalize_topk"),
    "routing_indices past topk": Refusal(
        dict(routing_indices=np.zeros((2, 3, 3), np.int32)), ValueError, "routing_indices"
    ),
    "routing_indices float": Refusal(
        dict(routing_indices=np.zeros((2, 3, 2), np.float32)), ValueError, "routing_indices"
    ),
    "normalize_topk False with softmax": Refusal(dict(normalize_topk=False), ValueError, "normalize_topk"),
    "group_score unknown": Refusal(
        dict(_BIAS, num_groups=2, group_topk=1, group_score="mean"), ValueError, "group_score"
    ),
    "group_score without groups": Refusal(dict(group_score="max"), ValueError, "group_score"),
    "group_score past a group": Refusal(
        dict(_BIAS, num_groups=4, group_topk=1, topk=1, group_score="top2_sum"), ValueError, "group_score"
    ),
    "activation": Refusal(dict(activation="tanh"), ValueError, "activation"),
    "score_function": Refusal(dict(score_function="relu"), ValueError, "score_function"),
    "exchange": Refusal(dict(exchange="nvlink"), ValueError, "exchange", own_words=True),
    # the arrays
    "x int": Refusal(dict(x=np.zeros((2, 3, HIDDEN), np.int32)), ValueError, "x"),
    "x hidden": Refusal(dict(x=np.zeros((2, 3, HIDDEN + 1), np.float32)), ValueError, "x", own_words=True),
    "x list": Refusal(dict(x=np.zeros((2, 3, HIDDEN)).tolist()), TypeError, "x"),
    "gate 3-D": Refusal(
        dict(gate=np.zeros((1, HIDDEN, EXPERTS), np.float32)),
        ValueError,
        ("gate_weight", "gate"),
        own_words=True,
    ),
    "gate_up width": Refusal(
        dict(gate_up=np.zeros((EXPERTS, HIDDEN, FFN), np.float32)), ValueError, "gate_up"
    ),
    "gate_up experts": Refusal(
        dict(gate_up=np.zeros((EXPERTS - 1, HIDDEN, 2 * FFN), np.float32)), ValueError, "gate_up"
    ),
    "down hidden": Refusal(dict(down=np.zeros((EXPERTS, FFN, HIDDEN - 1), np.float32)), ValueError, "down"),
    "down 2-D": Refusal(dict(down=np.zeros((FFN, HIDDEN), np.float32)), ValueError, "down"),
    "down int": Refusal(dict(down=np.zeros((EXPERTS, FFN, HIDDEN), np.int32)), ValueError, "down"),
}

#: Where docs/moe.md's argument table says the frameworks differ: name -> (change, PyTorch's outcome,
#: JAX's outcome), an outcome being None (the call runs) or (error, argument).
DIFFERENT = {
    "a weight in another float dtype": (
        dict(gate_up=base_arrays()["gate_up"].astype(np.float16)),
        (ValueError, "gate_up"),
        None,
    ),
    "shared weights in another float dtype": (
        {name: value.astype(np.float16) for name, value in _SHARED.items()},
        (ValueError, "shared_gate_up"),
        None,
    ),
    "x of rank 2": (dict(x=np.zeros((6, HIDDEN), np.float32)), None, (ValueError, "x")),
}


@dataclass(frozen=True)
class HostileCall:
    """A valid call with unlucky data: the arrays (JAX layouts; None: absent) and options, the corruption
    applied, and which unmasked tokens hold non-finite (or overflowing) values."""

    arrays: dict[str, np.ndarray | None]
    options: dict
    corruption: str
    broken: np.ndarray = field(repr=False)  # [B, S] bool
    batches: tuple[int, ...] | None = None  # sequences of each token shard (None: equal shards)

    @property
    def token_mask(self) -> np.ndarray | None:
        return self.arrays.get("token_mask")

    @property
    def valid(self) -> np.ndarray:
        """[B, S] bool: the tokens the layer routes."""
        mask = self.token_mask
        return np.ones(self.arrays["x"].shape[:2], bool) if mask is None else mask

    def shard(self, index: int, shards: int) -> HostileCall:
        """Token shard `index` of `shards` (rows of the batch in order, as the layers split it, or as
        `batches` says); the weights stay whole."""
        batches = self.batches or (self.broken.shape[0] // shards,) * shards
        first = sum(batches[:index])
        rows = slice(first, first + batches[index])
        arrays = dict(self.arrays, x=self.arrays["x"][rows])
        for name in ("token_mask", "routing_indices"):
            if arrays.get(name) is not None:
                arrays[name] = arrays[name][rows]
        return dataclasses.replace(self, arrays=arrays, broken=self.broken[rows])

    def masking(self, tokens: np.ndarray) -> HostileCall:
        """The same call with `tokens` [B, S] masked out as well (for "the others are unaffected")."""
        return dataclasses.replace(self, arrays={**self.arrays, "token_mask": self.valid & ~tokens})


CORRUPTIONS = (
    "none",
    "nan_tokens",  # unmasked tokens of NaN: NaN logits, weights and activations
    "inf_tokens",  # +inf and -inf tokens
    "huge_tokens",  # 1e30: finite logits, activations that overflow fp32
    "masked_nan",  # NaN and inf in padding only: never read
    "nan_gate",  # a NaN router column: that expert's scores NaN for every token
    "no_tokens",  # B = 0 or S = 0
    "all_masked",  # every token padding
    "overflow",  # every token to one expert under a small capacity: nearly every slot dropped
    "ties",  # every token the same: every weight ties
)


def corrupted(arrays: dict, options: dict, corruption: str, rng: np.random.Generator) -> HostileCall:
    """`arrays` (a valid call's, changed in place) with `corruption` applied, as a HostileCall."""
    x = arrays["x"]
    batch, seq = x.shape[:2]
    if corruption == "all_masked":
        arrays["token_mask"] = np.zeros((batch, seq), bool)
    if corruption == "masked_nan" and arrays.get("token_mask") is None:
        arrays["token_mask"] = rng.random((batch, seq)) < 0.7
    broken = np.zeros((batch, seq), bool)
    tokens = batch * seq
    if corruption in ("nan_tokens", "inf_tokens", "huge_tokens", "masked_nan") and tokens:
        picks = rng.choice(tokens, size=min(tokens, int(rng.integers(1, 3))), replace=False)
        values = {"nan_tokens": [np.nan], "inf_tokens": [np.inf, -np.inf], "huge_tokens": [1e30, -1e30]}
        values["masked_nan"] = [np.nan, np.inf]
        for i, token in enumerate(picks):
            broken.flat[token] = True
            x.reshape(tokens, HIDDEN)[token] = values[corruption][i % len(values[corruption])]
        if corruption == "masked_nan":
            arrays["token_mask"] = arrays["token_mask"] & ~broken
            broken[:] = False  # padding: nothing it holds is read
        elif arrays.get("token_mask") is not None:
            broken &= arrays["token_mask"]
    if corruption == "nan_gate":
        arrays["gate"][:, int(rng.integers(0, EXPERTS))] = np.nan
    if corruption == "overflow":
        arrays["gate"][:, 0] += 10.0  # every token ranks expert 0 first (x made positive)
        arrays["x"] = np.abs(x)
    if corruption == "ties" and tokens:
        arrays["x"] = np.broadcast_to(x.reshape(tokens, HIDDEN)[:1], x.shape).copy()
    return HostileCall(arrays=arrays, options=options, corruption=corruption, broken=broken)


@st.composite
def hostile_calls(draw, shards: int = 1, corruptions: tuple[str, ...] = CORRUPTIONS) -> HostileCall:
    """A hostile call whose batch splits into `shards` token shards (B a multiple of it; the corruption's
    tokens may all fall in one shard)."""
    corruption = draw(st.sampled_from(corruptions))
    empty = corruption == "no_tokens"
    batch = 0 if empty and draw(st.booleans()) else shards * draw(st.integers(1, 2))
    seq = 0 if empty and batch else draw(st.integers(1, 4))
    arrays: dict = base_arrays(batch, seq, seed=draw(st.integers(0, 2**16)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    topk = draw(st.integers(1, 2))
    options: dict = dict(topk=topk, score_function=draw(st.sampled_from(["softmax", "sigmoid"])))
    capacity = draw(st.sampled_from([None, None, 0.25, 0.5, 2.0]))
    if corruption == "overflow":
        capacity = 0.25
    options["capacity_factor"] = capacity
    if capacity is not None:
        options["drop_policy"] = draw(st.sampled_from(["position", "probs"]))
    elif batch * seq and draw(st.booleans()):
        options["pipeline_chunks"] = draw(st.integers(2, 3))
    for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"):
        if draw(st.booleans()):
            options[name] = draw(st.sampled_from([1e-3, 0.1]))
    options["return_stats"] = draw(st.booleans())
    if draw(st.booleans()):
        options["balance_counts"] = "scores"
    if options["score_function"] == "sigmoid" and draw(st.booleans()):
        arrays["expert_bias"] = rng.normal(0, 0.5, EXPERTS).astype(np.float32)
    if options["score_function"] == "sigmoid" or draw(st.booleans()):
        # sigmoid either way; softmax only unnormalised (over all E, before the top-k)
        options["normalize_topk"] = draw(st.sampled_from([None, True, False]))
        if options["score_function"] == "softmax":
            options["use_pre_softmax"] = True
    if draw(st.booleans()):
        # two groups of two experts, one chosen: the group score by each rule that fits in a group
        options.update(num_groups=2, group_topk=1)
        options["group_score"] = draw(st.sampled_from(["topk_sum", "top2_sum", "max"]))
    if draw(st.booleans()):
        arrays.update(shared_arrays(gate=draw(st.booleans())))
    if draw(st.booleans()):
        arrays["token_mask"] = rng.random((batch, seq)) < 0.7
    if draw(st.booleans()):  # router replay of ids in and out of range, repeats included
        arrays["routing_indices"] = rng.integers(-2, EXPERTS + 2, (batch, seq, topk)).astype(np.int32)
    return corrupted(arrays, options, corruption, rng)


#: Every option of the layer at once (sigmoid scores with a bias, shared experts with their gate, a mask,
#: the three losses, the statistics, the scores' counts), what expert_parallel_calls runs every case with.
EVERY_OPTION = dict(
    topk=2,
    score_function="sigmoid",
    aux_loss_coeff=0.1,
    seq_aux_loss_coeff=0.1,
    z_loss_coeff=1e-3,
    return_stats=True,
)


#: Group-limited selection on the layer's four experts: two groups of two, one chosen.
_GROUPS = dict(num_groups=2, group_topk=1)


def expert_parallel_calls(shards: int = 2, unequal: bool = True) -> list[HostileCall]:
    """The data-dependent cases every rank of an EP group (every shard of a mesh) must handle alike, each
    with every option on: NaN tokens in one shard (under the probs policy, and dropless in pipelined chunks),
    overflowing tokens, one shard all padding, every token to one expert under a small capacity (most slots
    dropped) and under a large one (most of the fixed slabs' rows unused), the scores' counts, unnormalised
    sigmoid weights, group-limited selection by the groups' top two and by their largest score, replayed
    expert ids in and out of range (dropless in chunks and under a capacity), no tokens on any shard, and,
    with `unequal` (process groups: dropless allows it), a rank without tokens."""
    rng = np.random.default_rng(11)
    cases = [
        ("nan_tokens", dict(capacity_factor=0.5, drop_policy="probs")),
        ("nan_tokens", dict(capacity_factor=None, pipeline_chunks=2)),
        ("huge_tokens", dict(capacity_factor=None, balance_counts="scores", normalize_topk=False)),
        ("overflow", dict(capacity_factor=0.25, drop_policy="position", **_GROUPS, group_score="top2_sum")),
        ("overflow", dict(capacity_factor=4.0, drop_policy="probs", **_GROUPS, group_score="max")),
        ("one_shard_masked", dict(capacity_factor=1.0, drop_policy="probs", balance_counts="scores")),
        ("replayed_ids", dict(capacity_factor=None, pipeline_chunks=2)),
        ("replayed_ids", dict(capacity_factor=0.5, drop_policy="probs")),
    ]
    calls = []
    for corruption, options in cases:
        arrays = dict(base_arrays(2 * shards, 3, seed=len(calls)), **shared_arrays(gate=True))
        arrays["expert_bias"] = rng.normal(0, 0.5, EXPERTS).astype(np.float32)
        arrays["token_mask"] = rng.random((2 * shards, 3)) < 0.8
        if corruption == "one_shard_masked":
            arrays["token_mask"][:2] = False  # the first shard: padding alone
        if corruption == "nan_tokens":  # the first shard's first token alone: the other shards whole
            arrays["x"][0, 0] = np.nan
            arrays["token_mask"][0, 0] = True
        if corruption == "replayed_ids":  # router replay of ids in and out of range, repeats included
            shape = (2 * shards, 3, EVERY_OPTION["topk"])
            arrays["routing_indices"] = rng.integers(-2, EXPERTS + 2, shape).astype(np.int32)
        # Corrupted here, not by `corrupted`, which sees no further corruption in them.
        own = corruption in ("nan_tokens", "replayed_ids")
        call = corrupted(arrays, dict(EVERY_OPTION, **options), "none" if own else corruption, rng)
        if corruption == "nan_tokens":
            call.broken[0, 0] = True
        if own:
            call = dataclasses.replace(call, corruption=corruption)
        calls.append(call)
    arrays = dict(base_arrays(0, 3, seed=10), **shared_arrays(gate=True))  # no tokens anywhere
    arrays.update(
        expert_bias=rng.normal(0, 0.5, EXPERTS).astype(np.float32), token_mask=np.ones((0, 3), bool)
    )
    options = dict(EVERY_OPTION, capacity_factor=1.0, drop_policy="probs", balance_counts="scores")
    calls.append(corrupted(arrays, options, "no_tokens", rng))
    if unequal:
        arrays = dict(base_arrays(2 * (shards - 1), 3, seed=9), **shared_arrays(gate=True))
        arrays["expert_bias"] = rng.normal(0, 0.5, EXPERTS).astype(np.float32)
        arrays["token_mask"] = rng.random((2 * (shards - 1), 3)) < 0.8
        options = dict(EVERY_OPTION, capacity_factor=None, pipeline_chunks=2, balance_counts="scores")
        call = corrupted(arrays, options, "none", rng)
        calls.append(
            dataclasses.replace(call, corruption="a rank without tokens", batches=(0, *(2,) * (shards - 1)))
        )
    return calls


# What the results must be ------------------------------------------------------------------------------


def record(out, aux_loss, dropped, stats: dict, grads: dict) -> dict:
    """One run's results as the family compares them, numpy throughout (from anything np.asarray reads)."""
    return dict(
        out=np.asarray(out),
        aux_loss=float(aux_loss),
        dropped=int(dropped),
        stats={name: np.asarray(value) for name, value in stats.items()},
        grads={name: np.asarray(value) for name, value in grads.items()},
    )


def agree(got: np.ndarray, expected: np.ndarray, what: str, rtol: float = 1e-4) -> None:
    """Non-finite exactly where the other is, the finite values to fp32 rounding."""
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{what}: non-finite entries")
    scale = float(np.max(np.abs(expected[finite]), initial=1.0))
    np.testing.assert_allclose(got[finite], expected[finite], rtol=rtol, atol=rtol * scale, err_msg=what)


def same_results(got: dict, expected: dict, call: HostileCall, what: str) -> None:
    """Outputs, losses, counts and gradients alike. With broken tokens the gradients that sum over them are
    compared where both are finite (an overflowing activation times a zero derivative is 0 in one order of
    IEEE operations and NaN in another); the other tokens' input gradients in full."""
    agree(got["out"], expected["out"], f"out {what}")
    agree(np.float32(got["aux_loss"]), np.float32(expected["aux_loss"]), f"aux_loss {what}")
    assert got["dropped"] == expected["dropped"], (what, got["dropped"], expected["dropped"])
    for name in ("routed", "kept", "dropped", "max_load"):
        np.testing.assert_array_equal(got["stats"][name], expected["stats"][name], err_msg=f"{name} {what}")
    for name, grad in expected["grads"].items():
        mine = got["grads"][name]
        if not call.broken.any():
            agree(mine, grad, f"grad {name} {what}", rtol=1e-3)
            continue
        if name == "x":
            others = call.valid & ~call.broken
            agree(mine[others], grad[others], f"grad x of the finite tokens {what}", rtol=1e-3)
            assert np.isfinite(mine[others]).all(), f"grad x of the finite tokens {what}"
        both = np.isfinite(mine) & np.isfinite(grad)
        agree(mine[both], grad[both], f"grad {name} where finite {what}", rtol=1e-3)


def routed_slots(call: HostileCall) -> int:
    """The slots the router routes in `call` (its whole batch): K per unmasked token, or with a replay
    those of each unmasked token's ids that are in range and new to the token."""
    valid = call.valid
    replayed = call.arrays.get("routing_indices")
    if replayed is None:
        return call.options["topk"] * int(valid.sum())
    slots = [
        len({int(i) for i in ids if 0 <= i < EXPERTS}) for ids in replayed.reshape(-1, replayed.shape[-1])
    ]
    return int(np.asarray(slots).reshape(valid.shape)[valid].sum())


def check_invariants(
    call: HostileCall, results: dict, routed: int | None = None, first_expert: int = 0
) -> None:
    """What docs/moe.md promises whatever the data: padding rows and their gradients exactly zero; exact
    counts; the finite tokens' outputs finite; every weight of an expert that kept no slot a zero gradient
    (no unused row of a capacity slab or of a worst-case buffer reaches it). For one rank of a group:
    `routed`, the group's routed slots (`routed_slots` of the whole call: the counts are the group's), and
    `first_expert`, the global id of the first expert whose weights the results' gradients hold."""
    valid, out = call.valid, results["out"]
    assert (out[~valid] == 0).all(), "padding rows of out"
    assert (results["grads"]["x"][~valid] == 0).all(), "padding rows of the x gradient"
    stats = results["stats"]
    replayed = call.arrays.get("routing_indices")
    expected = routed_slots(call) if routed is None else routed
    assert stats["routed"].sum() == expected, (stats, replayed)
    assert stats["dropped"] == (stats["routed"] - stats["kept"]).sum() == results["dropped"], stats
    finite = valid & ~call.broken
    if replayed is not None:  # a replay may pick an expert of NaN logits (nan_gate): NaN weights
        nan_experts = np.flatnonzero(np.isnan(call.arrays["gate"]).any(axis=0))
        finite &= ~np.isin(replayed, nan_experts).any(axis=-1)
    assert np.isfinite(out[finite]).all(), "a finite token's output"
    held = results["grads"]["gate_up"].shape[0]
    for expert in np.flatnonzero(stats["kept"][first_expert : first_expert + held] == 0):
        for name in ("gate_up", "down"):
            assert not results["grads"][name][expert].any(), (name, first_expert + expert, "no slots")
