"""torch.compile(fullgraph=True) traces through the ops; CUDA graphs capture them (GPU only)."""

import pytest
import torch

import moetriton.torch as mt
from tests.torch._helpers import DEVICE

T, H, E, K = 6, 8, 4, 2


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=generator).to(DEVICE)
    ids = torch.rand(T, E, generator=generator).topk(K, dim=1).indices.to(DEVICE)
    mask = torch.zeros(T, E, dtype=torch.bool, device=DEVICE).scatter_(1, ids, True)
    probs = torch.rand(T, E, generator=generator).to(DEVICE)
    weight = torch.randn(H, H, generator=generator).to(DEVICE)
    return x, mask, probs, weight


def _moe(x, mask, probs, weight):
    out, permuted_probs, row_id_map, pad_offsets, counts = mt.token_dispatch(
        x, mask, T * K, probs, align_size=4
    )
    reverse = torch.arange(E - 1, -1, -1, device=x.device)
    shuffled, _ = mt.sort_chunks_by_index(out, counts, reverse)  # e.g. towards other ranks' layout
    restored, _ = mt.sort_chunks_by_index(shuffled @ weight, counts.flip(0), reverse)
    return mt.token_combine(restored * permuted_probs[:, None], row_id_map, probs, pad_offsets)


def test_compile_fullgraph_matches_eager_forward_and_backward():
    x, mask, probs, weight = _inputs()
    results = []
    for fn in (_moe, torch.compile(_moe, fullgraph=True)):
        xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = fn(xg, mask, pg, weight)
        y.square().sum().backward()
        results.append((y.detach(), xg.grad, pg.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_compile_with_a_data_dependent_expert_count(monkeypatch):
    """TE's index map with no expert count (max_token_num=-1): E = max id + 1 is a data-dependent size in
    the trace, which validation must not guard on (TE's own compile tests call it this way)."""
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    x, _, probs, _ = _inputs()
    ids = probs.topk(K, dim=1).indices.int()
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def permute_unpermute(x, ids, weights):
        out, row_id_map = mt.moe_permute(x, ids, num_out_tokens=-1, max_token_num=-1, map_type="index")
        return mt.moe_unpermute(out.square(), row_id_map, weights, map_type="index")

    results = []
    for fn in (permute_unpermute, torch.compile(permute_unpermute, fullgraph=True)):
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = fn(xg, ids, wg)
        y.sum().backward()
        results.append((y.detach(), xg.grad, wg.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_replays_the_whole_step():
    x, mask, probs, weight = _inputs()
    static = [t.clone() for t in (x, mask, probs)]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _moe(*static, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _moe(*static, weight)
    for seed in (1, 2):
        fresh = _inputs(seed)
        for target, source in zip(static, fresh[:3], strict=True):
            target.copy_(source)
        graph.replay()
        torch.testing.assert_close(y, _moe(*fresh[:3], weight), rtol=0, atol=0)
