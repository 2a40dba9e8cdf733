"""What the MoE layers keep for their backward: the exact bytes autograd saves, counted on CPU.

    python -m benchmarks.saved_bytes                 # every layer shape, both frameworks
    python -m benchmarks.saved_bytes --list          # every saved tensor with its shape

Nothing is computed: PyTorch runs the layer on meta tensors under `torch.autograd.graph.saved_tensors_hooks`
(every tensor an autograd node saves passes the hook), JAX traces `jax.vjp` of the layer on abstract arrays
and reads its residuals (`saved_residuals`). The layer's arguments (x, the router and expert weights) are not
counted: the previous layer and the optimizer hold them anyway. Counted as a GPU step runs: bf16, dropless,
EP = 1, SwiGLU, the PyTorch experts on torch._grouped_mm (its support check reads a CUDA device's compute
capability, so the meta run takes the GPU's path). Each row gives the bytes, the elements per routed slot
(T * K slots) and, for comparison, what the backward cannot cheaply rebuild: the gate/up output, 2F elements
per slot. Writes <out>/device-independent/saved_bytes.csv (the counts depend on the code, not on a device).
"""

from __future__ import annotations

import argparse
import math

from moetriton.kernels.rules.shapes import MOE_LAYER_SHAPES, MoELayerShape

from .common import add_out_option, write_results

#: The results folder: the counts depend on the code, not on a device.
DEVICE = "device-independent"
TINY = MoELayerShape("tiny", 64, 32, 24, 8, 2)


def _layer_options(shape: MoELayerShape) -> dict:
    return dict(
        topk=shape.topk,
        score_function=shape.score_function,
        num_groups=shape.num_groups,
        group_topk=shape.group_topk,
        aux_loss_coeff=1e-2,
    )


def torch_saved(shape: MoELayerShape) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, bytes) of every tensor the PyTorch layer saves for its backward, arguments excluded."""
    import torch

    import moetriton.torch as mt
    from moetriton.torch.moe import experts

    def meta(*size):
        return torch.empty(*size, device="meta", dtype=torch.bfloat16, requires_grad=True)

    arguments = (
        meta(1, shape.num_tokens, shape.hidden),
        meta(shape.num_experts, shape.hidden),
        meta(shape.num_experts, shape.hidden, 2 * shape.ffn),
        meta(shape.num_experts, shape.ffn, shape.hidden),
    )
    owned = {id(argument) for argument in arguments}
    saved = []

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in owned:
            saved.append(
                (
                    tuple(tensor.shape),
                    str(tensor.dtype).removeprefix("torch."),
                    tensor.numel() * tensor.element_size(),
                )
            )
        return tensor

    supported = experts.grouped_mm_supported
    experts.grouped_mm_supported = lambda *tensors: True  # the GPU's path (see the module docstring)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            mt.moe(*arguments, **_layer_options(shape))
    finally:
        experts.grouped_mm_supported = supported
    return saved


def jax_saved(shape: MoELayerShape) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, bytes) of every residual of the JAX layer's vjp, arguments excluded."""
    import jax
    import jax.numpy as jnp

    from moetriton.jax import moe

    try:
        from jax.ad_checkpoint import saved_residuals
    except ImportError:  # JAX 0.10 exports only the printing form
        from jax._src.ad_checkpoint import saved_residuals

    def abstract(*size):
        return jax.ShapeDtypeStruct(size, jnp.bfloat16)

    def step(x, gate, gate_up, down):
        out, aux_loss, _ = moe(x, gate, gate_up, down, **_layer_options(shape))
        return jnp.sum(out.astype(jnp.float32)) + aux_loss

    residuals = saved_residuals(
        step,
        abstract(1, shape.num_tokens, shape.hidden),
        abstract(shape.hidden, shape.num_experts),
        abstract(shape.num_experts, shape.hidden, 2 * shape.ffn),
        abstract(shape.num_experts, shape.ffn, shape.hidden),
    )
    return [
        (tuple(aval.shape), str(aval.dtype), math.prod(aval.shape) * aval.dtype.itemsize)
        for aval, source in residuals
        if not source.startswith("from the argument")
    ]


COUNTERS = {"torch": torch_saved, "jax": jax_saved}


def row(framework: str, shape: MoELayerShape) -> tuple[dict, list]:
    saved = COUNTERS[framework](shape)
    slots = shape.num_tokens * shape.topk
    total = sum(size for _, _, size in saved)
    needed = slots * 2 * shape.ffn * 2  # the gate/up output, bf16
    return (
        dict(
            framework=framework,
            shape=shape.name,
            tokens=shape.num_tokens,
            saved_tensors=len(saved),
            saved_bytes=total,
            saved_elements_per_slot=total / 2 / slots,
            needed_elements_per_slot=2 * shape.ffn,
            ratio_to_needed=total / needed,
        ),
        saved,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", default=",".join(MOE_LAYER_SHAPES), help="MOE_LAYER_SHAPES names, or tiny"
    )
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--list", action="store_true", help="print every saved tensor")
    add_out_option(parser)
    args = parser.parse_args(argv)
    shapes = {**MOE_LAYER_SHAPES, "tiny": TINY}
    rows = []
    for name in args.shapes.split(","):
        if name not in shapes:
            parser.error(f"--shapes: expected names from {sorted(shapes)}, got {name!r}")
        for framework in args.frameworks.split(","):
            if framework not in COUNTERS:
                parser.error(f"--frameworks: expected names from {sorted(COUNTERS)}, got {framework!r}")
            result, saved = row(framework, shapes[name])
            rows.append(result)
            print(
                f"{framework:<6} {name:<8} {result['saved_tensors']:>3} tensors"
                f" {result['saved_bytes'] / 1e9:8.3f} GB"
                f"  {result['saved_elements_per_slot']:9.0f} elements per slot"
                f" (needed {result['needed_elements_per_slot']}: x{result['ratio_to_needed']:.2f})"
            )
            for tensor_shape, dtype, size in saved if args.list else ():
                print(f"    {dtype:<9} {list(tensor_shape)!s:<22} {size / 1e6:10.2f} MB")
    print(f"wrote {write_results('saved_bytes', rows, DEVICE, 1, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
