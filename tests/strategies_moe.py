"""Hypothesis strategies for the MoE layers (framework-neutral: numpy arrays plus arguments), shared by
tests/jax and tests/torch so that both layers are tested on the same problems.

`moe_problems()` draws one layer call: tokens [B, S, H] (B divisible by the number of token shards), gate
[H, E], fused gate+up expert weights [E, H, 2F], down weights [E, F, H], an expert bias, top-K with a score
function (groups sometimes), alignment on or off, and a capacity policy (dropless, or a capacity factor small
enough to force overflow sometimes). Values are small and well scaled, so bf16 and fp32 runs stay close to the
fp32 dense reference. `with_shared_experts(problem, ...)` adds the shared experts' weights (and picks the
activation) to a problem; `with_recipe_options(problem, ...)` a padding mask, the other two losses and the
drop policy; `with_biases(problem)` GPT-OSS's router bias and expert projection biases.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from hypothesis import strategies as st

from moetriton.kernels.rules.expert_parallel import gate_up_width
from moetriton.kernels.rules.moe import BIASES, SHARED_WEIGHTS


@dataclass(frozen=True)
class MoEProblem:
    batch: int
    seq: int
    hidden: int
    ffn: int
    num_experts: int
    topk: int
    score_function: str
    num_groups: int | None
    group_topk: int | None
    align_size: int | None
    capacity_factor: float | None  # None: dropless
    routing: str  # "random", "one_expert" (every token prefers expert 0), "empty_experts"
    x: np.ndarray  # [B, S, H] float32
    gate: np.ndarray  # [H, E] float32
    gate_up: np.ndarray  # [E, H, 2F] float32
    down: np.ndarray  # [E, F, H] float32
    expert_bias: np.ndarray | None  # [E] float32 (sigmoid / sqrtsoftplus only)
    activation: str = "swiglu"
    shared_gate_up: np.ndarray | None = None  # [H, 2Fs] float32 ([H, Fs] for a non-gated activation)
    shared_down: np.ndarray | None = None  # [Fs, H] float32
    shared_gate: np.ndarray | None = None  # [H, 1] float32
    token_mask: np.ndarray | None = None  # [B, S] bool, False: padding
    gate_bias: np.ndarray | None = None  # [E] float32: the router's logit bias
    gate_up_bias: np.ndarray | None = None  # [E, 2F] float32 ([E, F] for a non-gated activation)
    down_bias: np.ndarray | None = None  # [E, H] float32
    options: dict = field(default_factory=dict)  # more layer options: seq / z-loss coefficients, drop_policy

    @property
    def shared_weights(self) -> dict[str, np.ndarray]:
        """The shared experts' weights the problem has, by argument name (empty without shared experts)."""
        shared = (self.shared_gate_up, self.shared_down, self.shared_gate)  # the layers' argument order
        return {name: value for name, value in zip(SHARED_WEIGHTS, shared, strict=True) if value is not None}

    @property
    def biases(self) -> dict[str, np.ndarray]:
        """The router and projection biases the problem has, by argument name (BIASES order)."""
        biases = (self.gate_bias, self.gate_up_bias, self.down_bias)
        return {name: value for name, value in zip(BIASES, biases, strict=True) if value is not None}

    @property
    def num_tokens(self) -> int:
        return self.batch * self.seq

    def layer_options(self, aux_loss_coeff: float) -> dict:
        """Keyword arguments of the layer and its dense reference (both frameworks) that the problem fixes,
        but for the expert bias, whose array type is the framework's."""
        router = dict(topk=self.topk, score_function=self.score_function)
        router.update(num_groups=self.num_groups, group_topk=self.group_topk)
        layout = dict(align_size=self.align_size, capacity_factor=self.capacity_factor)
        losses = dict(aux_loss_coeff=aux_loss_coeff, **self.options)
        return dict(router, **layout, **losses, activation=self.activation)


def with_shared_experts(
    problem: MoEProblem, *, gate: bool, activation: str = "swiglu", num_shared: int = 2
) -> MoEProblem:
    """`problem` with `num_shared` shared experts (one FFN of width num_shared * F), a per-token gate if
    `gate`, and `activation` (a non-gated one keeps the first F columns of the routed gate_up)."""
    rng = np.random.default_rng(problem.num_tokens * 7 + problem.num_experts)
    hidden, shared_ffn = problem.hidden, num_shared * problem.ffn
    scale = 1 / np.sqrt(hidden)
    return replace(
        problem,
        activation=activation,
        gate_up=problem.gate_up[..., : gate_up_width(activation, problem.ffn)].copy(),
        shared_gate_up=rng.normal(0, scale, (hidden, gate_up_width(activation, shared_ffn))).astype(
            np.float32
        ),
        shared_down=rng.normal(0, 1 / np.sqrt(shared_ffn), (shared_ffn, hidden)).astype(np.float32),
        shared_gate=rng.normal(0, scale, (hidden, 1)).astype(np.float32) if gate else None,
    )


def with_biases(problem: MoEProblem, *, router: bool = True, projections: bool = True) -> MoEProblem:
    """`problem` with GPT-OSS's biases: a router bias [E] (large enough to change the selection) and/or
    each expert's projection biases [E, W] and [E, H]."""
    rng = np.random.default_rng(problem.num_tokens * 5 + problem.num_experts + 1)
    experts, width = problem.num_experts, problem.gate_up.shape[-1]
    biases = {}
    if router:
        biases["gate_bias"] = rng.normal(0, 0.5, experts).astype(np.float32)
    if projections:
        biases["gate_up_bias"] = rng.normal(0, 0.5, (experts, width)).astype(np.float32)
        biases["down_bias"] = rng.normal(0, 0.5, (experts, problem.hidden)).astype(np.float32)
    return replace(problem, **biases)


def with_probs_on_input(problem: MoEProblem) -> MoEProblem:
    """`problem` routed top-1 with the weight on the expert's input (Llama 4), groups off."""
    options = dict(problem.options, probs_on_input=True)
    return replace(problem, topk=1, num_groups=None, group_topk=None, options=options)


def with_recipe_options(
    problem: MoEProblem,
    *,
    masked: bool = True,
    seq_aux_loss_coeff: float = 0.05,
    z_loss_coeff: float = 1e-3,
    drop_policy: str = "probs",
) -> MoEProblem:
    """`problem` with a padding mask (the tail of every other sequence, and all of the last one when there
    are several: a sequence of padding alone), the sequence-wise loss, the z-loss and a drop policy."""
    mask = None
    if masked:
        mask = np.ones((problem.batch, problem.seq), bool)
        mask[::2, (problem.seq + 1) // 2 :] = False
        if problem.batch > 1:
            mask[-1] = False
    options = dict(seq_aux_loss_coeff=seq_aux_loss_coeff, z_loss_coeff=z_loss_coeff, drop_policy=drop_policy)
    return replace(problem, token_mask=mask, options=options)


def with_pipeline_chunks(problem: MoEProblem, chunks: int) -> MoEProblem:
    """`problem` (dropless) with its routed path in `chunks` token chunks: an option of the layer that its
    dense reference ignores (the results are the unchunked layer's)."""
    return replace(problem, options={**problem.options, "pipeline_chunks": chunks})


#: Experts of `probs_policy_slots`.
PROBS_POLICY_EXPERTS = 5


def probs_policy_slots(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices [T, K] int32 with -1 for masked slots, merging weights [T, K] fp32) for the probs drop
    policy's ranking: few distinct weights (many exact ties), NaN, -inf and -0.0 among them."""
    rng = np.random.default_rng(seed)
    tokens, topk = int(rng.integers(1, 12)), int(rng.integers(1, 4))
    indices = rng.integers(-1, PROBS_POLICY_EXPERTS, (tokens, topk)).astype(np.int32)
    pool = np.array([0.0, -0.0, 0.25, 0.5, 0.75, np.nan, -np.inf], np.float32)
    return indices, rng.choice(pool, (tokens, topk))


def kept_by_weight(indices: np.ndarray, weights: np.ndarray, capacity: int, num_experts: int) -> np.ndarray:
    """numpy oracle of drop_policy "probs" (moetriton.kernels.rules.moe.NON_FINITE): each expert's
    `capacity` slots of highest weight, NaN below every number, equal weights (-0.0 and +0.0, NaN and NaN)
    to the earlier (token, slot); the others -1."""
    flat, weight = indices.reshape(-1), weights.reshape(-1).astype(np.float64)
    kept = np.zeros(flat.shape, bool)
    for expert in range(num_experts):
        slots = np.flatnonzero(flat == expert)
        missing = np.isnan(weight[slots])
        descending = np.where(missing, 0.0, -weight[slots]) + 0.0  # + 0.0: -0.0 becomes +0.0
        ranked = slots[np.lexsort((slots, descending, missing))]  # last key first: NaN last, weight, slot
        kept[ranked[:capacity]] = True
    return np.where(kept.reshape(indices.shape), indices, -1)


@st.composite
def moe_problems(
    draw,
    *,
    shards: int = 1,
    max_experts_per_shard: int = 3,
    policies: tuple[str, ...] = ("dropless", "capacity"),
) -> MoEProblem:
    """A layer call whose batch splits into `shards` token shards and whose experts split over `shards` EP
    ranks (E is a multiple of `shards`)."""
    batch = shards * draw(st.integers(1, 2))
    seq = draw(st.integers(1, 5))
    hidden = draw(st.sampled_from([8, 16]))
    ffn = draw(st.sampled_from([8, 12]))
    num_experts = shards * draw(st.integers(1, max_experts_per_shard))
    topk = draw(st.integers(1, min(num_experts, 3)))
    score_function = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    groups = None
    if score_function != "softmax" and num_experts % 2 == 0 and topk % 2 == 0 and draw(st.booleans()):
        groups = (2, 2) if topk // 2 <= num_experts // 2 else None
    policy = draw(st.sampled_from(policies))
    capacity_factor = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0])) if policy == "capacity" else None
    align_size = draw(st.sampled_from([None, 2, 4]))
    routing = draw(st.sampled_from(["random", "one_expert", "empty_experts"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    gate = rng.normal(0, 1 / np.sqrt(hidden), (hidden, num_experts)).astype(np.float32)
    if routing == "one_expert":
        gate[:, 0] += 3.0 / np.sqrt(hidden)
    x = rng.normal(0, 1, (batch, seq, hidden)).astype(np.float32)
    if routing == "one_expert":
        x = np.abs(x)  # with the shifted gate column, every token ranks expert 0 first
    if routing == "empty_experts" and num_experts > topk:
        gate[:, num_experts - 1] -= 10.0 / np.sqrt(hidden)
        x = np.abs(x)
    return MoEProblem(
        batch=batch,
        seq=seq,
        hidden=hidden,
        ffn=ffn,
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        num_groups=None if groups is None else groups[0],
        group_topk=None if groups is None else groups[1],
        align_size=align_size,
        capacity_factor=capacity_factor,
        routing=routing,
        x=x,
        gate=gate,
        gate_up=rng.normal(0, 1 / np.sqrt(hidden), (num_experts, hidden, 2 * ffn)).astype(np.float32),
        down=rng.normal(0, 1 / np.sqrt(ffn), (num_experts, ffn, hidden)).astype(np.float32),
        expert_bias=(
            rng.normal(0, 0.1, num_experts).astype(np.float32) if score_function != "softmax" else None
        ),
    )
