#!/usr/bin/env bash
# Copy TransformerEngine's own tests out of a TE git directory (a clone or a bare mirror) into .te/ of this
# checkout (git-ignored): its JAX permutation and router tests into .te/tests/jax/, for
# scripts/te_jax_tests.sh, and its PyTorch permutation test into .te/tests/pytorch/, for
# scripts/te_torch_tests.sh. Each folder gets a REVISION file with the commit the files came from.
#
#     bash scripts/fetch_te_tests.sh TE_GIT_DIR [REV]          (REV default HEAD)
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
te_git=$1
revision=$(git -C "$te_git" rev-parse "${2:-HEAD}")
copy() {  # copy FOLDER FILE...: TE's tests/FOLDER/FILE into .te/tests/FOLDER/
  local folder=$1 dest=$repo/.te/tests/$1
  shift
  mkdir -p "$dest"
  for name in "$@"; do
    git -C "$te_git" show "$revision:tests/$folder/$name" > "$dest/$name"
  done
  echo "$revision" > "$dest/REVISION"
  echo "TE $revision: $* -> $dest"
}
copy jax test_permutation.py test_fused_router.py test_distributed_permutation.py test_distributed_router.py
copy pytorch test_permutation.py
