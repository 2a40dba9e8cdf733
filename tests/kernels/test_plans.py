"""Launch plans: sizes, the linear-work bound of map building, and empty inputs (pure Python, no kernels)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetriton import kernels
from moetriton.kernels.permutation import _MAX_BLOCKS


@given(st.integers(0, 10**6), st.integers(1, 4096), st.sampled_from([None, 1, 8, 128]))
def test_padded_buffer_holds_every_layout(num_out_tokens, num_experts, align_size):
    rows = kernels.buffer_rows(num_out_tokens, num_experts, align_size)
    if align_size is None:
        assert rows == num_out_tokens
        return
    assert rows % align_size == 0
    # The worst layout of num_out_tokens routed slots: every expert's count one past a multiple of A.
    worst = sum(
        -(-count // align_size) * align_size
        for count in _worst_counts(num_out_tokens, num_experts, align_size)
    )
    assert worst <= rows


def _worst_counts(total: int, num_experts: int, align_size: int) -> list[int]:
    counts = [0] * num_experts
    for expert in range(num_experts):
        take = min(1 if align_size > 1 else total, total)
        counts[expert] += take
        total -= take
    counts[0] += total
    return counts


@given(st.integers(1, 2**22), st.integers(1, 2048), st.booleans())
def test_map_building_work_is_linear(num_tokens, num_experts, is_mask):
    buffers, launches = kernels.row_map_plan(
        num_tokens=num_tokens,
        num_slots=num_experts if is_mask else 8,
        num_experts=num_experts,
        is_mask=is_mask,
        num_rows=num_tokens * 8,
        align_size=1,
    )
    num_blocks = launches[0].grid[0]
    block_t = launches[0].constexprs["BLOCK_T"]
    assert num_blocks <= _MAX_BLOCKS and num_blocks * block_t >= num_tokens
    # Each block reads every block's counts once: that prefix work never exceeds its own token work.
    assert num_blocks <= 2 * block_t
    assert buffers["block_counts"].shape == (num_blocks, num_experts)


@pytest.mark.parametrize("padded", [None, 16])
def test_empty_inputs_launch_nothing_and_zero_their_outputs(padded):
    plan = kernels.dispatch_plan(
        num_tokens=0,
        hidden=8,
        num_slots=4,
        num_experts=4,
        is_mask=True,
        num_out_tokens=10,
        align_size=padded,
        element_bytes=2,
        has_probs=True,
        scale_cols=None,
    )
    assert plan.launches == ()
    for name in ("output", "permuted_probs", "tokens_per_expert", "pad_offsets"):
        assert plan.buffers[name].zero


def test_heuristic_defaults_lie_in_the_search_spaces():
    with pytest.raises(ValueError, match="outside the search space"):
        kernels.SEARCH_SPACES["combine"].default(block_h=3, num_warps=4)
    for space in kernels.SEARCH_SPACES.values():
        assert space.configs(), space.kernel
