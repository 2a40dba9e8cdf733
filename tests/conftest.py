"""Test session set-up: pick the device, use the Triton interpreter on CPU, load the hypothesis profile.

Runs before any test module imports moetriton, so TRITON_INTERPRET=1 is in place before kernels are
compiled. On a machine with a CUDA GPU the same tests run against compiled kernels.
"""

import os

from hypothesis import HealthCheck, settings


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # a JAX-only environment: ask JAX
        import jax

        return jax.default_backend() == "gpu"


# Several test workers share one GPU: JAX must not grab 75% of its memory per process up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ON_GPU = _has_cuda()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["MOETRITON_TEST_DEVICE"] = "cuda" if ON_GPU else "cpu"

# Deterministic for CI (derandomize); the GPU profile explores more examples, still reproducibly.
_common = dict(
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=25, **_common)
settings.register_profile("gpu", max_examples=100, **_common)
settings.register_profile("quick", max_examples=5, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if ON_GPU else "ci"))
