"""The FP8 recipe classes of transformer_engine.common.recipe that TransformerEngine's PyTorch permutation
test names when it builds its FP8 parameter list, for moetriton's runner of that test
(scripts/te_torch_tests.sh). They only tell the recipes apart: moetriton has no TE quantizers, so the tests
that use a recipe skip before quantizing anything (te_pytorch.is_fp8_available and its siblings)."""

from __future__ import annotations


class Recipe:
    """A recipe's kind, asked the way TE's tests ask it."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def __repr__(self) -> str:
        return type(self).__name__


class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history."""


class Float8CurrentScaling(Recipe):
    """Per-tensor scales from the current amax."""


class Float8BlockScaling(Recipe):
    """Scales per 1x128 (or 128x128) block."""


class MXFP8BlockScaling(Recipe):
    """E8M0 scales per 32 elements (microscaling)."""
