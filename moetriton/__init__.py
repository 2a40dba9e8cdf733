"""moetriton: Triton kernels for Mixture-of-Experts token routing, from PyTorch and JAX.

The parts are imported by name, and importing `moetriton` alone loads neither framework:
`moetriton.torch` (PyTorch ops and the MoE layer), `moetriton.jax` (JAX ops, the MoE layer, Flax modules),
`moetriton.kernels` (the Triton kernels and their launch plans, framework-neutral).

Example:
    >>> import moetriton
    >>> isinstance(moetriton.__version__, str)
    True
"""

import importlib.metadata
import pkgutil

# The subpackages ship from their own source folders (pyproject.toml's package-dir). A checkout's root can
# stand before site-packages on sys.path (a script run from the checkout with the wheel installed): then this
# file is found there, and the extended __path__ still reaches the installed subpackages.
__path__ = pkgutil.extend_path(__path__, __name__)

try:
    __version__ = importlib.metadata.version("moetriton")
except importlib.metadata.PackageNotFoundError:  # source folders on the import path, not installed
    __version__ = "0+unknown"
