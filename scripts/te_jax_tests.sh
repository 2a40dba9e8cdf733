#!/usr/bin/env bash
# Run TransformerEngine's own JAX permutation and router tests against moetriton.jax.te: TE's
# test_permutation.py, test_fused_router.py, test_distributed_permutation.py and test_distributed_router.py,
# unchanged, with our stand-ins for the helpers they import (tests/te_jax: conftest, utils,
# distributed_test_base) and transformer_engine.jax.permutation / .router bound to moetriton.jax.te.
#
#     bash scripts/te_jax_tests.sh DEST [PYTEST_ARGS...]
#
# TE_TESTS names the folder with TE's test files (default .te/tests/jax, filled by
# scripts/fetch_te_tests.sh). NVTE_JAX_UNITTEST_LEVEL picks TE's parameter lists (L0 default, L2 full).
# JAX sees TE_JAX_HOST_DEVICES host CPU devices (default 8) so that the distributed tests have meshes on
# a CPU; on GPUs the distributed tests use the GPUs there are. moetriton must be importable (installed,
# or on PYTHONPATH as scripts/gpu_check.sh puts it). Writes DEST/te_jax_junit.xml and DEST/te_jax.log;
# the exit status is pytest's.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_output_folder.sh"
te_tests=${TE_TESTS:-$repo/.te/tests/jax}
files="test_permutation.py test_fused_router.py test_distributed_permutation.py test_distributed_router.py"

# TE's files and our helpers side by side in a folder of their own: the tests import their helpers as
# top-level modules (utils, distributed_test_base, test_permutation), and our suite never sees them.
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
for name in $files; do
  if [ ! -f "$te_tests/$name" ]; then
    echo "$te_tests/$name not found: run scripts/fetch_te_tests.sh TE_GIT_DIR first (or set TE_TESTS)" >&2
    exit 2
  fi
  cp "$te_tests/$name" "$run_dir/"
done
cp "$repo/tests/te_jax/te_conftest.py" "$run_dir/conftest.py"
cp "$repo/tests/te_jax/utils.py" "$repo/tests/te_jax/distributed_test_base.py" "$run_dir/"

export NVTE_JAX_UNITTEST_LEVEL=${NVTE_JAX_UNITTEST_LEVEL:-L0}
export XLA_FLAGS="--xla_force_host_platform_device_count=${TE_JAX_HOST_DEVICES:-8}${XLA_FLAGS:+ $XLA_FLAGS}"
revision=$(cat "$te_tests/REVISION" 2>/dev/null || echo "revision unknown")
echo "TE tests from $te_tests ($revision), level $NVTE_JAX_UNITTEST_LEVEL" | tee "$dest/te_jax.log"
(cd "$run_dir" && "${PYTHON:-python3}" -m pytest $files -q -rs -p no:cacheprovider --rootdir "$run_dir" \
  --junitxml "$dest/te_jax_junit.xml" "$@") 2>&1 | tee -a "$dest/te_jax.log"
exit "${PIPESTATUS[0]}"
