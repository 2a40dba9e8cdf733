"""Expert-parallel exchange arithmetic (moetriton.kernels.rules.expert_parallel), checked by simulating the
exchange between EP ranks with numpy: every row reaches the right rank, chunk and expert, fits the static
buffers (adversarial routing included), and the reverse exchange returns it to the row it left."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetriton.kernels.rules.expert_parallel import (
    dropless_exchange,
    dropped_slots,
    ep_layout,
    exchange_block_index,
    peer_chunks,
)


def _padded_counts(ids: np.ndarray, num_experts: int, align: int) -> np.ndarray:
    counts = np.bincount(ids[ids >= 0], minlength=num_experts)
    return -(-counts // align) * align


@st.composite
def _exchanges(draw):
    ep = draw(st.sampled_from([1, 2, 4, 8]))
    local = draw(st.integers(1, 4))
    num_experts = ep * local
    topk = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, 12))
    align = draw(st.sampled_from([1, 2, 4, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pattern = draw(st.sampled_from(["random", "one_rank", "one_expert"]))
    ids = []
    for _ in range(ep):
        scores = rng.random((num_tokens, num_experts))
        if pattern == "one_rank":  # every token prefers the experts of rank 0 (the worst case)
            scores[:, :local] += 2
        if pattern == "one_expert":
            scores[:, 0] += 2
        ids.append(np.argsort(-scores, axis=1)[:, :topk])
    layout = ep_layout(
        num_tokens=num_tokens, num_experts=num_experts, topk=topk, ep_size=ep, align_size=align
    )
    return layout, ids


@given(_exchanges())
def test_dropless_exchange_moves_every_row_to_its_expert_and_back(case):
    layout, ids = case
    ep, local = layout.ep_size, layout.local_experts
    counts_all = np.stack([_padded_counts(rank_ids, layout.num_experts, layout.align) for rank_ids in ids])
    assert (counts_all.sum(1) <= layout.send_rows).all()
    # Row tags: (source rank, send-buffer row) so that each received row tells where it came from.
    send = [np.stack([np.full(layout.send_rows, r), np.arange(layout.send_rows)], 1) for r in range(ep)]
    plans = [dropless_exchange(counts_all, r, layout) for r in range(ep)]
    recv = [np.full((layout.recv_rows, 2), -1) for _ in range(ep)]
    for src in range(ep):
        plan = plans[src]
        for dst in range(ep):
            size, start, land = (
                plan["send_sizes"][dst],
                plan["input_offsets"][dst],
                plan["output_offsets"][dst],
            )
            assert land + size <= layout.recv_rows
            recv[dst][land : land + size] = send[src][start : start + size]
    # The padded exchange's block: the smallest size that holds the largest pair, the same on every rank.
    block_rows = layout.exchange_block_rows
    assert list(block_rows) == sorted(set(block_rows)) and block_rows[-1] == layout.pair_rows
    largest = max(plan["send_sizes"].max() for plan in plans)
    index = int(exchange_block_index(counts_all, layout))
    assert block_rows[index] >= largest and (index == 0 or block_rows[index - 1] < largest)
    for rank in range(ep):
        plan = plans[rank]
        assert plan["recv_sizes"].sum() == plan["chunk_sizes"].sum() == plan["group_sizes"].sum()
        assert plan["recv_sizes"].sum() <= layout.recv_rows
        # Source-major chunks: chunk (p, j) holds source p's block of local expert j.
        chunk_starts = np.concatenate([[0], np.cumsum(plan["chunk_sizes"])[:-1]])
        for p in range(ep):
            assert plan["recv_offsets"][p] == chunk_starts[p * local]
            for j in range(local):
                expert = rank * local + j
                block_start = counts_all[p, :expert].sum()
                start, size = chunk_starts[p * local + j], plan["chunk_sizes"][p * local + j]
                got = recv[rank][start : start + size]
                assert (got[:, 0] == p).all()
                np.testing.assert_array_equal(got[:, 1], block_start + np.arange(size))
        order = layout.expert_major_order()
        inverse = layout.source_major_order()
        assert sorted(order) == list(range(ep * local))
        assert [order[i] for i in inverse] == list(range(ep * local))
        # With a gap chunk (p, L) after each source's chunks: the same expert-major order, then the gaps.
        gapped, gapped_inverse = layout.expert_major_order(gaps=True), layout.source_major_order(gaps=True)
        expected = [divmod(chunk, local) for chunk in order]
        assert [divmod(chunk, local + 1) for chunk in gapped[: ep * local]] == expected
        assert gapped[ep * local :] == [p * (local + 1) + local for p in range(ep)]
        assert [gapped[i] for i in gapped_inverse] == list(range(ep * (local + 1)))
    # Reverse: each rank sends its received rows back; they land where they left the source.
    for rank in range(ep):
        plan = plans[rank]
        for src in range(ep):
            start, size = plan["recv_offsets"][src], plan["recv_sizes"][src]
            land = plan["return_offsets"][src]
            np.testing.assert_array_equal(recv[rank][start : start + size, 1], land + np.arange(size))


@given(_exchanges())
def test_peer_chunks_name_every_expert_major_row_of_the_sources_send_buffers(case):
    """The peer exchange's receiving layout: walking its chunks in order reads, for every local expert and
    then every source, exactly that source's send-buffer rows of the expert (tagged rows, as above)."""
    layout, ids = case
    ep, local = layout.ep_size, layout.local_experts
    counts_all = np.stack([_padded_counts(rank_ids, layout.num_experts, layout.align) for rank_ids in ids])
    for rank in range(ep):
        chunks = peer_chunks(counts_all, rank, layout)
        got = [
            (chunk % ep, row)
            for chunk, (size, start) in enumerate(
                zip(chunks["chunk_sizes"], chunks["source_offsets"], strict=True)
            )
            for row in range(start, start + size)
        ]
        expected = [
            (p, row)
            for j in range(local)
            for p in range(ep)
            for row in range(
                counts_all[p, : rank * local + j].sum(), counts_all[p, : rank * local + j + 1].sum()
            )
        ]
        assert got == expected
        assert chunks["chunk_sizes"].sum() == dropless_exchange(counts_all, rank, layout)["recv_sizes"].sum()


@given(
    st.integers(1, 64), st.sampled_from([(8, 2, 1), (8, 2, 4), (64, 8, 8), (256, 8, 4)]), st.floats(0.1, 4.0)
)
def test_capacity_sizes(num_tokens, shape, capacity_factor):
    num_experts, topk, ep = shape
    layout = ep_layout(
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        ep_size=ep,
        align_size=16,
        capacity_factor=capacity_factor,
    )
    balanced = num_tokens * topk / num_experts
    assert layout.capacity % 16 == 0 and layout.capacity >= capacity_factor * balanced
    assert layout.capacity < capacity_factor * balanced + 16 or layout.capacity == 16
    assert layout.send_rows == num_experts * layout.capacity
    assert layout.recv_rows == ep * layout.local_experts * layout.capacity
    routed = np.array([layout.capacity + 3, 0, layout.capacity, 1] + [0] * (num_experts - 4))
    assert int(dropped_slots(routed, layout)) == 3


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(num_experts=6, ep_size=4), "num_experts"),
        (dict(topk=9), "topk"),
        (dict(align_size=0), "align_size"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(capacity_factor=float("inf")), "capacity_factor"),
        (dict(ep_size=0), "ep_size"),
    ],
)
def test_bad_layouts_name_the_argument(kwargs, name):
    arguments = dict(num_tokens=4, num_experts=8, topk=2, ep_size=2) | kwargs
    with pytest.raises(ValueError, match=name):
        ep_layout(**arguments)


@pytest.mark.parametrize(
    ("shape", "choices"),
    [
        ((16384, 8, 2, 2, None), 17),
        ((8192, 256, 8, 2, None), 17),
        ((16384, 8, 2, 8, None), 20),
        ((8192, 256, 8, 8, 128), 23),
        ((0, 8, 2, 2, 4), 1),
    ],
)
def test_exchange_block_sizes_step_from_the_mean_pair_to_the_worst_case(shape, choices):
    num_tokens, num_experts, topk, ep, align = shape
    layout = ep_layout(
        num_tokens=num_tokens, num_experts=num_experts, topk=topk, ep_size=ep, align_size=align
    )
    block_rows = layout.exchange_block_rows
    assert len(block_rows) == choices and block_rows[-1] == layout.pair_rows
    mean = -(-num_tokens * topk // ep)
    if mean:
        assert block_rows[0] == mean  # no source's largest pair is below its mean pair
        # Each size at most 1/64 of the mean pair above the one before up to 1.125 times it, 1/16 up to 1.5
        # times, then a quarter of itself.
        for limit, step in ((1.125, 64), (1.5, 16)):
            sizes = [rows for rows in block_rows if rows <= limit * mean]
            assert all(b - a <= -(-mean // step) for a, b in itertools.pairwise(sizes))
        assert len([rows for rows in block_rows if rows <= 1.125 * mean]) == 9
        assert all(b <= 1.25 * a + 1 for a, b in itertools.pairwise(block_rows))


def test_block_index_is_the_same_in_numpy_torch_and_jax():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    layout = ep_layout(num_tokens=64, num_experts=8, topk=2, ep_size=2)
    block_rows = layout.exchange_block_rows
    for largest in (1, block_rows[0], block_rows[0] + 1, block_rows[3], block_rows[-2] + 1, layout.pair_rows):
        counts = np.zeros((2, 8), np.int64)
        counts[0, :4] = [largest // 4 + (i < largest % 4) for i in range(4)]
        expected = int(np.searchsorted(block_rows, largest))
        for array in (np.asarray, torch.as_tensor, jnp.asarray):
            assert int(exchange_block_index(array(counts), layout)) == expected
