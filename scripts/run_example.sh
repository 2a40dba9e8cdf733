#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main example: a toy MoE layer from PyTorch and from JAX, forward and
# backward, checked against the pure-framework references and timed (examples/run.py; GPU if present, else
# small shapes on CPU under the Triton interpreter). Extra arguments go to examples/run.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
python examples/run.py "$@"
