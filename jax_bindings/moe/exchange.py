"""The MoE layer's row exchange of one token shard: which exchange a call runs (`resolve_exchange`) and the
exchange around the experts (`exchanged_experts`: the send buffer in, the expert outputs back in the send
buffer's layout), one module per exchange: moetriton.jax.moe.all_to_all (dropless: ragged or padded) and
moetriton.jax.moe.capacity (fixed slabs)."""

from __future__ import annotations

from moetriton.kernels.rules.expert_parallel import EPLayout

from .all_to_all import dropless_experts
from .capacity import capacity_experts
from .config import MoEConfig
from .experts import ExpertWeights, expert_mlp


def exchanged_experts(send, counts, experts: ExpertWeights, layout: EPLayout, config: MoEConfig):
    """Send buffer [send_rows, H] (token_dispatch's, with its counts per expert [E]) -> the expert outputs in
    the same rows: with one EP rank the send buffer is the receive buffer, already expert-major; with more,
    the rows go to their experts' ranks and come back (dropless: `dropless_experts`, capacity:
    `capacity_experts`)."""
    if layout.ep_size == 1:
        return expert_mlp(send, counts, experts, config)
    if layout.dropless:
        return dropless_experts(send, counts, experts, layout, config)
    return capacity_experts(send, experts, layout, config)


def resolve_exchange(exchange: str) -> str:
    """ "ragged" or "padded": the exchange the call runs ("all_to_all" is "ragged", "auto" is "padded")."""
    # "auto" is the padded exchange everywhere. XLA:CPU has no ragged-all-to-all; between the GPUs of one
    # host XLA's ragged-all-to-all was far slower than the padded exchange (docs/moe.md, "Row exchange";
    # https://github.com/openxla/xla/issues/33386 reports the same on B200s); between GPUs of different
    # processes jaxlib 0.11 refuses it unless XLA_FLAGS allows its NCCL send/recv fallback.
    if exchange == "auto":
        return "padded"
    return "ragged" if exchange == "all_to_all" else exchange
