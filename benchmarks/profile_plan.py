"""Times every launch of an op's plan on its own (CUDA-graph replays), to see where an op spends its time.

python -m benchmarks.profile_plan [--shapes ...] [--op dispatch]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

import moetriton.torch as mt
from benchmarks.common import shape_dispatch_plan
from benchmarks.timing import time_graph
from moetriton import kernels
from moetriton.kernels.rules.shapes import NAMED_SHAPES
from moetriton.torch.executor import device_info, run_plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default=",".join(NAMED_SHAPES))
    parser.add_argument("--kinds", default="mask,indices")
    args = parser.parse_args()
    device = torch.device("cuda")
    for shape_name in args.shapes.split(","):
        shape = NAMED_SHAPES[shape_name]
        T, H, E, K = shape.num_tokens, shape.hidden, shape.num_experts, shape.topk
        for kind in args.kinds.split(","):
            scores = torch.rand(T, E, device=device)
            ids = scores.topk(K, dim=1).indices
            routing = (
                torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
                if kind == "mask"
                else ids.int()
            )
            inputs = dict(
                inp=torch.randn(T, H, device=device, dtype=torch.bfloat16),
                routing=routing,
                probs=torch.rand(routing.shape, device=device),
                scales=None,
            )
            plan = shape_dispatch_plan(shape, is_mask=kind == "mask", device=device_info(device))
            # Each launch as a one-launch plan through the executor, its inputs the earlier launches' outputs.
            env = dict(inputs)
            parts = []
            for launch in plan.launches:
                single = kernels.Plan(
                    {name: plan.buffers[name] for name in launch.outputs}, (launch,), launch.outputs
                )
                env.update(zip(launch.outputs, run_plan(single, env, device), strict=True))
                ms = time_graph([lambda single=single, now=dict(env): run_plan(single, now, device)] * 4)
                parts.append(f"{launch.kernel.fn.__name__}{launch.grid}: {ms * 1e3:.1f} us")
            # The whole plan in one graph (gaps and, on Hopper, programmatic dependent launch included), and
            # the public op that runs it.
            ms = time_graph([lambda plan=plan, inputs=inputs: run_plan(plan, inputs, device)] * 4)
            parts.append(f"whole plan: {ms * 1e3:.1f} us")
            routed = dict(routing_map=routing) if kind == "mask" else dict(indices=routing, num_experts=E)
            op = functools.partial(
                mt.token_dispatch, inputs["inp"], num_out_tokens=T * K, probs=inputs["probs"]
            )
            ms = time_graph([lambda op=op, routed=routed: op(**routed)] * 4)
            parts.append(f"token_dispatch: {ms * 1e3:.1f} us")
            block = plan.launches[0].constexprs.get("BLOCK_T")
            print(f"{shape_name:<8} {kind:<8} block {block}: " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
