#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Without a CUDA GPU the kernels run under the Triton
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and the tests that need a GPU are skipped; the
# summary lists every skip with its reason. Extra arguments go to pytest, e.g. a quick subset:
#     HYPOTHESIS_PROFILE=quick bash scripts/run_tests.sh tests/torch/test_permutation.py
# TEST_WORKERS sets the number of pytest-xdist workers (default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
python -m pytest -q -rs -n "${TEST_WORKERS:-2}" "$@"
