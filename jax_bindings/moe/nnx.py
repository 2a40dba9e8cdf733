"""Flax NNX front end of the expert-parallel MoE layer: `MoE` (moetriton.jax.moe.nnx).

NNX is Flax's current API: a module is a Python object that owns its variables, built eagerly with an
`nnx.Rngs`. `MoE` owns the layer's parameters with the Linen `MoEBlock`'s names, shapes, initialisers and
logical axes (gate [H, E] ("embed", "router_experts"), gate_up [E, H, 2F] ("experts", "embed", "mlp"), down
[E, F, H] ("experts", "mlp", "embed"), the optional shared experts'), and calls `moetriton.jax.moe` with
them: every layer option is moe()'s, passed through by name, so the two front ends and the function take
the same options. With a `mesh`, the variables are created sharded: their logical axes through `rules`
(default DEFAULT_LOGICAL_AXIS_RULES: experts over "ep", the rest replicated) onto the mesh, which is the
layout moe() computes in. The optional expert bias is an `ExpertBias` variable, not an `nnx.Param`: an
optimizer over the parameters leaves it alone, and the caller's load-balancing rule
(`moetriton.jax.update_expert_bias`) sets it. Importing this module imports flax; `moetriton.jax` does not.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from moetriton.kernels.rules import moe as layer_rules
from moetriton.kernels.rules.expert_parallel import gate_up_width
from moetriton.kernels.rules.moe import MoEStats

from .flax import _BIAS_AXES, _SHARED_INIT_AND_AXES, DEFAULT_LOGICAL_AXIS_RULES, _expert_init
from .layer import moe

#: moe()'s arguments that the module supplies itself (its variables, the call's inputs, the options that
#: decide the variables' shapes or placement); every other keyword of moe() is a layer option.
_OWN_ARGUMENTS = frozenset(
    {
        "x",
        "gate",
        "gate_up",
        "down",
        "expert_bias",
        "shared_gate_up",
        "shared_down",
        "shared_gate",
        *layer_rules.BIASES,
        "topk",
        "activation",
        "mesh",
        "token_mask",
        "return_stats",
    }
)
_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(moe).parameters.items()}
LAYER_OPTIONS = tuple(name for name in _DEFAULTS if name not in _OWN_ARGUMENTS)
#: The options the shared layer rules check before the variables are made, as the Linen block does.
_CHECKED = (
    "score_function",
    "exchange",
    "drop_policy",
    "pipeline_chunks",
    "capacity_factor",
    "balance_counts",
    "probs_on_input",
    "fp8",
    *layer_rules.LOSSES,
)


_gate_init = nnx.initializers.lecun_normal()


class ExpertBias(nnx.Variable):
    """The [E] fp32 selection bias of aux-loss-free balancing: a variable the gradient step skips."""


class MoE(nnx.Module):
    """Mixture-of-experts MLP with expert parallelism, as an NNX module.

    `__call__(x [B, S, H], token_mask=None, return_stats=False, routing_indices=None)` returns (out
    [B, S, H], aux_loss fp32 scalar, dropped int32 scalar), and with `return_stats` a fourth element,
    MoEStats, as `moetriton.jax.moe`, whose docstring explains every option. token_mask: [B, S] bool or
    None.

    Args:
        hidden: H. num_experts: E (a multiple of the EP size). ffn_dim: F. topk: K.
        rngs: the initialisers' keys (`nnx.Rngs(0)`).
        activation: the experts' activation (decides gate_up's width: 2F gated, F otherwise).
        num_shared_experts, shared_expert_gate: shared experts of width num_shared_experts * F, optionally
            gated per token (shared_gate [H, 1]).
        use_expert_bias: an ExpertBias [E] (zeros) for sigmoid / sqrtsoftplus selection.
        use_gate_bias, use_projection_biases: the router bias gate_bias [E] and the experts' biases
            gate_up_bias [E, 2F] and down_bias [E, H] (GPT-OSS), parameters with the Linen block's names and
            logical axes, zeros at init.
        param_dtype: the parameters' dtype; gate_init, expert_init: their initialisers (the Linen block's).
        mesh: where the layer runs (None: one device); the variables are created sharded on it.
        rules: logical axis -> mesh axis, for the variables' shardings.
        **options: moe()'s layer options by name (LAYER_OPTIONS: score_function, num_groups, capacity_factor,
            aux_loss_coeff, ep_axis, data_axes, dtype, ...); an unknown name is refused here.

    Example:
        >>> model = MoE(64, num_experts=8, ffn_dim=32, topk=2, rngs=nnx.Rngs(0), aux_loss_coeff=1e-2)
        >>> out, aux_loss, dropped = model(jnp.ones((2, 4, 64)))
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        ffn_dim: int,
        topk: int,
        *,
        rngs: nnx.Rngs,
        activation: str = "swiglu",
        num_shared_experts: int = 0,
        shared_expert_gate: bool = False,
        use_expert_bias: bool = False,
        use_gate_bias: bool = False,
        use_projection_biases: bool = False,
        param_dtype: Any = jnp.float32,
        gate_init: Any = _gate_init,
        expert_init: Any = _expert_init,
        mesh: Mesh | None = None,
        rules: tuple[tuple[str, str | None], ...] = DEFAULT_LOGICAL_AXIS_RULES,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(LAYER_OPTIONS))
        if unknown:
            raise TypeError(f"MoE: unknown layer options {unknown}; moe() takes {LAYER_OPTIONS}")
        chosen = {name: options.get(name, _DEFAULTS[name]) for name in _CHECKED}
        layer_rules.check_options(
            activation=activation, exchanges=layer_rules.JAX_EXCHANGES, topk=topk, **chosen
        )
        self.topk, self.activation, self.mesh, self.options = topk, activation, mesh, dict(options)
        shapes = {
            "gate": (hidden, num_experts),
            "gate_up": (num_experts, hidden, gate_up_width(activation, ffn_dim)),
            "down": (num_experts, ffn_dim, hidden),
            **layer_rules.shared_weight_shapes(
                hidden=hidden,
                ffn=ffn_dim,
                num_shared_experts=num_shared_experts,
                shared_expert_gate=shared_expert_gate,
                activation=activation,
            ),
            **layer_rules.bias_shapes(
                hidden=hidden,
                ffn=ffn_dim,
                num_experts=num_experts,
                experts_held=num_experts,
                activation=activation,
                gate_bias=use_gate_bias,
                projection_biases=use_projection_biases,
            ),
        }
        inits_and_axes = {
            "gate": (gate_init, ("embed", "router_experts")),
            "gate_up": (expert_init, ("experts", "embed", "mlp")),
            "down": (expert_init, ("experts", "mlp", "embed")),
            **{
                name: (gate_init if init == "gate_init" else expert_init, axes)
                for name, (init, axes) in _SHARED_INIT_AND_AXES.items()
            },
            **{name: (nnx.initializers.zeros_init(), axes) for name, axes in _BIAS_AXES.items()},
        }
        # Eager sharding places each variable on the mesh as it is created; without a mesh there is nothing
        # to place, and the annotations stay as metadata (nnx.get_partition_spec reads them).
        sharding = dict(sharding_rules=rules, eager_sharding=mesh is not None)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            for name, shape in shapes.items():
                init, axes = inits_and_axes[name]
                value = init(rngs.params(), shape, param_dtype)
                setattr(self, name, nnx.Param(value, out_sharding=axes, **sharding))
            self.expert_bias = (
                ExpertBias(
                    jnp.zeros((num_experts,), jnp.float32), out_sharding=("router_experts",), **sharding
                )
                if use_expert_bias
                else None
            )
        self._optional_names = tuple(name for name in (*_SHARED_INIT_AND_AXES, *_BIAS_AXES) if name in shapes)

    def __call__(
        self,
        x: jax.Array,
        token_mask: jax.Array | None = None,
        return_stats: bool = False,
        routing_indices: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array, MoEStats]:
        return moe(
            x,
            self.gate[...],
            self.gate_up[...],
            self.down[...],
            topk=self.topk,
            expert_bias=None if self.expert_bias is None else self.expert_bias[...],
            activation=self.activation,
            mesh=self.mesh,
            token_mask=token_mask,
            return_stats=return_stats,
            routing_indices=routing_indices,
            **{name: getattr(self, name)[...] for name in self._optional_names},
            **self.options,
        )
