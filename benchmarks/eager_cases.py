"""Eager-mode benchmarks: what a user who calls the ops without CUDA graphs or jit-fused steps sees.

For every op, implementation and named shape (tiny included), three figures (benchmarks.timing):
host time to issue one call, eager wall time per call (200 calls back to back, one sync), and the
graph / steady-state GPU time (PyTorch: CUDA-graph replays; JAX: the CUPTI span of a jitted run queued
behind other work). Implementations: moetriton; TransformerEngine's Triton kernels through their PyTorch
wrappers (`transformer_engine.pytorch.triton.permutation`), when importable; the pure-framework
baselines (the shipped references; eager torch softmax + topk + scatter for the router).

Ops: dispatch (mask + probs -> rows + probs, map included), dispatch_bwd, dispatch_fwd_bwd, combine
(merging probs), combine_bwd, combine_fwd_bwd, chunk_sort, router_topk (softmax, forward) and router_fwd_bwd,
reported as "e:<op>" so they stand apart from the graph-mode rows of the other modules. The *_bwd rows call
the backward op alone (moetriton.torch.permutation, as autograd does) beside TE's backward kernel wrapper: the
like-for-like comparison. The *_fwd_bwd rows go through torch.autograd for moetriton (what a training step
pays, autograd engine included); for TE they come twice: "te-triton" calls its two wrappers directly (no
autograd engine: favours TE), "te-autograd" calls them from a minimal torch.autograd.Function, as TE's
moe_permute_with_probs / moe_unpermute do (a lower bound of TE as users call it). TE's dispatch is
its row-map build plus permute-with-probs; its combine backward is
unpermute_with_mask_map_bwd_with_merging_probs; its dispatch backward is an unpermute of the cotangent.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from collections.abc import Callable
from types import ModuleType

import torch

from moetriton.kernels.rules.shapes import MoEShape

from .common import Result, token_bytes
from .timing import input_sets, time_eager, time_graph, time_host_and_eager, time_jax

DTYPE = torch.bfloat16


def te_permutation():
    """TE's PyTorch wrappers of its Triton permutation kernels, or None where TE is not importable."""
    try:
        from transformer_engine.pytorch.triton import permutation
    except ImportError:
        return None
    return permutation


def _te_autograd(te, T: int, E: int, N: int, H: int):
    """TE's dispatch (mask + probs) and combine (merging probs) kernels behind torch.autograd.Functions that
    do nothing else, so that the fwd_bwd rows can charge TE the autograd engine that its users pay too."""

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mask, probs):
            row_map = te.make_row_id_map(mask, T, E)
            ctx.save_for_backward(row_map)
            return te.permute_with_mask_map(x, row_map, probs, None, None, T, E, N, H, 0)[0]

        @staticmethod
        def backward(ctx, grad):
            (row_map,) = ctx.saved_tensors
            return te.unpermute_with_mask_map(grad, row_map, None, None, None, T, E, H)[0], None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, row_map, weights):
            ctx.save_for_backward(rows, row_map, weights)
            return te.unpermute_with_mask_map(rows, row_map, weights, None, None, T, E, H)[0]

        @staticmethod
        def backward(ctx, grad):
            rows, row_map, weights = ctx.saved_tensors
            grad_rows, grad_weights = te.unpermute_with_mask_map_bwd_with_merging_probs(
                grad, row_map, rows, weights, None, T, E, N, H
            )
            return grad_rows, None, grad_weights

    return Dispatch.apply, Combine.apply


def rotating_call(sets: list, fn: Callable) -> Callable[[], object]:
    """A no-argument call that runs `fn` on the next input set each time."""
    sets_iter = itertools.cycle(sets)
    return lambda: fn(*next(sets_iter))


def mask_routing(shape: MoEShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A [T, E] mask with K random experts per token and its [T, E] probs (softmax over the K, else 0)."""
    scores = torch.rand(shape.num_tokens, shape.num_experts, device=generator.device, generator=generator)
    top, ids = scores.topk(shape.topk, dim=1)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.zeros_like(scores).scatter_(1, ids, top.softmax(-1))
    return mask, probs


def _torch_results(shape: MoEShape, quick: bool) -> list[Result]:
    import moetriton.torch as mt

    out: list[Result] = []

    def sync(_):
        torch.cuda.synchronize()

    def add(op, impl, fn, sets, nbytes, capturable=True, note=""):
        eager = time_host_and_eager(rotating_call(sets, fn), sync)
        calls = [lambda s=s: fn(*s) for s in sets]
        graph_ms = time_graph(calls) if capturable else time_eager(calls[:2])
        note = note or ("CUDA graph" if capturable else "events around eager calls (not capturable)")
        out.append(
            Result(
                f"e:{op}", "torch", impl, shape.name, graph_ms, nbytes, note, eager.host_ms, eager.eager_ms
            )
        )

    torch_eager_cases(mt, shape, add, te=te_permutation(), quick=quick)
    return out


def torch_eager_cases(
    mt: ModuleType,
    shape: MoEShape,
    add: Callable,
    te=None,
    quick: bool = False,
    device: str = "cuda",
    max_sets: int = 16,
) -> None:
    """Every PyTorch case at `shape`, handed to `add(op, impl, fn, sets, nbytes, capturable=True)`: `fn(*s)`
    is one call on the input set `s` of `sets` (at most `max_sets` of them, on `device`), `nbytes` its ideal
    bytes. `mt` is the moetriton.torch package whose ops run, an argument so that benchmarks.ab_package can
    pass either of two versions; TE's cases where `te` (te_permutation()) is given; the torch references
    unless `quick`."""
    permutation, reference = mt.permutation, mt.reference
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K
    eb = torch.finfo(DTYPE).bits // 8
    map_bytes = T * (E + 1) * 4
    generator = torch.Generator(device=device).manual_seed(0)

    def inputs(nbytes, build):
        return [build() for _ in range(input_sets(nbytes, maximum=max_sets))]

    # dispatch -------------------------------------------------------------------------------------------
    dispatch_bytes = token_bytes(T, H, eb) + T * E * 5 + token_bytes(N, H, eb) + N * 4 + map_bytes + E * 4

    def make_dispatch(requires_grad=False):
        x = torch.randn(T, H, device=device, dtype=DTYPE, generator=generator, requires_grad=requires_grad)
        mask, probs = mask_routing(shape, generator)
        grad = torch.randn(N, H, device=device, dtype=DTYPE, generator=generator)
        return x, mask, probs, grad

    sets = inputs(dispatch_bytes, make_dispatch)
    add("dispatch", "moetriton", lambda x, m, p, g: mt.token_dispatch(x, m, N, p), sets, dispatch_bytes)
    if te is not None:

        def te_dispatch(x, m, p, g):
            row_map = te.make_row_id_map(m, T, E)
            return te.permute_with_mask_map(x, row_map, p, None, None, T, E, N, H, 0), row_map

        add("dispatch", "te-triton", te_dispatch, sets, dispatch_bytes)
    if not quick:
        add(
            "dispatch",
            "torch-ref",
            lambda x, m, p, g: reference.token_dispatch(x, m, N, p),
            sets[:2],
            dispatch_bytes,
            capturable=False,
        )

    grad_sets = inputs(dispatch_bytes, lambda: make_dispatch(requires_grad=True))
    fwd_bwd_bytes = dispatch_bytes + token_bytes(N, H, eb) + map_bytes + token_bytes(T, H, eb)

    # Backward passes return the gradients (torch.autograd.grad) rather than accumulate them into .grad:
    # accumulation is an extra elementwise pass that TE's wrapper calls do not make.
    def dispatch_fwd_bwd(x, m, p, g):
        out_rows = mt.token_dispatch(x, m, N, p)[0]
        return torch.autograd.grad(out_rows, x, g)

    add("dispatch_fwd_bwd", "moetriton", dispatch_fwd_bwd, grad_sets, fwd_bwd_bytes)
    bwd_bytes = token_bytes(N, H, eb) + map_bytes + token_bytes(T, H, eb)
    maps = [
        (g, mt.token_dispatch(x.detach(), m, N)[2], te.make_row_id_map(m, T, E) if te else None)
        for x, m, _, g in grad_sets
    ]
    add(
        "dispatch_bwd",
        "moetriton",
        lambda g, r, t: permutation.DISPATCH_BACKWARD(g, None, r),
        maps,
        bwd_bytes,
    )
    if te is not None:
        add(
            "dispatch_bwd",
            "te-triton",
            lambda g, r, t: te.unpermute_with_mask_map(g, t, None, None, None, T, E, H),
            maps,
            bwd_bytes,
        )
    if te is not None:

        def te_dispatch_fwd_bwd(x, m, p, g):
            row_map = te.make_row_id_map(m, T, E)
            te.permute_with_mask_map(x.detach(), row_map, p, None, None, T, E, N, H, 0)
            return te.unpermute_with_mask_map(g, row_map, None, None, None, T, E, H)

        add("dispatch_fwd_bwd", "te-triton", te_dispatch_fwd_bwd, grad_sets, fwd_bwd_bytes)
        te_dispatch_autograd, te_combine_autograd = _te_autograd(te, T, E, N, H)
        add(
            "dispatch_fwd_bwd",
            "te-autograd",
            lambda x, m, p, g: torch.autograd.grad(te_dispatch_autograd(x, m, p), x, g),
            grad_sets,
            fwd_bwd_bytes,
        )

    # combine ----------------------------------------------------------------------------------------------
    combine_bytes = token_bytes(N, H, eb) + map_bytes + T * E * 4 + token_bytes(T, H, eb)
    combine_bwd_bytes = token_bytes(T, H, eb) + 2 * token_bytes(N, H, eb) + map_bytes + 2 * T * E * 4

    def make_combine():
        mask, probs = mask_routing(shape, generator)
        row_map = mt.token_dispatch(torch.empty(T, 0, device=device, dtype=DTYPE), mask, N)[2]
        expert_out = torch.randn(N, H, device=device, dtype=DTYPE, generator=generator, requires_grad=True)
        grad = torch.randn(T, H, device=device, dtype=DTYPE, generator=generator)
        te_map = te.make_row_id_map(mask, T, E) if te is not None else None
        return expert_out, row_map, probs.requires_grad_(), grad, te_map

    sets = inputs(combine_bwd_bytes, make_combine)
    add("combine", "moetriton", lambda y, r, w, g, t: mt.token_combine(y, r, w), sets, combine_bytes)

    def combine_fwd_bwd(y, r, w, g, t):
        return torch.autograd.grad(mt.token_combine(y, r, w), (y, w), g)

    add(
        "combine_bwd",
        "moetriton",
        lambda y, r, w, g, t: permutation.COMBINE_BACKWARD(g, r, y.detach(), w.detach(), False),
        sets,
        combine_bwd_bytes,
    )
    if te is not None:
        add(
            "combine_bwd",
            "te-triton",
            lambda y, r, w, g, t: te.unpermute_with_mask_map_bwd_with_merging_probs(
                g, t, y.detach(), w.detach(), None, T, E, N, H
            ),
            sets,
            combine_bwd_bytes,
        )

    add("combine_fwd_bwd", "moetriton", combine_fwd_bwd, sets, combine_bytes + combine_bwd_bytes)
    if te is not None:
        add(
            "combine",
            "te-triton",
            lambda y, r, w, g, t: te.unpermute_with_mask_map(y.detach(), t, w.detach(), None, None, T, E, H),
            sets,
            combine_bytes,
        )

        def te_combine_fwd_bwd(y, r, w, g, t):
            y, w = y.detach(), w.detach()
            te.unpermute_with_mask_map(y, t, w, None, None, T, E, H)
            return te.unpermute_with_mask_map_bwd_with_merging_probs(g, t, y, w, None, T, E, N, H)

        add("combine_fwd_bwd", "te-triton", te_combine_fwd_bwd, sets, combine_bytes + combine_bwd_bytes)
        add(
            "combine_fwd_bwd",
            "te-autograd",
            lambda y, r, w, g, t: torch.autograd.grad(te_combine_autograd(y, t, w), (y, w), g),
            sets,
            combine_bytes + combine_bwd_bytes,
        )
    if not quick:
        add(
            "combine",
            "torch-ref",
            lambda y, r, w, g, t: reference.token_combine(y.detach(), r, w.detach()),
            sets[:2],
            combine_bytes,
            capturable=False,
        )

    # chunk sort -----------------------------------------------------------------------------------------
    ranks = min(8, E)
    sort_bytes = 2 * token_bytes(N, H, eb) + N * 4

    def make_sort():
        rows = torch.randn(N, H, device=device, dtype=DTYPE, generator=generator)
        cuts = torch.sort(torch.randint(0, N + 1, (E - 1,), device=device, generator=generator)).values
        edges = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), N)])
        sizes = (edges[1:] - edges[:-1]).int()
        order = torch.arange(E, device=device, dtype=torch.int32).view(ranks, E // ranks).t().reshape(-1)
        return rows, sizes, order

    sets = inputs(sort_bytes, make_sort)
    add("chunk_sort", "moetriton", lambda x, s, o: mt.sort_chunks_by_index(x, s, o), sets, sort_bytes)
    if te is not None:

        def te_sort(x, s, o):
            row_map = te.make_chunk_sort_map(s, o, N, E)
            return te.sort_chunks_by_map(x, row_map, None, N, H, True)

        add("chunk_sort", "te-triton", te_sort, sets, sort_bytes)
    if not quick:
        add(
            "chunk_sort",
            "torch-ref",
            lambda x, s, o: reference.sort_chunks_by_index(x, s, o),
            sets[:2],
            sort_bytes,
            capturable=False,
        )

    # router ------------------------------------------------------------------------------------------------
    router_bytes = T * E * (2 + 2 + 1)

    def make_logits():
        logits = torch.randn(T, E, device=device, dtype=DTYPE, generator=generator, requires_grad=True)
        return logits, torch.randn(T, E, device=device, dtype=DTYPE, generator=generator)

    def torch_topk(logits):
        top, ids = logits.topk(K, dim=-1)
        probs = torch.zeros_like(logits).scatter(1, ids, top.float().softmax(-1).to(logits.dtype))
        return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)

    sets = inputs(router_bytes, make_logits)
    add(
        "router_topk",
        "moetriton",
        lambda lg, g: mt.fused_topk_with_score_function(lg, K),
        sets,
        router_bytes,
    )
    add("router_topk", "torch-eager", lambda lg, g: torch_topk(lg), sets, router_bytes)

    def router_fwd_bwd(api):
        def run(logits, grad):
            return torch.autograd.grad(api(logits)[0], logits, grad)

        return run

    fwd_bwd = router_bytes + T * E * (2 + 2 + 1 + 2)
    add(
        "router_fwd_bwd",
        "moetriton",
        router_fwd_bwd(lambda lg: mt.fused_topk_with_score_function(lg, K)),
        sets,
        fwd_bwd,
    )
    add("router_fwd_bwd", "torch-eager", router_fwd_bwd(torch_topk), sets, fwd_bwd)


def _jax_results(shape: MoEShape, quick: bool) -> list[Result]:
    import jax
    import jax.numpy as jnp

    import moetriton.jax as mj
    from moetriton.jax import reference
    from moetriton.jax.executor import on_gpu

    if not on_gpu():
        return []
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N = T * K
    eb = 2
    map_bytes = T * (E + 1) * 4
    out: list[Result] = []

    def add(op, impl, fn, sets, nbytes):
        jitted = jax.jit(fn)
        eager = time_host_and_eager(rotating_call(sets, jitted), jax.block_until_ready)
        steady = time_jax(fn, sets)
        note = f"steady-state GPU span of a jitted run; synced wall {steady.wall_ms:.4f} ms"
        out.append(
            Result(
                f"e:{op}",
                "jax",
                impl,
                shape.name,
                steady.device_ms,
                nbytes,
                note,
                eager.host_ms,
                eager.eager_ms,
            )
        )

    def make_sets(nbytes, build):
        return [build(key) for key in jax.random.split(jax.random.key(0), input_sets(nbytes))]

    def make(key):
        keys = jax.random.split(key, 4)
        scores = jax.random.uniform(keys[0], (T, E))
        top, ids = jax.lax.top_k(scores, K)
        mask = jnp.zeros((T, E), bool).at[jnp.arange(T)[:, None], ids].set(True)
        probs = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], ids].set(jax.nn.softmax(top, -1))
        x = jax.random.normal(keys[1], (T, H), jnp.bfloat16)
        rows = jax.random.normal(keys[2], (N, H), jnp.bfloat16)
        grad = jax.random.normal(keys[3], (T, H), jnp.bfloat16)
        return x, mask, probs, rows, grad

    dispatch_bytes = token_bytes(T, H, eb) + T * E * 5 + token_bytes(N, H, eb) + N * 4 + map_bytes + E * 4
    combine_bytes = token_bytes(N, H, eb) + map_bytes + T * E * 4 + token_bytes(T, H, eb)
    sets = make_sets(dispatch_bytes + combine_bytes, make)
    # The reference's argsort combine and its vjp hold several [T * K, H] fp32 temporaries per input set:
    # past the small shapes they do not fit beside the rotating sets.
    with_reference = not quick and N * H <= 2**24
    for impl, api in (("moetriton", mj), ("jax-ref", reference)):
        if impl != "moetriton" and not with_reference:
            continue
        add(
            "dispatch",
            impl,
            lambda x, m, p, r, g, api=api: api.token_dispatch(x, m, N, p),
            sets,
            dispatch_bytes,
        )

        def combine_fwd_bwd(x, m, p, r, g, api=api):
            row_map = api.token_dispatch(x[:, :0], m, N)[2]
            y, vjp = jax.vjp(lambda rows, w: api.token_combine(rows, row_map, w), r, p)
            return y, vjp(g)

        add("combine_fwd_bwd", impl, combine_fwd_bwd, sets, 2 * combine_bytes + token_bytes(N, H, eb))

    def logits_set(key):
        return (jax.random.normal(key, (T, E), jnp.bfloat16),)

    sets = make_sets(T * E * 5, logits_set)
    add("router_topk", "moetriton", lambda lg: mj.fused_topk_with_score_function(lg, K), sets, T * E * 5)
    return out


def results(shape: MoEShape, quick: bool = False) -> list[Result]:
    if not torch.cuda.is_available():
        return []
    out = []
    for framework in (_torch_results, _jax_results):  # one framework's failure keeps the other's rows
        try:
            out += framework(shape, quick)
        except Exception:
            print(f"{framework.__name__} {shape.name} failed:\n{traceback.format_exc()}", file=sys.stderr)
    return out
