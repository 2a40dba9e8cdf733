"""benchmarks.saved_bytes counts what each MoE layer keeps for its backward: on the tiny shape, the tensors
with one row per routed slot are the dispatched rows [TK, H], the gate/up output [TK, 2F] and the expert
output [TK, H] (the activation output is computed again in the backward), in both frameworks, and everything
else has one row per token or per expert (routing metadata; JAX also keeps the masked tokens [T, H])."""

import csv

import pytest

from benchmarks import saved_bytes

SHAPE = saved_bytes.TINY
SLOTS = SHAPE.num_tokens * SHAPE.topk


@pytest.mark.parametrize("framework", sorted(saved_bytes.COUNTERS))
def test_per_slot_tensors_are_rows_hidden_and_expert_output(framework):
    saved = saved_bytes.COUNTERS[framework](SHAPE)
    per_slot = sorted(shape[1] for shape, _, _ in saved if len(shape) == 2 and shape[0] == SLOTS)
    assert per_slot == sorted([SHAPE.hidden, 2 * SHAPE.ffn, SHAPE.hidden]), saved
    others = [shape for shape, _, _ in saved if not (len(shape) == 2 and shape[0] == SLOTS)]
    assert all(shape[:1] in ((), (SHAPE.num_tokens,), (SHAPE.num_experts,)) for shape in others), others


def test_results_file(tmp_path):
    assert saved_bytes.main(["--shapes", "tiny", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / saved_bytes.DEVICE / "saved_bytes.csv").open()))
    assert [row["framework"] for row in rows] == ["torch", "jax"]
    for row in rows:
        assert float(row["saved_elements_per_slot"]) >= 2 * SHAPE.hidden + 2 * SHAPE.ffn, row
