"""What every benchmark module reports, and where the results go.

A case module of the runner (benchmarks.run) exposes `results(shape: MoEShape, quick: bool) -> list[Result]`.
It times its own ops (each framework has its own honest timer) and states the ideal bytes of each op: every
input read once and every output written once. The runner divides those bytes by the time for GB/s and by
the measured device-to-device copy bandwidth for % of ceiling.

Results files have stable names: one CSV per benchmark and machine, `<root>/<machine>/<name>.csv`, root
benchmarks/results unless a benchmark's `--out` names another, machine the GPU's name as the autotune cache
spells it (`NVIDIA_H100_80GB_HBM3`), prefixed with the GPU count when a benchmark uses several
(`2x_NVIDIA_H200`), or `cpu`. Every row starts with the columns of `provenance`: device, GPU count, package
versions, the checkout's commit and the date, so a file says what produced it.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from moetriton import kernels
from moetriton.kernels.rules.expert_parallel import EPLayout, ep_layout
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES, MoELayerShape, MoEShape


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


def shapes_parser(description: str, shapes: str) -> argparse.ArgumentParser:
    """Options every shape benchmark has: --shapes (comma-separated names, default `shapes`) and --out; the
    module docstring `description` is the help text, as written. The benchmark adds its own options."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=shapes)
    add_out_option(parser)
    return parser


def exchange_parser(description: str) -> argparse.ArgumentParser:
    """Options of the exchange benchmarks (benchmarks.exchange_jax, benchmarks.exchange_torch): --shapes,
    --out, --steps, --tokens."""
    parser = shapes_parser(description, "mixtral,dsv3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per GPU (default: the shape's)")
    return parser


def layer_shape(name: str, num_tokens: int = 0) -> MoELayerShape:
    """The named MoE layer shape, with `num_tokens` tokens per GPU where it is not 0."""
    shape = MOE_LAYER_SHAPES[name]
    return replace(shape, num_tokens=num_tokens) if num_tokens else shape


def shape_dispatch_plan(
    shape: MoEShape, is_mask: bool, device: kernels.DeviceInfo, config: dict | None = None
) -> kernels.Plan:
    """kernels.dispatch_plan of the dispatch the permutation benchmarks and the autotuner time: a shape's
    bf16 tokens to its T x K routed slots, unpadded, with probs and without scales, through a mask (E slots
    a token) or expert indices (K slots); `config` as kernels.dispatch_plan takes it."""
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    S = E if is_mask else K
    sizes = dict(num_tokens=T, hidden=H, num_slots=S, num_experts=E, num_out_tokens=T * K, element_bytes=2)
    return kernels.dispatch_plan(
        **sizes, is_mask=is_mask, has_probs=True, scale_cols=None, device=device, config=config
    )


#: Variants of the moetriton layer rows of both layer benchmarks (--variants), by the recipe options each
#: turns on: "plain" (the layer alone), "shared" (one shared expert of the routed FFN size), each option of
#: the training recipes alone, "recipe" (all of them but the shared expert), and the dropless routed path in
#: 2 or 4 pipelined token chunks (pipeline_chunks; with a shared expert too). Their step time against
#: "plain" is what the option costs.
LAYER_VARIANTS = {
    "plain": {},
    "shared": dict(num_shared_experts=1),
    "seq_aux": dict(seq_aux_loss_coeff=1e-4),
    "z_loss": dict(z_loss_coeff=1e-3),
    "mask": dict(padding=True),
    "stats": dict(return_stats=True),
    "probs": dict(drop_policy="probs"),
    "recipe": dict(
        seq_aux_loss_coeff=1e-4, z_loss_coeff=1e-3, padding=True, return_stats=True, drop_policy="probs"
    ),
    "pipeline2": dict(pipeline_chunks=2),
    "pipeline4": dict(pipeline_chunks=4),
    "shared_pipeline2": dict(num_shared_experts=1, pipeline_chunks=2),
    "fp8": dict(fp8="tensorwise"),
    "fp8_blockwise": dict(fp8="blockwise"),
}
#: Tokens per sequence of the layer benchmarks' [B, S, H] inputs (the sequence-wise loss reads S).
SEQUENCE_LENGTH = 4096
#: Every PADDING_PERIOD-th token of the "mask" variants is padding.
PADDING_PERIOD = 16


def add_variants_option(parser: argparse.ArgumentParser) -> None:
    """--variants of the layer benchmarks: comma-separated LAYER_VARIANTS names (default "plain")."""
    parser.add_argument(
        "--variants",
        default="plain",
        type=_variant_names,
        help=f"comma-separated moetriton layer variants, from {tuple(LAYER_VARIANTS)} (the baseline runs"
        " plain only)",
    )


def _variant_names(text: str) -> str:
    unknown = [name for name in text.split(",") if name not in LAYER_VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected names from {tuple(LAYER_VARIANTS)}, got {unknown}")
    return text


def variant_options(variant: str, num_tokens: int) -> tuple[dict, int, np.ndarray | None]:
    """(layer keyword options, shared experts, token mask [T] bool or None) of a LAYER_VARIANTS name;
    "probs" only acts under a capacity."""
    options = dict(LAYER_VARIANTS[variant])
    shared = options.pop("num_shared_experts", 0)
    mask = (
        np.arange(num_tokens) % PADDING_PERIOD != PADDING_PERIOD - 1
        if options.pop("padding", False)
        else None
    )
    return options, shared, mask


def sequences(num_tokens: int) -> tuple[int, int]:
    """(B, S) of a layer benchmark's T tokens: sequences of SEQUENCE_LENGTH where T divides into them, else
    one sequence."""
    length = SEQUENCE_LENGTH if num_tokens % SEQUENCE_LENGTH == 0 else num_tokens
    return num_tokens // max(length, 1), length


def router_options(shape: MoELayerShape) -> dict:
    """A layer shape's scoring options (score function, group limit) as keyword arguments of the top-k
    router, moe() and MoEConfig, which take the shape's topk beside them."""
    return dict(score_function=shape.score_function, num_groups=shape.num_groups, group_topk=shape.group_topk)


def shape_layout(shape: MoELayerShape, ep_size: int, align_size: int | None = None) -> EPLayout:
    """The dropless EP layout of a layer shape's tokens on one GPU of `ep_size`."""
    sizes = dict(num_tokens=shape.num_tokens, num_experts=shape.num_experts, topk=shape.topk)
    return ep_layout(**sizes, ep_size=ep_size, align_size=align_size)


#: Where results files go unless a benchmark's --out names another root.
RESULTS_ROOT = Path(__file__).resolve().parent / "results"
VERSIONED = ("torch", "triton", "jax", "jaxlib", "jax-triton")


def add_out_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_ROOT,
        help="results root: writes <out>/<machine>/<name>.csv (default: %(default)s)",
    )


def machine_dir(device_name: str, gpus: int = 1) -> str:
    """Folder of one machine's results: the device name with anything but letters, digits, '.' and '-' as
    '_' (the autotune cache's spelling), `<n>x_` in front for a benchmark that uses n > 1 GPUs; CPU runs
    (smoke runs of the layer benchmarks) all go to `cpu`."""
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_") or "cpu"
    return f"{gpus}x_{name}" if gpus > 1 and name != "cpu" else name


def versions() -> dict:
    """Installed versions, from package metadata (importing jax_triton would empty TRITON_CACHE_DIR)."""
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = ""
    return found


def commit() -> str:
    """The checkout's commit (short hash, `+` when files differ from it), or "" outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if dirty else "")


def provenance(device_name: str, gpus: int = 1) -> dict:
    """The leading columns of every results row."""
    found = versions()
    return dict(
        device=device_name,
        gpus=gpus,
        date=datetime.datetime.now(datetime.UTC).date().isoformat(),
        commit=commit(),
        **{name.replace("-", "_"): found[name] for name in ("python", *VERSIONED)},
    )


def write_results(
    name: str,
    rows: list[dict],
    device_name: str,
    gpus: int = 1,
    root: Path = RESULTS_ROOT,
    columns: list[str] | None = None,
) -> Path:
    """Write `rows` (dicts) with the provenance columns in front to <root>/<machine>/<name>.csv, replacing
    the file; returns its path. Columns: `columns`, then any others in order of first appearance."""
    head = provenance(device_name, gpus)
    columns = list(dict.fromkeys([*head, *(columns or []), *(column for row in rows for column in row)]))
    path = Path(root) / machine_dir(device_name, gpus) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows({**head, **row} for row in rows)
    return path
