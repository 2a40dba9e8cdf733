"""The plan executor's fast launches (moetriton.torch._launch): on CUDA, after a specialization's first call,
each launch goes through a function generated for it. Here, on any machine, that function is checked
against the JIT-style launch of the same specialization: the same launcher call, with every tensor argument
replaced by its device address and scratch buffers by their workspace addresses."""

from __future__ import annotations

import torch

from moetriton import kernels
from moetriton.torch import _launch


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
