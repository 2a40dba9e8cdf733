"""Kernel configs from the committed autotune cache, resolved at launch time (no autotuning on the call path).

Files: moetriton/autotune_cache/<device>/<kernel>.json, written by scripts/autotune.py:
    {"kernel": ..., "device": ..., "triton": "3.6.0", "source_hash": "...",
     "entries": {"<key>": {"features": {...}, "best": {...config...}, "ms": ..., "timings": {...}}}}

Each file also records the GPU's architecture and multiprocessor count ("arch": "sm_90", "num_sms": 132).

Which folder: $MOETRITON_AUTOTUNE_CACHE first when it is set (scripts/autotune.py's output folder: a cache
tuned on this machine), then the package's. Which file: the device's own; else, for a GPU with no cache of
its own, the cache of the closest GPU of the same architecture (nearest multiprocessor count, then name),
reported once (an H200 without its files uses the H100's rather than bare heuristics). Which entry: the
exact key; else the nearest bucket (same categorical features, smallest sum of |log2| distances over the
numeric ones); else None, and the plan uses its heuristic. A cache written by another Triton version or for
other kernel source is still used (every cached config is a member of the kernel's search space, so it is
correct, if perhaps no longer the fastest) and reported once.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.resources
import inspect
import io
import json
import math
import os
import re
import textwrap
import tokenize
import warnings
from collections.abc import Mapping
from pathlib import Path

import triton

from .plan import DeviceInfo, SearchSpace

# Kernel name -> its entry kernels, as paths below moetriton.kernels. The cache hash covers their source and,
# transitively, every @triton.jit helper they call, so changing one kernel leaves the other kernels' entries
# fresh.
KERNEL_SOURCES = {
    "row_map": (
        "permutation.row_map._count_experts_kernel",
        "permutation.row_map._scan_counts_kernel",
        "permutation.dispatch._dispatch_kernel",
    ),
    "dispatch": ("permutation.dispatch._dispatch_kernel", "permutation.dispatch._scatter_kernel"),
    "combine": ("permutation.combine._combine_kernel",),
    "combine_backward": ("permutation.combine._combine_backward_kernel",),
    "sort_chunks": ("chunk_sort._sort_chunks_kernel",),
    "grouped_matmul": ("grouped_gemm._grouped_matmul_kernel",),
    "grouped_matmul_wgrad": ("grouped_gemm._grouped_matmul_wgrad_kernel",),
    "fp8_grouped_matmul_tensorwise": ("grouped_gemm.fp8._fp8_grouped_matmul_kernel",),
    "fp8_grouped_matmul_blockwise": ("grouped_gemm.fp8._fp8_grouped_matmul_kernel",),
    "fp8_grouped_matmul_wgrad_tensorwise": ("grouped_gemm.fp8._fp8_grouped_matmul_wgrad_kernel",),
    "fp8_grouped_matmul_wgrad_blockwise": ("grouped_gemm.fp8._fp8_grouped_matmul_wgrad_kernel",),
    "router_topk": ("router.topk._topk_forward_kernel",),
    "router_topk_backward": ("router.topk._topk_backward_kernel",),
    "router_aux_scores": ("router.aux_loss._aux_scores_forward_kernel",),
    "router_aux_scores_backward": ("router.aux_loss._aux_scores_backward_kernel",),
}
# Features compared for equality rather than by distance.
CATEGORICAL = ("element_bytes", "is_mask", "weighted", "gather")


def device_dir(device_name: str) -> str:
    """Folder name of a device: its name with anything but letters, digits, '.', '-' turned into '_'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_")


def key_of(features: Mapping[str, int]) -> str:
    return ",".join(f"{name}={int(value)}" for name, value in sorted(features.items()))


def _code(source: str) -> str:
    """A function's code as the compiler sees it: its tokens without the docstring, comments and blank or
    continuation lines (statement ends and indentation kept), so that editing prose leaves the hash, and
    the cache tuned for the code, as they were."""
    source = textwrap.dedent(source)
    body = ast.parse(source).body[0].body
    docstring = None  # where the docstring token starts (indentation only before it: ASCII columns)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        docstring = (body[0].lineno, body[0].col_offset)
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def offset(position: tuple[int, int]) -> int:
        return line_starts[position[0] - 1] + position[1]

    kept, fstring = [], []  # fstring: start positions of the f-strings being read (Python >= 3.12)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        name = tokenize.tok_name[token.type]
        # Python 3.12 splits an f-string into parts; older versions read it as one STRING token: keep one.
        if name == "FSTRING_START":
            fstring.append(token.start)
        if fstring:
            if name == "FSTRING_END":
                start = fstring.pop()
                if not fstring:
                    kept.append(f"STRING:{source[offset(start) : offset(token.end)]}")
            continue
        if token.type in (tokenize.COMMENT, tokenize.NL):
            continue
        if token.type == tokenize.STRING and token.start == docstring:
            continue
        text = token.string if token.type not in (tokenize.INDENT, tokenize.NEWLINE) else ""
        kept.append(f"{name}:{text}")
    return " ".join(kept)


def source_hash(kernel: str) -> str:
    """Hash of a kernel's code and of the @triton.jit helpers it calls, transitively (docstrings and
    comments excluded, see `_code`). A helper is found where its caller finds it (the caller's module
    globals), so moving a helper to another module leaves the hash as it was."""
    digest, seen, pending = hashlib.sha256(), set(), []
    for path in KERNEL_SOURCES[kernel]:
        module_name, name = path.rsplit(".", 1)
        pending.append((name, vars(importlib.import_module(f"moetriton.kernels.{module_name}"))))
    while pending:
        name, scope = pending.pop()
        function = scope.get(name)
        if name in seen or not hasattr(function, "fn"):  # only jit functions count
            continue
        seen.add(name)
        code = _code(inspect.getsource(function.fn))
        digest.update(code.encode())
        called = re.findall(r"NAME:(_[A-Za-z0-9_]+) OP:\(", code)
        pending.extend((helper, function.fn.__globals__) for helper in called)
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    return Path(str(importlib.resources.files("moetriton.autotune_cache")))


def _borrowed(device: DeviceInfo, kernel: str) -> Path | None:
    """The cache file of the closest other GPU of `device`'s architecture for `kernel`, or None."""
    candidates = []
    for path in sorted(cache_root().glob(f"*/{kernel}.json")):
        data = json.loads(path.read_text())
        if data.get("arch") == device.arch and device.arch not in ("cpu", "unknown"):
            candidates.append((abs(int(data.get("num_sms", 0)) - device.num_sms), path.parent.name, path))
    return min(candidates)[2] if candidates else None


def user_cache_root() -> Path | None:
    """The folder named by MOETRITON_AUTOTUNE_CACHE (read before the package's cache), or None."""
    folder = os.environ.get("MOETRITON_AUTOTUNE_CACHE")
    return Path(folder).expanduser() if folder else None


@functools.cache
def _load(device: DeviceInfo, kernel: str) -> dict | None:
    path = cache_root() / device_dir(device.name) / f"{kernel}.json"
    user = user_cache_root()
    if user is not None and (user / device_dir(device.name) / f"{kernel}.json").is_file():
        path = user / device_dir(device.name) / f"{kernel}.json"
    if not path.is_file():
        path = _borrowed(device, kernel)
        if path is None:
            return None
        warnings.warn(
            f"moetriton: no autotune cache for {device.name}; {kernel} uses {path.parent.name}'s (same "
            f"architecture {device.arch}). Run scripts/autotune.py on this GPU for configs of its own.",
            stacklevel=3,
        )
    data = json.loads(path.read_text())
    stale = []
    if data.get("triton") != triton.__version__:
        stale.append(f"written with Triton {data.get('triton')}, running {triton.__version__}")
    if kernel in KERNEL_SOURCES and data.get("source_hash") != source_hash(kernel):
        stale.append("kernel source changed since")
    if stale:
        warnings.warn(
            f"moetriton: autotune cache {path} is stale ({'; '.join(stale)}); its configs are still "
            "valid but may not be the fastest. Rerun scripts/autotune.py.",
            stacklevel=3,
        )
    return data


def _distance(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    if set(a) != set(b) or any(a[name] != b[name] for name in CATEGORICAL if name in a):
        return math.inf
    return sum(abs(math.log2(max(a[n], 1)) - math.log2(max(b[n], 1))) for n in a if n not in CATEGORICAL)


def lookup(kernel: str, features: Mapping[str, int], device: DeviceInfo) -> dict[str, int] | None:
    """Cached best config for `kernel` on `device` at `features` (exact key, else nearest bucket), or None."""
    data = _load(device, kernel)
    if not data or not data.get("entries"):
        return None
    entries = data["entries"]
    exact = entries.get(key_of(features))
    if exact is not None:
        return dict(exact["best"])
    nearest = min(entries.values(), key=lambda entry: _distance(features, entry["features"]))
    if math.isinf(_distance(features, nearest["features"])):
        return None
    return dict(nearest["best"])


def resolve(
    space: SearchSpace,
    heuristic: Mapping[str, int],
    config: Mapping[str, int] | None,
    features: Mapping[str, int],
    device: DeviceInfo,
) -> dict[str, int]:
    """The config a plan uses: the caller's, else the autotune cache's for `device`, else the heuristic.
    The heuristic must lie in the search space (checked), so every config a plan can use is tested."""
    chosen = config if config is not None else lookup(space.kernel, features, device)
    return dict(space.default(**heuristic), **(chosen or {}))
