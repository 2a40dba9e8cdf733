"""The expert-parallel MoE layer (moetriton.torch.MoELayer) over torch.distributed, checked against the
dense single-process reference on every rank.

    python examples/torch_moe_ep.py                               # one process (EP = 1)
    torchrun --nproc-per-node 2 examples/torch_moe_ep.py          # EP = 2: NCCL on GPUs, gloo on CPU
    torchrun --nproc-per-node 4 examples/torch_moe_ep.py --small  # small shapes even on GPUs

Every rank builds the same global weights from one seed, keeps its E / EP experts and its shard of the
sequences, runs one forward + backward step for each configuration (dropless; capacity_factor=1; a
DeepSeek-V3-style layer: sigmoid scores, group-limited top-k, a selection bias, a shared expert, the
sequence-wise and z losses, the probs drop policy, then the aux-loss-free bias update from the step's
statistics), and compares its outputs and gradients with the reference's (replicated weights' gradients
summed over the ranks). GPUs run bf16, but the DeepSeek-V3-style layer in fp32 (FP32_ON_GPU says why);
CPUs fp32. On CPU the Triton
kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here before moetriton is imported).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def _setup() -> tuple[int, int, torch.device]:
    """(rank, world, device); a process group when started by torchrun."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    return rank, world, device


def _step(mt, layer, x, cotangent):
    """One forward + backward of the layer: (out, aux_loss, dropped, grads by name, x grad, stats)."""
    layer.zero_grad()
    xg = x.detach().clone().requires_grad_()
    out, aux_loss, dropped, stats = layer(xg, return_stats=True)
    ((out.float() * cotangent).sum() + aux_loss).backward()
    grads = {name: param.grad.float().clone() for name, param in layer.named_parameters()}
    return out.detach(), aux_loss.detach(), dropped, grads, xg.grad, stats


#: The configurations every rank runs: name -> MoELayer options (beside the sizes, alignment and group).
CONFIGS = {
    "dropless": {},
    "capacity 1.0": dict(capacity_factor=1.0),
    "dsv3-style": dict(
        score_function="sigmoid",
        num_groups=4,
        group_topk=2,
        expert_bias=True,
        num_shared_experts=1,
        seq_aux_loss_coeff=1e-3,
        z_loss_coeff=1e-3,
        capacity_factor=1.0,
        drop_policy="probs",
    ),
}
#: Configurations run in fp32 on GPUs too. With sigmoid scores, a selection bias and slots kept by
#: probability, a last-bit difference between the bf16 logits of a rank's shard and of the reference's whole
#: batch (cuBLAS picks its kernel by shape) moves whole slots between experts, so the bf16 outputs cannot be
#: compared with the reference token for token; in fp32 they can.
FP32_ON_GPU = {"dsv3-style"}
SEQUENCE = 8  # tokens per sequence: x is [B, S, H]


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative error accepted against the reference."""
    return 5e-2 if dtype == torch.bfloat16 else 1e-4


def run(small: bool) -> dict[str, float]:
    """Worst error over the ranks per configuration; printed by rank 0."""
    rank, world, device = _setup()
    import moetriton.torch as mt
    from moetriton.torch.reference_moe import moe_reference

    on_gpu = device.type == "cuda"
    big = on_gpu and not small
    tokens, hidden, ffn = (4096, 1024, 512) if big else (16, 32, 16)
    align_size, timed_steps = (16, 3) if big else (4, 1)
    num_experts, topk = 4 * world, 2
    default_dtype = torch.bfloat16 if on_gpu else torch.float32
    group = dist.group.WORLD if world > 1 else None
    generator = torch.Generator().manual_seed(0)
    x_all = torch.randn(world * tokens // SEQUENCE, SEQUENCE, hidden, generator=generator)
    cotangent_all = torch.randn(x_all.shape, generator=generator)
    shard = slice(rank * tokens // SEQUENCE, (rank + 1) * tokens // SEQUENCE)
    errors, tolerances = {}, {}
    for policy, options in CONFIGS.items():
        dtype = torch.float32 if policy in FP32_ON_GPU else default_dtype
        layer = mt.MoELayer(
            hidden,
            ffn,
            num_experts,
            topk,
            aux_loss_coeff=1e-2,
            align_size=align_size,
            ep_group=group,
            dtype=dtype,
            device=device,
            **options,
        )
        torch.manual_seed(1)  # the same global weights on every rank; each keeps its experts
        weights = dict(
            gate_weight=torch.randn(num_experts, hidden) / hidden**0.5,
            gate_up=torch.randn(num_experts, hidden, 2 * ffn) / hidden**0.5,
            down=torch.randn(num_experts, ffn, hidden) / ffn**0.5,
        )
        if layer.shared_gate_up is not None:
            weights.update(
                shared_gate_up=torch.randn(layer.shared_gate_up.shape) / hidden**0.5,
                shared_down=torch.randn(layer.shared_down.shape) / ffn**0.5,
            )
        local = slice(rank * layer.down.shape[0], (rank + 1) * layer.down.shape[0])
        with torch.no_grad():
            for name, value in weights.items():
                getattr(layer, name).copy_(value[local] if name in ("gate_up", "down") else value)
            if layer.expert_bias is not None:
                layer.expert_bias.copy_(torch.linspace(-0.1, 0.1, num_experts))
        x, cotangent = x_all[shard].to(device, dtype), cotangent_all[shard].to(device)
        out, aux_loss, dropped, grads, grad_x, stats = _step(mt, layer, x, cotangent)
        if group is not None:
            for name in ("gate_weight", "shared_gate_up", "shared_down"):  # replicated on every rank
                if name in grads:
                    dist.all_reduce(grads[name], group=group)
        leaves = {name: value.to(device, dtype).clone().requires_grad_() for name, value in weights.items()}
        x_leaf = x_all.to(device, dtype).clone().requires_grad_()
        reference_options = {name: value for name, value in options.items() if name != "num_shared_experts"}
        reference_options["expert_bias"] = layer.expert_bias
        ref_out, ref_aux, ref_dropped = moe_reference(
            x_leaf,
            **leaves,
            topk=topk,
            aux_loss_coeff=1e-2,
            align_size=align_size,
            num_shards=world,
            **reference_options,
        )
        ((ref_out * cotangent_all.to(device)).sum() + ref_aux).backward()
        pairs = [
            (out.float(), ref_out.detach()[shard]),
            (aux_loss, ref_aux.detach()),
            (grad_x.float(), x_leaf.grad[shard].float()),
        ]
        for name, leaf in leaves.items():
            expected = leaf.grad[local] if name in ("gate_up", "down") else leaf.grad
            pairs.append((grads[name], expected.float()))
        error = torch.stack([((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) for a, b in pairs]).max()
        if group is not None:
            dist.all_reduce(error, group=group, op=dist.ReduceOp.MAX)
        if int(dropped) != int(ref_dropped):
            raise RuntimeError(f"{policy}: dropped {int(dropped)} slots, the reference {int(ref_dropped)}")
        errors[policy] = float(error)
        tolerances[policy] = tolerance(dtype)
        if layer.expert_bias is not None:  # aux-loss-free balancing, once per optimizer step
            layer.update_expert_bias(stats.routed, update_rate=1e-3)
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(timed_steps):
            _step(mt, layer, x, cotangent)
        if on_gpu:
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) / timed_steps * 1e3
        if rank == 0:
            print(
                f"MoELayer EP={world} ({dist.get_backend() if group else 'no group'}, {device.type}) "
                f"{policy}: T={tokens}/rank H={hidden} F={ffn} E={num_experts} K={topk} "
                f"{str(dtype).removeprefix('torch.')}"
                f" | max relative error vs reference {float(error):.1e}, dropped {int(dropped)} (reference "
                f"{int(ref_dropped)}), aux loss {float(aux_loss):.4f}, load max / mean"
                f" {float(stats.max_load) / max(float(stats.mean_load), 1e-9):.2f}, fwd+bwd {step_ms:.2f} ms"
            )
    if group is not None:
        dist.destroy_process_group()
    above = {
        policy: (error, tolerances[policy]) for policy, error in errors.items() if error > tolerances[policy]
    }
    if above:
        raise RuntimeError(f"errors above their dtype's tolerance, (error, tolerance) by config: {above}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="small shapes even on GPUs")
    run(parser.parse_args().small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
