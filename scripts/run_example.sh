#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: the toy MoE layer from PyTorch and JAX (examples/run.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
python examples/run.py "$@"
