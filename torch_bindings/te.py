"""TransformerEngine-compatible names, signatures and return orders.

TE / Megatron users switch by changing an import:
    from moetriton.torch import moe_permute, moe_unpermute, ...   # instead of transformer_engine.pytorch

Differences from TE (all deliberate, see docs/te_migration.md):
- row_id_map has our format ([T, 2S + 2] int32); pass it only to moe_unpermute.
- A routed slot whose prob is 0 still carries its token (TE writes a zero row there, yet routes the gradient
  to the token); pure data movement is exact.
- Slots past num_out_tokens are dropped instead of written out of bounds; -1 in an index map never gets a
  row (TE gives -1 entries rows when num_out_tokens allows).
- moe_unpermute takes T from row_id_map; restore_shape, if given, is checked, never trusted.
- moe_unpermute with an index map and no merging_probs sums all K slots (TE assumes K = 1).
- moe_permute_and_pad_with_probs syncs with the host once (TE: twice) and checks tokens_per_expert
  against routing_map in that same sync.
"""

from __future__ import annotations

import torch

from moetriton.kernels.rules import validation
from moetriton.kernels.rules.layout import round_up

from .chunk_sort import sort_chunks_by_index
from .permutation import token_combine, token_dispatch


def moe_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
    *,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's moe_permute -> (output, row_id_map).

    map_type "mask": routing_map [T, E], num_out_tokens (>= 0) rows. map_type "index": routing_map [T, K]
    expert ids; num_out_tokens <= 0 means T * K, a smaller value drops the tail of the expert-sorted list.
    Pass `num_experts` with an index map to avoid a host sync (without it E = max id + 1 is read back).
    `max_token_num` is accepted and ignored, as in TE.

    Example:
        >>> out, row_id_map = moe_permute(torch.randn(4, 8), torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1]]),
        ...                               map_type="index", num_experts=3)
        >>> out.shape
        torch.Size([8, 8])
    """
    if map_type == "mask":
        if num_out_tokens < 0:
            raise ValueError(f"num_out_tokens: expected >= 0 with map_type='mask', got {num_out_tokens}")
        output, _, row_id_map, _, _ = token_dispatch(inp, routing_map, num_out_tokens)
        return output, row_id_map
    if map_type != "index":
        raise ValueError(f"map_type: expected 'mask' or 'index', got {map_type!r}")
    if num_experts is None:  # a host read (under torch.compile a data-dependent size, never guarded on)
        num_experts = int(routing_map.max().clamp(min=0)) + 1 if routing_map.numel() else 1
    num_rows = num_out_tokens if num_out_tokens > 0 else routing_map.numel()
    output, _, row_id_map, _, _ = token_dispatch(
        inp, None, num_rows, indices=routing_map.to(torch.int32), num_experts=num_experts
    )
    return output, row_id_map


def moe_permute_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's moe_permute_with_probs -> (output, permuted_probs, row_id_map); mask map, probs [T, E].

    Example:
        >>> mask = torch.tensor([[True, False], [True, True]])
        >>> out, pp, _ = moe_permute_with_probs(torch.randn(2, 4), torch.rand(2, 2), mask, 3)
        >>> pp.shape
        torch.Size([3])
    """
    output, permuted_probs, row_id_map, _, _ = token_dispatch(inp, routing_map, num_out_tokens, probs)
    return output, permuted_probs, row_id_map


def moe_permute_and_pad_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    align_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """TE's moe_permute_and_pad_with_probs -> (output, permuted_probs, row_id_map, pad_offsets,
    target_tokens_per_expert).

    The output has exactly sum(target) rows, as in TE, which needs that sum on the host: one sync, in which
    `tokens_per_expert` is also checked against routing_map. pad_offsets is None when no expert needs
    padding (as in TE) and int64 otherwise; target is int64. For a sync-free padded dispatch use
    token_dispatch(..., align_size=A), whose buffer has a static worst-case size.

    Example:
        >>> mask = torch.tensor([[True, False], [True, True], [False, True]])
        >>> out, pp, _, pad, target = moe_permute_and_pad_with_probs(
        ...     torch.randn(3, 4), torch.rand(3, 2), mask, mask.sum(0), 4)
        >>> out.shape, target.tolist()
        (torch.Size([8, 4]), [4, 4])
    """
    validation.check_positive("align_size", align_size)
    counts = routing_map.ne(0).sum(0)
    target = round_up(tokens_per_expert.to(counts.device), align_size)
    mismatch = (counts != tokens_per_expert.to(counts.device)).any()
    routed, padded_total, bad = torch.stack([counts.sum(), target.sum(), mismatch.long()]).tolist()
    if bad:
        raise ValueError(
            "tokens_per_expert: expected the per-expert counts of routing_map "
            f"{counts.tolist()}, got {tokens_per_expert.tolist()}"
        )
    output, permuted_probs, row_id_map, pad_offsets, _ = token_dispatch(
        inp, routing_map, routed, probs, align_size=align_size
    )
    pad_offsets = None if padded_total == routed else pad_offsets.long()
    return output[:padded_total], permuted_probs[:padded_total], row_id_map, pad_offsets, target.long()


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    restore_shape: torch.Size | tuple[int, int] | None = None,
    map_type: str = "mask",
    probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """TE's moe_unpermute -> [T, H]; merging_probs [T, E] (mask) or [T, K] (index). `probs` is TE's
    deprecated alias of merging_probs.

    Example:
        >>> x = torch.randn(4, 8)
        >>> ids = torch.tensor([[0], [1], [0], [1]])
        >>> out, row_id_map = moe_permute(x, ids, map_type="index", num_experts=2)
        >>> torch.equal(moe_unpermute(out, row_id_map, map_type="index"), x)
        True
    """
    if map_type not in ("mask", "index"):
        raise ValueError(f"map_type: expected 'mask' or 'index', got {map_type!r}")
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("probs: deprecated alias of merging_probs; pass only one of them")
        merging_probs = probs
    if restore_shape is not None and tuple(restore_shape) != (row_id_map.shape[0], inp.shape[1]):
        raise ValueError(
            f"restore_shape: expected {(row_id_map.shape[0], inp.shape[1])} (tokens of row_id_map, "
            f"hidden of inp), got {tuple(restore_shape)}"
        )
    return token_combine(inp, row_id_map, merging_probs, pad_offsets)


def moe_sort_chunks_by_index(
    inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> torch.Tensor:
    """TE's moe_sort_chunks_by_index -> output [N, H].

    Example:
        >>> x = torch.arange(3.0)[:, None]
        >>> moe_sort_chunks_by_index(x, torch.tensor([1, 2]), torch.tensor([1, 0]))[:, 0]
        tensor([1., 2., 0.])
    """
    return sort_chunks_by_index(inp, split_sizes, sorted_index)[0]


def moe_sort_chunks_by_index_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's moe_sort_chunks_by_index_with_probs -> (output [N, H], permuted_probs [N]).

    Example:
        >>> out, p = moe_sort_chunks_by_index_with_probs(torch.zeros(3, 2), torch.tensor([0.5, 0.25, 0.125]),
        ...                                              torch.tensor([1, 2]), torch.tensor([1, 0]))
        >>> p.tolist()
        [0.25, 0.125, 0.5]
    """
    output, _, permuted_probs = sort_chunks_by_index(inp, split_sizes, sorted_index, probs)
    return output, permuted_probs
