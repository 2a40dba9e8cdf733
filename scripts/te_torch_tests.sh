#!/usr/bin/env bash
# Run TransformerEngine's own PyTorch permutation test against moetriton.torch: TE's test_permutation.py,
# unchanged, with transformer_engine.pytorch and transformer_engine.common.recipe bound to our stand-ins
# (tests/te_torch: conftest, te_pytorch, te_recipe), whose six permutation functions are moetriton.torch's.
#
#     bash scripts/te_torch_tests.sh DEST [PYTEST_ARGS...]
#
# TE_TESTS names the folder with TE's test file (default .te/tests/pytorch, filled by
# scripts/fetch_te_tests.sh). On CUDA the kernels run compiled. Without CUDA the tests' "cuda" tensors are
# placed on the CPU, where the ops run the pure-PyTorch reference, or the Triton kernels interpreted when
# TRITON_INTERPRET=1 is set (1 to 6.5 min per 4096-token case on 2 cores: choose a subset with -k). TE's FP8
# tests skip (moetriton has no TE FP8 tensor types), as do its benchmarks unless RUN_BENCHMARK_TESTS=1.
# moetriton must be importable (installed, or on PYTHONPATH as scripts/gpu_check.sh puts it). Writes
# DEST/te_torch_junit.xml and DEST/te_torch.log; the exit status is pytest's.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_output_folder.sh"
te_tests=${TE_TESTS:-$repo/.te/tests/pytorch}
python=${PYTHON:-python3}
case $python in  # pytest runs from the run folder: a relative interpreter path is taken from here
  /*) ;;
  */*) python=$PWD/$python ;;
esac
name=test_permutation.py
if [ ! -f "$te_tests/$name" ]; then
  echo "$te_tests/$name not found: run scripts/fetch_te_tests.sh TE_GIT_DIR first (or set TE_TESTS)" >&2
  exit 2
fi

# TE's file and our stand-ins side by side in a folder of their own, which our suite never sees.
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
cp "$te_tests/$name" "$run_dir/"
cp "$repo/tests/te_torch/te_conftest.py" "$run_dir/conftest.py"
cp "$repo/tests/te_torch/te_pytorch.py" "$repo/tests/te_torch/te_recipe.py" "$run_dir/"

revision=$(cat "$te_tests/REVISION" 2>/dev/null || echo "revision unknown")
echo "TE tests from $te_tests ($revision), TRITON_INTERPRET=${TRITON_INTERPRET:-unset}" | tee "$dest/te_torch.log"
(cd "$run_dir" && "$python" -m pytest "$name" -q -rs -p no:cacheprovider --rootdir "$run_dir" \
  --junitxml "$dest/te_torch_junit.xml" "$@") 2>&1 | tee -a "$dest/te_torch.log"
exit "${PIPESTATUS[0]}"
