#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Without a GPU the kernels run under the Triton
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
python -m pytest tests -q -n "${TEST_WORKERS:-2}" "$@"
