"""Bad input gets a clear ValueError that names the argument, case by case (PyTorch API)."""

import pytest
import torch

import moetriton.torch as mt
from tests.torch._helpers import DEVICE

T, H, E, K = 4, 8, 3, 2


def _x(**kwargs):
    return torch.zeros(T, H, device=DEVICE, **kwargs)


def _mask():
    return torch.ones(T, E, dtype=torch.bool, device=DEVICE)


def _ids():
    return torch.zeros(T, K, dtype=torch.int32, device=DEVICE)


DISPATCH_CASES = {
    "inp rank": (lambda: mt.token_dispatch(torch.zeros(T, device=DEVICE), _mask(), 4), "inp"),
    "inp dtype": (lambda: mt.token_dispatch(_x(dtype=torch.int32), _mask(), 4), "inp"),
    "mask tokens": (lambda: mt.token_dispatch(_x(), _mask()[:2], 4), "routing_map"),
    "mask rank": (lambda: mt.token_dispatch(_x(), _mask()[0], 4), "routing_map"),
    "mask float": (lambda: mt.token_dispatch(_x(), _mask().float(), 4), "routing_map"),
    "both maps": (lambda: mt.token_dispatch(_x(), _mask(), 4, indices=_ids(), num_experts=E), "routing_map"),
    "no map": (lambda: mt.token_dispatch(_x(), None, 4), "routing_map"),
    "num_out_tokens missing": (lambda: mt.token_dispatch(_x(), _mask()), "num_out_tokens"),
    "num_out_tokens negative": (lambda: mt.token_dispatch(_x(), _mask(), -1), "num_out_tokens"),
    "num_out_tokens float": (lambda: mt.token_dispatch(_x(), _mask(), 4.0), "num_out_tokens"),
    "num_experts mismatch": (lambda: mt.token_dispatch(_x(), _mask(), 4, num_experts=E + 1), "num_experts"),
    "indices without num_experts": (lambda: mt.token_dispatch(_x(), None, 4, indices=_ids()), "num_experts"),
    "indices dtype": (
        lambda: mt.token_dispatch(_x(), None, 4, indices=_ids().float(), num_experts=E),
        "indices",
    ),
    "indices tokens": (
        lambda: mt.token_dispatch(_x(), None, 4, indices=_ids()[:1], num_experts=E),
        "indices",
    ),
    "num_experts zero": (
        lambda: mt.token_dispatch(_x(), None, 4, indices=_ids(), num_experts=0),
        "num_experts",
    ),
    "probs shape": (
        lambda: mt.token_dispatch(_x(), _mask(), 4, torch.zeros(T, E + 1, device=DEVICE)),
        "probs",
    ),
    "probs dtype": (
        lambda: mt.token_dispatch(_x(), _mask(), 4, torch.zeros(T, E, dtype=torch.int32, device=DEVICE)),
        "probs",
    ),
    "align_size zero": (lambda: mt.token_dispatch(_x(), _mask(), 4, align_size=0), "align_size"),
    "align_size negative": (lambda: mt.token_dispatch(_x(), _mask(), 4, align_size=-8), "align_size"),
    "scales tokens": (lambda: mt.token_dispatch(_x(), _mask(), 4, scales=torch.zeros(T + 1, 2)), "scales"),
    "capacity zero": (lambda: mt.token_dispatch(_x(), _mask(), capacity=0), "capacity"),
    "capacity float": (lambda: mt.token_dispatch(_x(), _mask(), capacity=2.0), "capacity"),
    "capacity with num_out_tokens": (
        lambda: mt.token_dispatch(_x(), _mask(), 4, capacity=2),
        "num_out_tokens",
    ),
    "capacity with align_size": (
        lambda: mt.token_dispatch(_x(), _mask(), None, align_size=4, capacity=2),
        "align_size",
    ),
}


@pytest.mark.skipif(
    DEVICE.type != "cpu", reason="CUDA tensors are read only with MOETRITON_CHECK=1 (test_index_safety.py)"
)
def test_indices_out_of_range_are_rejected_on_cpu():
    for bad in (E, -2):
        ids = _ids()
        ids[1, 0] = bad
        with pytest.raises(ValueError, match=r"indices: expected expert ids in \[-1, 3\)"):
            mt.token_dispatch(_x(), None, 4, indices=ids, num_experts=E)


def test_devices_must_match():
    if DEVICE.type != "cuda":
        pytest.skip("needs a second device kind (CUDA) to mismatch against")
    with pytest.raises(ValueError, match=r"^routing_map: expected device"):
        mt.token_dispatch(_x(), _mask().cpu(), 4)


def _row_map():
    return mt.token_dispatch(_x(), _mask(), T * E)[2]


COMBINE_CASES = {
    "inp rank": (lambda: mt.token_combine(torch.zeros(T * E, device=DEVICE), _row_map()), "inp"),
    "inp fp8": (
        lambda: mt.token_combine(torch.zeros(T * E, H, device=DEVICE).to(torch.float8_e4m3fn), _row_map()),
        "inp",
    ),
    "map dtype": (
        lambda: mt.token_combine(torch.zeros(T * E, H, device=DEVICE), _row_map().long()),
        "row_id_map",
    ),
    "map width": (
        lambda: mt.token_combine(torch.zeros(T * E, H, device=DEVICE), _row_map()[:, :0]),
        "row_id_map",
    ),
    "map width odd": (  # not [T, 2S + 2]: a column cut off
        lambda: mt.token_combine(torch.zeros(T * E, H, device=DEVICE), _row_map()[:, :-1]),
        "row_id_map",
    ),
    "merging_probs shape": (
        lambda: mt.token_combine(torch.zeros(T * E, H, device=DEVICE), _row_map(), torch.zeros(T, K)),
        "merging_probs",
    ),
    "pad_offsets rank": (
        lambda: mt.token_combine(torch.zeros(T * E, H, device=DEVICE), _row_map(), None, torch.zeros(1, E)),
        "pad_offsets",
    ),
}


def _sort(x=None, sizes=None, order=None, probs=None):
    x = torch.zeros(6, H, device=DEVICE) if x is None else x
    sizes = torch.tensor([2, 4], device=DEVICE) if sizes is None else sizes
    order = torch.tensor([1, 0], device=DEVICE) if order is None else order
    return mt.sort_chunks_by_index(x, sizes, order, probs)


SORT_CASES = {
    "inp rank": (lambda: _sort(x=torch.zeros(6, device=DEVICE)), "inp"),
    "sizes dtype": (lambda: _sort(sizes=torch.tensor([2.0, 4.0], device=DEVICE)), "split_sizes"),
    "order length": (lambda: _sort(order=torch.tensor([0], device=DEVICE)), "sorted_indices"),
    "probs length": (lambda: _sort(probs=torch.zeros(5, device=DEVICE)), "probs"),
}


#: "op: case" -> (call, the argument its error names first): the cases of every op's table.
BAD_ARGUMENTS = {
    f"{op}: {case}": value
    for op, cases in (("dispatch", DISPATCH_CASES), ("combine", COMBINE_CASES), ("sort_chunks", SORT_CASES))
    for case, value in cases.items()
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_rejected_naming_the_argument(case):
    call, name = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=rf"^{name}"):
        call()


@pytest.mark.skipif(
    DEVICE.type != "cpu", reason="CUDA tensors are read only with MOETRITON_CHECK=1 (test_index_safety.py)"
)
@pytest.mark.parametrize(
    ("sizes", "order", "name"),
    [([2, -1], [1, 0], "split_sizes"), ([4, 4], [1, 0], "split_sizes"), ([2, 4], [1, 1], "sorted_indices")],
)
def test_sort_chunks_rejects_bad_values_on_cpu(sizes, order, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        _sort(sizes=torch.tensor(sizes), order=torch.tensor(order))


def test_memoised_checks_tell_equal_values_of_other_types_apart():
    """True == 1 == 1.0 in Python, with one hash: a memoised check must still see each one's own type, so
    that no answer depends on what was called before."""
    from moetriton.torch._checks import memoised

    @memoised
    def kind(*, value):
        if isinstance(value, bool):
            raise TypeError("value: expected an int, got bool")
        return type(value).__name__

    assert kind(value=1) == "int" and kind(value=1.0) == "float"
    with pytest.raises(TypeError, match="got bool"):
        kind(value=True)
    assert kind(value=1) == "int"
