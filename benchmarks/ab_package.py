"""Same-process A/B of two versions of the whole package: host time and eager time per call of the PyTorch
ops, to show that a change leaves what an eager user pays per call where it was.

    python -m benchmarks.ab_package BASELINE_ROOT [--shapes tiny] [--ops dispatch,combine,...] [--rounds 10]
                                    [--out ab_package.csv] [--smoke] [--stub-kernels]

BASELINE_ROOT is a folder holding another checkout's kernels/, torch_bindings/ (and jax_bindings/,
autotune_cache/), e.g. `mkdir /tmp/base && git archive REV | tar -x -C /tmp/base`; the candidate is this
checkout (the folder above benchmarks/). On a GPU, from the repository root:

    python -m benchmarks.ab_package /tmp/base --shapes tiny --rounds 10 --out ab_package.csv

Why one process: timings taken in separate processes (or runs, or machines) are not comparable at the level of
the change to be judged (clock states, where the allocator and caches start, other load), so both versions run
in one process, timed alternately. Both import themselves by the absolute name `moetriton`, so they cannot be
imported side by side: the baseline is imported first, from a temporary site folder of links under the
package's import names (as scripts/gpu_check.sh does), then its modules are taken out of sys.modules and the
candidate is imported the same way. Functions keep their own module globals, so the baseline's still run its
own code; before each version's calls its modules are put back into sys.modules, so that what it imports by
name at call time (lazily imported modules, the autotune cache through importlib.resources) is its own too.
Every module of a version must come from its own folder (checked, and reported: the *_torch_file columns). The
baseline's torch.library custom ops register as `moetriton_baseline::<op>`: torch lets a later definition of
`moetriton::<op>` replace an earlier one, which would send the baseline's dispatcher calls (torch.compile,
tensor subclasses; plain eager calls do not use them) to the candidate. Each version reads the autotune cache
of its own checkout (and MOETRITON_AUTOTUNE_CACHE's, where set).

Ops: the moetriton cases of benchmarks.eager_cases (the same inputs, built by each version for itself from
the same seed): dispatch, dispatch_fwd_bwd, dispatch_bwd, combine, combine_bwd, combine_fwd_bwd,
chunk_sort, router_topk, router_fwd_bwd (the *_bwd rows call the backward op alone; *_fwd_bwd and
router_fwd_bwd go through torch.autograd). Both versions must have the API those cases call. Each round
times every op with benchmarks.timing.time_host_and_eager, baseline then candidate (the order flips every
round, so neither version always runs second). Shapes: named shapes of moetriton.kernels.rules.shapes, or
TxHxExK (e.g. 16x32x8x2).

Columns (one row per op and shape; the leading provenance columns of benchmarks.common, of this checkout):
op, shape, rounds, kernels ("run", or "stubbed" with --stub-kernels); {baseline,candidate}_host_us: median
over the rounds of the host time to issue one call (µs); {baseline,candidate}_eager_us: median over the
rounds of the wall time per call of calls back to back with one sync at the end (µs); host_ratio,
eager_ratio: candidate / baseline; {baseline,candidate}_torch_file: the file each version's moetriton.torch
was imported from. The same table goes to stdout.

On CPU it needs TRITON_INTERPRET=1 (the kernels run under the Triton interpreter): only the host time
means anything there, and --smoke (one timed issue, one burst of one call, two input sets) keeps a run
short enough for a test, e.g. `TRITON_INTERPRET=1 python -m benchmarks.ab_package /tmp/base --shapes
16x32x8x2 --rounds 1 --smoke`.

--stub-kernels: the host path alone, measurable without a GPU: CPU tensors (on any machine) under
TRITON_INTERPRET=1, e.g. `TRITON_INTERPRET=1 python -m benchmarks.ab_package /tmp/base --shapes tiny,16x32x8x2
--rounds 20 --stub-kernels`. The inputs are built with the kernels running (interpreted), then, while the ops
are timed, every kernel launch of both versions is a no-op: `InterpretedFunction.run`, what
`kernel[grid](...)` calls under the interpreter, is replaced for the process (both versions launch through the
same Triton), so each version still checks its arguments, builds and caches its plans, binds its executables,
arranges its inputs, allocates its results and scratch, and runs the rest of its own Python up to the launch
call; only the interpreter's argument copies and the kernel bodies are skipped. A version's op that launched
nothing while timed (a reference fallback) is an error. Both figures are then host time (eager = host: nothing
waits). What it does not measure: the GPU launch itself (Triton's compiled launcher, the driver), CUDA
allocations (CPU tensors come from the CPU allocator) and anything the device does. And it times the
executor's CPU path, not its GPU fast path: on CPU every call takes `Executable._launch_first` (workspace
views of the scratch buffers, one `kernel[grid](...)` call per launch with keyword constexprs and options),
where a GPU call after the first takes the generated fast launches (scratch as addresses, Triton's compiled
launcher called directly); the public functions also check index values of CPU tensors on the host (row maps,
ids, split sizes), which GPU calls skip. So a change to the ops' and the plans' Python shows here as on the
GPU, a change to the fast launch does not. Both versions run on the same path, so the difference is
comparable; the absolute figures are this CPU's, not an H100 host's.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.timing import EagerTiming, time_host_and_eager

# moetriton, and the benchmarks modules that import it (common, eager_cases), are imported inside the
# functions: only once both versions are loaded, and first while the candidate is the active one.

PACKAGE = "moetriton"
#: A checkout's source folder of each subpackage, by import name (pyproject's package-dir).
SOURCE_FOLDERS = {
    "kernels": "kernels",
    "torch": "torch_bindings",
    "jax": "jax_bindings",
    "autotune_cache": "autotune_cache",
}
CHECKOUT = Path(__file__).resolve().parents[1]
LABELS = ("baseline", "candidate")
COLUMNS = [
    "op",
    "shape",
    "rounds",
    "kernels",
    "baseline_host_us",
    "candidate_host_us",
    "host_ratio",
    "baseline_eager_us",
    "candidate_eager_us",
    "eager_ratio",
    "baseline_torch_file",
    "candidate_torch_file",
]


@dataclass
class Version:
    """One version of the package: its checkout folder and its modules by import name."""

    label: str
    root: Path
    modules: dict[str, ModuleType]
    torch_file: Path  # where its moetriton.torch came from, links resolved
    stand_in_root: Path | None = None  # the empty package root written for a version without one

    @property
    def torch(self) -> ModuleType:
        return self.modules[f"{PACKAGE}.torch"]

    def check_origin(self) -> None:
        """Raise unless every module of this version with a file comes from its own checkout."""
        for name, module in self.modules.items():
            path = getattr(module, "__file__", None)
            if (
                path
                and not Path(path).resolve().is_relative_to(self.root)
                and Path(path) != self.stand_in_root
            ):
                raise RuntimeError(f"the {self.label}'s {name} comes from {path}, not from {self.root}")


def _package_modules() -> dict[str, ModuleType]:
    return {
        name: module
        for name, module in sys.modules.items()
        if name == PACKAGE or name.startswith(f"{PACKAGE}.")
    }


def _forget_package() -> None:
    for name in _package_modules():
        del sys.modules[name]


@contextlib.contextmanager
def _custom_ops_in(namespace: str):
    """While a version is imported, its torch.library custom ops `moetriton::<op>` register as
    `<namespace>::<op>`."""
    define = torch.library.custom_op

    def renamed(name, *args, **kwargs):
        package, _, op = name.partition("::")
        return define(f"{namespace}::{op}" if package == PACKAGE else name, *args, **kwargs)

    torch.library.custom_op = renamed
    try:
        yield
    finally:
        torch.library.custom_op = define


class Versions:
    """The versions imported so far, and the one whose modules sys.modules holds."""

    def __init__(self, site_root: Path) -> None:
        self.site_root = site_root
        self.active: Version | None = None

    def load(self, label: str, root: Path, op_namespace: str) -> Version:
        """Import `root`'s package as `moetriton` through its moetriton.torch, with the active version's
        modules set aside; it becomes the active version."""
        package = self.site_root / label / PACKAGE
        package.mkdir(parents=True)
        for name, folder in SOURCE_FOLDERS.items():
            if (root / folder).is_dir():
                (package / name).symlink_to(root / folder, target_is_directory=True)
        stand_in_root = None
        if (root / PACKAGE / "__init__.py").is_file():  # versions with a package root (moetriton.__version__)
            (package / "__init__.py").symlink_to(root / PACKAGE / "__init__.py")
        else:
            stand_in_root = package / "__init__.py"
            # An empty one: a folder without it would be a namespace portion, and a regular moetriton
            # package later on the path (the checkout's root in the working directory) would win over it.
            stand_in_root.write_text("")
        self._set_aside()
        importlib.invalidate_caches()
        sys.path.insert(0, str(package.parent))
        try:
            # The package's path (a namespace package's follows sys.path; a package root's extends over it)
            # fixed to this version's folder, so that no other folder on the path (another site, an
            # installed moetriton, a checkout's package root) serves one of its modules.
            importlib.import_module(PACKAGE).__path__ = [str(package)]
            with _custom_ops_in(op_namespace):
                torch_module = importlib.import_module(f"{PACKAGE}.torch")
                # Versions whose PyTorch permutation ops module was named `ops` (the cases read
                # moetriton.torch.permutation).
                if not hasattr(torch_module, "permutation"):
                    torch_module.permutation = importlib.import_module(f"{PACKAGE}.torch.ops")
        finally:
            sys.path.remove(str(package.parent))
        version = Version(
            label, root, _package_modules(), Path(torch_module.__file__).resolve(), stand_in_root
        )
        version.check_origin()
        self.active = version
        return version

    def activate(self, version: Version) -> None:
        """Put `version`'s modules into sys.modules in place of the active version's."""
        if version is not self.active:
            self._set_aside()
            sys.modules.update(version.modules)
            self.active = version

    def _set_aside(self) -> None:
        """Take the package's modules out of sys.modules, keeping those the active version imported since
        it was loaded or activated with it."""
        if self.active is not None:
            self.active.modules.update(_package_modules())
        _forget_package()


class StubbedLaunches:
    """Within: every kernel launch under the Triton interpreter is a no-op that only counts itself
    (--stub-kernels). `InterpretedFunction.run` is what `kernel[grid](...)` calls under TRITON_INTERPRET=1,
    in every version (they share this process's Triton), and the first thing of a launch that is no longer
    the package's own code."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> StubbedLaunches:
        from triton.runtime.interpreter import InterpretedFunction

        self._run = InterpretedFunction.run

        def launch(kernel, *args, grid, warmup, **kwargs) -> None:
            self.count += 1

        InterpretedFunction.run = launch
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._run


def parse_shape(spec: str):
    """A named shape of moetriton.kernels.rules.shapes, or one given as TxHxExK."""
    from moetriton.kernels.rules.shapes import NAMED_SHAPES, MoEShape

    if spec in NAMED_SHAPES:
        return NAMED_SHAPES[spec]
    sizes = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)", spec)
    if sizes is None:
        raise SystemExit(f"unknown shape {spec!r}: one of {', '.join(NAMED_SHAPES)}, or TxHxExK")
    return MoEShape(spec, *map(int, sizes.groups()))


def _cases(version: Version, shape, device: str, max_sets: int) -> dict[str, tuple[Callable, list]]:
    """op -> (fn, input sets) of the moetriton cases of benchmarks.eager_cases, run by `version`."""
    from benchmarks.eager_cases import torch_eager_cases

    cases = {}

    def collect(op, impl, fn, sets, nbytes, capturable=True):
        if impl == "moetriton":
            cases[op] = (fn, sets)

    torch_eager_cases(version.torch, shape, collect, quick=True, device=device, max_sets=max_sets)
    return cases


def compare(
    versions: Versions,
    pair: tuple[Version, Version],
    shape,
    ops: list[str] | None,
    rounds: int,
    device: str,
    smoke: bool,
    stub_kernels: bool = False,
) -> list[dict]:
    """One row per op (COLUMNS) of both versions at `shape`, timed alternately round by round; with
    `stub_kernels`, every launch while timed is a no-op (the inputs are built with the kernels running)."""
    from benchmarks.eager_cases import rotating_call

    cases = {}
    for version in pair:
        versions.activate(version)
        # Stubbed launches read no data, so two input sets do (and keep the interpreted set-up short).
        cases[version.label] = _cases(version, shape, device, max_sets=2 if smoke or stub_kernels else 16)
    ops = ops or list(cases["baseline"])
    unknown = sorted(set(ops) - set(cases["baseline"]))
    if unknown:
        raise SystemExit(f"unknown ops {unknown}: the ops are {', '.join(cases['baseline'])}")
    counts = dict(calls=1, issues=1, bursts=1) if smoke else {}
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    timings: dict[tuple[str, str], list[EagerTiming]] = {(op, label): [] for op in ops for label in LABELS}
    stub = StubbedLaunches() if stub_kernels else None
    with stub or contextlib.nullcontext():
        for round_index in range(rounds):
            for op in ops:
                for version in pair if round_index % 2 == 0 else pair[::-1]:
                    versions.activate(version)
                    fn, sets = cases[version.label][op]
                    launches = stub.count if stub else None
                    timing = time_host_and_eager(rotating_call(sets, fn), lambda _: sync(), **counts)
                    if stub and stub.count == launches:  # a reference ran: nothing of interest was timed
                        raise RuntimeError(f"the {version.label}'s {op} launched no kernel")
                    timings[op, version.label].append(timing)
    rows = []
    for op in ops:
        row = dict(op=op, shape=shape.name, rounds=rounds, kernels="stubbed" if stub_kernels else "run")
        for figure in ("host", "eager"):
            for label in LABELS:
                times = [getattr(timing, f"{figure}_ms") for timing in timings[op, label]]
                row[f"{label}_{figure}_us"] = round(statistics.median(times) * 1e3, 3)
            row[f"{figure}_ratio"] = round(row[f"candidate_{figure}_us"] / row[f"baseline_{figure}_us"], 4)
        for version in pair:
            row[f"{version.label}_torch_file"] = str(version.torch_file)
        rows.append(row)
    return rows


def _print_row(row: dict) -> None:
    print(
        f"{row['op']:<17}{row['shape']:<10}{row['baseline_host_us']:>11.2f}{row['candidate_host_us']:>11.2f}"
        f"{row['host_ratio']:>7.3f}{row['baseline_eager_us']:>11.2f}{row['candidate_eager_us']:>11.2f}"
        f"{row['eager_ratio']:>7.3f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("baseline", type=Path, help="folder of the baseline's kernels/, torch_bindings/, ...")
    parser.add_argument("--shapes", default="tiny", help="named shapes or TxHxExK, comma-separated")
    parser.add_argument("--ops", help="comma-separated (default: every op)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, help="CSV file to write (default: the table on stdout only)")
    parser.add_argument("--smoke", action="store_true", help="the fewest calls that run every path")
    parser.add_argument(
        "--stub-kernels",
        action="store_true",
        help="time the host path alone: CPU tensors, every kernel launch a no-op (needs TRITON_INTERPRET=1)",
    )
    args = parser.parse_args(argv)
    baseline_root = args.baseline.resolve()
    missing = [folder for folder in ("kernels", "torch_bindings") if not (baseline_root / folder).is_dir()]
    if missing:
        parser.error(f"{baseline_root} has no {' or '.join(missing)}")
    device = "cuda" if torch.cuda.is_available() and not args.stub_kernels else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Set before Triton is imported, or its helpers are not interpreted; without the interpreter the ops
        # would run their PyTorch references, not the code compared.
        parser.error("no GPU: run with TRITON_INTERPRET=1 in the environment")
    with tempfile.TemporaryDirectory(prefix="ab_package_") as site_root:
        versions = Versions(Path(site_root))
        pair = (
            versions.load("baseline", baseline_root, op_namespace=f"{PACKAGE}_baseline"),
            versions.load("candidate", CHECKOUT, op_namespace=PACKAGE),
        )
        shapes = [parse_shape(spec) for spec in args.shapes.split(",")]
        device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        kernels = "kernel launches stubbed out (host path only)" if args.stub_kernels else "kernels run"
        print(
            f"# {device_name}, {kernels}; µs per call, median of {args.rounds} rounds;"
            " ratio = candidate / baseline"
        )
        for version in pair:
            print(f"# {version.label}: moetriton.torch from {version.torch_file}")
        print(
            f"{'op':<17}{'shape':<10}{'host base':>11}{'host cand':>11}{'ratio':>7}"
            f"{'eager base':>11}{'eager cand':>11}{'ratio':>7}"
        )
        ops = args.ops.split(",") if args.ops else None
        rows = []
        for shape in shapes:
            timed = compare(versions, pair, shape, ops, args.rounds, device, args.smoke, args.stub_kernels)
            for row in timed:
                _print_row(row)
                rows.append(row)
        for version in pair:  # modules imported lazily while timing included
            versions.activate(version)
            version.check_origin()
        if args.out:
            from benchmarks.common import provenance

            head = provenance(device_name)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, [*head, *COLUMNS])
                writer.writeheader()
                writer.writerows({**head, **row} for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
