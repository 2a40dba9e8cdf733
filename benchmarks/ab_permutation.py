"""Same-process A/B of two versions of the permutation kernels on one GPU.

    python -m benchmarks.ab_permutation BASELINE [--shapes qwen3,dsv3,mixtral,small,tiny] [--top 5]
                                     [--kind mask] [--rounds 3] [--sort-baseline CHUNK_SORT.py]

BASELINE is another version of the permutation kernels: a copy of the kernels/permutation/ folder (e.g.
`mkdir /tmp/base && git archive HEAD kernels/permutation | tar -x -C /tmp/base`, then /tmp/base/kernels/
permutation), or of the single kernels/permutation.py of versions before the family became a package; the
candidate is the installed package's. Each version runs its own plans
(dispatch writes the row map its combine kernels read), at the same configs: the `--top` fastest of the
device's autotune cache for each key, plus the cache's best, so a change that moves the best config shows.
Per op, shape and config: graph time of either version, interleaved over `--rounds` rounds (best of the
rounds' medians), then each version's best over the configs and the ratio candidate / baseline. Runs across
machines differ by a few %; a same-process A/B is what can judge a 1-3% change.

With --sort-baseline (another version of kernels/chunk_sort.py), the chunk sort is compared the same way,
forward and backward, on each shape's rows as two EP ranks receive them (T * K rows, E source-major chunks
of random sizes sorted to expert-major), at the plan's own config.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import torch

from benchmarks.timing import input_sets, time_graph
from moetriton import kernels
from moetriton.kernels import permutation as candidate
from moetriton.kernels.rules.shapes import NAMED_SHAPES
from moetriton.kernels.runtime import autotune
from moetriton.torch.executor import device_info, run_plan


def _load_baseline(path: str, name: str = "_ab_baseline"):
    """The baseline module (a file) or package (a folder with its __init__.py), loaded inside
    moetriton.kernels so that its relative imports resolve."""
    folder = Path(path)
    if folder.is_dir():
        spec = importlib.util.spec_from_file_location(
            f"moetriton.kernels.{name}", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
    else:
        spec = importlib.util.spec_from_file_location(f"moetriton.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its submodules import the package by name
    spec.loader.exec_module(module)
    return module


def _configs(kernel: str, features: dict, info, top: int) -> list[dict]:
    """The `top` fastest cached configs of `kernel` at `features` on this device (best first), or [None]
    (the plan's own choice) without a cache entry."""
    path = autotune.cache_root() / autotune.device_dir(info.name) / f"{kernel}.json"
    entry = json.loads(path.read_text())["entries"].get(autotune.key_of(features)) if path.is_file() else None
    if entry is None:
        return [None]
    ranked = sorted(entry["timings"].items(), key=lambda item: item[1])[:top]
    configs = [dict((k, int(v)) for k, v in (p.split("=") for p in name.split(","))) for name, _ in ranked]
    return configs if entry["best"] in configs else [entry["best"], *configs]


def _cases(module, shape, kind: str, info, sets):
    """(op, cache kernel, features, plan(config), inputs per set) of `module` at one shape."""
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    S, N, eb = (E if kind == "mask" else K), T * K, 2
    data = dict(num_tokens=T, hidden=H, num_slots=S, element_bytes=eb)

    def dispatch(config):
        return module.dispatch_plan(
            num_tokens=T, hidden=H, num_slots=S, num_experts=E, is_mask=kind == "mask", num_out_tokens=N,
            element_bytes=eb, has_probs=True, scale_cols=None, device=info,
            config=None if config is None else {"dispatch": config},
        )  # fmt: skip

    map_plan = dispatch(None)
    maps = [
        run_plan(
            kernels.Plan(map_plan.buffers, map_plan.launches, ("row_id_map",)),
            dict(inp=s["x"], routing=s["routing"], probs=s["probs"], scales=None),
            torch.device("cuda"),
        )[0]
        for s in sets
    ]

    # Versions whose combine bounds its rows take the buffer's row count.
    rows = dict(num_rows=N) if "num_rows" in inspect.signature(module.combine_plan).parameters else {}

    def combine(weighted: bool, gather: bool):
        return lambda config: module.combine_plan(
            num_tokens=T, hidden=H, num_slots=S, element_bytes=eb, has_weights=weighted, gather_probs=gather,
            device=info, config=config, **rows,
        )  # fmt: skip

    def combine_backward(config):
        return module.combine_backward_plan(
            num_tokens=T, hidden=H, num_slots=S, num_rows=N, padded=False, element_bytes=eb, device=info,
            config=config,
        )  # fmt: skip

    pairs = list(zip(sets, maps, strict=True))
    yield (
        "dispatch",
        "dispatch",
        data,
        dispatch,
        [dict(inp=s["x"], routing=s["routing"], probs=s["probs"], scales=None) for s in sets],
    )
    for op, weighted, gather in (("combine", True, False), ("dispatch_bwd", False, True)):
        inputs = [
            dict(
                inp=s["rows"],
                row_id_map=m,
                weights=s["probs"] if weighted else None,
                permuted_probs=s["permuted_probs"] if gather else None,
            )
            for s, m in pairs
        ]
        yield (
            op,
            "combine",
            dict(data, weighted=int(weighted), gather=int(gather)),
            combine(weighted, gather),
            inputs,
        )
    inputs = [dict(grad=s["x"], row_id_map=m, inp=s["rows"], weights=s["probs"]) for s, m in pairs]
    yield "combine_bwd", "combine_backward", data, combine_backward, inputs


def _sort_rows(module, shape, info, generator):
    """(op, plan, inputs) of the chunk sort, forward and backward, at one shape (EP = 2 chunk layout)."""
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N, ep = T * K, 2
    cuts = torch.sort(torch.randint(0, N + 1, (E - 1,), device="cuda", generator=generator)).values
    bounds = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), N)])
    sizes = (bounds[1:] - bounds[:-1]).int()
    local = E // ep
    order = torch.tensor([p * local + j for j in range(local) for p in range(ep)], device="cuda").int()
    rows = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=generator)
    inputs = dict(inp=rows, split_sizes=sizes, sorted_indices=order, probs=None)
    plan_sizes = dict(num_rows=N, hidden=H, num_splits=E, element_bytes=2, has_probs=False)
    for backward in (False, True):
        plan = module.sort_chunks_plan(**plan_sizes, backward=backward, device=info)
        yield ("sort_chunks_bwd" if backward else "sort_chunks"), plan, inputs


def _ab_sort(baseline_path: str, shapes: list[str], rounds: int, info) -> None:
    from moetriton.kernels import chunk_sort

    modules = {"baseline": _load_baseline(baseline_path, "_ab_chunk_sort"), "candidate": chunk_sort}
    device = torch.device("cuda")
    for name in shapes:
        shape = NAMED_SHAPES[name]
        cases = {
            key: list(_sort_rows(module, shape, info, torch.Generator(device="cuda").manual_seed(1)))
            for key, module in modules.items()
        }
        for index, (op, _, _) in enumerate(cases["baseline"]):
            times = {key: float("inf") for key in modules}
            for _ in range(rounds):
                for key in modules:
                    _, plan, inputs = cases[key][index]
                    times[key] = min(
                        times[key], 1e3 * time_graph([lambda p=plan, i=inputs: run_plan(p, i, device)])
                    )
            ratio = times["candidate"] / times["baseline"]
            print(
                f"{op},{name},best,{times['baseline']:.1f},{times['candidate']:.1f},{ratio:.3f}", flush=True
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("baseline")
    parser.add_argument("--shapes", default="qwen3,dsv3,mixtral,small,tiny")
    parser.add_argument("--kind", default="mask", choices=("mask", "indices"))
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sort-baseline", help="another version of kernels/chunk_sort.py to compare")
    args = parser.parse_args()
    device = torch.device("cuda")
    info = device_info(device)
    modules = {"baseline": _load_baseline(args.baseline), "candidate": candidate}
    print(f"# {torch.cuda.get_device_name()} kind={args.kind}; us per call, graph replays")
    print("op,shape,config,baseline_us,candidate_us,ratio")
    for name in args.shapes.split(","):
        shape = NAMED_SHAPES[name]
        T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
        generator = torch.Generator(device="cuda").manual_seed(0)
        sets = []
        for _ in range(input_sets(4 * T * K * H)):
            scores = torch.rand(T, E, device="cuda", generator=generator)
            ids = scores.topk(K, dim=1).indices
            mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
            routing = mask if args.kind == "mask" else ids.int()
            sets.append(
                dict(
                    x=torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=generator),
                    routing=routing,
                    probs=torch.rand(routing.shape, device="cuda", generator=generator),
                    rows=torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16, generator=generator),
                    permuted_probs=torch.rand(T * K, device="cuda", generator=generator),
                )
            )
        cases = {key: list(_cases(module, shape, args.kind, info, sets)) for key, module in modules.items()}
        for index, (op, kernel, features, _, _) in enumerate(cases["baseline"]):
            best = {}
            for config in _configs(kernel, features, info, args.top):
                times = {key: float("inf") for key in modules}
                for _ in range(args.rounds):
                    for key in modules:
                        _, _, _, plan_of, inputs = cases[key][index]
                        plan = plan_of(config)
                        calls = [lambda p=plan, i=i: run_plan(p, i, device) for i in inputs]
                        times[key] = min(times[key], 1e3 * time_graph(calls))
                label = "cache" if config is None else ";".join(f"{k}={v}" for k, v in config.items())
                ratio = times["candidate"] / times["baseline"]
                print(f"{op},{name},{label},{times['baseline']:.1f},{times['candidate']:.1f},{ratio:.3f}")
                for key in modules:
                    best[key] = min(best.get(key, float("inf")), times[key])
            ratio = best["candidate"] / best["baseline"]
            print(f"{op},{name},best,{best['baseline']:.1f},{best['candidate']:.1f},{ratio:.3f}", flush=True)
    if args.sort_baseline:
        _ab_sort(args.sort_baseline, args.shapes.split(","), args.rounds, info)


if __name__ == "__main__":
    main()
