"""Autotune: sweep every kernel's search space on this GPU and write a config cache.

    python scripts/autotune.py [--shapes mixtral,qwen3,dsv3,small] [--kernels ...] [--budget S]
                               [--replays R] [--retune] [--out DIR | --update-package-cache]

For every kernel and key (the named shapes, with mask and index routing), every config of the kernel's
search space is compiled and timed (CUDA-graph replays over rotating input sets, median), and
<out>/<device>/<kernel>.json records the best config, all candidates' times, the Triton version and the
kernel-source hash. The output folder is a user folder ($XDG_CACHE_HOME/moetriton/autotune_cache, else
~/.cache/moetriton/autotune_cache) unless `--out` names another, which moetriton reads when
MOETRITON_AUTOTUNE_CACHE names it (before the package's cache); `--update-package-cache` writes into the
package's own cache (autotune_cache/ of the checkout, which moetriton reads), which is how a new GPU's
cache is added to the repository. A fresh output folder starts from the package's cache for this GPU, and
the sweep resumes where it stopped: keys already there with the current hash and Triton version are
skipped. `--budget` stops it cleanly after that many seconds, so a sweep fits in several short runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `benchmarks`

import torch
import triton
from tqdm import tqdm

from benchmarks.common import shape_dispatch_plan
from benchmarks.timing import input_sets, time_graph
from moetriton import kernels
from moetriton.kernels.rules.fp8 import RECIPES
from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES, NAMED_SHAPES, MoEShape
from moetriton.kernels.runtime import autotune
from moetriton.torch.executor import device_info, run_plan

DTYPE = torch.bfloat16


def _routing(shape: MoEShape, kind: str, generator: torch.Generator):
    scores = torch.rand(shape.num_tokens, shape.num_experts, device="cuda", generator=generator)
    ids = scores.topk(shape.topk, dim=1).indices
    if kind == "mask":
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
    return ids.int()


def _cases(shape: MoEShape, kind: str, device, tuned):
    """(kernel, features, plan(config), inputs list) for each kernel at this shape and routing kind.
    `tuned(kernel, features)` is the best config tuned so far for that key, or None."""
    T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
    N, S, eb = T * K, (E if kind == "mask" else K), 2
    generator = torch.Generator(device="cuda").manual_seed(0)
    info = device_info(device)
    map_features = dict(num_tokens=T, num_slots=S, num_experts=E, is_mask=int(kind == "mask"))
    data_features = dict(num_tokens=T, hidden=H, num_slots=S, element_bytes=eb)

    base = shape_dispatch_plan(shape, kind == "mask", info)
    map_plan = kernels.Plan(base.buffers, base.launches, ("row_id_map",))
    sets = []
    for _ in range(input_sets(2 * N * H * eb)):
        x = torch.randn(T, H, device="cuda", dtype=DTYPE, generator=generator)
        routing = _routing(shape, kind, generator)
        probs = torch.rand(routing.shape, device="cuda", generator=generator)
        (row_map,) = run_plan(map_plan, dict(inp=x, routing=routing, probs=probs, scales=None), device)
        rows = torch.randn(N, H, device="cuda", dtype=DTYPE, generator=generator)
        cuts = torch.sort(torch.randint(0, N + 1, (E - 1,), device="cuda", generator=generator)).values
        sizes = torch.diff(torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), N)])).long()
        ranks = min(8, E)
        order = torch.arange(E, device="cuda").view(ranks, E // ranks).t().reshape(-1)
        sets.append(
            dict(
                inp=x,
                routing=routing,
                probs=probs,
                scales=None,
                row_id_map=row_map,
                rows=rows,
                grad=x,
                weights=probs,
                permuted_probs=torch.rand(N, device="cuda", generator=generator),
                split_sizes=sizes,
                sorted_indices=order,
            )
        )

    def dispatch_plan(config, only):
        # The whole op is timed for either kernel: row_map's token blocks also set the ranks inside the
        # dispatch kernel. The other kernel's config is the one tuned here, if any, else the cache's.
        other = "dispatch" if only == "row_map" else "row_map"
        other_features = data_features if other == "dispatch" else map_features
        return shape_dispatch_plan(
            shape, kind == "mask", info, {only: config, other: tuned(other, other_features)}
        )

    yield (
        "row_map",
        map_features,
        lambda c: dispatch_plan(c, "row_map"),
        sets,
    )
    yield (
        "dispatch",
        data_features,
        lambda c: dispatch_plan(c, "dispatch"),
        sets,
    )
    # Combine, and dispatch's backward: an unweighted combine, which also gathers the probs' gradient when
    # dispatch had probs.
    for weighted, gather in ((True, False), (False, False), (False, True)):
        yield (
            "combine",
            dict(data_features, weighted=int(weighted), gather=int(gather)),
            lambda c, weighted=weighted, gather=gather: kernels.combine_plan(
                **data_features, has_weights=weighted, gather_probs=gather, device=info, config=c
            ),
            [
                dict(
                    s,
                    inp=s["rows"],
                    permuted_probs=s["permuted_probs"] if gather else None,
                    weights=s["weights"] if weighted else None,
                )
                for s in sets
            ],
        )
    yield (
        "combine_backward",
        data_features,
        lambda c: kernels.combine_backward_plan(
            **data_features, num_rows=N, padded=False, device=info, config=c
        ),
        [dict(s, inp=s["rows"]) for s in sets],
    )
    if kind != "mask":
        return
    yield from _router_cases(shape, info, generator)
    yield from _fp8_cases(shape, info, generator)
    sort_features = dict(num_rows=N, hidden=H, num_splits=E, element_bytes=eb)
    yield (
        "sort_chunks",
        sort_features,
        lambda c: kernels.sort_chunks_plan(
            **sort_features, has_probs=False, backward=False, device=info, config=c
        ),
        [dict(s, inp=s["rows"], probs=None) for s in sets],
    )


def _fp8_cases(shape: MoEShape, info, generator: torch.Generator):
    """The FP8 grouped GEMMs of both recipes at a layer shape's two projections (gate/up: K = H, N = 2F;
    down: K = F, N = H; balanced groups): forward and data gradient (one search space per recipe) and weight
    gradient. One input set: the operands exceed the L2 many times over."""
    layer = MOE_LAYER_SHAPES.get(shape.name)
    if layer is None:
        return
    import moetriton.torch as mt

    rows, experts = layer.num_tokens * layer.topk, layer.num_experts
    sizes = torch.full((experts,), rows // experts, dtype=torch.int32, device="cuda")
    sizes[: rows % experts] += 1
    common = dict(num_rows=rows, num_groups=experts, device=info)
    for depth, num_cols in ((layer.hidden, 2 * layer.ffn), (layer.ffn, layer.hidden)):
        features = dict(rows_per_group=-(-rows // experts), depth=depth, num_cols=num_cols)
        shapes = dict(depth=depth, num_cols=num_cols)
        transposed = dict(depth=num_cols, num_cols=depth)
        for recipe, spec in RECIPES.items():
            x = torch.randn(rows, depth, device="cuda", generator=generator, dtype=DTYPE)
            dy = torch.randn(rows, num_cols, device="cuda", generator=generator, dtype=DTYPE)
            w = torch.randn(experts, depth, num_cols, device="cuda", generator=generator, dtype=DTYPE)
            x_rows, x_scale, x_cols, x_cols_scale = mt.quantize(x, sizes, recipe, columnwise=True)
            gradient = getattr(torch, spec.gradient_dtype)
            dy_rows, dy_scale, dy_cols, dy_cols_scale = mt.quantize(
                dy, sizes, recipe, fp8_dtype=gradient, columnwise=True
            )
            w_rows, w_cols, w_scale = mt.quantize_weights(w, recipe)
            del x, dy, w
            space = f"fp8_grouped_matmul_{recipe}"
            yield (
                space,
                features,
                lambda c, r=recipe, s=shapes: kernels.fp8_grouped_matmul_plan(
                    recipe=r, **s, **common, config=c
                ),
                [dict(lhs=x_rows, rhs=w_cols, lhs_scale=x_scale, rhs_scale=w_scale, group_sizes=sizes)],
            )
            yield (
                space,
                dict(features, **transposed),
                lambda c, r=recipe, s=transposed: kernels.fp8_grouped_matmul_plan(
                    recipe=r, **s, data_gradient=True, **common, config=c
                ),
                [dict(lhs=dy_rows, rhs=w_rows, lhs_scale=dy_scale, rhs_scale=w_scale, group_sizes=sizes)],
            )
            yield (
                f"fp8_grouped_matmul_wgrad_{recipe}",
                features,
                lambda c, r=recipe, s=shapes: kernels.fp8_grouped_matmul_wgrad_plan(
                    recipe=r, **s, **common, config=c
                ),
                [
                    dict(
                        lhs=x_cols,
                        grad=dy_cols,
                        lhs_scale=x_cols_scale,
                        grad_scale=dy_cols_scale,
                        group_sizes=sizes,
                    )
                ],
            )


def _router_cases(shape: MoEShape, info, generator: torch.Generator):
    """The four token-block router kernels at the shape's (T, E, K), fp32 logits: DeepSeek-style sigmoid with
    8 groups for dsv3, softmax otherwise (the cache key is (T, E, K), so one scoring per shape)."""
    T, E, K = shape.num_tokens, shape.num_experts, shape.topk
    grouped = shape.name == "dsv3"
    scoring = dict(
        score_function="sigmoid" if grouped else "softmax", use_pre_softmax=False, scaling_factor=1.0
    )
    routing = dict(
        scoring,
        num_groups=8 if grouped else 0,
        group_topk=4 if grouped else 0,
        has_bias=grouped,
        return_indices=False,
    )
    sets = []
    for _ in range(input_sets(8 * T * E)):
        logits = torch.randn(T, E, device="cuda", generator=generator)
        bias = torch.randn(E, device="cuda", generator=generator) if grouped else None
        forward = kernels.topk_plan(num_tokens=T, num_experts=E, topk=K, **routing, device=info)
        _, routing_map, _ = run_plan(forward, dict(logits=logits, bias=bias), logits.device)
        sets.append(
            dict(
                logits=logits,
                bias=bias,
                routing_map=routing_map,
                grad_probs=torch.randn(T, E, device="cuda", generator=generator),
                grad_scores=torch.randn(T, E, device="cuda", generator=generator),
            )
        )
    common = dict(num_tokens=T, num_experts=E)
    score = routing["score_function"]
    yield (
        "router_topk",
        dict(common, topk=K),
        lambda c: kernels.topk_plan(**common, topk=K, **routing, device=info, config=c),
        sets,
    )
    yield (
        "router_topk_backward",
        dict(common, topk=K),
        lambda c: kernels.topk_backward_plan(**common, topk=K, **scoring, device=info, config=c),
        sets,
    )
    yield (
        "router_aux_scores",
        dict(common, topk=K),
        lambda c: kernels.aux_scores_plan(**common, topk=K, score_function=score, device=info, config=c),
        sets,
    )
    yield (
        "router_aux_scores_backward",
        common,
        lambda c: kernels.aux_scores_backward_plan(**common, score_function=score, device=info, config=c),
        sets,
    )


def _user_cache() -> Path:
    """The default output folder: a per-user cache folder, so a sweep never rewrites the package's cache
    unless asked."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moetriton" / "autotune_cache"


def _load(path: Path, kernel: str, info: kernels.DeviceInfo) -> dict:
    fresh = dict(
        kernel=kernel,
        device=info.name,
        arch=info.arch,
        num_sms=info.num_sms,
        triton=triton.__version__,
        source_hash=autotune.source_hash(kernel),
        entries={},
    )
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("triton") == fresh["triton"] and data.get("source_hash") == fresh["source_hash"]:
            return data
        print(f"{path}: stale (Triton {data.get('triton')}, hash {data.get('source_hash')}); retuning")
    return fresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join(NAMED_SHAPES))
    parser.add_argument("--kinds", default="mask,indices")
    parser.add_argument("--kernels", default=",".join(autotune.KERNEL_SOURCES))
    parser.add_argument("--out", default=None, help=f"output folder (default {_user_cache()})")
    parser.add_argument(
        "--update-package-cache",
        action="store_true",
        help=f"write into the package's cache ({autotune.cache_root()}) instead of a user folder",
    )
    parser.add_argument("--budget", type=float, default=math.inf, help="stop after this many seconds")
    parser.add_argument("--replays", type=int, default=10, help="graph replays per config (median)")
    parser.add_argument("--retune", action="store_true", help="time the selected keys again, replacing them")
    args = parser.parse_args(argv)
    if args.out is not None and args.update_package_cache:
        parser.error("--out and --update-package-cache exclude each other")
    out_root = autotune.cache_root() if args.update_package_cache else Path(args.out or _user_cache())
    if not torch.cuda.is_available():
        print("autotuning needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    device_name = device_info(device).name
    out_dir = out_root / autotune.device_dir(device_name)
    print(f"writing {out_dir}")
    committed = autotune.cache_root() / autotune.device_dir(device_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    if committed.is_dir() and committed.resolve() != out_dir.resolve():
        for file in committed.glob("*.json"):
            if not (out_dir / file.name).exists():
                shutil.copy(file, out_dir / file.name)
    wanted = set(args.kernels.split(","))

    caches: dict[str, dict] = {}  # kernel -> its cache file's contents, loaded once
    retuned: dict[str, set[str]] = {}  # kernel -> keys timed by this run

    def cache(kernel: str) -> dict:
        if kernel not in caches:
            caches[kernel] = _load(out_dir / f"{kernel}.json", kernel, device_info(device))
            retuned.setdefault(kernel, set())
        return caches[kernel]

    def tuned(kernel: str, features: dict) -> dict | None:
        entry = cache(kernel)["entries"].get(autotune.key_of(features))
        return entry and entry["best"]

    started = time.monotonic()
    work = [(shape, kind) for shape in args.shapes.split(",") for kind in args.kinds.split(",")]
    with tqdm(total=len(work), desc="keys", unit="shape") as progress:
        for shape_name, kind in work:
            for kernel, features, make_plan, sets in _cases(NAMED_SHAPES[shape_name], kind, device, tuned):
                if kernel not in wanted:
                    continue
                path = out_dir / f"{kernel}.json"
                data = cache(kernel)
                key = autotune.key_of(features)
                if key in data["entries"] and not (args.retune and key not in retuned[kernel]):
                    continue
                retuned[kernel].add(key)
                if time.monotonic() - started > args.budget:
                    print(f"budget of {args.budget:.0f} s spent; rerun to resume")
                    return 0
                timings = {}
                configs = kernels.SEARCH_SPACES[kernel].configs()
                for config in configs:
                    plan = make_plan(config)
                    try:
                        ms = time_graph(
                            [lambda s=s, plan=plan: run_plan(plan, s, device) for s in sets],
                            replays=args.replays,
                        )
                    except Exception as error:  # a config the compiler cannot fit is recorded, not fatal
                        ms = math.inf
                        progress.write(f"{kernel} {key} {config}: {type(error).__name__}: {error}"[:200])
                    timings[autotune.key_of(config)] = ms
                best = min(configs, key=lambda config: timings[autotune.key_of(config)])
                ms = timings[autotune.key_of(best)]
                data["entries"][key] = dict(features=features, best=best, ms=ms, timings=timings)
                path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
                progress.write(f"{kernel:<17} {shape_name:<8} {kind:<8} {ms * 1e3:8.1f} us  {best}")
            progress.update()
    return 0


if __name__ == "__main__":
    sys.exit(main())
