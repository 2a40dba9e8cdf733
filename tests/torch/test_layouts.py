"""Every public PyTorch function, forward and backward, gives for strided inputs and cotangents exactly what
it gives for their contiguous copies, and `loss = out.sum()` (a stride-0 cotangent) gives the reference's
gradients.

Each case names a public function, builds its inputs, and calls it through `run(api, inputs)`; the
reference side calls moetriton.torch.reference / reference_router (TE's names map onto the same reference
functions). Layouts: tests/strategies.LAYOUTS for inputs, COTANGENT_LAYOUTS for the gradients fed back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import moetriton.torch as mt
from moetriton.torch import reference, reference_router
from tests.strategies import COTANGENT_LAYOUTS, LAYOUTS
from tests.torch._helpers import DEVICE, bits, cotangent, relayout

T, H, E, K = 6, 40, 4, 2


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[torch.Generator], dict[str, torch.Tensor]]  # inputs by name (differentiable first)
    differentiable: tuple[str, ...]  # inputs that take gradients
    run: Callable[[object, dict], tuple[torch.Tensor, ...]]  # (api, inputs) -> float outputs
    reference: Callable[[dict], tuple[torch.Tensor, ...]]
    tolerance: float = 1e-5


def _routing(generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.rand(T, E, generator=generator).topk(K, dim=1).indices
    ids[2, 1] = -1
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids.clamp(min=0), True)
    return dict(
        x=torch.randn(T, H, generator=generator),
        ids=ids.int(),
        mask=mask,
        probs_e=torch.rand(T, E, generator=generator),
        probs_k=torch.rand(T, K, generator=generator),
    )


def _to_device(values: dict) -> dict:
    return {name: value.to(DEVICE) for name, value in values.items()}


def _dispatch_case(kind: str, align_size: int | None) -> Case:
    def build(generator):
        return _to_device(_routing(generator))

    def call(api, inputs):
        if kind == "mask":
            args = (inputs["x"], inputs["mask"], int(inputs["mask"].sum()), inputs["probs_e"], align_size)
            out = api.token_dispatch(*args)
        else:
            out = api.token_dispatch(
                inputs["x"], None, T * K, inputs["probs_k"], align_size, indices=inputs["ids"], num_experts=E
            )
        return out[0], out[1]

    probs = "probs_e" if kind == "mask" else "probs_k"
    return Case(
        f"token_dispatch-{kind}-align{align_size}",
        build,
        ("x", probs),
        lambda api, inputs: call(api, inputs),
        lambda inputs: call(reference, inputs),
    )


def _combine_case(weighted: bool, align_size: int | None) -> Case:
    def build(generator):
        inputs = _routing(generator)
        layout = reference.token_dispatch(inputs["x"], inputs["mask"], T * K, None, align_size)
        rows = layout[0].shape[0]
        return _to_device(
            dict(
                expert_out=torch.randn(rows, H, generator=generator),
                weights=inputs["probs_e"],
                row_id_map=layout[2],
                **({} if align_size is None else {"pad_offsets": layout[3]}),
            )
        )

    def call(api, inputs):
        weights = inputs["weights"] if weighted else None
        return (
            api.token_combine(inputs["expert_out"], inputs["row_id_map"], weights, inputs.get("pad_offsets")),
        )

    return Case(
        f"token_combine-weighted{weighted}-align{align_size}",
        build,
        ("expert_out", "weights") if weighted else ("expert_out",),
        call,
        lambda inputs: call(reference, inputs),
    )


def _sort_build(generator):
    sizes = torch.tensor([3, 0, 5, 2, 1])
    return _to_device(
        dict(
            rows=torch.randn(13, H, generator=generator),
            probs=torch.rand(13, generator=generator),
            sizes=sizes,
            order=torch.tensor([2, 4, 0, 3, 1]),
        )
    )


def _sort_call(api, inputs):
    out = api.sort_chunks_by_index(inputs["rows"], inputs["sizes"], inputs["order"], inputs["probs"])
    return out[0], out[2]


def _te_cases() -> list[Case]:
    def build(generator):
        return _to_device(_routing(generator))

    def permute_with_probs(inputs):
        routed = int(inputs["mask"].sum())
        out, permuted_probs, _ = mt.moe_permute_with_probs(
            inputs["x"], inputs["probs_e"], inputs["mask"], routed
        )
        return out, permuted_probs

    def permute_index(inputs):
        return (mt.moe_permute(inputs["x"], inputs["ids"], map_type="index", num_experts=E)[0],)

    def unpermute_index(inputs):
        out, row_id_map = mt.moe_permute(inputs["x"], inputs["ids"], map_type="index", num_experts=E)
        return (mt.moe_unpermute(out * 1.5, row_id_map, inputs["probs_k"], map_type="index"),)

    def permute_and_pad(inputs):
        mask = inputs["mask"]
        out, permuted_probs, _, _, _ = mt.moe_permute_and_pad_with_probs(
            inputs["x"], inputs["probs_e"], mask, mask.sum(0), 4
        )
        return out, permuted_probs

    def sort_with_probs(inputs):
        return mt.moe_sort_chunks_by_index_with_probs(
            inputs["rows"], inputs["probs"], inputs["sizes"], inputs["order"]
        )

    def reference_permute_and_pad(inputs):
        mask = inputs["mask"]
        out, permuted_probs, _, _, counts = reference.token_dispatch(
            inputs["x"], mask, int(mask.sum()), inputs["probs_e"], 4
        )
        used = int(counts.sum())
        return out[:used], permuted_probs[:used]

    def reference_unpermute_index(inputs):
        out, _, row_id_map, _, _ = reference.token_dispatch(
            inputs["x"], None, T * K, indices=inputs["ids"], num_experts=E
        )
        return (reference.token_combine(out * 1.5, row_id_map, inputs["probs_k"]),)

    return [
        Case(
            "moe_permute_with_probs",
            build,
            ("x", "probs_e"),
            lambda api, inputs: permute_with_probs(inputs),
            lambda inputs: _dispatch_case("mask", None).reference(inputs),
        ),
        Case(
            "moe_permute-index",
            build,
            ("x",),
            lambda api, inputs: permute_index(inputs),
            lambda inputs: (
                reference.token_dispatch(inputs["x"], None, T * K, indices=inputs["ids"], num_experts=E)[0],
            ),
        ),
        Case(
            "moe_unpermute-index",
            build,
            ("x", "probs_k"),
            lambda api, inputs: unpermute_index(inputs),
            reference_unpermute_index,
        ),
        Case(
            "moe_permute_and_pad_with_probs",
            build,
            ("x", "probs_e"),
            lambda api, inputs: permute_and_pad(inputs),
            reference_permute_and_pad,
        ),
        Case(
            "moe_sort_chunks_by_index_with_probs",
            _sort_build,
            ("rows", "probs"),
            lambda api, inputs: sort_with_probs(inputs),
            lambda inputs: _sort_call(reference, inputs),
        ),
    ]


def _router_cases() -> list[Case]:
    def build(generator):
        return _to_device(
            dict(logits=torch.randn(T, 8, generator=generator), bias=torch.randn(8, generator=generator))
        )

    def topk(module):
        def call(inputs):
            return module.fused_topk_with_score_function(
                inputs["logits"],
                4,
                num_groups=4,
                group_topk=2,
                score_function="sigmoid",
                expert_bias=inputs["bias"],
            )[:1]

        return call

    def scores(module):
        return lambda inputs: module.fused_compute_score_for_moe_aux_loss(inputs["logits"], 3, "softmax")[1:]

    def aux_build(generator):
        return _to_device(
            dict(
                probs=torch.rand(T, 8, generator=generator),
                counts=torch.randint(0, 9, (8,), generator=generator),
            )
        )

    def aux(module):
        return lambda inputs: (module.fused_moe_aux_loss(inputs["probs"], inputs["counts"], T, 8, 3, 0.01),)

    return [
        Case(
            "fused_topk_with_score_function",
            build,
            ("logits",),
            lambda api, i: topk(mt)(i),
            topk(reference_router),
        ),
        Case(
            "fused_compute_score_for_moe_aux_loss",
            build,
            ("logits",),
            lambda api, i: scores(mt)(i),
            scores(reference_router),
        ),
        Case("fused_moe_aux_loss", aux_build, ("probs",), lambda api, i: aux(mt)(i), aux(reference_router)),
    ]


CASES = [
    *(_dispatch_case(kind, align) for kind in ("mask", "indices") for align in (None, 4)),
    *(_combine_case(weighted, align) for weighted in (False, True) for align in (None, 4)),
    Case(
        "sort_chunks_by_index", _sort_build, ("rows", "probs"), _sort_call, lambda i: _sort_call(reference, i)
    ),
    *_te_cases(),
    *_router_cases(),
]


def _inputs(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    return case.build(torch.Generator().manual_seed(seed))


def _grads(case: Case, inputs: dict, layout: str, grad_layout: str) -> tuple:
    """Outputs and input gradients of the public function, inputs in `layout`, cotangents in `grad_layout`."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in case.differentiable}
    strided = {name: relayout(leaves.get(name, value), layout) for name, value in inputs.items()}
    outputs = case.run(mt, strided)
    cotangents = [cotangent(out, grad_layout, seed=i) for i, out in enumerate(outputs)]
    found = torch.autograd.grad(outputs, list(leaves.values()), cotangents, allow_unused=True)
    return tuple(o.detach() for o in outputs), found


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_strided_inputs_give_the_contiguous_results(case, layout):
    inputs = _inputs(case)
    expected_out, expected_grads = _grads(case, inputs, "contiguous", "contiguous")
    got_out, got_grads = _grads(case, inputs, layout, "contiguous")
    for got, expected in zip((*got_out, *got_grads), (*expected_out, *expected_grads), strict=True):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert torch.equal(bits(got), bits(expected)), case.name


@pytest.mark.parametrize("grad_layout", COTANGENT_LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_strided_cotangents_give_the_contiguous_gradients(case, grad_layout):
    inputs = _inputs(case, seed=1)
    leaves = {name: inputs[name].clone().requires_grad_() for name in case.differentiable}
    outputs = case.run(mt, {**inputs, **leaves})
    strided = [cotangent(out, grad_layout, seed=i) for i, out in enumerate(outputs)]
    dense = [g.contiguous() for g in strided]
    got = torch.autograd.grad(outputs, list(leaves.values()), strided, retain_graph=True)
    expected = torch.autograd.grad(outputs, list(leaves.values()), dense)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(bits(g), bits(e)), case.name


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_sum_loss_gradients_match_the_reference(case):
    inputs = _inputs(case, seed=2)
    gradients = []
    for side in ("moetriton", "reference"):
        leaves = {name: inputs[name].clone().requires_grad_() for name in case.differentiable}
        full = {**inputs, **leaves}
        outputs = case.run(mt, full) if side == "moetriton" else case.reference(full)
        loss = sum(out.sum() for out in outputs)
        gradients.append(torch.autograd.grad(loss, list(leaves.values())))
    for got, expected in zip(*gradients, strict=True):
        assert torch.isfinite(got).all(), case.name
        torch.testing.assert_close(got, expected, rtol=case.tolerance, atol=case.tolerance, msg=case.name)
