"""One moetriton op, two ways in: the torch.library custom op and a direct eager call.

Every op is defined once, by its implementation (what runs: the launch plan, or the reference), its fake
(shapes only), and for differentiable ops its autograd `setup` and `backward`. From these, `Op` builds:

* the torch.library custom op `moetriton::<name>`, with the fake and autograd registered: what
  torch.compile traces (fullgraph included), and what tensor subclasses (FakeTensor, DTensor, ...) reach
  through the dispatcher;
* a torch.autograd.Function over the same implementation, setup and backward.

Calling an `Op` picks one: plain tensors in eager mode (the common case of a training step) run the
implementation directly, through the autograd.Function when a gradient is needed, so the call pays none of
the dispatcher's and the custom-op wrapper's host cost (several times the kernels' own launch cost for
small shapes); anything else goes through the custom op. Both ways run the same code and give the same
results, but for results a plan marks as placeholders (probs an op was not given; never returned by the
public functions): None on the direct path, which saves their allocations, size-0 tensors from the custom
op, whose schema fixes its results.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

from moetriton import kernels

from .executor import Executable, allocate, bound, device_info, dtype_name, filling_placeholders, uses_kernels

# Types whose instances take the direct path; subclasses (FakeTensor, DTensor, quantized wrappers) do not.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Executables a PlanBinding keeps by call key (the oldest dropped first beyond this; `bound` keeps them too).
_MAX_KEYS = 1024


class PlanBinding:
    """How an op's arguments become a launch plan: `plan` (a plan builder of moetriton.kernels), `inputs`
    (a function of the op's arguments giving the plan's input tensors by name, from which the builder's
    `sized_by` declaration gives its sizes), `options` (a function of the op's arguments giving the builder's
    other arguments) and `reference` (what runs where kernels do not). The device is the first argument's.
    `run` is the op's implementation and `fake` its shapes-only twin, from the same plan, or from
    `outputs(sizes)` (the plan's output buffers, shape arithmetic only) where building the whole plan needs
    concrete sizes and torch.compile may trace with symbolic ones; `first` returns the plan's first result
    alone.

    An eager call finds its executable in the PlanBinding's own table, by a key of what the plan's arguments
    are a function of: the device, the declaration's `Sizes.key` of the inputs and the options' arguments
    (`options.key(args)`: the op's last arguments for `trailing`, else the options' items). Only a new key
    builds the arguments and goes through `bound`: the per-call path builds no argument dict and unpacks no
    keywords (building them per call costs a quarter of a small op's host time, the key and its lookup a
    small fraction of that)."""

    def __init__(
        self,
        plan: Callable[..., kernels.Plan],
        inputs: Callable[..., dict],
        options: Callable[..., dict],
        reference: Callable[..., Any],
        *,
        outputs: Callable[[dict], dict] | None = None,
        first: bool = False,
    ) -> None:
        self.plan, self.inputs, self.options, self.reference = plan, inputs, options, reference
        self.outputs, self.first = outputs, first
        self.declared = plan.sizes  # the builder's `sized_by` declaration
        self.options_key = getattr(options, "key", None) or (lambda args: tuple(options(*args).items()))
        self.executables: dict[tuple, Executable] = {}

    def sizes(self, inputs: dict, args: tuple) -> dict:
        """The plan builder's arguments for the op's `args`, whose plan inputs are `inputs`."""
        sizes = self.declared.of(inputs, dtype_name)
        sizes.update(self.options(*args))
        return sizes

    def run(self, *args):
        device = args[0].device
        if not uses_kernels(device):
            return self.reference(*args)
        inputs = self.inputs(*args)
        key = (device, self.declared.key(inputs), self.options_key(args))
        executable = self.executables.get(key)
        if executable is None:
            executable = self._bind(key, inputs, args)
        results = executable(inputs)
        return results[0] if self.first else results

    def _bind(self, key: tuple, inputs: dict, args: tuple) -> Executable:
        """The executable of a call whose key is new: its plan's arguments built and bound."""
        executable = bound(self.plan, key[0], **self.sizes(inputs, args))
        if len(self.executables) >= _MAX_KEYS:
            self.executables.pop(next(iter(self.executables)), None)
        self.executables[key] = executable
        return executable

    def fake(self, *args):
        device, inputs = args[0].device, self.inputs(*args)
        sizes = self.sizes(inputs, args)
        if self.outputs is None:
            plan = self.plan(**sizes, device=device_info(device))
        else:
            outputs = self.outputs(sizes)
            plan = kernels.Plan(outputs, (), tuple(outputs))
        return fake_results(plan, inputs, device)[0 if self.first else slice(None)]


def trailing(*names: str | None) -> Callable[..., dict]:
    """`PlanBinding.options` for ops whose last arguments are plan options: those arguments by `names`, in
    order (None skips an argument the plan does not take). Its `key(args)` is those last arguments, all the
    options are a function of."""
    # (position counted from the end, name) of each named argument, found once.
    named = tuple((index - len(names), name) for index, name in enumerate(names) if name is not None)

    def options(*args) -> dict:
        return {name: args[position] for position, name in named}

    # A slice taken in C: no Python frame on the eager path.
    options.key = operator.itemgetter(slice(-len(names), None) if names else slice(0, 0))
    return options


def fake_results(plan: kernels.Plan, inputs: dict, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The results of `plan` as uninitialised tensors (sizes may be symbolic): every op's fake."""
    buffers = allocate(plan, inputs, device, fake=True)
    return tuple(buffers[name] for name in plan.results)


def zeros_like_meta(meta: tuple) -> torch.Tensor:
    """Zeros of a tensor known by (shape, dtype, device): the gradient of an unused output, when another
    output's gradient needs a partner. (Tensors themselves are not kept on ctx: an output kept there would
    form a reference cycle with its grad_fn.)"""
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


class Op:
    """An op built from its implementation; call it like the implementation."""

    def __init__(
        self,
        name: str,
        impl: Callable[..., Any],
        fake: Callable[..., Any],
        *,
        setup: Callable[..., None] | None = None,
        backward: Callable[..., tuple] | None = None,
    ) -> None:
        self.impl = impl
        self.custom = torch.library.custom_op(
            f"moetriton::{name}",
            _with_placeholders(impl),
            mutates_args=(),
            schema=torch.library.infer_schema(impl, mutates_args=()),
        )
        self.custom.register_fake(fake)
        self.function = None
        if backward is not None:
            self.custom.register_autograd(backward, setup_context=setup)
            self.function = _autograd_function(name, impl, setup, backward)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.custom(*args)
        needs_grad = False
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if type(arg) not in _PLAIN or arg.is_meta:
                    return self.custom(*args)
                needs_grad = needs_grad or arg.requires_grad
        if needs_grad and self.function is not None and torch.is_grad_enabled():
            return self.function.apply(*args)
        return self.impl(*args)


def _with_placeholders(impl: Callable[..., Any]) -> Callable[..., Any]:
    """`impl` as the custom op runs it: results a plan marks as placeholders come back as size-0 tensors
    (the schema's fixed results) where the direct eager path gets None."""

    @functools.wraps(impl)
    def run(*args, **kwargs):
        with filling_placeholders():
            return impl(*args, **kwargs)

    return run


def _autograd_function(
    name: str, impl: Callable[..., Any], setup: Callable[..., None], backward: Callable[..., tuple]
) -> type[torch.autograd.Function]:
    """A torch.autograd.Function running `impl`, then `setup(ctx, inputs, output)`, with `backward`: the
    custom op's autograd registration, as a Function. Gradients of outputs that were not used arrive as None
    (not materialised as zeros), as integer outputs never carry one."""

    def forward(ctx, *args):
        ctx.set_materialize_grads(False)
        output = impl(*args)
        setup(ctx, args, output)
        return output

    return type(
        f"{name.title().replace('_', '')}Function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
