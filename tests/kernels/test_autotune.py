"""The autotune cache: committed files parse and hold only search-space configs, keyed by the features the
plan builders look up; lookups resolve exactly, by nearest bucket, or not at all; a stale cache is reported
once and still used; a GPU without a cache of its own uses the closest same-architecture GPU's, and says so
once."""

import json
import warnings

import pytest
import triton

from moetriton import kernels
from moetriton.kernels.runtime import autotune
from tests._plans import dispatch_plan_with_defaults

TEST_GPU = kernels.DeviceInfo("Test GPU 80GB", 132, arch="sm_90")


def _cache_files():
    return sorted(autotune.cache_root().glob("*/*.json"))


@pytest.mark.parametrize("path", _cache_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_cache_holds_only_search_space_configs(path):
    data = json.loads(path.read_text())
    space = kernels.SEARCH_SPACES[data["kernel"]]
    configs = space.configs()
    assert data["entries"], path
    assert data["arch"].startswith("sm_") and data["num_sms"] > 0
    for key, entry in data["entries"].items():
        assert key == autotune.key_of(entry["features"])
        assert entry["best"] in configs, (key, entry["best"])
        assert entry["ms"] == min(entry["timings"].values())


def _looked_up_features(monkeypatch) -> dict[str, set[tuple[str, ...]]]:
    """kernel -> the feature-name sets its plan builders pass to the cache lookup, over every variant the
    autotuner tunes apart (weighted / gathering combine, mask / index routing, forward / backward sorts)."""
    seen: dict[str, set[tuple[str, ...]]] = {}

    def record(kernel, features, device):
        seen.setdefault(kernel, set()).add(tuple(sorted(features)))
        return None

    monkeypatch.setattr(autotune, "lookup", record)
    device = kernels.DeviceInfo("Feature Probe GPU", 132, arch="sm_90")  # a fresh key for every @cached plan
    for is_mask in (True, False):
        kernels.dispatch_plan(
            num_tokens=64, hidden=256, num_slots=8 if is_mask else 2, num_experts=8, is_mask=is_mask,
            num_out_tokens=128, element_bytes=2, has_probs=True, scale_cols=None, device=device,
        )  # fmt: skip
    for has_weights, gather_probs in ((True, False), (False, False), (False, True)):
        kernels.combine_plan(
            num_tokens=64, hidden=256, num_slots=8, num_rows=512, element_bytes=2, has_weights=has_weights,
            gather_probs=gather_probs, device=device,
        )  # fmt: skip
    kernels.combine_backward_plan(
        num_tokens=64, hidden=256, num_slots=8, num_rows=128, padded=False, element_bytes=2, device=device
    )
    for backward in (False, True):
        kernels.sort_chunks_plan(
            num_rows=128, hidden=256, num_splits=8, element_bytes=2, has_probs=True, backward=backward,
            device=device,
        )  # fmt: skip
    router = dict(num_tokens=64, num_experts=16, topk=2, score_function="softmax", device=device)
    kernels.topk_plan(
        **router, use_pre_softmax=False, num_groups=1, group_topk=1, scaling_factor=1.0, has_bias=False,
        return_indices=True,
    )  # fmt: skip
    kernels.topk_backward_plan(**router, use_pre_softmax=False, scaling_factor=1.0)
    kernels.aux_scores_plan(**router)
    router.pop("topk")
    kernels.aux_scores_backward_plan(**router)
    gemm = dict(num_rows=256, depth=256, num_cols=128, num_groups=4, device=device)
    for recipe in ("tensorwise", "blockwise"):
        for data_gradient in (False, True):
            kernels.fp8_grouped_matmul_plan(recipe=recipe, data_gradient=data_gradient, **gemm)
        kernels.fp8_grouped_matmul_wgrad_plan(recipe=recipe, **gemm)
    return seen


@pytest.mark.parametrize("path", _cache_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_cache_was_tuned_for_the_kernels_code(path):
    """A kernel edit leaves every committed cache of it stale (users would be warned on every run) until it
    is retuned, or re-stamped after the compiled code is shown unchanged."""
    data = json.loads(path.read_text())
    assert data["source_hash"] == autotune.source_hash(data["kernel"]), (
        f"{path}: kernel code changed since this cache was written; rerun scripts/autotune.py"
    )


def test_committed_cache_keys_carry_the_features_the_plans_look_up(monkeypatch):
    looked_up = _looked_up_features(monkeypatch)
    for path in _cache_files():
        data = json.loads(path.read_text())
        assert data["kernel"] in looked_up, f"{path}: no plan builder probed here looks this kernel up"
        for key, entry in data["entries"].items():
            assert tuple(sorted(entry["features"])) in looked_up[data["kernel"]], (path.name, key)


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    device_dir = tmp_path / autotune.device_dir("Test GPU 80GB")
    device_dir.mkdir()
    entries = {}
    for num_tokens, block_h in ((1024, 512), (16384, 4096)):
        features = dict(
            num_tokens=num_tokens, hidden=2048, num_slots=8, element_bytes=2, weighted=1, gather=0
        )
        entries[autotune.key_of(features)] = dict(
            features=features, best=dict(block_h=block_h, num_warps=8), ms=0.1, timings={"x": 0.1}
        )
    data = dict(
        kernel="combine",
        device="Test GPU 80GB",
        arch="sm_90",
        num_sms=132,
        triton=triton.__version__,
        source_hash=autotune.source_hash("combine"),
        entries=entries,
    )
    (device_dir / "combine.json").write_text(json.dumps(data))
    monkeypatch.setattr(autotune, "cache_root", lambda: tmp_path)
    autotune._load.cache_clear()
    yield device_dir / "combine.json"
    autotune._load.cache_clear()


def test_lookup_exact_nearest_and_none(fake_cache):
    features = dict(num_tokens=16384, hidden=2048, num_slots=8, element_bytes=2, weighted=1, gather=0)
    assert autotune.lookup("combine", features, TEST_GPU) == dict(block_h=4096, num_warps=8)
    assert autotune.lookup("combine", dict(features, num_tokens=2048), TEST_GPU)["block_h"] == 512
    assert autotune.lookup("combine", dict(features, num_tokens=8192), TEST_GPU)["block_h"] == 4096
    assert autotune.lookup("combine", dict(features, element_bytes=4), TEST_GPU) is None
    assert autotune.lookup("combine", dict(features, weighted=0), TEST_GPU) is None
    assert autotune.lookup("combine", features, kernels.DeviceInfo("Other GPU", 132, arch="sm_80")) is None
    plan = kernels.combine_plan(
        num_tokens=16384,
        hidden=2048,
        num_slots=8,
        num_rows=16384 * 8,
        element_bytes=2,
        has_weights=True,
        gather_probs=False,
        device=TEST_GPU,
    )
    assert plan.launches[0].constexprs["BLOCK_H"] == 2048 and plan.launches[0].num_warps == 8


def test_a_user_cache_folder_is_read_before_the_packages(fake_cache, tmp_path, monkeypatch):
    """MOETRITON_AUTOTUNE_CACHE (scripts/autotune.py's output folder) wins over the package's cache."""
    data = json.loads(fake_cache.read_text())
    for entry in data["entries"].values():
        entry["best"] = dict(entry["best"], block_h=1024)
    user = tmp_path / "user"
    (user / fake_cache.parent.name).mkdir(parents=True)
    (user / fake_cache.parent.name / fake_cache.name).write_text(json.dumps(data))
    features = dict(num_tokens=16384, hidden=2048, num_slots=8, element_bytes=2, weighted=1, gather=0)
    monkeypatch.setenv("MOETRITON_AUTOTUNE_CACHE", str(user))
    autotune._load.cache_clear()
    assert autotune.lookup("combine", features, TEST_GPU)["block_h"] == 1024
    monkeypatch.delenv("MOETRITON_AUTOTUNE_CACHE")
    autotune._load.cache_clear()
    assert autotune.lookup("combine", features, TEST_GPU)["block_h"] == 4096


def test_a_gpu_without_a_cache_borrows_the_closest_of_its_architecture(fake_cache):
    features = dict(num_tokens=16384, hidden=2048, num_slots=8, element_bytes=2, weighted=1, gather=0)
    sibling = kernels.DeviceInfo("Test GPU 141GB", 132, arch="sm_90")
    with pytest.warns(UserWarning, match="no autotune cache for Test GPU 141GB.*Test_GPU_80GB"):
        assert autotune.lookup("combine", features, sibling) == dict(block_h=4096, num_warps=8)
    with warnings.catch_warnings():  # said once
        warnings.simplefilter("error")
        assert autotune.lookup("combine", features, sibling) == dict(block_h=4096, num_warps=8)
    # Another architecture does not borrow: its heuristic decides.
    assert autotune.lookup("combine", features, kernels.DeviceInfo("Test GPU 2", 132, arch="sm_100")) is None


def test_stale_cache_is_reported_once_and_still_used(fake_cache):
    data = json.loads(fake_cache.read_text())
    data["triton"] = "0.0.0"
    fake_cache.write_text(json.dumps(data))
    features = dict(num_tokens=1024, hidden=2048, num_slots=8, element_bytes=2, weighted=1, gather=0)
    with pytest.warns(UserWarning, match="stale"):
        assert autotune.lookup("combine", features, TEST_GPU)["block_h"] == 512
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.lookup("combine", features, TEST_GPU)["block_h"] == 512


def test_dispatch_plan_consults_the_cache_for_both_of_its_kernels(tmp_path, monkeypatch):
    device_dir = tmp_path / autotune.device_dir("Test GPU 80GB")
    device_dir.mkdir()
    features = {
        "row_map": dict(num_tokens=4096, num_slots=64, num_experts=64, is_mask=1),
        "dispatch": dict(num_tokens=4096, hidden=1024, num_slots=64, element_bytes=2),
    }
    best = {"row_map": dict(block_tokens=32, num_warps=8), "dispatch": dict(block_bytes=2048, num_warps=16)}
    for kernel in ("row_map", "dispatch"):
        entry = dict(features=features[kernel], best=best[kernel], ms=0.1, timings={"x": 0.1})
        data = dict(
            kernel=kernel,
            device="Test GPU 80GB",
            triton=triton.__version__,
            source_hash=autotune.source_hash(kernel),
            entries={autotune.key_of(features[kernel]): entry},
        )
        (device_dir / f"{kernel}.json").write_text(json.dumps(data))
    monkeypatch.setattr(autotune, "cache_root", lambda: tmp_path)
    autotune._load.cache_clear()
    try:
        plan = dispatch_plan_with_defaults(
            num_tokens=4096,
            hidden=1024,
            num_experts=64,
            num_out_tokens=4096 * 4,
            has_probs=True,
            device=TEST_GPU,
        )
    finally:
        autotune._load.cache_clear()
    count, _, dispatch = plan.launches
    assert count.constexprs["BLOCK_T"] == 32 and count.num_warps == 8 and count.grid == (4096 // 32,)
    # The ranks inside dispatch use the same token blocks as the counts.
    assert dispatch.constexprs["BLOCK_T"] == 32
    assert dispatch.constexprs["BLOCK_H"] == 1024 and dispatch.num_warps == 16


_KERNEL = '''@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """Grid (cdiv(n, BLOCK),): doubles x."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # one tile
    for _ in range(2):
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * 2, mask=offsets < n, cache_modifier=".cs")
    tl.debug_barrier()
'''


@pytest.mark.parametrize(
    ("edit", "same"),
    [
        (('"""Grid (cdiv(n, BLOCK),): doubles x."""', '"""Another docstring,\n    two lines."""'), True),
        (("# one tile", "# the program's tile, explained at length"), True),
        (("    offsets =", "\n    offsets ="), True),  # a blank line
        (("x_ptr + offsets) * 2", "x_ptr + offsets) * 3"), False),
        (('".cs"', '".cg"'), False),  # a string that is code, not a docstring
        (("    tl.debug_barrier()", "        tl.debug_barrier()"), False),  # moved into the loop
    ],
)
def test_the_cache_hash_follows_code_not_prose(edit, same):
    """Editing a kernel's docstring or comments leaves the hash (and the cache tuned for the code) fresh;
    any change of code, indentation included, makes it stale."""
    edited = _KERNEL.replace(*edit)
    assert edited != _KERNEL
    assert (autotune._code(edited) == autotune._code(_KERNEL)) is same


def test_the_cache_hash_reads_f_strings_alike_on_every_python():
    """Python 3.12 tokenizes an f-string in parts: they are joined back into the one string token older
    versions give, so the hash of a function does not depend on the interpreter that computed it."""
    code = autotune._code('def _f(x):\n    return f"{x}-{x!r:>4}" + f"{f\'{x}\'}"\n')
    assert 'STRING:f"{x}-{x!r:>4}" OP:+' in code
    assert code.count("STRING:") == 2
