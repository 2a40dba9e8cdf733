"""The peer exchange's copies (moetriton.kernels.peer_copy) run from their plans with every "peer" a
buffer of this process (the kernels see only device addresses, so a table of local buffers stands in for the
peers' mapped memory): pulled rows, probs and the scaled rows with their dot products equal an indexing
reference; pushed rows land at their source rows and nothing else is written. The multi-GPU exchange itself
runs in tests/torch/test_moe.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import ep_layout, peer_chunks
from moetriton.torch.executor import run_plan
from tests.torch._helpers import DEVICE


def _case(ep: int, local: int, hidden: int, dtype: torch.dtype, seed: int):
    """(layout, chunks, sources [EP] of [S, H] with probs [S], expected rows: the (source, row) of every
    receiving row). Every source buffer has S rows (the symmetric staging allocation), a tail nobody
    reads included."""
    generator = torch.Generator().manual_seed(seed)
    layout = ep_layout(num_tokens=8, num_experts=ep * local, topk=2, ep_size=ep)
    counts = torch.randint(0, 4, (ep, ep * local), generator=generator)
    counts[0, 0] = 0  # an empty chunk
    rank = seed % ep
    chunks = peer_chunks(counts.numpy(), rank, layout)
    sources = []
    rows = int(counts.sum(1).max()) + 3
    for _ in range(ep):
        sources.append(
            (
                torch.randn(rows, hidden, generator=generator).to(dtype).to(DEVICE),
                torch.rand(rows, generator=generator).to(DEVICE),
            )
        )
    mapping = [
        (chunk % ep, row)
        for chunk, (size, start) in enumerate(
            zip(chunks["chunk_sizes"], chunks["source_offsets"], strict=True)
        )
        for row in range(start, start + size)
    ]
    device_chunks = {name: torch.as_tensor(value).to(DEVICE) for name, value in chunks.items()}
    return layout, device_chunks, sources, mapping


def _table(tensors) -> torch.Tensor:
    return torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.int64, device=DEVICE)


def _exchange_sizes(num_rows: int, ep: int, local: int, sources, dtype: torch.dtype) -> dict:
    """The sizes a pull or push plan takes: `num_rows` receiving rows in EP * L chunks from the EP sources
    of `_case` (rows [S, H] of `dtype`)."""
    source_rows, hidden = sources[0][0].shape
    return dict(
        num_rows=num_rows,
        num_chunks=ep * local,
        num_sources=ep,
        source_rows=source_rows,
        hidden=hidden,
        element_bytes=dtype.itemsize,
    )


def _name(dtype: torch.dtype) -> str:
    """The plans' name of a torch dtype: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


CASES = [(2, 3, 40), (3, 1, 64), (2, 2, 200)]


@pytest.mark.parametrize(("ep", "local", "hidden"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_pull_gathers_every_row_and_prob_from_its_source(ep, local, hidden, dtype):
    _, chunks, sources, mapping = _case(ep, local, hidden, dtype, seed=hidden + ep)
    plan = kernels.pull_rows_plan(
        **_exchange_sizes(len(mapping), ep, local, sources, dtype), dtype=_name(dtype), probs_dtype="float32"
    )
    inputs = dict(
        peer_rows=_table([rows for rows, _ in sources]),
        peer_probs=_table([probs for _, probs in sources]),
        **chunks,
    )
    out, out_probs = run_plan(plan, inputs, torch.device(DEVICE))
    assert out.shape == (len(mapping), hidden) and out.dtype == dtype
    for i, (p, row) in enumerate(mapping):
        assert torch.equal(out[i].cpu(), sources[p][0][row].cpu())
        assert out_probs[i].item() == sources[p][1][row].item()


@pytest.mark.parametrize(("ep", "local", "hidden"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_pull_with_scale_dot_gives_scaled_rows_and_fp32_dot_products(ep, local, hidden, dtype):
    """The weighted combine's backward: out[i] = w[i] * g (rounded once) and dots[i] = <g, saved[i]> over
    the whole row in fp32."""
    _, chunks, sources, mapping = _case(ep, local, hidden, dtype, seed=7 * hidden + ep)
    num_rows = len(mapping)
    generator = torch.Generator().manual_seed(1)
    saved = torch.randn(num_rows, hidden, generator=generator).to(dtype).to(DEVICE)
    weights = torch.rand(num_rows, generator=generator).to(DEVICE)
    plan = kernels.pull_rows_plan(
        **_exchange_sizes(num_rows, ep, local, sources, dtype), dtype=_name(dtype), scale_dot=True
    )
    inputs = dict(peer_rows=_table([rows for rows, _ in sources]), saved=saved, weights=weights, **chunks)
    out, dots = run_plan(plan, inputs, torch.device(DEVICE))
    grads = torch.stack([sources[p][0][row] for p, row in mapping]).float().cpu()
    expected = (grads * weights.cpu()[:, None]).to(dtype)
    # One rounding of the fp32 product; the interpreter's bf16 rounding may differ from the GPU's by an ulp.
    ulp = 2**-7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.cpu(), expected, rtol=ulp, atol=0)
    torch.testing.assert_close(dots.cpu(), (grads * saved.float().cpu()).sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("ep", "local", "hidden"), CASES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_push_lands_rows_at_their_source_rows_and_writes_nothing_else(ep, local, hidden, with_probs):
    dtype = torch.bfloat16
    _, chunks, sources, mapping = _case(ep, local, hidden, dtype, seed=3 * hidden + ep)
    num_rows = len(mapping)
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(num_rows, hidden, generator=generator).to(dtype).to(DEVICE)
    probs = torch.rand(num_rows, generator=generator).to(DEVICE)
    targets = [
        (torch.full_like(buffer, float("nan")), torch.full_like(buffer_probs, float("nan")))
        for buffer, buffer_probs in sources
    ]
    plan = kernels.push_rows_plan(
        **_exchange_sizes(num_rows, ep, local, sources, dtype), has_probs=with_probs
    )
    inputs = dict(
        rows=rows,
        probs=probs if with_probs else None,
        peer_rows=_table([buffer for buffer, _ in targets]),
        peer_probs=_table([buffer_probs for _, buffer_probs in targets]) if with_probs else None,
        **chunks,
    )
    assert run_plan(plan, inputs, torch.device(DEVICE)) == ()
    written = [np.zeros(buffer.shape[0], dtype=bool) for buffer, _ in targets]
    for i, (p, row) in enumerate(mapping):
        assert torch.equal(targets[p][0][row].cpu(), rows[i].cpu())
        if with_probs:
            assert targets[p][1][row].item() == probs[i].item()
        written[p][row] = True
    for p, (buffer, buffer_probs) in enumerate(targets):
        assert torch.isnan(buffer[torch.as_tensor(~written[p])].float()).all()
        assert torch.isnan(buffer_probs[torch.as_tensor(~written[p])]).all()


def test_plans_reject_a_table_that_is_not_ep_times_l_chunks():
    with pytest.raises(ValueError, match="chunks"):
        kernels.pull_rows_plan(
            num_rows=4, num_chunks=3, num_sources=2, source_rows=4, hidden=8, dtype="float32", element_bytes=4
        )
    with pytest.raises(ValueError, match="exclusive"):
        kernels.pull_rows_plan(
            num_rows=4,
            num_chunks=2,
            num_sources=2,
            source_rows=4,
            hidden=8,
            dtype="float32",
            element_bytes=4,
            probs_dtype="float32",
            scale_dot=True,
        )
