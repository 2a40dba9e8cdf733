"""Launch plans that tests of several folders build (plans are framework-neutral): a dispatch plan with
defaults for the arguments most tests hold fixed, and the plans of the config sweeps, which run every
config of every permutation kernel's search space through the PyTorch executor
(tests/kernels/test_configs.py) and through the JAX one (tests/jax/test_configs.py) on the same problem."""

from __future__ import annotations

from moetriton import kernels

#: What a dispatch plan gets unless a test says otherwise: bf16 tokens routed by a mask, without probs or
#: scales, into an unpadded buffer.
_DISPATCH_DEFAULTS = dict(is_mask=True, element_bytes=2, has_probs=False, scale_cols=None, align_size=None)


def dispatch_plan_with_defaults(**arguments) -> kernels.Plan:
    """kernels.dispatch_plan of `arguments` over `_DISPATCH_DEFAULTS`; a mask's slots are its experts, so a
    mask dispatch needs no num_slots."""
    arguments = {**_DISPATCH_DEFAULTS, **arguments}
    if arguments["is_mask"]:
        arguments.setdefault("num_slots", arguments["num_experts"])
    return kernels.dispatch_plan(**arguments)


#: The config sweeps' problem: tokens, columns, experts and slots per token of its expert ids.
NUM_TOKENS, HIDDEN, NUM_EXPERTS, TOPK = 7, 40, 5, 2
#: The chunk sorts' problem: rows, and the sizes of the chunks in order and the order they go in.
SORT_ROWS, SORT_SPLIT_SIZES, SORT_ORDER = 23, [4, 0, 7, 3, 5], [2, 4, 0, 3, 1]


def distinct_configs(name: str, interpreted: bool) -> list[dict]:
    """The configs of kernel `name`'s search space; under the interpreter, where num_warps has no effect,
    configs that differ only in num_warps once."""
    configs = kernels.SEARCH_SPACES[name].configs()
    if interpreted:
        unique = {tuple(sorted((k, v) for k, v in c.items() if k != "num_warps")): c for c in configs}
        configs = list(unique.values())
    return configs


def sweep_dispatch_plan(kind: str, align_size: int | None, config: dict) -> kernels.Plan:
    """The sweep's bf16 dispatch with probs by a "mask" or by expert ids ("indices"), with `config` for the
    row-map kernel or for the dispatch kernel (whichever's parameters it holds)."""
    name = "row_map" if set(config) <= set(kernels.SEARCH_SPACES["row_map"].params) else "dispatch"
    return dispatch_plan_with_defaults(
        num_tokens=NUM_TOKENS,
        hidden=HIDDEN,
        num_slots=NUM_EXPERTS if kind == "mask" else TOPK,
        num_experts=NUM_EXPERTS,
        is_mask=kind == "mask",
        num_out_tokens=NUM_TOKENS * TOPK,
        align_size=align_size,
        has_probs=True,
        config={name: config},
    )


def _sweep_row_sizes(num_rows: int) -> dict:
    """The sizes of the sweep's plans over a buffer of `num_rows` bf16 rows and the row map to it."""
    return dict(num_tokens=NUM_TOKENS, hidden=HIDDEN, num_slots=TOPK, num_rows=num_rows, element_bytes=2)


def sweep_combine_plan(num_rows: int, weighted: bool, config: dict) -> kernels.Plan:
    """The sweep's bf16 combine of `num_rows` rows: weighted, or unweighted and gathering the probs
    (dispatch's backward)."""
    return kernels.combine_plan(
        **_sweep_row_sizes(num_rows), has_weights=weighted, gather_probs=not weighted, config=config
    )


def sweep_combine_backward_plan(num_rows: int, padded: bool, config: dict) -> kernels.Plan:
    """The sweep's bf16 weighted combine's backward over `num_rows` rows, padded or not."""
    return kernels.combine_backward_plan(**_sweep_row_sizes(num_rows), padded=padded, config=config)


def sweep_sort_chunks_plan(backward: bool, config: dict) -> kernels.Plan:
    """The sweep's bf16 chunk sort with probs of SORT_ROWS rows in len(SORT_SPLIT_SIZES) chunks, or its
    backward."""
    sizes = dict(num_rows=SORT_ROWS, hidden=HIDDEN, num_splits=len(SORT_SPLIT_SIZES), element_bytes=2)
    return kernels.sort_chunks_plan(**sizes, has_probs=True, backward=backward, config=config)
