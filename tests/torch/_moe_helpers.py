"""The MoE layer on shared problems (tests/strategies_moe.py) against the dense reference, in one process or
on one rank of a process group; and the worker that spawned EP test processes run."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from moetriton.kernels.rules.moe import BIASES, SHARED_WEIGHTS
from tests.strategies_moe import MoEProblem
from tests.strategies_moe_hostile import ARRAYS, EXPERTS, record

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # fp32 layer vs fp32 reference: GEMM and reduction order only
#: The shared experts' weights: replicated on every rank, their gradients summed over the ranks as the
#: router weight's.
SHARED = SHARED_WEIGHTS
#: The arrays every rank holds whole (gradients summed over the ranks) and those sharded over EP with the
#: experts, beyond gate_weight, gate_up and down.
REPLICATED = ("gate_bias", *SHARED)
PER_EXPERT = ("gate_up_bias", "down_bias")
assert set(BIASES) <= {*REPLICATED, *PER_EXPERT}


def options(problem: MoEProblem) -> dict:
    """Keyword arguments shared by moe() and moe_reference()."""
    return problem.layer_options(aux_loss_coeff=0.1)  # large enough that a wrong aux-loss gradient shows


def tensors(problem: MoEProblem, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's inputs, fp32 (torch gate weight is [E, H]; the shared experts' weights where the
    problem has them) and the output cotangent [B, S, H]."""
    generator = torch.Generator().manual_seed(problem.batch * 131 + problem.seq)
    values = dict(
        x=torch.from_numpy(problem.x),
        gate_weight=torch.from_numpy(problem.gate).t().contiguous(),
        gate_up=torch.from_numpy(problem.gate_up),
        down=torch.from_numpy(problem.down),
        cotangent=torch.randn(problem.x.shape, generator=generator),
        **{name: torch.from_numpy(value) for name, value in problem.shared_weights.items()},
        **{name: torch.from_numpy(value) for name, value in problem.biases.items()},
    )
    if problem.expert_bias is not None:
        values["expert_bias"] = torch.from_numpy(problem.expert_bias)
    if problem.token_mask is not None:
        values["token_mask"] = torch.from_numpy(problem.token_mask)
    return {name: value.to(device) for name, value in values.items()}


def run_layer(
    problem: MoEProblem, full: dict, rank: int, world: int, exchange: str = "auto", **groups
) -> dict:
    """This rank's layer call on its token shard (of `world`) and the experts of its place in ep_group (all
    of them without one), with the replicated shared experts' weights: outputs and gradients."""
    import moetriton.torch as mt

    ep_group = groups.get("ep_group")
    ep_rank, ep = (dist.get_rank(ep_group), dist.get_world_size(ep_group)) if ep_group is not None else (0, 1)
    batch, local = problem.batch // world, problem.num_experts // ep
    tokens = slice(rank * batch, (rank + 1) * batch)
    experts = slice(ep_rank * local, (ep_rank + 1) * local)
    inputs = dict(
        x=full["x"][tokens].clone(),
        gate_weight=full["gate_weight"].clone(),
        gate_up=full["gate_up"][experts].clone(),
        down=full["down"][experts].clone(),
        **{name: full[name].clone() for name in REPLICATED if name in full},
        **{name: full[name][experts].clone() for name in PER_EXPERT if name in full},
    )
    for value in inputs.values():
        value.requires_grad_()
    mask = full.get("token_mask")
    out, aux_loss, dropped, stats = mt.moe(
        **inputs,
        expert_bias=full.get("expert_bias"),
        token_mask=None if mask is None else mask[tokens],
        exchange=exchange,
        return_stats=True,
        **options(problem),
        **groups,
    )
    ((out * full["cotangent"][tokens]).sum() + aux_loss).backward()
    return dict(
        out=out.detach(),
        aux_loss=aux_loss.detach(),
        dropped=dropped,
        stats=stats,
        **{f"grad {name}": value.grad for name, value in inputs.items()},
    )


def reference(problem: MoEProblem, full: dict, num_shards: int = 1) -> dict:
    """The unsharded reference: outputs and gradients of every input."""
    from moetriton.torch.reference_moe import moe_reference

    optional = (name for name in (*REPLICATED, *PER_EXPERT) if name in full)
    names = ("x", "gate_weight", "gate_up", "down", *optional)
    inputs = {name: full[name].clone().requires_grad_() for name in names}
    out, aux_loss, dropped, stats = moe_reference(
        **inputs,
        expert_bias=full.get("expert_bias"),
        token_mask=full.get("token_mask"),
        num_shards=num_shards,
        return_stats=True,
        **options(problem),
    )
    ((out * full["cotangent"]).sum() + aux_loss).backward()
    return dict(
        out=out.detach(),
        aux_loss=aux_loss.detach(),
        dropped=dropped,
        stats=stats,
        **{f"grad {name}": value.grad for name, value in inputs.items()},
    )


def check_stats(got, expected) -> None:
    """A layer's MoEStats against the reference's: losses to fp32 rounding, counts exactly."""
    for name, value in got._asdict().items():
        want = getattr(expected, name)
        if name.endswith("loss") or name == "mean_load":
            assert value.dtype == torch.float32, (name, value.dtype)
            torch.testing.assert_close(value, want.to(value), **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert value.dtype == torch.int32, (name, value.dtype)
            assert value.tolist() == want.tolist(), (name, value, want)


def check_rank(
    problem: MoEProblem, got: dict, expected: dict, rank: int, world: int, ep_rank: int = 0, ep: int = 1
) -> None:
    """A rank's results against the reference: its token shard (of `world`), the experts of its place
    `ep_rank` in an EP group of `ep` ranks, the global aux loss and dropped count; `got["grad gate_weight"]`
    and the shared experts' gradients must already be summed over the ranks, expert gradients over the
    ranks that hold the same experts."""
    batch, local = problem.batch // world, problem.num_experts // ep
    tokens = slice(rank * batch, (rank + 1) * batch)
    experts = slice(ep_rank * local, (ep_rank + 1) * local)
    assert got["dropped"].dtype == torch.int32 and got["dropped"].shape == ()
    assert int(got["dropped"]) == int(expected["dropped"]), (got["dropped"], expected["dropped"])
    assert got["aux_loss"].dtype == torch.float32
    check_stats(got["stats"], expected["stats"])
    for name, part in (
        ("out", tokens),
        ("aux_loss", ...),
        ("grad x", tokens),
        ("grad gate_weight", ...),
        ("grad gate_up", experts),
        ("grad down", experts),
        *((f"grad {name}", ...) for name in REPLICATED if f"grad {name}" in expected),
        *((f"grad {name}", experts) for name in PER_EXPERT if f"grad {name}" in expected),
    ):
        torch.testing.assert_close(
            got[name], expected[name][part], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}"
        )


def ep_worker(
    rank: int,
    world: int,
    store: str,
    backend: str,
    problems: list,
    data: int = 1,
    auto_picks: str | None = None,
) -> None:
    """One rank of a spawned test group: every problem through the layer on a data x EP grid of the ranks
    (rank = data index x EP + EP rank; `data` = 1: EP over the whole group; `data` = world: every expert on
    every rank), the token statistics shared by the whole group, against the reference; the second
    problem also runs twice and must repeat bit for bit. With EP > 1 on GPUs (NCCL) every problem runs with
    both row exchanges, all_to_all and peer (the dropless one takes it; the capacity path ignores it).
    `auto_picks`: the exchange "auto" must choose for this rank's EP group (moetriton.torch.moe.exchange_for;
    then every problem runs with "auto" alone)."""
    # A gloo rank computes on CPU tensors: under the Triton interpreter where the parent set it (CPU-only
    # machines, tests/conftest.py), else through the PyTorch reference path (a GPU machine, whose Triton may
    # not interpret: kernels/runtime/interpreter.py).
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ep = world // data
        data_index, ep_rank = divmod(rank, ep)
        # Every rank creates every subgroup, in one order (torch.distributed's rule for new_group).
        ep_groups = [dist.new_group(list(range(d * ep, (d + 1) * ep))) for d in range(data)]
        replicas = [dist.new_group(list(range(e, world, ep))) for e in range(ep)]
        groups = {}
        if ep > 1:
            groups["ep_group"] = dist.group.WORLD if data == 1 else ep_groups[data_index]
        if data > 1:
            groups["token_group"] = dist.group.WORLD
        exchanges = ("all_to_all", "peer") if backend == "nccl" and ep > 1 else ("auto",)
        if auto_picks is not None:
            from moetriton.torch.moe import exchange_for

            assert exchange_for(groups.get("ep_group"), device) == auto_picks
            exchanges = ("auto",)
        for index, problem in enumerate(problems):
            full = tensors(problem, device)
            expected = reference(problem, full, num_shards=world)
            for exchange in exchanges:
                runs = []
                for _ in range(2 if index == 1 else 1):
                    runs.append(run_layer(problem, full, rank, world, exchange, **groups))
                    # Replicated parameters' gradients are summed over their replicas, as DDP would: the
                    # gate's over every rank, the experts' over the ranks that hold the same experts.
                    for name in ("gate_weight", *REPLICATED):
                        if f"grad {name}" in runs[-1]:
                            dist.all_reduce(runs[-1][f"grad {name}"])
                    if data > 1:
                        for name in ("gate_up", "down", *PER_EXPERT):
                            if f"grad {name}" in runs[-1]:
                                dist.all_reduce(runs[-1][f"grad {name}"], group=replicas[ep_rank])
                check_rank(problem, runs[0], expected, rank, world, ep_rank, ep)
                for name, value in runs[0].items():
                    pairs = (
                        zip(runs[-1][name], value, strict=True)
                        if name == "stats"
                        else [(runs[-1][name], value)]
                    )
                    assert all(torch.equal(*pair) for pair in pairs), f"{name} differs between two runs"
        if data == 1:
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


#: Routings every rank must survive (tokens per rank, expert bias steering, capacity factor); see
#: `routing_worker`. "skewed": every slot goes to the last rank's experts, so the others receive no rows.
ROUTING_CASES = (
    ("skewed", None),
    ("skewed", 1.0),
    ("one_expert", None),
    ("one_expert", 1.0),
    ("empty_rank", None),
    ("all_empty", None),
    ("all_empty", 1.0),
)


def _routing_case(name: str, rank: int, world: int, num_experts: int) -> tuple[list[int], torch.Tensor]:
    """(tokens of every rank, expert bias [E]) of a routing case."""
    tokens = {"empty_rank": [0] + [5] * (world - 1), "all_empty": [0] * world}.get(name, [4] * world)
    bias = torch.zeros(num_experts)
    if name == "skewed":
        bias[: num_experts - num_experts // world] = -100.0
    elif name == "one_expert":
        bias[1:] = -100.0
    return tokens, bias


def routing_worker(rank: int, world: int, store: str, backend: str) -> None:
    """One rank of a spawned group running ROUTING_CASES through the EP layer against the dense reference:
    ranks that receive no rows, a rank without tokens, no tokens at all, every slot on one expert; with
    both exchanges on GPUs, dropless unchunked and in 3 pipelined chunks. Then capacity with different T
    per rank: the same ValueError on every rank, and the group still works afterwards (no rank left in a
    collective)."""
    import pytest

    import moetriton.torch as mt
    from moetriton.torch.reference_moe import moe_reference

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        num_experts, hidden, ffn, topk = 2 * world, 8, 8, 1 if world == 1 else 2
        local = num_experts // world
        generator = torch.Generator().manual_seed(11)
        full = dict(
            gate_weight=torch.randn(num_experts, hidden, generator=generator),
            gate_up=torch.randn(num_experts, hidden, 2 * ffn, generator=generator) / hidden**0.5,
            down=torch.randn(num_experts, ffn, hidden, generator=generator) / ffn**0.5,
        )
        exchanges = ("all_to_all", "peer") if backend == "nccl" else ("auto",)
        for name, capacity_factor in ROUTING_CASES:
            counts, bias = _routing_case(name, rank, world, num_experts)
            x_all = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(len(name)))
            cotangent = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(5))
            options = dict(
                topk=topk,
                score_function="sigmoid",
                expert_bias=bias,
                aux_loss_coeff=0.1,
                capacity_factor=capacity_factor,
            )
            expected = _dense(moe_reference, x_all, full, cotangent, options, world)
            first = sum(counts[:rank])
            mine = slice(first, first + counts[rank])
            experts = slice(rank * local, (rank + 1) * local)
            # Dropless also in 3 pipelined chunks: every rank runs as many chunks whatever its T (a rank
            # without tokens runs 3 empty ones), or the chunks' exchanges would not pair up.
            runs = [(exchange, chunks) for exchange in exchanges for chunks in (1, 3)]
            for exchange, chunks in runs if capacity_factor is None else [("auto", 1)]:
                leaves = dict(
                    x=x_all[mine].to(device, copy=True),
                    gate_weight=full["gate_weight"].to(device, copy=True),
                    gate_up=full["gate_up"][experts].to(device, copy=True),
                    down=full["down"][experts].to(device, copy=True),
                )
                for value in leaves.values():
                    value.requires_grad_()
                out, aux_loss, dropped = mt.moe(
                    *leaves.values(),
                    **{**options, "expert_bias": bias.to(device)},
                    ep_group=dist.group.WORLD,
                    exchange=exchange,
                    pipeline_chunks=chunks,
                )
                ((out * cotangent[mine].to(device)).sum() + aux_loss).backward()
                dist.all_reduce(leaves["gate_weight"].grad)
                got = dict(
                    out=out, aux_loss=aux_loss, **{f"grad {key}": value.grad for key, value in leaves.items()}
                )
                want = dict(
                    out=expected["out"][mine],
                    aux_loss=expected["aux_loss"],
                    **{"grad x": expected["grad x"][mine], "grad gate_weight": expected["grad gate_weight"]},
                    **{f"grad {key}": expected[f"grad {key}"][experts] for key in ("gate_up", "down")},
                )
                for key, value in want.items():
                    torch.testing.assert_close(
                        got[key].cpu(),
                        value,
                        **TOLERANCE,
                        msg=lambda m, k=key, n=name, c=chunks: f"{n} {c} chunks {k}: {m}",
                    )
                assert int(dropped) == int(expected["dropped"]), (
                    name,
                    int(dropped),
                    int(expected["dropped"]),
                )
        if world > 1:
            x = torch.randn(3 + rank, hidden, device=device)
            weights = [full[key].to(device) for key in ("gate_weight", "gate_up", "down")]
            weights[1:] = [weight[rank * local : (rank + 1) * local] for weight in weights[1:]]
            with pytest.raises(
                ValueError, match=r"same number of tokens on every rank of ep_group, got \[3, 4"
            ):
                mt.moe(x, *weights, topk=topk, capacity_factor=1.0, ep_group=dist.group.WORLD)
            out, _, _ = mt.moe(x[:3], *weights, topk=topk, capacity_factor=1.0, ep_group=dist.group.WORLD)
            assert out.shape == (3, hidden)
    finally:
        dist.destroy_process_group()


def _dense(moe_reference, x_all, full, cotangent, options, world) -> dict:
    """The dense reference's outputs and gradients for every rank's tokens at once."""
    leaves = {key: value.clone().requires_grad_() for key, value in (("x", x_all), *full.items())}
    shards = world if options["capacity_factor"] is not None else 1
    out, aux_loss, dropped = moe_reference(*leaves.values(), **options, num_shards=shards)
    ((out * cotangent).sum() + aux_loss).backward()
    return dict(
        out=out.detach(),
        aux_loss=aux_loss.detach(),
        dropped=dropped,
        **{f"grad {key}": value.grad for key, value in leaves.items()},
    )


def graph_worker(rank: int, world: int, store: str) -> None:
    """One GPU rank: a capacity layer step with a gated shared expert (forward and backward, the peer
    exchange) captured in a CUDA graph after eager warm-up steps (the staging buffer is allocated there),
    replayed on new tokens, against the eager step on the same tokens: outputs and gradients bit for bit."""
    import moetriton.torch as mt
    from moetriton.torch.moe import exchange_for

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        assert exchange_for(dist.group.WORLD, device) == "peer"
        generator = torch.Generator(device).manual_seed(11)
        hidden, ffn, experts = 64, 32, 4 * world
        gate = torch.randn(experts, hidden, device=device, generator=generator, dtype=torch.bfloat16) / 8
        local = experts // world
        gate_up = torch.randn(local, hidden, 2 * ffn, device=device, dtype=torch.bfloat16) / 8
        down = torch.randn(local, ffn, hidden, device=device, dtype=torch.bfloat16) / 6
        shared_gate_up = torch.randn(hidden, 2 * ffn, device=device, dtype=torch.bfloat16) / 8
        shared_down = torch.randn(ffn, hidden, device=device, dtype=torch.bfloat16) / 6
        shared_gate = torch.randn(hidden, 1, device=device, dtype=torch.bfloat16) / 8
        weights = [w.requires_grad_() for w in (gate, gate_up, down)]
        shared = [w.requires_grad_() for w in (shared_gate_up, shared_down, shared_gate)]
        kwargs = dict(topk=2, capacity_factor=1.0, aux_loss_coeff=0.01, ep_group=dist.group.WORLD)

        def step(x):
            out, aux_loss, dropped = mt.moe(
                x, *weights, shared_gate_up=shared[0], shared_down=shared[1], shared_gate=shared[2], **kwargs
            )
            grads = torch.autograd.grad((out.float().square().sum() + aux_loss), [x, *weights, *shared])
            return (out, aux_loss, dropped, *grads)

        def tokens(seed):
            source = torch.Generator(device).manual_seed(seed + rank)
            return torch.randn(64, hidden, device=device, generator=source, dtype=torch.bfloat16)

        static_x = tokens(0).requires_grad_()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_results = step(static_x)
        fresh = tokens(100)
        with torch.no_grad():
            static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        expected = step(fresh.requires_grad_())
        for got, want in zip(static_results, expected, strict=True):
            assert torch.equal(got, want)
        # Before the group goes: with a captured graph alive, NCCL's teardown waited forever on two H100s.
        del graph
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def exchange_modes_worker(rank: int, world: int, store: str) -> None:
    """One of `world` gloo ranks: which all_to_all_single calls are started asynchronously. all_to_all_rows
    and the dropless layer in one chunk run every row exchange synchronously, forward and backward (nothing
    runs beside them); start_exchange and the layer in two chunks start every one asynchronously."""
    import moetriton.torch as mt
    from moetriton.torch.moe import all_to_all_rows
    from moetriton.torch.moe.collectives import finish_exchange, start_exchange

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        modes = []
        issue = dist.all_to_all_single

        def recording(output, *args, async_op=False, **kwargs):
            modes.append((async_op, output.shape[-1]))
            return issue(output, *args, async_op=async_op, **kwargs)

        dist.all_to_all_single = recording
        rows = torch.randn(2 * world, 3, requires_grad=True)
        all_to_all_rows(rows, None, None, rows.shape[0], None).sum().backward()
        assert modes == [(False, 3)] * 2, modes
        modes.clear()
        finish_exchange(start_exchange(rows, None, None, rows.shape[0], None)).sum().backward()
        assert modes == [(True, 3)] * 2, modes

        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(6, 8, generator=generator, requires_grad=True)
        gate = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(0))
        gate_up, down = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 8, 8, requires_grad=True)
        results = {}
        for chunks in (1, 2):
            modes.clear()
            group = dist.group.WORLD
            out, _, _ = mt.moe(x, gate, gate_up, down, topk=2, ep_group=group, pipeline_chunks=chunks)
            grads = torch.autograd.grad(out.sum(), (x, gate_up, down))
            # Each chunk's rows [., H] go out and come back, and so do their gradients (the count exchange,
            # [EP, E] ints, is synchronous either way).
            rows_modes = [asynchronous for asynchronous, width in modes if width == x.shape[1]]
            assert rows_modes == [chunks > 1] * 4 * chunks, (chunks, modes)
            results[chunks] = (out, *grads)
        for one, two in zip(results[1], results[2], strict=True):
            torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


#: The torch.distributed collectives a layer call may reach; `hostile_worker` records every call to them.
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "reduce_scatter_tensor",
)


def _local_call(arrays: dict, options: dict, rank: int, world: int, ep_group) -> tuple:
    """The PyTorch layer's call on this rank: gate as [E, H], this rank's experts of gate_up and down
    (arrays of every expert; anything else as given), tensors for numpy arrays."""
    local = {}
    for name, value in arrays.items():
        if isinstance(value, np.ndarray) and name in ("gate_up", "down") and value.shape[:1] == (EXPERTS,):
            value = value[rank * EXPERTS // world : (rank + 1) * EXPERTS // world]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(
                np.ascontiguousarray(value.T if name == "gate" and value.ndim == 2 else value)
            )
        local[name] = value
    positional = [local.pop(name) for name in ("x", "gate", "gate_up", "down")]
    return positional, dict(local, **options, ep_group=ep_group)


def _refuse_before_any_collective(rank: int, world: int, recorded: list) -> None:
    """Every bad argument of the hostile family, given to every rank: each rank raises the family's error
    naming the argument and has entered no collective."""
    from tests.strategies_moe_hostile import REFUSED, base_arrays

    valid = base_arrays()
    valid["x"] = valid["x"][rank : rank + 1]  # this rank's token shard
    for case, refusal in REFUSED.items():
        recorded.clear()
        arrays = {name: value for name, value in {**valid, **refusal.change}.items() if name in ARRAYS}
        options = {name: value for name, value in refusal.change.items() if name not in ARRAYS}
        positional, keywords = _local_call(
            arrays, dict(dict(topk=2), **options), rank, world, dist.group.WORLD
        )
        try:
            import moetriton.torch as mt

            mt.moe(*positional, **keywords)
        except (TypeError, ValueError) as error:
            assert isinstance(error, refusal.error), (case, error)
            assert str(error).startswith(f"{refusal.named('torch')}:"), (case, error)
        else:
            raise AssertionError(f"{case}: no error on rank {rank}")
        assert not recorded, f"{case}: rank {rank} entered {recorded} before refusing"


def hostile_results(call, layer, cotangent: np.ndarray, experts: slice = slice(None), reduce=None) -> dict:
    """`layer`'s (moe, or the reference, with any fixed keywords) results on a hostile call as the family
    compares them: forward, stats and the gradients of <out, cotangent> + aux_loss, as numpy, gate [H, E].
    experts: the experts of gate_up and down the call holds (an EP rank's); reduce: applied to the
    gradients of the replicated weights (an EP rank's all_reduce)."""
    present = {name: value for name, value in call.arrays.items() if value is not None}
    leaves = {}
    for name, value in present.items():
        value = value[experts] if name in ("gate_up", "down") else value
        leaves[name] = torch.from_numpy(np.ascontiguousarray(value.T if name == "gate" else value))
    names = [name for name in ("x", "gate", "gate_up", "down", *SHARED) if name in leaves]
    for name in names:
        leaves[name].requires_grad_()
    rest = {name: value for name, value in leaves.items() if name not in ("x", "gate", "gate_up", "down")}
    out, aux_loss, dropped, stats = layer(
        *(leaves[name] for name in ("x", "gate", "gate_up", "down")),
        **rest,
        **dict(call.options, return_stats=True),
    )
    loss = (out * torch.from_numpy(cotangent)).sum() + aux_loss
    grads = dict(zip(names, torch.autograd.grad(loss, [leaves[name] for name in names]), strict=True))
    if reduce is not None:
        for name in ("gate", *SHARED):
            if name in grads:
                reduce(grads[name])
    grads["gate"] = grads["gate"].t()
    return record(out.detach(), aux_loss, dropped, {k: v.detach() for k, v in stats._asdict().items()}, grads)


def _cotangent(call) -> np.ndarray:
    return np.random.default_rng(7).normal(size=call.arrays["x"].shape).astype(np.float32)


def _rank_shard(call, rank: int, world: int) -> tuple:
    """(this rank's shard of `call`, the rows of its tokens in the batch, its experts)."""
    mine = call.shard(rank, world)
    first = sum(call.batches[:rank]) if call.batches else rank * call.arrays["x"].shape[0] // world
    experts = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    return mine, slice(first, first + mine.arrays["x"].shape[0]), experts


def _rank_part(results: dict, rows: slice, experts: slice) -> dict:
    """The reference's results as one rank holds them: its tokens' rows, its experts' weights."""
    grads = dict(results["grads"], x=results["grads"]["x"][rows])
    for name in ("gate_up", "down"):
        grads[name] = grads[name][experts]
    return dict(results, out=results["out"][rows], grads=grads)


def hostile_worker(rank: int, world: int, store: str) -> None:
    """One of `world` gloo ranks: every bad argument of the hostile family refused on every rank before any
    collective (and the group usable afterwards); then the data-dependent cases
    (tests/strategies_moe_hostile.expert_parallel_calls: NaN tokens on one rank, overflowing tokens, a rank
    of padding alone, overflowing and mostly unused capacity slabs, a rank without tokens, every option on)
    against the dense reference, on every rank, with exact zeros for padding and for the experts no slot
    reached."""
    from tests.strategies_moe_hostile import (
        check_invariants,
        expert_parallel_calls,
        routed_slots,
        same_results,
    )

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}
    recorded: list[str] = []

    def recording(name, function):
        def call(*args, **kwargs):
            recorded.append(name)
            return function(*args, **kwargs)

        return call

    try:
        for name, function in originals.items():
            setattr(dist, name, recording(name, function))
        _refuse_before_any_collective(rank, world, recorded)
        for name, function in originals.items():
            setattr(dist, name, function)
        import moetriton.torch as mt
        from moetriton.torch.reference_moe import moe_reference

        for call in expert_parallel_calls(world):
            mine, rows, experts = _rank_shard(call, rank, world)
            rank_layer = functools.partial(mt.moe, ep_group=dist.group.WORLD)
            got = hostile_results(mine, rank_layer, _cotangent(call)[rows], experts, dist.all_reduce)
            reference = functools.partial(moe_reference, num_shards=1 if call.batches else world)
            expected = _rank_part(hostile_results(call, reference, _cotangent(call)), rows, experts)
            same_results(got, expected, mine, f"rank {rank}, {call.corruption} {call.options}")
            check_invariants(mine, got, routed=routed_slots(call), first_expert=rank * EXPERTS // world)
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        dist.destroy_process_group()
