"""One-off studies: benchmarks that answered one question about the kernels, kept because a user may want the
answer again on another GPU. The suite is benchmarks/ (benchmarks.run and the layer benchmarks); a study is
not part of it.

Each module's first docstring line states its question, the answer it gave and where that answer is
documented. A study writes its results to benchmarks/studies/results/<machine>/<name>.csv (the layout of
benchmarks/results, benchmarks.common), one file per study and machine; `--out ROOT` names another root.
"""

from pathlib import Path

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
