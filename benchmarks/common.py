"""What every benchmark module reports, and how the runner turns it into the table.

A benchmark module exposes `results(shape: MoEShape, quick: bool) -> list[Result]`. It times its own ops
(each framework has its own honest timer) and states the ideal bytes of each op: every input read once and
every output written once. The runner divides those bytes by the time for GB/s and by the measured
device-to-device copy bandwidth for % of ceiling.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace

from moetriton.kernels.shapes import MOE_LAYER_SHAPES, MoELayerShape


@dataclass(frozen=True)
class Result:
    op: str  # e.g. "dispatch", "combine", "combine_bwd", "chunk_sort", "topk_fwd"
    framework: str  # "torch" or "jax"
    impl: str  # "moetriton", or the baseline's name ("torch-ref", "jax-ref", ...)
    shape: str  # named shape
    ms: float  # median time per call
    bytes: int  # ideal bytes moved (read + write)
    note: str = ""
    host_ms: float | None = None  # host time to issue one call (eager mode)
    eager_ms: float | None = None  # wall time per call of calls back to back with one sync (eager mode)

    def gbps(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    def as_dict(self) -> dict:
        return asdict(self)


def token_bytes(rows: int, hidden: int, element_bytes: int) -> int:
    return rows * hidden * element_bytes


def exchange_parser(description: str) -> argparse.ArgumentParser:
    """Options of the exchange scripts (scripts/exchange_jax.py, scripts/exchange_torch.py): --shapes,
    --steps, --tokens."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="mixtral,dsv3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per GPU (default: the shape's)")
    return parser


def layer_shape(name: str, num_tokens: int = 0) -> MoELayerShape:
    """The named MoE layer shape, with `num_tokens` tokens per GPU where it is not 0."""
    shape = MOE_LAYER_SHAPES[name]
    return replace(shape, num_tokens=num_tokens) if num_tokens else shape
