"""The experts of the MoE layer: the grouped MLP on expert-major rows (torch._grouped_mm where supported, a
masked per-expert loop elsewhere), the batched MLP of the capacity policy, both as the exchanges call them
(`Experts`), and the shared experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._stages import stage
from ..activation import ACTIVATE, ACTIVATE_BACKWARD
from ..fp8 import fp8_grouped_linear


def _activate(hidden: Tensor, activation: str) -> Tensor:
    """[..., 2F] -> [..., F] (SwiGLU) or [..., F] -> [..., F]; zero rows stay zero. One moetriton kernel per
    direction (math in fp32), where eager PyTorch ran several elementwise kernels over the halves and
    their copies (docs/moe.md, "Measured")."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    activated = ACTIVATE(flat, activation)  # [M, F], named: M may be 0
    return activated.view(*hidden.shape[:-1], activated.shape[-1])


def grouped_mm_supported(rows: Tensor, *weights: Tensor) -> bool:
    """True where the dropless experts run `torch._grouped_mm`: CUDA, compute capability 9.0+, bf16 rows
    and weights [L, K, M], and every row stride a multiple of 16 bytes (H, K and M multiples of 8)."""
    return (
        hasattr(torch, "_grouped_mm")
        and rows.is_cuda
        and torch.cuda.get_device_properties(rows.device).major >= 9  # constant under torch.compile
        and all(tensor.dtype == torch.bfloat16 for tensor in (rows, *weights))
        and all(
            size % 8 == 0
            for size in (rows.shape[1], *(size for weight in weights for size in weight.shape[1:]))
        )
    )


def _group_ends(group_sizes: Tensor, num_rows: int) -> Tensor:
    """[L] int32 end row of each group, the last one at num_rows: no output row left undefined (rows past
    the groups join the last one). A fill, not a host-to-device copy."""
    offsets = group_sizes.cumsum(0, dtype=torch.int32)
    offsets[-1:].fill_(num_rows)
    return offsets


def _expert_of_row(offsets: Tensor, num_rows: int) -> Tensor:
    """[N, 1] int64 the group of each of num_rows rows from `_group_ends`' offsets [L] (no host sync)."""
    positions = torch.arange(num_rows, device=offsets.device, dtype=torch.int32)
    return torch.searchsorted(offsets, positions, right=True)[:, None]


def _group_bias(bias: Tensor, group_sizes: Tensor, num_rows: int) -> Tensor:
    """[N, M]: bias [L, M] row j on each row of group j, zero on rows past the groups (so that zero rows
    there stay zero through a projection with bias). From the group sizes on the device: no host sync."""
    ends = group_sizes.cumsum(0, dtype=torch.int32)  # [L], not `_group_ends`: the tail is told apart
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])  # [L + 1, M]: row L for the tail
    return padded[_expert_of_row(ends, num_rows)[:, 0]]


def grouped_linear(
    rows: Tensor,
    group_sizes: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    use_grouped_mm: bool | None = None,
) -> Tensor:
    """One projection of every expert on expert-major rows: out[i] = rows[i] @ weight[j] (+ bias[j]) for
    row i of group j. [N, K] -> [N, M].

    Args:
        rows: [N, K]; group j's rows follow group j - 1's, group_sizes[j] of them; rows past the last group
            join it in the product and take no bias.
        group_sizes: [L] int32/int64 on rows' device (no host sync).
        weight: [L, K, M] (any strides: a transposed view of [L, M, K] is read in place by
            torch._grouped_mm); bias: [L, M] or None.
        use_grouped_mm: force torch._grouped_mm (True) or the masked per-expert product (False); None picks
            `grouped_mm_supported`.

    Example:
        >>> weight, bias = torch.randn(2, 8, 4), torch.randn(2, 4)
        >>> grouped_linear(torch.randn(5, 8), torch.tensor([3, 2]), weight, bias).shape
        torch.Size([5, 4])
    """
    offsets = _group_ends(group_sizes, rows.shape[0])
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(rows, weight)
    with stage("grouped_gemm"):
        if use_grouped_mm:
            out = torch._grouped_mm(rows, weight, offs=offsets)
        else:
            expert_of_row = _expert_of_row(offsets, rows.shape[0])
            out = rows.new_zeros(rows.shape[0], weight.shape[2])
            for expert in range(weight.shape[0]):
                mine = expert_of_row == expert
                # The other rows are masked out of the product too, not only out of its result: the weight
                # gradient sums rows x gradient, and another expert's non-finite row times a zero
                # gradient would be NaN in this expert's gradient.
                out = torch.where(mine, torch.where(mine, rows, 0) @ weight[expert], out)
        if bias is None:
            return out
        return out + _group_bias(bias, group_sizes, rows.shape[0]).to(out.dtype)


def _grouped_weight_gradient(rows: Tensor, grad: Tensor, group_sizes: Tensor, use_grouped_mm: bool) -> Tensor:
    """The weight gradient of grouped_linear without bias: [L, K, M] = per group rows^T @ grad, from rows
    [N, K] and grad [N, M] (rows past the groups join the last one, as in the product)."""
    offsets = _group_ends(group_sizes, rows.shape[0])
    if use_grouped_mm:
        return torch._grouped_mm(rows.t(), grad, offs=offsets)
    expert_of_row = _expert_of_row(offsets, rows.shape[0])
    # Each group's rows alone on both sides: another group's non-finite row must not reach this gradient.
    return torch.stack(
        [
            torch.where(expert_of_row == expert, rows, 0).t() @ torch.where(expert_of_row == expert, grad, 0)
            for expert in range(group_sizes.shape[0])
        ]
    )


class _ActivatedDown(torch.autograd.Function):
    """down(activation(hidden)): the second half of the expert MLP, keeping only hidden [N, W] for the
    backward, which computes the activation output [N, F] again (one elementwise kernel) instead of keeping
    it: F fewer elements per routed row. Grouped rows (group_sizes [L]) or, with group_sizes None, the
    capacity policy's L equal slabs. The gradients are the same products autograd would run (and the
    activation's own backward kernel), so they are bit for bit the unfused path's."""

    @staticmethod
    def forward(ctx, hidden, group_sizes, down, activation, use_grouped_mm):
        ctx.activation, ctx.use_grouped_mm = activation, use_grouped_mm
        ctx.save_for_backward(hidden, group_sizes, down)
        with stage("activation"):
            act = _activate(hidden, activation)
        return _down(act, group_sizes, down, use_grouped_mm)

    @staticmethod
    def backward(ctx, grad):
        hidden, group_sizes, down = ctx.saved_tensors
        grad = grad.to(hidden.dtype)
        with stage("activation"):
            act = _activate(hidden, ctx.activation)
        with stage("grouped_gemm"):
            if group_sizes is None:  # slabs [L, M, F] x [L, F, H]
                slabs = act.view(down.shape[0], -1, act.shape[-1])
                grad_slabs = grad.view(down.shape[0], -1, grad.shape[-1])
                grad_act = torch.bmm(grad_slabs, down.transpose(1, 2)).view(act.shape)
                grad_down = torch.bmm(slabs.transpose(1, 2), grad_slabs) if ctx.needs_input_grad[2] else None
            else:
                grad_act = grouped_linear(
                    grad, group_sizes, down.transpose(1, 2), use_grouped_mm=ctx.use_grouped_mm
                )
                grad_down = None
                if ctx.needs_input_grad[2]:
                    grad_down = _grouped_weight_gradient(act, grad, group_sizes, ctx.use_grouped_mm)
        with stage("activation"):
            flat = grad_act.reshape(-1, grad_act.shape[-1])
            grad_hidden = ACTIVATE_BACKWARD(flat, hidden.reshape(-1, hidden.shape[-1]), ctx.activation)
        return grad_hidden.view(hidden.shape), None, grad_down, None, None


def _activated_down(
    hidden: Tensor, group_sizes: Tensor | None, down: Tensor, activation: str, use_grouped_mm: bool
) -> Tensor:
    # The function's node takes the stage of the range it is created in (benchmarks.moe_torch attributes a
    # backward node's CPU time so); its kernels run in the inner activation and GEMM ranges.
    with stage("grouped_gemm"):
        return _ActivatedDown.apply(hidden, group_sizes, down, activation, use_grouped_mm)


def _down(act: Tensor, group_sizes: Tensor | None, down: Tensor, use_grouped_mm: bool) -> Tensor:
    """act [N, F] (grouped) or [L, M, F] (slabs) times each expert's down projection."""
    if group_sizes is None:
        with stage("grouped_gemm"):
            return torch.bmm(act, down)
    return grouped_linear(act, group_sizes, down, use_grouped_mm=use_grouped_mm)


def _fp8_mlp(
    rows: Tensor,
    group_sizes: Tensor,
    gate_up: Tensor,
    down: Tensor,
    activation: str,
    recipe: str,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
) -> Tensor:
    """The grouped MLP with both projections in FP8 (`fp8_grouped_linear`: operands quantized by `recipe`,
    FP8 products forward and backward; the weights quantized on each call, once per step). The activation
    output is kept for the backward here, as the FP8 projection keeps its own quantized copy of it."""
    with stage("grouped_gemm"):
        hidden = fp8_grouped_linear(rows, group_sizes, gate_up, recipe)
        if gate_up_bias is not None:
            hidden = hidden + _group_bias(gate_up_bias, group_sizes, rows.shape[0]).to(hidden.dtype)
    with stage("activation"):
        act = _activate(hidden, activation)
    with stage("grouped_gemm"):
        out = fp8_grouped_linear(act, group_sizes, down, recipe)
        if down_bias is None:
            return out
        return out + _group_bias(down_bias, group_sizes, rows.shape[0]).to(out.dtype)


def expert_mlp(
    rows: Tensor,
    group_sizes: Tensor,
    gate_up: Tensor,
    down: Tensor,
    activation: str,
    use_grouped_mm: bool | None = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    fp8: str | None = None,
) -> Tensor:
    """Dropless experts on expert-major rows: [N, H] -> [N, H].

    Args:
        rows: [N, H]; expert j's rows follow expert j - 1's, group_sizes[j] of them; rows past the last
            group must be zero (token_dispatch's tail): they join the last group, take no bias and come out
            zero.
        group_sizes: [L] int32/int64 on rows' device (no host sync).
        gate_up: [L, H, 2F] (SwiGLU) or [L, H, F]; down: [L, F, H].
        activation: one of ACTIVATIONS.
        use_grouped_mm: force torch._grouped_mm (True) or the masked per-expert loop (False); None picks
            `grouped_mm_supported`.
        gate_up_bias: [L, 2F] (or [L, F]) and down_bias [L, H], or None: each expert's projection biases.
        fp8: None, or the FP8 recipe of both projections ("tensorwise" / "blockwise": `_fp8_mlp`).

    Example:
        >>> rows = torch.randn(5, 8)
        >>> gate_up, down = torch.randn(2, 8, 8), torch.randn(2, 4, 8)
        >>> expert_mlp(rows, torch.tensor([3, 2]), gate_up, down, "swiglu").shape
        torch.Size([5, 8])
    """
    if fp8 is not None:
        return _fp8_mlp(rows, group_sizes, gate_up, down, activation, fp8, gate_up_bias, down_bias)
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(rows, gate_up, down)
    hidden = grouped_linear(rows, group_sizes, gate_up, gate_up_bias, use_grouped_mm=use_grouped_mm)
    out = _activated_down(hidden, group_sizes, down, activation, use_grouped_mm)
    if down_bias is None:
        return out
    with stage("grouped_gemm"):
        return out + _group_bias(down_bias, group_sizes, rows.shape[0]).to(out.dtype)


def batched_mlp(
    rows: Tensor,
    gate_up: Tensor,
    down: Tensor,
    activation: str,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    fp8: str | None = None,
) -> Tensor:
    """Capacity experts: rows [L * M, H], M rows per local expert -> [L * M, H], one bmm per projection
    (with `fp8`, the FP8 grouped MLP on L equal groups); gate_up_bias [L, W] and down_bias [L, H] or None.
    A slot no token fills computes the biases' output, which no combine reads."""
    if fp8 is not None:
        experts = gate_up.shape[0]
        sizes = torch.full((experts,), rows.shape[0] // experts, dtype=torch.int32, device=rows.device)
        return _fp8_mlp(rows, sizes, gate_up, down, activation, fp8, gate_up_bias, down_bias)
    slabs = rows.view(gate_up.shape[0], -1, rows.shape[1])  # [L, M, H]
    with stage("grouped_gemm"):
        hidden = torch.bmm(slabs, gate_up)
        if gate_up_bias is not None:
            hidden = hidden + gate_up_bias[:, None, :]
    out = _activated_down(hidden, None, down, activation, False)
    if down_bias is not None:
        with stage("grouped_gemm"):
            out = out + down_bias[:, None, :]
    return out.reshape(rows.shape)


@dataclass  # not frozen: torch 2.11's dynamo loses the fields a frozen dataclass sets in a compiled region
class Experts:
    """This rank's L experts as an exchange runs them: rows [N, H], expert-major -> their outputs [N, H].
    group_sizes [L]: the rows of each expert (dropless: `expert_mlp`), or None for L equal groups (the
    capacity policy's slabs: `batched_mlp`)."""

    gate_up: Tensor
    down: Tensor
    activation: str
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    fp8: str | None = None

    def __call__(self, rows: Tensor, group_sizes: Tensor | None = None) -> Tensor:
        biases = dict(gate_up_bias=self.gate_up_bias, down_bias=self.down_bias, fp8=self.fp8)
        if group_sizes is None:
            return batched_mlp(rows, self.gate_up, self.down, self.activation, **biases)
        return expert_mlp(rows, group_sizes, self.gate_up, self.down, self.activation, **biases)


def shared_mlp(
    tokens: Tensor, shared_gate_up: Tensor, shared_down: Tensor, shared_gate: Tensor | None, activation: str
) -> Tensor:
    """The shared experts on every token: tokens [T, H] -> [T, H] in tokens.dtype.

    shared_gate_up [H, 2Fs] (gated activation; [H, Fs] otherwise) and shared_down [Fs, H]: one dense FFN
    with the routed experts' activation (math in fp32), GEMMs in tokens.dtype with fp32 accumulation.
    shared_gate [H, 1] or None: the FFN's output scaled per token by sigmoid(tokens @ shared_gate) (logits
    and sigmoid in fp32).
    Reads nothing the routed path computes, so it can run beside the row exchange.

    Example:
        >>> out = shared_mlp(torch.randn(5, 8), torch.randn(8, 12), torch.randn(6, 8), None, "swiglu")
        >>> out.shape
        torch.Size([5, 8])
    """
    # The routed experts' stages: the profile attributes the shared FFN's GEMMs and activation alike.
    with stage("grouped_gemm"):
        hidden = tokens @ shared_gate_up  # [T, 2Fs] or [T, Fs]
    with stage("activation"):
        act = _activate(hidden, activation)  # [T, Fs]
    with stage("grouped_gemm"):
        out = act @ shared_down  # [T, H]
        if shared_gate is None:
            return out
        # fp32 logits, as JAX's (an [H, 1] GEMV: the fp32 copy of the tokens is the cheap part of the FFN)
        scale = torch.sigmoid(tokens.float() @ shared_gate.float())  # [T, 1]
        return (scale * out.float()).to(out.dtype)


def add_shared(routed: Tensor, shared: Tensor | None, valid: Tensor | None) -> Tensor:
    """routed [T, H] + the shared experts' [T, H] (zero on padding, valid [T] False), summed in fp32 and
    rounded once to routed.dtype; routed itself (untouched) without shared experts."""
    if shared is None:
        return routed
    shared = shared.float()
    if valid is not None:
        shared = torch.where(valid[:, None], shared, 0.0)
    return (routed.float() + shared).to(routed.dtype)
