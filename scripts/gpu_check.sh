#!/usr/bin/env bash
# One device-tool call: install what the GPU machine lacks, run the whole test suite on CUDA, run the
# benchmarks, and leave logs under $OUT. Usage (device tool, repo root): bash scripts/gpu_check.sh [stage...]
# Stages: setup (install only) smoke tests bench eager hostprof router gemm autotune usecache ab interleave jaxprof plan ncu
# exchange moe1 moe2 moe2torch moeab moeabtorch
# (default: tests bench). ncu: Nsight Compute counters of the combine kernels beside TE's (scripts/profile_kernels.py,
# NCU_SHAPES), report as $OUT/ncu.txt. gemm: the grouped-GEMM kernels beside torch._grouped_mm (GEMM_ARGS=--sweep to time configs).
# exchange: the layers' dropless row exchanges alone beside plain all-to-alls (scripts/exchange_jax.py,
# under several XLA_FLAGS unless EXCHANGE_ARGS=--one; scripts/exchange_torch.py under torchrun; 2 GPUs). moe1: the MoE layer examples and layer-step benchmarks on one GPU; moe2: the same with EP = 2 on two GPUs
# (torchrun for PyTorch, one process for JAX, each of its rows in a child process killed after
# MOE_ROW_TIMEOUT s); their logs and CSVs come back as $OUT/moe.tar. moe2torch: moe2's PyTorch half alone (the
# example under torchrun, then the layer-step benchmark, every rank's traces kept), as $OUT/moe.tar.
# moeab: the JAX layer's step (benchmarks.moe_jax, EP = MOE_AB_EP, default 2 on 2 GPUs) of this package and of
# another one (MOE_AB_BASELINE, a carried package folder), alternated MOE_AB_ROUNDS times; lines in $OUT/moeab.log,
# CSVs in $OUT/moeab/. moeabtorch: the same for the PyTorch layer (benchmarks.moe_torch under torchrun, this
# checkout's benchmark for both packages; $OUT/moeabtorch.log and $OUT/moeabtorch/).
# interleave: dispatch backward, combine and combine backward, ours and TE's, timed interleaved in one process
# (scripts/interleave_te.py, INTERLEAVE_SHAPES), as $OUT/interleave.csv; needs the carried `.te`.
# ab: same-process A/B of the permutation kernels against another version of kernels/permutation.py
# (AB_BASELINE, a carried file; AB_ARGS), table as $OUT/ab.csv.
# usecache copies what autotune wrote into the installed package, so later stages of the same call run with
# the new cache. Carry `.whl` (the jax-triton wheel) and, to benchmark TransformerEngine's Triton kernels
# beside ours, `.te` (a folder holding an importable `transformer_engine.pytorch.triton.permutation`; never
# committed).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent machines (a program using it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HOME=${HOME:-/root} TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
stages=${*:-tests bench}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 | tail -2
} > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site
[ -d .te ] && export PYTHONPATH=$PYTHONPATH:$PWD/.te
cd /tmp  # import the installed package, not the source folders
python3 -c "import torch, triton, jax; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices())" | tee -a "$OUT/setup.log"
repo=$OLDPWD
for stage in $stages; do
  case $stage in
    setup) ;;
    smoke) python3 "$repo/scripts/gpu_smoke.py" 2>&1 | tee "$OUT/smoke.log" ;;
    tests) (cd "$repo" && timeout -s INT -k 30 ${TEST_TIMEOUT:-420} python3 -m pytest ${TEST_PATHS:-tests} -q -p no:cacheprovider --durations=25 \
              -n ${TEST_WORKERS:-8} --maxfail=${MAXFAIL:-30} --tb=short -rfE -W ignore::pytest.PytestWarning \
              --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1; grep -v Warning "$OUT/tests.log" | tail -80
            # Workers outliving a timed-out run would load the host under the eager timings that follow.
            pkill -9 -f xdist; pkill -9 -f pytest
            # A run stopped at TEST_TIMEOUT (SIGINT: pytest still writes its durations and the junit file):
            # the tests it did not finish, by name.
            python3 -m pytest ${TEST_PATHS:-tests} -q -p no:cacheprovider --collect-only 2>/dev/null | grep "::" \
              | python3 scripts/tests_not_run.py "$OUT/junit.xml" > "$OUT/tests_not_run.txt"
            tail -30 "$OUT/tests_not_run.txt"; true) ;;
    bench) (cd "$repo" && timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks.run --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log") ;;
    eager) (cd "$repo" && timeout ${EAGER_TIMEOUT:-300} python3 -m benchmarks.run --modules benchmarks.eager_cases \
              --out "$OUT/eager" ${EAGER_ARGS:-} 2>&1 | tee "$OUT/eager.log"
            tar -C "$OUT" -cf "$OUT/eager.tar" eager && rm -r "$OUT/eager") ;;
    hostprof) (cd "$repo" && timeout ${HOSTPROF_TIMEOUT:-120} python3 scripts/profile_host.py ${HOSTPROF_ARGS:-} \
                 > "$OUT/hostprof.log" 2>&1; tail -40 "$OUT/hostprof.log") ;;
    ncu) (cd "$repo" && ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
          timeout ${NCU_TIMEOUT:-240} "$ncu_bin" --clock-control none --kernel-name regex:'_combine_kernel|_unpermute_kernel' \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section SchedulerStats --section WarpStateStats --section SourceCounters -f -o "$OUT/ncu" \
            python3 scripts/profile_kernels.py --shapes ${NCU_SHAPES:-qwen3,dsv3,mixtral} > "$OUT/ncu_run.log" 2>&1
          tail -5 "$OUT/ncu_run.log"
          "$ncu_bin" --import "$OUT/ncu.ncu-rep" --page details --print-units base > "$OUT/ncu.txt" 2>&1
          "$ncu_bin" --import "$OUT/ncu.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>&1
          rm -f "$OUT/ncu.ncu-rep"  # too large to bring back; the two text pages hold what it says
          grep -E "^  [_a-z]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -120) ;;
    usecache) cp -r /tmp/cache/. /tmp/site/moetriton/autotune_cache/ ;;
    interleave) (cd "$repo" && timeout ${INTERLEAVE_TIMEOUT:-200} python3 scripts/interleave_te.py \
                   --shapes ${INTERLEAVE_SHAPES:-qwen3,mixtral,dsv3,small,tiny} 2>&1 | grep -v -i warn \
                   | tee "$OUT/interleave.csv") ;;
    ab) (cd "$repo" && timeout ${AB_TIMEOUT:-300} python3 scripts/ab_permutation.py "$AB_BASELINE" ${AB_ARGS:-} 2>&1 \
           | grep -v -i "warn\|chosen =" | tee "$OUT/ab.csv" | grep "best\|^#") ;;
    jaxprof) (cd "$repo" && timeout ${JAXPROF_TIMEOUT:-150} python3 scripts/profile_jax.py --hlo "$OUT/hlo.txt" \
                ${JAXPROF_ARGS:-} > "$OUT/jaxprof.log" 2>&1; tail -80 "$OUT/jaxprof.log") ;;
    plan) (cd "$repo" && timeout ${PLAN_TIMEOUT:-150} python3 scripts/profile_plan.py ${PLAN_ARGS:-} 2>&1 | tee "$OUT/plan.log") ;;
    gemm) (cd "$repo" && timeout ${GEMM_TIMEOUT:-300} python3 -m benchmarks.grouped_gemm --out "$OUT" ${GEMM_ARGS:-} \
             2>&1 | tee "$OUT/gemm.log") ;;
    router) (cd "$repo" && timeout ${ROUTER_TIMEOUT:-300} python3 -m benchmarks.router_cases 2>&1 | tee "$OUT/router.log") ;;
    autotune) (cd "$repo" && timeout ${AUTOTUNE_TIMEOUT:-500} python3 scripts/autotune.py --out /tmp/cache ${AUTOTUNE_ARGS:-} \
                 > "$OUT/autotune.log" 2>&1; tail -45 "$OUT/autotune.log"; tar -C /tmp/cache -cf "$OUT/autotune_cache.tar" .) ;;
    exchange) (cd "$repo" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${EXCHANGE_TIMEOUT:-300} \
                 python3 scripts/exchange_jax.py ${EXCHANGE_ARGS:-}
               timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 scripts/exchange_torch.py; } 2>&1 \
                 | grep -v -i warn | tee "$OUT/exchange.log") ;;
    moe1) (cd "$repo" && mkdir -p "$OUT/moe" && {
            timeout ${MOE_EXAMPLE_TIMEOUT:-120} python3 examples/torch_moe_ep.py
            timeout ${MOE_EXAMPLE_TIMEOUT:-120} python3 examples/jax_moe_ep.py
            timeout ${MOE_TIMEOUT:-240} python3 -m benchmarks.moe_torch --out "$OUT/moe" ${MOE_TORCH_ARGS:-}
            XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOE_TIMEOUT:-240} python3 -m benchmarks.moe_jax --ep 1 \
              --isolate ${MOE_ROW_TIMEOUT:-150} --out "$OUT/moe" ${MOE_JAX_ARGS:-}
          } > "$OUT/moe/moe1.log" 2>&1; grep -v -i warn "$OUT/moe/moe1.log" | tail -40
          tar -C "$OUT" -cf "$OUT/moe.tar" moe && rm -r "$OUT/moe") ;;
    moe2) (cd "$repo" && mkdir -p "$OUT/moe" && {
            timeout ${MOE_EXAMPLE_TIMEOUT:-120} python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_moe_ep.py
            timeout ${MOE_EXAMPLE_TIMEOUT:-120} python3 examples/jax_moe_ep.py
            timeout ${MOE_TIMEOUT:-240} python3 -m torch.distributed.run --nproc-per-node 2 -m benchmarks.moe_torch \
              --out "$OUT/moe" ${MOE_TORCH_ARGS:-}
            XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOE_TIMEOUT:-600} python3 -m benchmarks.moe_jax \
              --ep ${MOE_JAX_EP:-1,2} --isolate ${MOE_ROW_TIMEOUT:-150} --out "$OUT/moe" ${MOE_JAX_ARGS:-}
          } > "$OUT/moe/moe2.log" 2>&1; grep -v -i warn "$OUT/moe/moe2.log" | tail -40
          tar -C "$OUT" -cf "$OUT/moe.tar" moe && rm -r "$OUT/moe") ;;
    moe2torch) (cd "$repo" && mkdir -p "$OUT/moe" && {
            timeout ${MOE_EXAMPLE_TIMEOUT:-120} python3 -m torch.distributed.run --nproc-per-node 2 examples/torch_moe_ep.py \
              && timeout ${MOE_TIMEOUT:-300} python3 -m torch.distributed.run --nproc-per-node 2 -m benchmarks.moe_torch \
                   --out "$OUT/moe" --trace "$OUT/moe/traces" ${MOE_TORCH_ARGS:-}
          } > "$OUT/moe/moe2torch.log" 2>&1; grep -v -i warn "$OUT/moe/moe2torch.log" | tail -40
          tar -C "$OUT" -cf "$OUT/moe.tar" moe && rm -r "$OUT/moe") ;;
    moeab) (cd "$repo" && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
              --target /tmp/site_base "$MOE_AB_BASELINE" > "$OUT/moeab_setup.log" 2>&1
            base=$(realpath "$MOE_AB_BASELINE")
            for round in $(seq ${MOE_AB_ROUNDS:-2}); do for site in /tmp/site /tmp/site_base; do
              # The baseline runs its own benchmarks/ where the folder has one (it may predate this one's imports).
              bench=$repo; [ $site = /tmp/site_base ] && [ -d "$base/benchmarks" ] && bench=$base
              (cd "$bench" && PYTHONPATH=$site:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOE_AB_TIMEOUT:-150} \
                python3 -m benchmarks.moe_jax --ep ${MOE_AB_EP:-2} --impl moetriton --out "$OUT/moeab/${site#/tmp/}_$round" \
                ${MOE_AB_ARGS:-} 2>&1 | grep "^impl=\|Error" | sed "s|^|${site#/tmp/} $round: |")
            done; done | tee "$OUT/moeab.log") ;;
    moeabtorch) (cd "$repo" && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
              --target /tmp/site_base "$MOE_AB_BASELINE" > "$OUT/moeabtorch_setup.log" 2>&1
            # Both packages run this checkout's benchmark (its columns and method), alternated.
            for round in $(seq ${MOE_AB_ROUNDS:-2}); do for site in /tmp/site /tmp/site_base; do
              PYTHONPATH=$site:/tmp/site timeout ${MOE_AB_TIMEOUT:-150} python3 -m torch.distributed.run \
                --nproc-per-node ${MOE_AB_EP:-2} -m benchmarks.moe_torch --impl moetriton \
                --out "$OUT/moeabtorch/${site#/tmp/}_$round" --trace "$OUT/moeabtorch/${site#/tmp/}_$round" \
                ${MOE_AB_ARGS:-} 2>&1 | grep "^moetriton\|Error" \
                | sed "s|^|${site#/tmp/} $round: |"
            done; done | tee "$OUT/moeabtorch.log"; tar -C "$OUT" -cf "$OUT/moeabtorch.tar" moeabtorch && rm -r "$OUT/moeabtorch") ;;
  esac
done
