"""examples/jax_moe.py runs end to end and agrees with the reference layer."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jax_moe.py"


def test_example_moe_layer_matches_the_reference(capsys):
    spec = importlib.util.spec_from_file_location("jax_moe_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    errors = example.main(small=True)
    assert set(errors) == {"output", "loss", "grad x", "grad router", "grad w_in", "grad w_out"}
    assert all(error < 1e-4 for error in errors.values()), errors
    assert "forward + backward" in capsys.readouterr().out
