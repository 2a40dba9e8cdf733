"""The plan executor (moetriton.torch.executor): the fast path the ops call equals the plain executor on
every plan family. Its fast launches: on CUDA, after a specialization's first call, each launch goes
through a function generated for it; here, on any machine, that function is checked against the JIT-style
launch of the same specialization: the same launcher call, with every tensor argument replaced by its
device address and scratch buffers by their workspace addresses. And a multi-launch plan whose scratch
buffers take an input's dtype (the grouped GEMM's weight gradient with its gathers)."""

from __future__ import annotations

import pytest
import torch

from moetriton import kernels
from moetriton.torch import chunk_sort, executor, permutation
from tests._plans import dispatch_plan_with_defaults

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


def _dispatch_plan(align_size: int | None) -> kernels.Plan:
    """Dispatch of 6 bf16 tokens of 32 columns by a [6, 4] mask into 12 rows, without probs (an absent
    input: passed as the dummy's address) or scales."""
    return dispatch_plan_with_defaults(
        num_tokens=6, hidden=32, num_experts=4, num_out_tokens=12, align_size=align_size
    )


def test_fast_launch_passes_what_the_jit_style_launch_passes():
    num_tokens, hidden, num_experts = 6, 32, 4
    plan = _dispatch_plan(align_size=8)
    executable = executor.Executable(plan, torch.device("cpu"))
    inputs = {
        # A row-sliced view: read through its row stride (64), not copied.
        "inp": torch.zeros(num_tokens, 2 * hidden, dtype=torch.bfloat16)[:, :hidden],
        "routing": torch.ones(num_tokens, num_experts, dtype=torch.bool),
        "probs": None,
        "scales": None,
    }
    env = dict(inputs)
    for name, shape, dtype, like, _, _, placeholder in executable.allocations:
        # Placeholders (the absent probs and scales) reach kernels as the dummy, like absent inputs.
        env[name] = None if placeholder else torch.empty(shape, dtype=dtype or inputs[like].dtype)
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
        # Grid, stream, kernel function and metadata, then launch metadata and the enter and exit hooks
        # (none for fast launches, which run only while no hook is registered), then the arguments.
        assert generated[:6] == jit_style[:6]
        assert generated[6:9] == (None, None, None)
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
    (out,) = executor.run_plan(plan, inputs, DEVICE)
    gathered_lhs = lhs.cpu().double()[lhs_rows.clamp(max=num_rows - 1).long()]
    gathered_grad = grad.cpu().double()[out_rows.long()]
    starts = [0, 15, 15]
    expected = torch.stack(
        [gathered_lhs[s : s + n].T @ gathered_grad[s : s + n] for s, n in zip(starts, sizes, strict=True)]
    )
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def _dispatch_inputs(num_tokens: int = 6, hidden: int = 32, num_experts: int = 4):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16).to(DEVICE)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(2, dim=1).indices, True)
    return tokens, mask.to(DEVICE)


def test_placeholder_results_are_none_directly_and_size0_tensors_from_the_custom_ops():
    """Results a plan marks as placeholders (probs and scales an op was not given, the backward chunk
    sort's map) are never allocated on the direct eager path; the custom ops return them as the size-0
    tensors their fakes promise (opcheck compares fake and real results), and every real result is equal
    either way."""
    tokens, mask = _dispatch_inputs()
    dispatch_args = (tokens, mask, None, None, 4, True, 12, None, None)
    direct = permutation.DISPATCH(*dispatch_args)
    custom = torch.ops.moetriton.dispatch(*dispatch_args)
    assert direct[1] is None and direct[2] is None and direct[4] is None  # probs, scales, pad offsets
    assert [(tuple(t.shape), t.dtype) for t in custom[1:3]] == [((0,), torch.float32)] * 2
    for mine, theirs in zip(direct, custom, strict=True):
        if mine is not None:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.moetriton.dispatch, dispatch_args)
    rows = direct[0]
    sizes = torch.tensor([5, 0, 7], dtype=torch.int32, device=DEVICE)
    order = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    for backward in (False, True):
        sort_args = (rows, sizes, order, None, backward)
        _, row_map, probs = chunk_sort.SORT_CHUNKS(*sort_args)
        assert probs is None and (row_map is None) == backward
        torch.library.opcheck(torch.ops.moetriton.sort_chunks, sort_args)
    grad_args = (rows, None, direct[3])
    assert permutation.DISPATCH_BACKWARD(*grad_args)[1] is None
    torch.library.opcheck(torch.ops.moetriton.dispatch_backward, grad_args)


class _RecordingLaunch:
    """Stands in for a fast launch: records the environment it is called with."""

    def __init__(self) -> None:
        self.environments: list[dict] = []

    def __call__(self, env: dict, stream: int) -> None:
        self.environments.append(dict(env))


def test_generated_run_takes_fast_launches_with_scratch_addresses_in_one_workspace(monkeypatch):
    """The per-call path once a specialization has fast launches (CUDA only in real use; here the fast
    launches are recorders): inputs arranged by the layout rule, results allocated, placeholders None
    (the absent probs and scales, and the pad offsets of an unpadded dispatch, which go to scratch),
    every scratch buffer an address at its 128-byte-aligned offset inside one workspace allocation, and a
    new specialization (an input 16-byte misaligned) falling back to the first-call path."""
    tokens, mask = _dispatch_inputs()
    executable = executor.Executable(_dispatch_plan(align_size=None), torch.device(DEVICE))
    keys = []

    def first(env, key, results):
        keys.append(key)
        return results

    monkeypatch.setattr(executable, "_launch_first", first)
    monkeypatch.setattr(executable, "_launch_on_device", lambda launches, env: [f(env, 0) for f in launches])
    transposed = mask.T.contiguous().T  # column-major: made contiguous before the kernels see it
    inputs = dict(inp=tokens, routing=transposed, probs=None, scales=None)
    assert executable(inputs)[1] is None and len(keys) == 1
    recorders = [_RecordingLaunch() for _ in executable.launchers]
    executable.fast[keys[0]] = recorders
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    executable.run = executable._generate_run()  # picks up the patched allocator
    output, probs, scales, row_map, pad_offsets, counts = executable(inputs)
    assert len(keys) == 1, "the known specialization took the fast launches"
    assert probs is None and scales is None and pad_offsets is None, "unpadded: no pad offsets"
    assert [tuple(t.shape) for t in (output, row_map, counts)] == [(12, 32), (6, 10), (4,)]
    assert len(allocated) == 4, "three results plus one workspace: no placeholders"
    (env,) = recorders[0].environments
    assert env["routing"].is_contiguous() and torch.equal(env["routing"], mask)
    assert env["inp"] is tokens, "row-major tokens are passed as they are"
    offsets = [env[name] - env[executable.scratch[0][0]] for name, _ in executable.scratch]
    assert offsets == [offset for _, offset in executable.scratch_offsets]
    assert all(offset % 128 == 0 for offset in offsets)
    assert all(recorder.environments == [env] for recorder in recorders)
    misaligned = torch.empty(6 * 32 + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(6, 32)
    executable(dict(inputs, inp=misaligned))
    assert len(keys) == 2 and keys[1] != keys[0]


def test_into_writes_given_results_in_place_and_rejects_what_it_cannot_fill():
    """Executable.into: a result named in the inputs is written there (the same values as a fresh one),
    the others are allocated; a result of the wrong shape or dtype, or one that must start zeroed, is an
    error before anything launches."""
    tokens = torch.randn(5, 16, device=DEVICE)
    indices = torch.tensor([[0, 2], [1, -1], [2, 0], [3, 1], [0, 3]], dtype=torch.int32, device=DEVICE)
    sizes = dict(
        num_tokens=5,
        hidden=16,
        num_slots=2,
        num_experts=4,
        is_mask=False,
        num_out_tokens=10,
        element_bytes=4,
        has_probs=False,
        scale_cols=None,
        align_size=4,
    )
    executable = executor.bound(kernels.dispatch_plan, torch.device(DEVICE), **sizes)
    inputs = dict(inp=tokens, routing=indices, probs=None, scales=None)
    fresh = executable(inputs)
    given = torch.full_like(fresh[0], float("nan"))
    into = executable.into({**inputs, "output": given})
    assert into[0] is given and torch.equal(given, fresh[0])
    for name in ("row_id_map", "tokens_per_expert"):
        index = executable.plan.results.index(name)
        assert torch.equal(into[index], fresh[index])
    with pytest.raises(ValueError, match="output: expected"):
        executable.into({**inputs, "output": given[:-1]})
    with pytest.raises(ValueError, match="output: expected"):
        executable.into({**inputs, "output": given.double()})
    scatter = executor.bound(
        kernels.scatter_plan,
        torch.device(DEVICE),
        num_tokens=5,
        hidden=16,
        num_slots=2,
        num_rows=fresh[0].shape[0],
        padded=True,
        element_bytes=4,
    )
    with pytest.raises(ValueError, match="starts zeroed"):
        scatter.into(dict(grad=tokens, row_id_map=fresh[3], grad_input=given))


def _plan_cases():
    """(family, plan, inputs) for every plan family at small sizes: what the equality test below runs."""
    generator = torch.Generator().manual_seed(11)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    tokens, hidden, experts, topk = 6, 40, 4, 2
    ids = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, -1], [0, 3]], dtype=torch.int32, device=DEVICE)
    probs = rand(tokens, topk)
    yield (
        "dispatch",
        _dispatch_plan(align_size=8),
        dict(
            inp=rand(tokens, 32, dtype=torch.bfloat16),
            routing=(torch.rand(tokens, 4, generator=generator) > 0.5).to(DEVICE),
            probs=None,
            scales=None,
        ),
    )
    dispatch = kernels.dispatch_plan(
        num_tokens=tokens, hidden=hidden, num_slots=topk, num_experts=experts, is_mask=False,
        num_out_tokens=12, element_bytes=4, has_probs=True, scale_cols=None,
    )  # fmt: skip
    x = rand(tokens, hidden)
    rows, _, _, row_map, _, _ = executor.run_plan(
        dispatch, dict(inp=x, routing=ids, probs=probs, scales=None), DEVICE
    )
    yield "dispatch ids", dispatch, dict(inp=x, routing=ids, probs=probs, scales=None)
    for weighted, gather in ((True, False), (False, True)):
        plan = kernels.combine_plan(
            num_tokens=tokens, hidden=hidden, num_slots=topk, num_rows=12, element_bytes=4,
            has_weights=weighted, gather_probs=gather,
        )  # fmt: skip
        inputs = dict(
            inp=rows, row_id_map=row_map, weights=probs if weighted else None,
            permuted_probs=rand(12) if gather else None,
        )  # fmt: skip
        yield "combine", plan, inputs
    for padded in (False, True):
        sizes = dict(num_tokens=tokens, hidden=hidden, num_slots=topk, num_rows=12, padded=padded)
        yield "scatter", kernels.scatter_plan(**sizes, element_bytes=4), dict(grad=x, row_id_map=row_map)
        yield (
            "combine backward",
            kernels.combine_backward_plan(**sizes, element_bytes=4),
            dict(grad=x, row_id_map=row_map, inp=rows, weights=probs),
        )
    for backward in (False, True):
        plan = kernels.sort_chunks_plan(
            num_rows=12, hidden=hidden, num_splits=3, element_bytes=4, has_probs=True, backward=backward
        )
        order = torch.tensor([2, 0, 1], device=DEVICE)
        yield (
            "sort chunks",
            plan,
            dict(
                inp=rows,
                split_sizes=torch.tensor([3, 5, 2], device=DEVICE),
                sorted_indices=order,
                probs=rand(12),
            ),
        )
    group_sizes = torch.tensor([5, 0, 7], dtype=torch.int32, device=DEVICE)
    gemm = dict(num_rows=12, depth=16, num_cols=24, num_groups=3, element_bytes=4)
    yield (
        "grouped matmul",
        kernels.grouped_matmul_plan(**gemm),
        dict(lhs=rand(12, 16), rhs=rand(3, 16, 24), group_sizes=group_sizes, lhs_rows=None, out_rows=None),
    )
    permutation = torch.randperm(12, generator=generator).to(DEVICE, torch.int32)
    yield (
        "grouped matmul wgrad",
        kernels.grouped_matmul_wgrad_plan(**gemm, gather_lhs=True),
        dict(
            lhs=rand(12, 16), grad=rand(12, 24), group_sizes=group_sizes, lhs_rows=permutation, out_rows=None
        ),
    )
    activation = dict(activation="swiglu", num_rows=12, width=16, num_groups=3, element_bytes=4)
    yield (
        "activation",
        kernels.activation_plan(**activation),
        dict(hidden=rand(12, 16), group_sizes=group_sizes),
    )
    yield (
        "activation backward",
        kernels.activation_backward_plan(**activation),
        dict(hidden=rand(12, 16), grad=rand(12, 8), group_sizes=group_sizes),
    )
    blocks = dict(num_blocks=2, rows=3, out_rows=5, width=8, element_bytes=4)
    block_sizes = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)
    yield (
        "place blocks",
        kernels.place_blocks_plan(**blocks),
        dict(blocks=rand(6, 8), sizes=block_sizes, dest_rows=None, offsets=None),
    )
    yield (
        "take blocks",
        kernels.take_blocks_plan(**blocks),
        dict(layout=rand(10, 8), sizes=block_sizes, dest_rows=None, offsets=None),
    )
    logits = rand(tokens, 8)
    topk_plan = kernels.topk_plan(
        num_tokens=tokens, num_experts=8, topk=2, score_function="softmax", use_pre_softmax=False,
        num_groups=0, group_topk=0, scaling_factor=1.0, has_bias=False, return_indices=True,
    )  # fmt: skip
    yield "router top-k", topk_plan, dict(logits=logits, bias=None)
    scores = kernels.aux_scores_plan(num_tokens=tokens, num_experts=8, topk=2, score_function="sigmoid")
    yield "router aux scores", scores, dict(logits=logits)
    loss = kernels.aux_loss_plan(num_rows=tokens, num_cols=8, num_experts=8, topk=2, coeff=0.5, total=6)
    counts = torch.arange(8, dtype=torch.int32, device=DEVICE)
    yield "router aux loss", loss, dict(probs=logits.softmax(-1), counts=counts, total=None)


@pytest.mark.parametrize("index", range(len(list(_plan_cases()))))
def test_fast_path_equals_the_plain_executor_on_every_plan_family(index):
    """`Executable` (the ops' fast path: generated per-call code, one workspace, compiled launchers) and
    `run_plan` (the plain loop) give the same results, bit for bit, on every plan family."""
    family, plan, inputs = list(_plan_cases())[index]
    plain = executor.run_plan(plan, inputs, DEVICE)
    fast = executor.Executable(plan, DEVICE)(inputs)
    fast_again = executor.Executable(plan, DEVICE)(inputs)  # a second call: the fast launches, on GPUs
    assert len(plain) == len(fast) == len(fast_again) == len(plan.results), family
    for name, mine, theirs, again in zip(plan.results, plain, fast, fast_again, strict=True):
        if mine is None:
            assert theirs is None and again is None, (family, name)
            continue
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (family, name)
        rows = _written(family)
        assert torch.equal(mine[rows], theirs[rows]) and torch.equal(mine[rows], again[rows]), (family, name)


def _written(family: str):
    """The rows of a result the plan writes: all, but for the block copies (sizes [2, 3] of 3-row blocks,
    placed in 5-row ones: the other rows are unspecified)."""
    return {"place blocks": [0, 1, 5, 6, 7], "take blocks": [0, 1, 3, 4, 5]}.get(family, ...)
