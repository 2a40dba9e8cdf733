"""The MoE layer on shared problems (tests/strategies_moe.py) against the dense reference, in one process or
on one rank of a process group; and the worker that spawned EP test processes run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.strategies_moe import MoEProblem

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # fp32 layer vs fp32 reference: GEMM and reduction order only


def options(problem: MoEProblem) -> dict:
    """Keyword arguments shared by moe() and moe_reference()."""
    return dict(
        topk=problem.topk,
        score_function=problem.score_function,
        num_groups=problem.num_groups,
        group_topk=problem.group_topk,
        align_size=problem.align_size,
        capacity_factor=problem.capacity_factor,
        aux_loss_coeff=0.1,  # large enough that a wrong aux-loss gradient shows
    )


def tensors(problem: MoEProblem, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's inputs, fp32 (torch gate weight is [E, H]) and the output cotangent [B, S, H]."""
    generator = torch.Generator().manual_seed(problem.batch * 131 + problem.seq)
    values = dict(
        x=torch.from_numpy(problem.x),
        gate_weight=torch.from_numpy(problem.gate).t().contiguous(),
        gate_up=torch.from_numpy(problem.gate_up),
        down=torch.from_numpy(problem.down),
        cotangent=torch.randn(problem.x.shape, generator=generator),
    )
    if problem.expert_bias is not None:
        values["expert_bias"] = torch.from_numpy(problem.expert_bias)
    return {name: value.to(device) for name, value in values.items()}


def run_layer(
    problem: MoEProblem, full: dict, rank: int, world: int, exchange: str = "auto", **groups
) -> dict:
    """This rank's layer call on its token shard and local experts: outputs and gradients."""
    import moetriton.torch as mt

    batch, local = problem.batch // world, problem.num_experts // world
    tokens = slice(rank * batch, (rank + 1) * batch)
    experts = slice(rank * local, (rank + 1) * local) if groups.get("ep_group") is not None else slice(None)
    inputs = dict(
        x=full["x"][tokens].clone(),
        gate_weight=full["gate_weight"].clone(),
        gate_up=full["gate_up"][experts].clone(),
        down=full["down"][experts].clone(),
    )
    for value in inputs.values():
        value.requires_grad_()
    out, aux_loss, dropped = mt.moe(
        *inputs.values(),
        expert_bias=full.get("expert_bias"),
        exchange=exchange,
        **options(problem),
        **groups,
    )
    ((out * full["cotangent"][tokens]).sum() + aux_loss).backward()
    return dict(
        out=out.detach(),
        aux_loss=aux_loss.detach(),
        dropped=dropped,
        **{f"grad {name}": value.grad for name, value in inputs.items()},
    )


def reference(problem: MoEProblem, full: dict, num_shards: int = 1) -> dict:
    """The unsharded reference: outputs and gradients of every input."""
    from moetriton.torch.reference_moe import moe_reference

    inputs = {name: full[name].clone().requires_grad_() for name in ("x", "gate_weight", "gate_up", "down")}
    out, aux_loss, dropped = moe_reference(
        *inputs.values(), expert_bias=full.get("expert_bias"), num_shards=num_shards, **options(problem)
    )
    ((out * full["cotangent"]).sum() + aux_loss).backward()
    return dict(
        out=out.detach(),
        aux_loss=aux_loss.detach(),
        dropped=dropped,
        **{f"grad {name}": value.grad for name, value in inputs.items()},
    )


def check_rank(problem: MoEProblem, got: dict, expected: dict, rank: int, world: int, ep: bool) -> None:
    """A rank's results against the reference: its token shard, its experts, the global aux loss and
    dropped count; `got["grad gate_weight"]` must already be summed over the ranks."""
    batch, local = problem.batch // world, problem.num_experts // world
    tokens = slice(rank * batch, (rank + 1) * batch)
    experts = slice(rank * local, (rank + 1) * local) if ep else slice(None)
    assert got["dropped"].dtype == torch.int32 and got["dropped"].shape == ()
    assert int(got["dropped"]) == int(expected["dropped"]), (got["dropped"], expected["dropped"])
    assert got["aux_loss"].dtype == torch.float32
    for name, part in (
        ("out", tokens),
        ("aux_loss", ...),
        ("grad x", tokens),
        ("grad gate_weight", ...),
        ("grad gate_up", experts),
        ("grad down", experts),
    ):
        torch.testing.assert_close(
            got[name], expected[name][part], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}"
        )


def ep_worker(rank: int, world: int, store: str, backend: str, problems: list, data_parallel: bool) -> None:
    """One rank of a spawned test group: every problem through the layer with EP over the whole group
    (or, with `data_parallel`, every expert on every rank and only the token statistics shared), against
    the reference; the second problem also runs twice and must repeat bit for bit. On GPUs (NCCL) every
    problem runs with both row exchanges, all_to_all and peer (the dropless one takes it; the capacity
    path ignores it)."""
    # A gloo rank computes on CPU tensors: under the Triton interpreter where the parent set it (CPU-only
    # machines, tests/conftest.py), else through the PyTorch reference path (a GPU machine, whose Triton may
    # not interpret: kernels/_interpreter.py).
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        groups = dict(token_group=dist.group.WORLD) if data_parallel else dict(ep_group=dist.group.WORLD)
        # Replicated parameters' gradients are summed over the ranks, as DDP would: the gate's always, the
        # experts' too when every rank holds every expert.
        replicated = ["grad gate_weight"] + (["grad gate_up", "grad down"] if data_parallel else [])
        exchanges = ("all_to_all", "peer") if backend == "nccl" and not data_parallel else ("auto",)
        for index, problem in enumerate(problems):
            full = tensors(problem, device)
            expected = reference(problem, full, num_shards=world)
            for exchange in exchanges:
                runs = []
                for _ in range(2 if index == 1 else 1):
                    runs.append(run_layer(problem, full, rank, world, exchange, **groups))
                    for name in replicated:
                        dist.all_reduce(runs[-1][name])
                check_rank(problem, runs[0], expected, rank, world, not data_parallel)
                for name, value in runs[0].items():
                    assert torch.equal(runs[-1][name], value), f"{name} differs between two runs"
        if not data_parallel:
            _check_ep_errors(problems[0], device)
    finally:
        dist.destroy_process_group()


def _check_ep_errors(problem: MoEProblem, device: torch.device) -> None:
    """Errors that need an EP group: experts not divisible by it, and global weights passed as local."""
    import pytest

    import moetriton.torch as mt

    world = dist.get_world_size()
    if world > 1 and device.type == "cpu":  # gloo: no peer memory to exchange through
        full, local = tensors(problem, device), problem.num_experts // world
        with pytest.raises(ValueError, match="exchange='peer' needs"):
            mt.moe(
                full["x"],
                full["gate_weight"],
                full["gate_up"][:local],
                full["down"][:local],
                ep_group=dist.group.WORLD,
                exchange="peer",
                **{**options(problem), "capacity_factor": None},
            )
    if world > 1:
        with pytest.raises(ValueError, match="num_experts"):
            mt.MoELayer(8, 8, world + 1, 1, ep_group=dist.group.WORLD)
        full = tensors(problem, device)
        with pytest.raises(ValueError, match="gate_up"):
            mt.moe(
                full["x"],
                full["gate_weight"],
                full["gate_up"],
                full["down"],
                ep_group=dist.group.WORLD,
                **options(problem),
            )
