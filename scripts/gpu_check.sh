#!/usr/bin/env bash
# GPU check: the test suite, a memory check of the kernels and the benchmarks on the GPUs of this machine,
# run as stages, with every log and result written to one output folder.
#
#     bash scripts/gpu_check.sh OUTDIR [STAGE...]          (default stages: tests bench)
#
# It runs in the Python environment it finds (PYTHON, default python3: torch with CUDA, jax with its CUDA
# plugin) and installs nothing into it. This checkout's package is put on the import path from a
# temporary folder (its source folders under their import names), so the checkout is what is tested,
# whatever else is installed. If jax_triton is not importable and JAX_TRITON_WHEELS names a folder of
# wheels, they are unpacked into that temporary folder (pip --no-index --no-deps --target); without
# jax_triton the JAX tests and benchmarks of the kernels cannot run on the GPU. TE_PATH may name a folder
# that holds an importable transformer_engine (its Triton permutation kernels), for the comparisons.
# Every stage runs in a process group of its own, under a time limit; when it ends, whatever that group
# left running is ended, and nothing else is.
#
# Stages (each writes OUTDIR/<stage>.log; results files go to OUTDIR/results/<gpu>/<name>.csv, the layout
# of benchmarks/results, so copying them there updates the committed results):
#   tests       the test suite on the GPU (TEST_PATHS, default tests; TEST_WORKERS xdist workers, default 8;
#               stopped with SIGINT after TESTS_TIMEOUT s, default 1800, so pytest still writes its report):
#               OUTDIR/junit.xml, and OUTDIR/tests_not_run.txt lists the collected tests without a result.
#               On GPUs the property tests draw 100 examples each (tests/conftest.py); HYPOTHESIS_PROFILE=ci
#               draws CI's 25: on two H100s with 16 workers the suite took over 515 s with 100, and its
#               slowest tests were JAX property tests (up to 149 s each)
#   sanitize    compute-sanitizer --tool memcheck over pytest, one run per file of SANITIZE_TESTS (default
#               "tests/torch/test_index_safety.py tests/jax/test_index_safety.py"), with the frameworks'
#               caching allocators off so an out-of-bounds access inside a cached block is seen;
#               OUTDIR/sanitize_summary.txt gives the error count per file and in total
#   bench       python -m benchmarks.run (BENCH_ARGS): every op, framework and named shape
#   eager       the same with --modules benchmarks.eager_cases (EAGER_ARGS): host, eager and graph time,
#               beside TransformerEngine where importable
#   moe1        the MoE layer examples and layer-step benchmarks on one GPU (benchmarks.moe_torch,
#               benchmarks.moe_jax; MOE_TORCH_ARGS, MOE_JAX_ARGS)
#   transformers  the transformers experts backend on one GPU: examples/transformers_moe.py, then
#               benchmarks.transformers_backend (step time and peak memory with moetriton, grouped_mm and
#               eager experts; TRANSFORMERS_ARGS); needs transformers in the Python environment
#   fp8         the FP8 grouped GEMMs and quantizers: benchmarks.fp8_grouped_gemm (FP8_ARGS), beside the
#               bf16 grouped GEMM and a dense FP8 GEMM of the same run
#   moe2        the same with EP = 2 over two GPUs (torchrun for PyTorch, one process for JAX)
#   overlap     on two GPUs, how much exchange time compute hides: benchmarks.studies.exchange_overlap (each
#               transport beside the experts' GEMMs), then the layer steps plain, with a shared expert and in
#               two pipelined token chunks (benchmarks.moe_torch, both exchanges, and benchmarks.moe_jax at
#               EP = 2), whose exposed_exchange_ms columns show what the shared experts and the chunks hide
#               (OVERLAP_ARGS, MOE_TORCH_ARGS, MOE_JAX_ARGS)
#   scaling     the EP examples over all GPUs, then the layer-step benchmarks at every EP of MOE_EP (default
#               1 2 4 8, those the GPUs allow): one torchrun per EP for PyTorch, one JAX run for all; parts
#               SCALING_PARTS (default "examples torch jax"); `python -m benchmarks.report --tables scaling
#               --root OUTDIR/results` gives the weak-scaling table
#   ab          same-process A/B of the permutation kernels against another version of them
#               (AB_BASELINE, a copy of the kernels/permutation/ folder; AB_ARGS): OUTDIR/ab.csv
#   ab_package  same-process A/B of the whole package against another version: AB_PACKAGE_ROOT, a folder
#               holding another checkout's source folders (e.g. from git archive), or AB_PACKAGE_REV, a
#               revision of this git checkout; host and eager time per call of the PyTorch ops
#               (benchmarks.ab_package, AB_PACKAGE_ARGS, default --shapes tiny --rounds 10):
#               OUTDIR/ab_package.csv
#   interleave  the study benchmarks.studies.interleave_te: our permutation kernels against TE's, interleaved
#               in one process (needs TE; INTERLEAVE_SHAPES): OUTDIR/studies/<gpu>/interleave_te.csv, the
#               layout of benchmarks/studies/results
#   ncu         Nsight Compute counters of the combine kernels beside TE's, from the study
#               benchmarks.studies.profile_kernels (NCU_SHAPES): OUTDIR/ncu.txt
#   te_jax      TransformerEngine's JAX permutation and router tests against moetriton.jax.te
#               (scripts/te_jax_tests.sh; TE's files in .te/tests/jax, from scripts/fetch_te_tests.sh, or
#               TE_TESTS; NVTE_JAX_UNITTEST_LEVEL, default L0; TE_JAX_ARGS go to pytest):
#               OUTDIR/te_jax/te_jax_junit.xml and te_jax.log
#   te_torch    TransformerEngine's PyTorch permutation test against moetriton.torch
#               (scripts/te_torch_tests.sh; TE's file in .te/tests/pytorch, from scripts/fetch_te_tests.sh,
#               or TE_TESTS; TE_TORCH_ARGS go to pytest): OUTDIR/te_torch/te_torch_junit.xml and te_torch.log
#   autotune    scripts/autotune.py into OUTDIR/autotune_cache (AUTOTUNE_ARGS); the stages after it in the
#               same call use the new cache
# Each stage's time limit is <STAGE>_TIMEOUT seconds (e.g. BENCH_TIMEOUT). The exit status is that of the
# last failing stage, 0 if none failed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_output_folder.sh"
outdir=$dest
stages=${*:-tests bench}
PY=${PYTHON:-python3}

# NVLink multicast stays off: on a host whose GPUs others share, a program using it can take them out of
# service. Set here so that every process a stage starts (torchrun's workers included) inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Test workers and benchmarks share the GPUs: JAX must not take 75% of a GPU's memory per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPYCACHEPREFIX=$work/pycache HYPOTHESIS_STORAGE_DIRECTORY=$work/hypothesis
[ -n "${HOME:-}" ] || export TRITON_CACHE_DIR=$work/triton

# This checkout's package under its import names, without installing it; a copy of the autotune cache, so
# that the autotune stage can extend it without touching the checkout.
mkdir -p "$work/site/moetriton"
ln -s "$repo/moetriton/__init__.py" "$work/site/moetriton/__init__.py"
ln -s "$repo/kernels" "$work/site/moetriton/kernels"
ln -s "$repo/torch_bindings" "$work/site/moetriton/torch"
ln -s "$repo/jax_bindings" "$work/site/moetriton/jax"
cp -r "$repo/autotune_cache" "$work/site/moetriton/autotune_cache"
export PYTHONPATH=$work/site${TE_PATH:+:$TE_PATH}${PYTHONPATH:+:$PYTHONPATH}

has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  if ! has_module jax_triton && [ -n "${JAX_TRITON_WHEELS:-}" ]; then
    echo "jax_triton not importable: unpacking $JAX_TRITON_WHEELS/*.whl into the temporary import path"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$JAX_TRITON_WHEELS"/*.whl
  fi
  "$PY" - <<'EOF'
import importlib.metadata as metadata
import platform

found = {"python": platform.python_version()}
for name in ("torch", "triton", "jax", "jaxlib", "jax-triton", "transformer_engine"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        found[name] = "-"
import torch

print(" ".join(f"{key} {value}" for key, value in found.items()), f"cuda GPUs {torch.cuda.device_count()}")
EOF
  has_module jax_triton || echo "jax_triton is not importable (set JAX_TRITON_WHEELS): JAX kernels cannot run on GPUs"
} 2>&1 | tee "$outdir/environment.txt"

# run LIMIT LOG COMMAND...: COMMAND in a process group of its own (timeout makes one), its output in LOG;
# SIGINT after LIMIT seconds, SIGKILL 30 s later; afterwards whatever is left of that group is ended.
run() {
  local limit=$1 log=$2
  shift 2
  (cd "$repo" && exec timeout -s INT -k 30 "$limit" "$@") >> "$log" 2>&1 &
  local pid=$! status
  wait "$pid"
  status=$?
  kill -KILL -- "-$pid" 2>/dev/null
  [ "$status" = 124 ] && echo "stopped after $limit s" >> "$log"
  return "$status"
}

failed=0
for stage in $stages; do
  log=$outdir/$stage.log
  : > "$log"
  echo "== $stage (log: $log)"
  limit_name=$(echo "$stage" | tr '[:lower:]' '[:upper:]')_TIMEOUT
  limit=${!limit_name:-}
  status=0
  case $stage in
    tests)
      run "${limit:-1800}" "$log" "$PY" -m pytest ${TEST_PATHS:-tests} -q -rs -p no:cacheprovider --durations=25 \
        -n "${TEST_WORKERS:-8}" --tb=short --junitxml="$outdir/junit.xml" || status=$?
      tail -40 "$log"
      # The collected tests without a result in the junit file (a run stopped at its time limit).
      (cd "$repo" && "$PY" -m pytest ${TEST_PATHS:-tests} -q -p no:cacheprovider --collect-only 2>/dev/null) \
        | grep "::" > "$work/collected.txt"
      "$PY" - "$outdir/junit.xml" "$work/collected.txt" > "$outdir/tests_not_run.txt" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree

done = set()
try:
    for case in ElementTree.parse(sys.argv[1]).iter("testcase"):
        done.add(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
except (OSError, ElementTree.ParseError):
    pass
collected = [line.strip() for line in open(sys.argv[2]) if "::" in line]
missing = [test for test in collected if test not in done]
print(f"{len(missing)} of {len(collected)} collected tests have no result")
print("\n".join(missing))
EOF
      head -1 "$outdir/tests_not_run.txt" ;;
    te_jax)
      run "${limit:-1800}" "$log" env PYTHON="$PY" bash scripts/te_jax_tests.sh "$outdir/te_jax" \
        ${TE_JAX_ARGS:-} || status=$?
      tail -20 "$log" ;;
    te_torch)
      run "${limit:-1800}" "$log" env PYTHON="$PY" bash scripts/te_torch_tests.sh "$outdir/te_torch" \
        ${TE_TORCH_ARGS:-} || status=$?
      tail -20 "$log" ;;
    sanitize)
      total=0
      : > "$outdir/sanitize_summary.txt"
      for file in ${SANITIZE_TESTS:-tests/torch/test_index_safety.py tests/jax/test_index_safety.py}; do
        if [ ! -f "$repo/$file" ]; then
          echo "$file: not found, skipped" | tee -a "$outdir/sanitize_summary.txt"
          continue
        fi
        : > "$work/sanitize_part.log"
        # One inductor compile thread: its worker pool would outlive pytest, and the sanitizer waits for it.
        run "${limit:-1200}" "$work/sanitize_part.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
          TORCHINDUCTOR_COMPILE_THREADS=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck --target-processes all \
          "$PY" -m pytest "$file" -q -rs -p no:cacheprovider -p no:xdist --tb=short
        file_status=$?
        { echo "--- $file"; cat "$work/sanitize_part.log"; } >> "$log"
        # The count of the last summary line ("========= ERROR SUMMARY: N errors").
        errors=$(grep -o "ERROR SUMMARY: [0-9]*" "$work/sanitize_part.log" | tail -1 | grep -o "[0-9]*$")
        echo "$file: ${errors:-unknown} memcheck errors, pytest exit status $file_status" \
          | tee -a "$outdir/sanitize_summary.txt"
        total=$((total + ${errors:-0}))
        if [ -z "$errors" ] || [ "$errors" != 0 ] || [ "$file_status" != 0 ]; then status=1; fi
      done
      echo "total: $total memcheck errors" | tee -a "$outdir/sanitize_summary.txt" ;;
    bench)
      run "${limit:-900}" "$log" "$PY" -m benchmarks.run --out "$outdir/results" ${BENCH_ARGS:-} || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    eager)
      run "${limit:-900}" "$log" "$PY" -m benchmarks.run --modules benchmarks.eager_cases --out "$outdir/results" \
        ${EAGER_ARGS:-} || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    moe1)
      run "${limit:-900}" "$log" bash -c '
        set -e
        "$0" examples/torch_moe_ep.py
        "$0" examples/jax_moe_ep.py
        "$0" -m benchmarks.moe_torch --out "$1/results" ${MOE_TORCH_ARGS:-}
        "$0" -m benchmarks.moe_jax --ep 1 --isolate "${MOE_ROW_TIMEOUT:-300}" --out "$1/results" ${MOE_JAX_ARGS:-}
      ' "$PY" "$outdir" || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    transformers)
      run "${limit:-900}" "$log" bash -c '
        set -e
        "$0" examples/transformers_moe.py
        "$0" -m benchmarks.transformers_backend --out "$1/results" ${TRANSFORMERS_ARGS:-}
      ' "$PY" "$outdir" || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    fp8)
      run "${limit:-900}" "$log" "$PY" -m benchmarks.fp8_grouped_gemm --out "$outdir/results" ${FP8_ARGS:-} \
        || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    moe2)
      run "${limit:-1200}" "$log" bash -c '
        set -e
        "$0" -m torch.distributed.run --nproc-per-node 2 examples/torch_moe_ep.py
        "$0" examples/jax_moe_ep.py
        "$0" -m torch.distributed.run --nproc-per-node 2 -m benchmarks.moe_torch --out "$1/results" \
          ${MOE_TORCH_ARGS:-}
        "$0" -m benchmarks.moe_jax --ep 1,2 --isolate "${MOE_ROW_TIMEOUT:-300}" --out "$1/results" \
          ${MOE_JAX_ARGS:-}
      ' "$PY" "$outdir" || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    overlap)
      run "${limit:-1200}" "$log" bash -c '
        set -e
        "$0" -m torch.distributed.run --nproc-per-node 2 -m benchmarks.studies.exchange_overlap \
          --out "$1/studies" ${OVERLAP_ARGS:-}
        "$0" -m torch.distributed.run --nproc-per-node 2 -m benchmarks.moe_torch \
          --variants plain,shared,pipeline2 --impl moetriton,moetriton_a2a --out "$1/results" ${MOE_TORCH_ARGS:-}
        "$0" -m benchmarks.moe_jax --ep 2 --impl moetriton --variants plain,shared,pipeline2 \
          --isolate "${MOE_ROW_TIMEOUT:-300}" --out "$1/results" ${MOE_JAX_ARGS:-}
      ' "$PY" "$outdir" || status=$?
      grep -v -i warn "$log" | tail -40 ;;
    scaling)
      gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
      sizes=""
      for size in ${MOE_EP:-1 2 4 8}; do [ "$size" -le "$gpus" ] && sizes="$sizes $size"; done
      run "${limit:-1800}" "$log" bash -c '
        set -e
        for part in ${SCALING_PARTS:-examples torch jax}; do
          case $part in
            examples)
              "$0" -m torch.distributed.run --nproc-per-node "$2" examples/torch_moe_ep.py
              "$0" examples/jax_moe_ep.py ;;
            torch)
              for size in $3; do
                "$0" -m torch.distributed.run --nproc-per-node "$size" -m benchmarks.moe_torch \
                  --out "$1/results" ${MOE_TORCH_ARGS:-}
              done ;;
            jax)
              "$0" -m benchmarks.moe_jax --ep "$(echo $3 | tr " " ,)" --isolate "${MOE_ROW_TIMEOUT:-300}" \
                --out "$1/results" ${MOE_JAX_ARGS:-} ;;
          esac
        done
      ' "$PY" "$outdir" "$gpus" "$sizes" || status=$?
      grep -v -i warn "$log" | tail -60 ;;
    ab)
      if [ -z "${AB_BASELINE:-}" ]; then
        echo "AB_BASELINE (a copy of kernels/permutation/) is not set; skipped" | tee -a "$log"
        status=1
      else
        run "${limit:-900}" "$log" "$PY" -m benchmarks.ab_permutation "$(realpath "$AB_BASELINE")" ${AB_ARGS:-} \
          || status=$?
        grep -v -i "warn\|chosen =" "$log" > "$outdir/ab.csv"
        grep "best\|^#" "$outdir/ab.csv"
      fi ;;
    ab_package)
      baseline=${AB_PACKAGE_ROOT:-}
      if [ -z "$baseline" ] && [ -n "${AB_PACKAGE_REV:-}" ]; then
        baseline=$work/ab_baseline
        mkdir -p "$baseline"
        git -C "$repo" archive "$AB_PACKAGE_REV" | tar -x -C "$baseline" || baseline=""
      fi
      if [ -z "$baseline" ]; then
        echo "neither AB_PACKAGE_ROOT nor a usable AB_PACKAGE_REV is set; skipped" | tee -a "$log"
        status=1
      else
        run "${limit:-900}" "$log" "$PY" -m benchmarks.ab_package "$(realpath "$baseline")" \
          ${AB_PACKAGE_ARGS:---shapes tiny --rounds 10} --out "$outdir/ab_package.csv" || status=$?
        grep -v -i warn "$log" | tail -20
      fi ;;
    interleave)
      if ! has_module transformer_engine; then
        echo "transformer_engine is not importable (set TE_PATH); skipped" | tee -a "$log"
      else
        run "${limit:-600}" "$log" "$PY" -m benchmarks.studies.interleave_te --out "$outdir/studies" \
          --shapes "${INTERLEAVE_SHAPES:-qwen3,mixtral,dsv3,small,tiny}" || status=$?
        grep -v -i warn "$log" | tail -20
      fi ;;
    ncu)
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
      if [ -z "$ncu_bin" ]; then
        echo "ncu (Nsight Compute) not found; skipped" | tee -a "$log"
        status=1
      else
        run "${limit:-600}" "$log" "$ncu_bin" --clock-control none \
          --kernel-name regex:'_combine_kernel|_unpermute_kernel' --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats \
          --section WarpStateStats --section SourceCounters -f -o "$outdir/ncu" \
          "$PY" -m benchmarks.studies.profile_kernels --shapes "${NCU_SHAPES:-qwen3,dsv3,mixtral}" || status=$?
        "$ncu_bin" --import "$outdir/ncu.ncu-rep" --page details --print-units base > "$outdir/ncu.txt" 2>&1
        "$ncu_bin" --import "$outdir/ncu.ncu-rep" --page raw --csv > "$outdir/ncu_raw.csv" 2>&1
        grep -E "^  [_a-z]|Duration|DRAM Throughput|Achieved Occupancy|Registers Per" "$outdir/ncu.txt" | head -60
      fi ;;
    autotune)
      run "${limit:-1800}" "$log" "$PY" scripts/autotune.py --out "$outdir/autotune_cache" ${AUTOTUNE_ARGS:-} \
        || status=$?
      tail -20 "$log"
      [ -d "$outdir/autotune_cache" ] && cp -r "$outdir/autotune_cache/." "$work/site/moetriton/autotune_cache/" ;;
    *)
      echo "unknown stage $stage (see: bash scripts/gpu_check.sh --help)"
      status=2 ;;
  esac
  echo "== $stage: exit status $status"
  [ "$status" = 0 ] || failed=$status
done
exit "$failed"
