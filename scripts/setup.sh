#!/usr/bin/env bash
# All set-up on a fresh machine: a .venv with moetriton (editable) and its extras. Sourced by the scripts
# below; safe to run again. A torch already in the environment is kept (install your CUDA build first on a
# GPU machine); otherwise torch 2.13.0 is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[torch,jax,test,bench]"
