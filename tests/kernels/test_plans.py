"""Launch plans: sizes, the linear-work bound of map building, and empty inputs (plans are pure Python;
the empty-input test also runs its plan)."""

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moetriton import kernels
from moetriton.kernels.runtime.plan import RowStride, launch_arguments, tuned_per_device
from moetriton.torch.executor import run_plan
from tests._plans import dispatch_plan_with_defaults
from tests.torch._helpers import DEVICE


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
    plan = dispatch_plan_with_defaults(
        num_tokens=num_tokens,
        hidden=64,
        num_slots=num_experts if is_mask else 8,
        num_experts=num_experts,
        is_mask=is_mask,
        num_out_tokens=num_tokens * 8,
    )
    count, scan, dispatch = plan.launches
    num_blocks, block_t = count.grid[0], count.constexprs["BLOCK_T"]
    assert (num_blocks - 1) * block_t < num_tokens <= num_blocks * block_t
    # Counting and ranking read each routing slot once; the scan reads each of the B * E <= T * E block
    # counts once (one program per expert tile); each dispatch program reads its token's ranks and one
    # row of offsets.
    assert plan.buffers["block_offsets"].shape == (num_blocks, num_experts)
    assert (
        scan.grid[0] * scan.constexprs["TILE_E"]
        >= num_experts
        > (scan.grid[0] - 1) * scan.constexprs["TILE_E"]
    )
    assert dispatch.constexprs["BLOCK_T"] == block_t <= 128  # mask ranks are bytes


@pytest.mark.parametrize("layout", [dict(align_size=None), dict(align_size=16), dict(capacity=3)])
def test_empty_inputs_launch_only_the_scan_and_the_fill_programs(layout):
    """With T = 0 no token program runs, yet the fill programs still write every output: zero rows, and the
    per-expert counts of the layout (C each with a capacity), so nothing needs a zeroed buffer."""
    num_out_tokens = None if "capacity" in layout else 10
    plan = dispatch_plan_with_defaults(
        num_tokens=0, hidden=8, num_experts=4, num_out_tokens=num_out_tokens, has_probs=True, **layout
    )
    assert [launch.kernel.fn.__name__ for launch in plan.launches] == [
        "_scan_counts_kernel",
        "_dispatch_kernel",
    ]
    assert not any(buffer.zero for buffer in plan.buffers.values())
    inputs = dict(
        inp=torch.empty(0, 8, dtype=torch.bfloat16, device=DEVICE),
        routing=torch.empty(0, 4, dtype=torch.bool, device=DEVICE),
        probs=torch.empty(0, 4, device=DEVICE),
        scales=None,
    )
    output, permuted_probs, _, _, _, counts = run_plan(plan, inputs, DEVICE)
    assert not output.any() and not permuted_probs.any()
    assert counts.tolist() == [layout.get("capacity", 0)] * 4


def test_heuristic_defaults_lie_in_the_search_spaces():
    with pytest.raises(ValueError, match="outside the search space"):
        kernels.SEARCH_SPACES["combine"].default(block_h=3, num_warps=4)
    for space in kernels.SEARCH_SPACES.values():
        assert space.configs(), space.kernel


def test_a_plan_may_return_part_of_its_buffers():
    """The autotune script runs a dispatch plan for its row map alone: buffers it does not return, those whose
    dtype follows an input's ("like:inp") included, are still allocated, and the map equals the full run's."""
    plan = dispatch_plan_with_defaults(
        num_tokens=6, hidden=8, num_experts=4, num_out_tokens=12, has_probs=True
    )
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        inp=torch.randn(6, 8, generator=generator).to(dtype=torch.bfloat16, device=DEVICE),
        routing=(torch.rand(6, 4, generator=generator) < 0.5).to(DEVICE),
        probs=torch.rand(6, 4, generator=generator).to(DEVICE),
        scales=None,
    )
    full = dict(zip(plan.results, run_plan(plan, inputs, DEVICE), strict=True))
    map_only = kernels.Plan(plan.buffers, plan.launches, ("row_id_map",))
    (row_id_map,) = run_plan(map_only, inputs, DEVICE)
    assert torch.equal(row_id_map, full["row_id_map"])


def _declared_builders():
    builders = [getattr(kernels, name) for name in kernels.__all__ if name.endswith("_plan")]
    return [builder for builder in builders if hasattr(builder, "sizes")]


@pytest.mark.parametrize("builder", _declared_builders(), ids=lambda builder: builder.__name__)
def test_size_declarations_name_the_builders_arguments(builder):
    parameters = inspect.signature(builder).parameters
    declared = builder.sizes
    names = [*declared.axes, *declared.present, *declared.dtypes]
    names += ["element_bytes"] * (declared.element_bytes is not None)
    assert set(names) <= set(parameters), builder.__name__


def test_every_plan_the_bindings_build_declares_its_sizes():
    builders = {getattr(kernels, name) for name in kernels.__all__ if name.endswith("_plan")}
    # The exchange and expert-count plans are built by the MoE layer from its own layout, not from arrays.
    by_layout = {"place_blocks_plan", "take_blocks_plan", "pull_rows_plan", "push_rows_plan"}
    by_layout.add("expert_count_plan")
    undeclared = {builder.__name__ for builder in builders if not hasattr(builder, "sizes")} - by_layout
    assert not undeclared


class _Array:
    def __init__(self, shape, itemsize, name):
        self.shape, self.dtype = shape, type("dtype", (), {"itemsize": itemsize, "name": name})()


def test_sizes_read_axes_presence_element_bytes_and_dtypes():
    sizes = kernels.Sizes(
        axes=dict(rows=("x", 0), slots=("row_map", 1, kernels.row_map_slots), cols=("absent", 1)),
        present=dict(has_x="x", has_absent="absent"),
        element_bytes="x",
        dtypes=dict(x_dtype="x", absent_dtype="absent"),
    )
    arrays = dict(x=_Array((5, 3), 2, "bfloat16"), row_map=_Array((5, 10), 4, "int32"), absent=None)
    got = sizes.of(arrays, lambda dtype: dtype.name)
    assert got == dict(
        rows=5, slots=4, cols=None, has_x=True, has_absent=False, element_bytes=2, x_dtype="bfloat16"
    )


def test_the_executors_shared_step_reads_dtypes_and_device_tuning_one_way():
    assert kernels.Buffer((2, 3), "like:inp").like == "inp"
    assert kernels.Buffer((2, 3), "int32").like is None
    tuned = {builder.__name__ for builder in _declared_builders() if tuned_per_device(builder)}
    assert {"dispatch_plan", "combine_plan", "sort_chunks_plan", "topk_plan"} <= tuned
    assert not tuned_per_device(kernels.aux_loss_plan)


def test_the_executors_walk_a_launchs_arguments_one_way():
    launch = kernels.Launch(
        kernel=None,
        grid=(1,),
        args=("x", RowStride("x", "X_ALIGN"), "absent", 7, RowStride("y", "Y_ALIGN")),
        outputs=("out",),
    )
    env = {"x": (24, 1), "absent": None, "y": (6, 1)}
    args, strides = launch_arguments(launch, env, "dummy", row_stride=lambda shape: shape[0])
    assert args == [(24, 1), 24, "dummy", 7, 6]
    assert strides == {"X_ALIGN": 8, "Y_ALIGN": 2}
    with pytest.raises(KeyError):  # a name the environment lacks is an error, not the dummy
        launch_arguments(launch, {"x": (24, 1)}, "dummy", row_stride=lambda shape: shape[0])
