"""The main job: a toy MoE layer through moetriton from PyTorch and from JAX, checked against the references.

    python examples/run.py            # GPU if present (realistic sizes), else small shapes on CPU
    python examples/run.py --small    # small shapes anywhere

On CPU the Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set here, before any
kernel module is imported).
"""

import argparse
import os
import sys


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="small shapes even on a GPU")
    args = parser.parse_args()
    on_gpu = _has_cuda()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    small = args.small or not on_gpu
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_moe

    torch_moe.main(small)
    try:
        import jax_moe
    except ImportError as error:
        print(f"jax    skipped: {error}")
    else:
        jax_moe.main(small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
