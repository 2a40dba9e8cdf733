#!/usr/bin/env bash
# Set-up, sourced by run_example.sh and run_tests.sh (or run on its own): a virtual environment .venv with
# moetriton installed from this checkout (editable) and its extras. It installs only when something changed:
# a stamp in .venv records the hash of pyproject.toml, the extras and the Python version of the last
# install, and a later run with the same stamp installs nothing and prints nothing.
#
# Environment:
#   MOETRITON_SYSTEM_SITE=1   create .venv with --system-site-packages: a CUDA torch, GPU jax or jax-triton
#                             installed in the Python that creates it is seen and kept (pip adds only what
#                             is missing). Use it on a GPU machine whose Python already has them.
#   MOETRITON_EXTRAS          extras to install (default torch,jax,test,bench)
#   PYTHON                    the interpreter that creates .venv (default python3)
# Without a torch in .venv (or, with MOETRITON_SYSTEM_SITE=1, in the system Python) torch 2.13.0 is
# installed from the package index. Install output goes to .venv/setup.log, shown only if it fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras=${MOETRITON_EXTRAS:-torch,jax,test,bench}
if [ ! -x .venv/bin/python ]; then
  flags=()
  [ "${MOETRITON_SYSTEM_SITE:-0}" = 1 ] && flags+=(--system-site-packages)
  "${PYTHON:-python3}" -m venv "${flags[@]}" .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=$( (sha256sum pyproject.toml; echo "$extras"; python -V) | sha256sum | cut -c1-16)
if [ "$(cat .venv/.moetriton-setup 2>/dev/null)" != "$stamp" ] || ! python -c "import moetriton.kernels" 2>/dev/null
then
  echo "setup: installing moetriton[$extras] from this checkout into .venv (log: .venv/setup.log)"
  if ! {
    python -m pip install -q --upgrade pip
    python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[$extras]"
  } > .venv/setup.log 2>&1; then
    cat .venv/setup.log
    echo "setup: failed (log above)" >&2
    exit 1
  fi
  echo "$stamp" > .venv/.moetriton-setup
fi
