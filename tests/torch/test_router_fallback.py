"""Without the Triton interpreter, CPU tensors run the reference inside the custom ops: forward, backward
(through torch.func, since autograd dispatch is off inside an op) and torch.compile. Runs in a subprocess
(`python -m tests.torch.test_router_fallback`) because TRITON_INTERPRET is read when moetriton is imported."""

from __future__ import annotations

from ..strategies_router import run_test_module


def test_cpu_fallback_without_interpreter():
    stdout = run_test_module("tests.torch.test_router_fallback", drop=("TRITON_INTERPRET",))
    assert "fallback checks passed" in stdout


def _main() -> None:
    import torch

    from moetriton.kernels import INTERPRETER
    from moetriton.torch import reference_router as reference
    from moetriton.torch import router

    assert not INTERPRETER
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 12, generator=generator, requires_grad=True)
    bias = torch.randn(12, generator=generator)
    cotangent = torch.randn(6, 12, generator=generator)
    kwargs = dict(
        num_groups=3, group_topk=2, score_function="sqrtsoftplus", expert_bias=bias, return_indices=True
    )
    ours = router.fused_topk_with_score_function(logits, 4, **kwargs)
    theirs = reference.fused_topk_with_score_function(logits, 4, **kwargs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    grads = [torch.autograd.grad(out[0], logits, cotangent)[0] for out in (ours, theirs)]
    torch.testing.assert_close(*grads)

    _, scores = router.fused_compute_score_for_moe_aux_loss(logits, 3, "sigmoid")
    _, ref_scores = reference.fused_compute_score_for_moe_aux_loss(logits, 3, "sigmoid")
    grads = [torch.autograd.grad(s, logits, cotangent)[0] for s in (scores, ref_scores)]
    torch.testing.assert_close(*grads)

    probs = torch.rand(7, 12, generator=generator, requires_grad=True)
    counts = torch.arange(12)
    for total in (7, torch.tensor(7)):
        losses = [
            f(probs, counts, total, 12, 4, 0.1)
            for f in (router.fused_moe_aux_loss, reference.fused_moe_aux_loss)
        ]
        torch.testing.assert_close(*losses)
        torch.testing.assert_close(*[torch.autograd.grad(loss, probs)[0] for loss in losses])

    # aot_eager traces through the fake implementations without needing a C++ compiler for CPU code.
    compiled = torch.compile(
        lambda x: router.fused_topk_with_score_function(x, 4, **kwargs), fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(logits), ours)
    print("fallback checks passed")


if __name__ == "__main__":
    _main()
