"""A toy MoE layer with moetriton.torch: route -> dispatch -> per-expert MLP -> combine, forward and backward.

Prints the largest difference from the pure-PyTorch reference (same layer built on moetriton.torch.reference)
and the time of a forward + backward step. Run through examples/run.py.
"""

from __future__ import annotations

import time

import torch

import moetriton.torch as mt
from moetriton.torch import reference


def moe_layer(api, x, router_weight, expert_weights, topk: int, align_size: int | None):
    """x [T, H] -> [T, H]: softmax top-k routing, dispatch, one matmul per expert, weighted combine."""
    num_experts = expert_weights.shape[0]
    scores = torch.softmax(x.float() @ router_weight, dim=-1)
    top_scores, top_ids = scores.topk(topk, dim=-1)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top_ids, True)
    probs = torch.zeros_like(scores).scatter_(1, top_ids, top_scores / top_scores.sum(-1, keepdim=True))
    permuted, _, row_id_map, pad_offsets, tokens_per_expert = api.token_dispatch(
        x, mask, x.shape[0] * topk, probs, align_size
    )
    # Grouped matmul over expert blocks (a loop here; a grouped GEMM in a real model).
    blocks = permuted.split([*tokens_per_expert.tolist(), permuted.shape[0] - int(tokens_per_expert.sum())])
    expert_out = torch.cat(
        [block @ expert_weights[e] if e < num_experts else block for e, block in enumerate(blocks)]
    )
    return api.token_combine(torch.nn.functional.gelu(expert_out), row_id_map, probs, pad_offsets)


def main(small: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_tokens, hidden, num_experts, topk = (64, 32, 8, 2) if small else (8192, 2048, 64, 4)
    dtype = torch.float32 if small else torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    router_weight = torch.randn(hidden, num_experts, device=device) / hidden**0.5
    expert_weights = (torch.randn(num_experts, hidden, hidden, device=device) / hidden**0.5).to(dtype)
    for align_size in (None, 16):
        outputs, grads = [], []
        for api in (mt, reference):
            xg = x.clone().requires_grad_()
            wg = expert_weights.clone().requires_grad_()
            y = moe_layer(api, xg, router_weight, wg, topk, align_size)
            y.float().square().mean().backward()
            outputs.append(y.float())
            grads.append((xg.grad.float(), wg.grad.float()))
        error = max(
            (outputs[0] - outputs[1]).abs().max().item(),
            *[(a - b).abs().max().item() for a, b in zip(*grads, strict=True)],
        )
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            xg = x.clone().requires_grad_()
            moe_layer(
                mt, xg, router_weight, expert_weights, topk, align_size
            ).float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) / 3 * 1e3
        print(
            f"torch  T={num_tokens} H={hidden} E={num_experts} K={topk} {str(dtype).removeprefix('torch.')} "
            f"align={align_size}: max |moetriton - reference| = {error:.2e}, "
            f"fwd+bwd step {step_ms:.2f} ms on {device}"
        )
