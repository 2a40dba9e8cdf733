#!/usr/bin/env bash
# Copy TransformerEngine's JAX permutation and router tests out of a TE git directory (a clone or a bare
# mirror) into .te/tests/jax/ of this checkout (git-ignored), for scripts/te_jax_tests.sh.
#
#     bash scripts/fetch_te_tests.sh TE_GIT_DIR [REV]          (REV default HEAD)
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=$repo/.te/tests/jax
mkdir -p "$dest"
files="test_permutation.py test_fused_router.py test_distributed_permutation.py test_distributed_router.py"
for name in $files; do
  git -C "$1" show "${2:-HEAD}:tests/jax/$name" > "$dest/$name"
done
git -C "$1" rev-parse "${2:-HEAD}" > "$dest/REVISION"
echo "TE $(cat "$dest/REVISION"): 4 test files in $dest"
