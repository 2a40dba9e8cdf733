"""The plan executor (moetriton.torch._launch). Its fast launches: on CUDA, after a specialization's first
call, each launch goes through a function generated for it; here, on any machine, that function is checked
against the JIT-style launch of the same specialization: the same launcher call, with every tensor argument
replaced by its device address and scratch buffers by their workspace addresses. And a multi-launch plan
whose scratch buffers take an input's dtype (the grouped GEMM's weight gradient with its gathers)."""

from __future__ import annotations

import torch

from moetriton import kernels
from moetriton.torch import _launch

from ._helpers import DEVICE


class _RecordingKernel:
    """Stands in for a compiled Triton kernel: `run` records the launcher call it receives."""

    function = object()
    packed_metadata = object()

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, *args) -> None:
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return None


def _address(value):
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def test_fast_launch_passes_what_the_jit_style_launch_passes():
    num_tokens, hidden, num_experts, topk = 6, 32, 4, 2
    plan = kernels.dispatch_plan(
        num_tokens=num_tokens,
        hidden=hidden,
        num_slots=num_experts,
        num_experts=num_experts,
        is_mask=True,
        num_out_tokens=num_tokens * topk,
        element_bytes=2,
        has_probs=False,  # an absent input: passed as the dummy's address
        scale_cols=None,
        align_size=8,
    )
    executable = _launch.Executable(plan, torch.device("cpu"))
    inputs = {
        # A row-sliced view: read through its row stride (64), not copied.
        "inp": torch.zeros(num_tokens, 2 * hidden, dtype=torch.bfloat16)[:, :hidden],
        "routing": torch.ones(num_tokens, num_experts, dtype=torch.bool),
        "probs": None,
        "scales": None,
    }
    env = dict(inputs)
    for name, shape, dtype, like, _, _ in executable.allocations:
        env[name] = torch.empty(shape, dtype=dtype or inputs[like].dtype)
    workspace = torch.empty(executable.workspace_bytes, dtype=torch.uint8)
    addresses = dict(env)
    for (name, dtype), part, (_, offset) in zip(
        executable.scratch,
        workspace.split_with_sizes(executable.scratch_bytes),
        executable.scratch_offsets,
        strict=True,
    ):
        env[name] = part.view(dtype)
        addresses[name] = workspace.data_ptr() + offset
        assert env[name].data_ptr() == addresses[name]
    assert executable.scratch, "the dispatch plan has scratch buffers: the case this test is about"
    dummy = torch.empty(0, dtype=torch.int32)
    key = ("specialization",)
    stream = 1234
    for launcher in executable.launchers:
        kernel = _RecordingKernel()
        constexpr_values = [f"constexpr-{name}" for name in launcher.constexpr_names]
        launcher.runners[key] = (kernel, constexpr_values)
        launcher(env, dummy, key, stream)
        fast = launcher._fast_launch(kernel, constexpr_values, env, dummy)
        fast(addresses, stream)
        jit_style, generated = kernel.calls
        # Grid, stream, kernel function and metadata, launch metadata, enter and exit hooks, then arguments.
        assert generated[:9] == jit_style[:9]
        assert list(generated[9:]) == [_address(value) for value in jit_style[9:]]
        assert all(not isinstance(value, torch.Tensor) for value in generated)
    strides = [arg for arg in executable.launchers[-1].template if arg[0] == 1]
    assert strides, "the permute launch reads the tokens through their row stride"


def test_weight_gradient_plan_gathers_its_permuted_operands_through_this_executor():
    """grouped_matmul_wgrad_plan with gather_lhs / gather_grad (run so by benchmarks.grouped_gemm): its
    row-gather launches write scratch buffers of the operands' dtype that the weight-gradient launch reads.
    out[g] = lhs[lhs_rows][rows of g]^T @ grad[out_rows][rows of g] in fp32, entries clipped into [0, M)."""
    generator = torch.Generator().manual_seed(0)
    num_rows, depth, num_cols, sizes = 40, 24, 16, [15, 0, 25]
    lhs = torch.randn(num_rows, depth, generator=generator).to(DEVICE)
    grad = torch.randn(num_rows, num_cols, generator=generator).to(DEVICE)
    lhs_rows = torch.randperm(num_rows, generator=generator).int()
    out_rows = torch.randperm(num_rows, generator=generator).int()
    lhs_rows[3] = 1000  # clipped: reads row M - 1
    group_sizes = torch.tensor(sizes, dtype=torch.int32)
    plan = kernels.grouped_matmul_wgrad_plan(
        num_rows=num_rows,
        depth=depth,
        num_cols=num_cols,
        num_groups=len(sizes),
        element_bytes=4,
        gather_lhs=True,
        gather_grad=True,
    )
    inputs = dict(lhs=lhs, grad=grad, group_sizes=group_sizes.to(DEVICE))
    inputs.update(lhs_rows=lhs_rows.to(DEVICE), out_rows=out_rows.to(DEVICE))
    (out,) = _launch.run_plan(plan, inputs, DEVICE)
    gathered_lhs = lhs.cpu().double()[lhs_rows.clamp(max=num_rows - 1).long()]
    gathered_grad = grad.cpu().double()[out_rows.long()]
    starts = [0, 15, 15]
    expected = torch.stack(
        [gathered_lhs[s : s + n].T @ gathered_grad[s : s + n] for s, n in zip(starts, sizes, strict=True)]
    )
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
