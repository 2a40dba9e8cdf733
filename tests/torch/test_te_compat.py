"""TransformerEngine-named functions: TE's signatures, return orders and semantics (and our documented
departures from them)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moetriton.torch as mt
from tests.torch._helpers import DEVICE, assert_reduced


def _problem(seed: int, num_tokens=9, hidden=6, num_experts=5, topk=2):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE)
    ids = torch.rand(num_tokens, num_experts, generator=generator).topk(topk, dim=1).indices.to(DEVICE)
    mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=DEVICE).scatter_(1, ids, True)
    probs = torch.rand(num_tokens, num_experts, generator=generator).to(DEVICE)
    return x, ids, mask, probs


@given(st.integers(0, 2**16), st.integers(0, 18))
def test_index_map_truncation_drops_the_tail_of_the_expert_sorted_list(seed, num_out_tokens):
    x, ids, _, _ = _problem(seed)
    ids[2, 1] = -1  # a slot with no expert never gets a row
    out, _ = mt.moe_permute(x, ids, num_out_tokens=num_out_tokens, map_type="index", num_experts=5)
    # TE's index map: stable sort of the flattened expert ids, (token, slot) order inside an expert.
    flat = ids.reshape(-1).long()
    order = torch.argsort(torch.where(flat >= 0, flat, 5), stable=True)
    kept = order[: min(num_out_tokens or flat.numel(), int((flat >= 0).sum()))]
    rows = out.shape[0]
    assert rows == (num_out_tokens or flat.numel())
    assert torch.equal(out[: kept.numel()], x[kept // 2])
    assert not out[kept.numel() :].any()


def test_index_map_round_trip_with_merging_probs():
    x, ids, _, _ = _problem(1)
    weights = torch.rand(ids.shape, device=DEVICE)
    out, row_id_map = mt.moe_permute(x, ids, map_type="index", num_experts=5)
    back = mt.moe_unpermute(out, row_id_map, weights, map_type="index")
    expected = (x[:, None, :] * weights[:, :, None]).sum(1)
    torch.testing.assert_close(back, expected, rtol=1e-6, atol=1e-6)


def test_index_map_without_num_experts_reads_it_back():
    x, ids, _, _ = _problem(2)
    assert torch.equal(
        mt.moe_permute(x, ids, map_type="index")[0],
        mt.moe_permute(x, ids, map_type="index", num_experts=5)[0],
    )


def test_mask_map_functions_and_return_orders():
    x, _, mask, probs = _problem(3)
    routed = int(mask.sum())
    out, row_id_map = mt.moe_permute(x, mask, num_out_tokens=routed)
    out2, permuted_probs, row_id_map2 = mt.moe_permute_with_probs(x, probs, mask, routed)
    expected = mt.token_dispatch(x, mask, routed, probs)
    assert torch.equal(out, expected[0]) and torch.equal(out2, expected[0])
    assert torch.equal(permuted_probs, expected[1])
    assert torch.equal(row_id_map, expected[2]) and torch.equal(row_id_map2, expected[2])
    back = mt.moe_unpermute(out, row_id_map, probs, restore_shape=x.shape)
    assert_reduced(back, mt.token_combine(out, row_id_map, probs), "unpermute")
    assert torch.equal(mt.moe_unpermute(out, row_id_map, probs=probs), back)  # TE's deprecated alias


def test_permute_and_pad_sizes_the_output_like_te():
    x, _, mask, probs = _problem(4)
    counts = mask.sum(0)
    out, permuted_probs, row_id_map, pad_offsets, target = mt.moe_permute_and_pad_with_probs(
        x, probs, mask, counts, 4
    )
    assert torch.equal(target, (counts + 3) // 4 * 4) and target.dtype == torch.int64
    assert out.shape == (int(target.sum()), x.shape[1]) and permuted_probs.shape == (int(target.sum()),)
    assert pad_offsets.dtype == torch.int64
    starts = torch.cumsum(target, 0) - target
    for expert in range(mask.shape[1]):
        tokens = torch.nonzero(mask[:, expert])[:, 0]
        block = out[starts[expert] : starts[expert] + target[expert]]
        assert torch.equal(block[: tokens.numel()], x[tokens])
        assert not block[tokens.numel() :].any()
    back = mt.moe_unpermute(out, row_id_map, probs, pad_offsets=pad_offsets)
    torch.testing.assert_close(back, x * (probs * mask).sum(1, keepdim=True), rtol=1e-6, atol=1e-6)


def test_permute_and_pad_without_needed_padding_returns_no_offsets():
    x, _, mask, probs = _problem(5)
    mask[:] = False
    mask[:8, 0] = True
    out, _, _, pad_offsets, target = mt.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0), 4)
    assert pad_offsets is None and out.shape[0] == 8 and target.tolist() == [8, 0, 0, 0, 0]


def test_permute_and_pad_checks_tokens_per_expert():
    x, _, mask, probs = _problem(6)
    with pytest.raises(ValueError, match=r"^tokens_per_expert"):
        mt.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0).flip(0) + 1, 4)


def test_unpermute_checks_restore_shape_and_probs_alias():
    x, _, mask, probs = _problem(7)
    out, row_id_map = mt.moe_permute(x, mask, num_out_tokens=int(mask.sum()))
    with pytest.raises(ValueError, match=r"^restore_shape"):
        mt.moe_unpermute(out, row_id_map, restore_shape=out.shape)
    with pytest.raises(ValueError, match=r"^probs"):
        mt.moe_unpermute(out, row_id_map, probs, probs=probs)
    with pytest.raises(ValueError, match=r"^map_type"):
        mt.moe_permute(x, mask, 4, map_type="dense")


def test_sort_chunks_compat():
    x = torch.arange(12.0, device=DEVICE).view(6, 2)
    probs = torch.arange(6.0, device=DEVICE)
    sizes = torch.tensor([1, 2, 3], device=DEVICE)
    order = torch.tensor([2, 0, 1], device=DEVICE)
    out = mt.moe_sort_chunks_by_index(x, sizes, order)
    out2, permuted = mt.moe_sort_chunks_by_index_with_probs(x, probs, sizes, order)
    expected_rows = torch.tensor([3, 4, 5, 0, 1, 2], device=DEVICE)
    assert torch.equal(out, x[expected_rows]) and torch.equal(out2, out)
    assert torch.equal(permuted, probs[expected_rows])
