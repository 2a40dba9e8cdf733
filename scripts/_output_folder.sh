# Sourced by the scripts that take an output folder first (gpu_check.sh, te_jax_tests.sh,
# te_torch_tests.sh), right after their `set -uo pipefail` line. Without the folder, or with an option
# first, it prints the calling script's header comment (its usage) and exits 2. Otherwise it sets `repo`
# (this checkout), makes the folder, sets `dest` to its absolute path and shifts it off the arguments.
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1" && dest=$(cd "$1" && pwd)
shift
