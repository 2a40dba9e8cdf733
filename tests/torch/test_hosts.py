"""EP groups that span hosts, on one machine: every rank's host as the launcher declares it or as
MOETRITON_HOST_OF_RANK overrides it, the row exchange "auto" chooses for a group (all_to_all where the group
spans hosts, peer memory only within one host), "peer" refused on every rank of a spanning group with one
message, and the layer against the dense reference on four gloo ranks posing as two hosts of two (EP = 4
across both hosts; data 2 x EP 2 with each EP group inside one host), and on two GPUs posing as two hosts.
Every spawned group runs under a time limit, so a rank left waiting fails the test instead of hanging it."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given

from moetriton.kernels.rules.expert_parallel import ranks_by_host
from moetriton.torch.moe import HOSTS_VARIABLE, choose_exchange, exchange_for, group_hosts
from moetriton.torch.moe.collectives import host_label
from tests.torch._moe_helpers import ep_worker
from tests.torch.test_moe import _ONE_SPAWN, _ep_problems, _gpu_worlds

TWO_HOSTS_OF_TWO = "0,0,1,1"
SPAWN_TIMEOUT_S = 120
PEER_ACROSS_HOSTS = r"exchange='peer' needs every rank of ep_group on one host"
PEER_WITHOUT_PEER_MEMORY = r"exchange='peer' needs CUDA GPUs of one host"


def _spawn(worker, args: tuple, world: int) -> None:
    """`worker(rank, *args)` on `world` spawned processes; fails if any raises or if any is still running
    after SPAWN_TIMEOUT_S (a rank left waiting in a collective), and leaves no process behind."""
    context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise AssertionError(f"ranks still running after {SPAWN_TIMEOUT_S} s: one is left waiting")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


# The decision on host lists, in one process ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("hosts", "ranks"),
    [
        ([0], [[0]]),
        ([0, 0, 0, 0], [[0, 1, 2, 3]]),
        ([0, 0, 1, 1], [[0, 1], [2, 3]]),
        ([1, 0, 1, 0], [[0, 2], [1, 3]]),
        ([5, 5, 2], [[0, 1], [2]]),
        ([], []),
    ],
)
def test_ranks_by_host(hosts, ranks):
    assert ranks_by_host(hosts) == ranks


@pytest.mark.parametrize("hosts", [[0, True], [0, "1"], [0.0]])
def test_ranks_by_host_refuses_what_is_not_an_int(hosts):
    with pytest.raises(ValueError, match="hosts: expected an int host id per rank"):
        ranks_by_host(hosts)


@pytest.mark.parametrize(
    ("exchange", "hosts", "peer_memory", "chosen"),
    [
        ("auto", [0, 0], True, "peer"),
        ("auto", [0, 0, 0, 0], True, "peer"),
        ("auto", [0, 0, 1, 1], True, "all_to_all"),
        ("auto", [0, 1], True, "all_to_all"),
        ("auto", [0, 0], False, "all_to_all"),  # gloo, CPU tensors, torch.compile: no peer memory
        ("auto", None, True, "all_to_all"),  # hosts unknown: never peer
        ("auto", None, False, "all_to_all"),
        ("peer", [0, 0], True, "peer"),
        ("all_to_all", [0, 0], True, "all_to_all"),
        ("all_to_all", [0, 1], False, "all_to_all"),
    ],
)
def test_auto_takes_peer_memory_only_within_one_host(exchange, hosts, peer_memory, chosen):
    assert choose_exchange(exchange, hosts, peer_memory) == chosen


@pytest.mark.parametrize(
    ("hosts", "peer_memory", "match"),
    [
        ([0, 0, 1, 1], True, PEER_ACROSS_HOSTS + r", got ranks on 2 hosts: \[0, 1\], \[2, 3\]"),
        ([0, 1, 0], False, PEER_ACROSS_HOSTS + r", got ranks on 2 hosts: \[0, 2\], \[1\]"),
        ([0, 0], False, PEER_WITHOUT_PEER_MEMORY),
        (None, True, PEER_WITHOUT_PEER_MEMORY),
    ],
)
def test_forced_peer_is_refused_where_it_cannot_run(hosts, peer_memory, match):
    with pytest.raises(ValueError, match=match):
        choose_exchange("peer", hosts, peer_memory)


def test_host_label_from_the_launcher_and_the_override():
    """torchrun's node rank (GROUP_RANK) separates ranks even on machines of one name; the override gives
    each global rank its entry, and must hold one non-empty label per rank."""
    assert host_label(0, 2, {}) == host_label(1, 2, {})
    assert host_label(0, 4, {"GROUP_RANK": "0"}) != host_label(2, 4, {"GROUP_RANK": "1"})
    assert host_label(0, 4, {"GROUP_RANK": "1"}) == host_label(1, 4, {"GROUP_RANK": "1"})
    declared = {HOSTS_VARIABLE: "a, a,b,b", "GROUP_RANK": "0"}
    labels = [host_label(rank, 4, declared) for rank in range(4)]
    assert labels[0] == labels[1] != labels[2] == labels[3]
    for bad in ("0,0,1", "0,,1,1", ""):
        with pytest.raises(ValueError, match=f"{HOSTS_VARIABLE}: expected 4 non-empty host labels"):
            host_label(0, 4, {HOSTS_VARIABLE: bad})


# Four gloo ranks posing as two hosts of two ----------------------------------------------------------------


def _refusal_worker(rank: int, world: int, store: str) -> None:
    """One of four gloo ranks declared as two hosts of two: the hosts every group sees, what "auto" chooses,
    "peer" refused on every rank with one message (gathered and compared), a declaration that differs
    between ranks refused on every rank, and the group still working afterwards."""
    import os

    import moetriton.torch as mt

    os.environ[HOSTS_VARIABLE] = TWO_HOSTS_OF_TWO
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        world_group = dist.group.WORLD
        # Every rank creates every subgroup, in one order (torch.distributed's rule for new_group).
        first_host, second_host, across = (dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [1, 2]))
        own_host = first_host if rank < 2 else second_host
        assert group_hosts(world_group) == (0, 0, 1, 1)
        assert group_hosts(own_host) == (0, 0)
        if rank in (1, 2):
            assert group_hosts(across) == (0, 1)
        assert exchange_for(world_group, cpu) == "all_to_all"
        assert exchange_for(own_host, cpu) == "all_to_all"  # one host, but gloo has no peer memory

        generator = torch.Generator().manual_seed(3)
        x = torch.randn(3, 8, generator=generator)
        gate, gate_up, down = torch.randn(4, 8), torch.randn(2, 8, 16), torch.randn(2, 8, 8)
        messages = []
        for group, match in ((world_group, PEER_ACROSS_HOSTS), (own_host, PEER_WITHOUT_PEER_MEMORY)):
            size = dist.get_world_size(group)
            local = slice(0, 4 // size)
            with pytest.raises(ValueError, match=match) as refused:
                mt.moe(x, gate, gate_up[local], down[local], topk=1, ep_group=group, exchange="peer")
            messages.append(str(refused.value))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, messages)
        assert all(theirs == everyone[0] for theirs in everyone), everyone
        assert "[0, 1], [2, 3]" in messages[0]

        # A declaration only some ranks hold: every rank of a new group raises the same error.
        os.environ[HOSTS_VARIABLE] = "0,0,0,0" if rank == 0 else TWO_HOSTS_OF_TWO
        late = dist.new_group(list(range(world)))
        with pytest.raises(ValueError, match=f"{HOSTS_VARIABLE}: expected the same value on every rank"):
            exchange_for(late, cpu, "peer")

        total = torch.ones(1)
        dist.all_reduce(total)  # nobody was left inside a collective
        assert total.item() == world

        # The hosts' memo holds no group alive: a dropped group is freed (gloo groups that outlive their
        # destruction are torn down at interpreter exit, where their threads can abort the process).
        os.environ[HOSTS_VARIABLE] = TWO_HOSTS_OF_TWO
        dropped = dist.new_group(list(range(world)))
        assert group_hosts(dropped) == (0, 0, 1, 1)
        dist.destroy_process_group(dropped)
        freed = weakref.ref(dropped)
        del dropped
        gc.collect()
        assert freed() is None
    finally:
        dist.destroy_process_group()


def test_spanning_group_choice_and_refusal_gloo(tmp_path):
    _spawn(_refusal_worker, (4, str(tmp_path / "store")), 4)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(1, id="ep4_across_two_hosts"),
        pytest.param(2, id="data2_x_ep2_each_inside_one_host"),
    ],
)
def test_layer_on_two_posing_hosts_matches_the_dense_reference_gloo(tmp_path, monkeypatch, data):
    """EP = 4 over both posing hosts, and data 2 x EP 2 where each EP group is one host's two ranks: "auto"
    takes all_to_all (across hosts, and on CPU where gloo has no peer memory), and each rank's outputs and
    gradients equal the dense reference's."""
    monkeypatch.setenv(HOSTS_VARIABLE, TWO_HOSTS_OF_TWO)  # inherited by the spawned ranks

    @_ONE_SPAWN
    @given(problems=_ep_problems(4))
    def check(problems):
        store = str(tmp_path / f"store_{time.monotonic_ns()}")
        _spawn(ep_worker, (4, store, "gloo", list(problems), data, "all_to_all"), 4)

    check()


# Two GPUs posing as two hosts -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("world", _gpu_worlds(2))
def test_two_gpus_posing_as_two_hosts_take_all_to_all_nccl(tmp_path, monkeypatch, world):
    """Two GPUs of one machine declared as two hosts: "auto" takes all_to_all, not peer memory, and the
    layer matches the dense reference."""
    monkeypatch.setenv(HOSTS_VARIABLE, "0,1")

    @_ONE_SPAWN
    @given(problems=_ep_problems(world))
    def check(problems):
        store = str(tmp_path / f"store_{time.monotonic_ns()}")
        _spawn(ep_worker, (world, store, "nccl", list(problems), 1, "all_to_all"), world)

    check()
