"""Does an XLA flag make the ragged all-to-all as fast as the padded exchange? No (history.md 29).

    python -m benchmarks.studies.exchange_jax_flags [--shapes mixtral,dsv3] [--steps 10]

benchmarks.exchange_jax (the JAX layer's ragged and padded exchanges beside a plain all_to_all) once per
variant of XLA's ragged all-to-all flags below, each in its own subprocess: XLA reads its flags once per
process, and an unknown flag aborts it. A variant that fails is a row with its error. Writes
<out>/<n>x_<gpu>/exchange_jax_flags.csv (benchmarks.studies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# benchmarks.common and benchmarks.exchange_jax import no JAX: its flags are set per child.
from benchmarks.common import exchange_parser
from benchmarks.exchange_jax import write_rows
from benchmarks.studies import RESULTS_ROOT

ROOT = Path(__file__).resolve().parents[2]

FLAG_VARIANTS = (
    "",
    "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false",
    "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true",
    "--xla_gpu_ragged_all_to_all_mode=symmetric",
)


def main() -> int:
    parser = exchange_parser(__doc__)
    parser.set_defaults(out=RESULTS_ROOT)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:  # the children's own results files
        for flags in FLAG_VARIANTS:
            env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
            command = [sys.executable, "-m", "benchmarks.exchange_jax", "--shapes", args.shapes]
            command += ["--steps", str(args.steps), "--tokens", str(args.tokens), "--out", scratch]
            result = subprocess.run(
                command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
            )
            sys.stdout.write(result.stdout)
            rows += [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
            if result.returncode != 0:
                rows.append(dict(flags=flags, error=result.stderr[-600:].replace("\n", " ")))
                print(json.dumps(rows[-1]), flush=True)
    write_rows("exchange_jax_flags", rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
