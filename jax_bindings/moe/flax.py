"""Flax Linen front end of the expert-parallel MoE layer: `MoEBlock` (moetriton.jax.moe.flax).

The block owns the layer's parameters, with logical-axis annotations so they shard the Flax way
(`nn.logical_axis_rules`): gate [H, E] ("embed", "router_experts"), fused gate+up [E, H, 2F] ("experts",
"embed", "mlp") and down [E, F, H] ("experts", "mlp", "embed"); the optional shared experts' shared_gate_up
[H, 2Fs] ("embed", "mlp"), shared_down [Fs, H] ("mlp", "embed") and shared_gate [H, 1] ("embed", None),
replicated by the default rules; the optional biases gate_bias [E] ("router_experts"), gate_up_bias [E, 2F]
("experts", "mlp") and down_bias [E, H] ("experts", "embed"). DEFAULT_LOGICAL_AXIS_RULES puts "experts"
on the "ep" mesh axis and replicates the rest, which is the layout `moetriton.jax.moe` computes in; rules
that also shard "embed" or "mlp" (FSDP) work too: jit gathers those weights before the layer. The optional
expert bias (sigmoid / sqrtsoftplus routing) is not trained by gradients: it lives in the "moe" collection,
for the caller's load-balancing update rule (`moetriton.jax.update_expert_bias`, aux-loss-free balancing, as
a train-state update: the block never mutates it). Importing this module imports flax; `moetriton.jax` does
not.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

from moetriton.kernels.rules import moe as layer_rules
from moetriton.kernels.rules.expert_parallel import gate_up_width
from moetriton.kernels.rules.moe import MoEStats

from .layer import moe

#: Logical axis -> mesh axis for the default layout (experts over "ep", everything else replicated).
DEFAULT_LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("experts", "ep"),
    ("embed", None),
    ("mlp", None),
    ("router_experts", None),
)


def init_sharded(module: nn.Module, key: jax.Array, *args, mesh: Mesh, rules=DEFAULT_LOGICAL_AXIS_RULES):
    """`module.init(key, *args)` under jit, every variable placed by its logical axes: the mesh sharding
    that `rules` give its annotation (the usual Flax recipe, as one call). Returns the boxed variables.

    Example:
        >>> block = MoEBlock(num_experts=8, ffn_dim=512, topk=2, mesh=mesh)
        >>> variables = init_sharded(block, key, x, mesh=mesh)
    """
    abstract = jax.eval_shape(module.init, key, *args)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    # On Auto axes the rules also constrain the variables inside the computation; on Explicit axes such a
    # constraint is an assertion about the types (the initialisers make replicated arrays), so there the
    # variables get their shardings where jit returns them.
    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
    with jax.set_mesh(mesh), contextlib.nullcontext() if explicit else nn.logical_axis_rules(rules):
        return jax.jit(module.init, out_shardings=shardings)(key, *args)


_expert_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)


#: The shared experts' parameters: the block attribute of their initialiser (the routed experts' or the
#: router's) and their logical axes.
_SHARED_INIT_AND_AXES = {
    "shared_gate_up": ("expert_init", ("embed", "mlp")),
    "shared_down": ("expert_init", ("mlp", "embed")),
    "shared_gate": ("gate_init", ("embed", None)),
}


#: The biases' logical axes (GPT-OSS's router bias and expert projection biases; zeros at init).
_BIAS_AXES = {
    "gate_bias": ("router_experts",),
    "gate_up_bias": ("experts", "mlp"),
    "down_bias": ("experts", "embed"),
}


class MoEBlock(nn.Module):
    """Mixture-of-experts MLP with expert parallelism; `__call__(x [B, S, H], token_mask=None,
    return_stats=False, routing_indices=None)` returns (out [B, S, H], aux_loss fp32 scalar, dropped int32
    scalar), and with `return_stats` a fourth element, `moetriton.kernels.rules.moe.MoEStats`, as
    `moetriton.jax.moe`, whose docstring explains every option below. token_mask: [B, S] bool or None
    (False: padding, routed nowhere, counted nowhere, output zero). return_stats is a Python bool, static
    under jit: bind it outside the jitted function (`jax.jit(functools.partial(block.apply,
    return_stats=True))`) or call apply inside one. routing_indices: [B, S, K] or None (router replay).

    Attributes:
        num_experts: E (a multiple of the EP size). ffn_dim: F. topk: K.
        score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, normalize_topk,
            group_score: router options (`fused_topk_with_score_function`).
        use_expert_bias: keep an [E] fp32 selection bias in the "moe" collection (sigmoid / sqrtsoftplus,
            or softmax with use_pre_softmax), zeros at init; the block only reads it (aux-loss-free
            balancing updates it, see below).
        aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff: weights of the load-balancing, sequence-wise
            load-balancing and router z losses (moetriton.kernels.rules.moe.LOSSES; aux_loss is their sum).
        align_size, capacity_factor (None: dropless), drop_policy ("position" or "probs": which slots a full
            expert keeps), activation, pipeline_chunks (dropless: the routed path in this many token
            chunks), balance_counts ("routed" or "scores": the load-balancing losses' counts),
            probs_on_input (top-1: the weight scales the expert's input, Llama 4), fp8 (None, "tensorwise"
            or "blockwise": the routed experts' GEMMs in FP8): layer options.
        num_shared_experts: always-on shared experts (DeepSeek-V3: 1), one FFN of width
            Fs = num_shared_experts * ffn_dim (parameters shared_gate_up [H, 2Fs] or [H, Fs] and
            shared_down [Fs, H], initialised by expert_init); 0: none.
        shared_expert_gate: scale the shared output per token by sigmoid(x @ shared_gate) (Qwen-MoE;
            shared_gate [H, 1], initialised by gate_init).
        use_gate_bias: a router bias gate_bias [E] ("router_experts"), added to the logits; with
            use_projection_biases the experts' biases gate_up_bias [E, 2F] ("experts", "mlp") and down_bias
            [E, H] ("experts", "embed") (GPT-OSS). Trained parameters, zeros at init.
        dtype: compute dtype (default: the input's); param_dtype: parameter dtype.
        mesh, ep_axis, data_axes, exchange: where the layer runs (mesh None: one device).

    Example:
        >>> block = MoEBlock(num_experts=8, ffn_dim=512, topk=2, mesh=mesh, data_axes=("data",))
        >>> variables = init_sharded(block, jax.random.key(0), x, mesh=mesh)  # gate_up, down over "ep"
        >>> out, aux_loss, dropped = jax.jit(block.apply)(variables, x)

    Aux-loss-free balancing (DeepSeek-V3): a training step reads the routed counts from the stats and
    returns the "moe" collection's new expert_bias with the new params (the block never mutates it):
        >>> from moetriton.jax import update_expert_bias
        >>> block = MoEBlock(num_experts=8, ffn_dim=512, topk=2, score_function="sigmoid",
        ...                  use_expert_bias=True, seq_aux_loss_coeff=1e-4)
        >>> variables = nn.meta.unbox(block.init(jax.random.key(0), x))  # {"params": ..., "moe": ...}
        >>> @jax.jit
        ... def train_step(variables, x, token_mask):
        ...     def loss_fn(params):
        ...         out, aux_loss, _, stats = block.apply(
        ...             {**variables, "params": params}, x, token_mask, return_stats=True
        ...         )
        ...         return jnp.mean(out**2) + aux_loss, stats
        ...     grads, stats = jax.grad(loss_fn, has_aux=True)(variables["params"])
        ...     params = jax.tree.map(lambda p, g: p - 1e-2 * g, variables["params"], grads)
        ...     bias = update_expert_bias(variables["moe"]["expert_bias"], stats.routed, 1e-3)
        ...     return {"params": params, "moe": {"expert_bias": bias}}
        >>> variables = train_step(variables, x, token_mask)
    """

    num_experts: int
    ffn_dim: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    normalize_topk: bool | None = None
    group_score: str = "topk_sum"
    use_expert_bias: bool = False
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    align_size: int | None = None
    capacity_factor: float | None = None
    drop_policy: str = "position"
    activation: str = "swiglu"
    pipeline_chunks: int = 1
    balance_counts: str = "routed"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    gate_init: Any = nn.initializers.lecun_normal()
    expert_init: Any = _expert_init
    mesh: Mesh | None = None
    ep_axis: str | None = "ep"
    data_axes: tuple[str, ...] = ()
    exchange: str = "auto"
    num_shared_experts: int = 0
    shared_expert_gate: bool = False
    use_gate_bias: bool = False
    use_projection_biases: bool = False
    probs_on_input: bool = False
    fp8: str | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        token_mask: jax.Array | None = None,
        return_stats: bool = False,
        routing_indices: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array, MoEStats]:
        layer_rules.check_options(  # before the weights' shapes are derived from the activation
            activation=self.activation,
            score_function=self.score_function,
            aux_loss_coeff=self.aux_loss_coeff,
            seq_aux_loss_coeff=self.seq_aux_loss_coeff,
            z_loss_coeff=self.z_loss_coeff,
            exchange=self.exchange,
            exchanges=layer_rules.JAX_EXCHANGES,
            drop_policy=self.drop_policy,
            pipeline_chunks=self.pipeline_chunks,
            capacity_factor=self.capacity_factor,
            balance_counts=self.balance_counts,
            probs_on_input=self.probs_on_input,
            topk=self.topk,
            fp8=self.fp8,
        )
        hidden, experts = x.shape[-1], self.num_experts
        shared_shapes = layer_rules.shared_weight_shapes(
            hidden=hidden,
            ffn=self.ffn_dim,
            num_shared_experts=self.num_shared_experts,
            shared_expert_gate=self.shared_expert_gate,
            activation=self.activation,
        )
        width = gate_up_width(self.activation, self.ffn_dim)
        gate = self.param(
            "gate",
            nn.with_logical_partitioning(self.gate_init, ("embed", "router_experts")),
            (hidden, experts),
            self.param_dtype,
        )
        gate_up = self.param(
            "gate_up",
            nn.with_logical_partitioning(self.expert_init, ("experts", "embed", "mlp")),
            (experts, hidden, width),
            self.param_dtype,
        )
        down = self.param(
            "down",
            nn.with_logical_partitioning(self.expert_init, ("experts", "mlp", "embed")),
            (experts, self.ffn_dim, hidden),
            self.param_dtype,
        )
        shared = {}
        for name, shape in shared_shapes.items():
            init, axes = _SHARED_INIT_AND_AXES[name]
            init = nn.with_logical_partitioning(getattr(self, init), axes)
            shared[name] = self.param(name, init, shape, self.param_dtype)
        bias_shapes = layer_rules.bias_shapes(
            hidden=hidden,
            ffn=self.ffn_dim,
            num_experts=experts,
            experts_held=experts,
            activation=self.activation,
            gate_bias=self.use_gate_bias,
            projection_biases=self.use_projection_biases,
        )
        biases = {
            name: self.param(
                name,
                nn.with_logical_partitioning(nn.initializers.zeros_init(), _BIAS_AXES[name]),
                shape,
                self.param_dtype,
            )
            for name, shape in bias_shapes.items()
        }
        expert_bias = None
        if self.use_expert_bias:
            expert_bias = self.variable(
                "moe",
                "expert_bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), ("router_experts",)),
                jax.random.key(0),
                (experts,),
                jnp.float32,
            ).value
        return moe(
            x,
            gate,
            gate_up,
            down,
            topk=self.topk,
            expert_bias=nn.meta.unbox(expert_bias),
            score_function=self.score_function,
            use_pre_softmax=self.use_pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
            normalize_topk=self.normalize_topk,
            group_score=self.group_score,
            aux_loss_coeff=self.aux_loss_coeff,
            align_size=self.align_size,
            capacity_factor=self.capacity_factor,
            activation=self.activation,
            dtype=self.dtype,
            mesh=self.mesh,
            ep_axis=self.ep_axis,
            data_axes=self.data_axes,
            exchange=self.exchange,
            **shared,
            **biases,
            seq_aux_loss_coeff=self.seq_aux_loss_coeff,
            z_loss_coeff=self.z_loss_coeff,
            drop_policy=self.drop_policy,
            pipeline_chunks=self.pipeline_chunks,
            token_mask=token_mask,
            return_stats=return_stats,
            routing_indices=routing_indices,
            balance_counts=self.balance_counts,
            probs_on_input=self.probs_on_input,
            fp8=self.fp8,
        )
