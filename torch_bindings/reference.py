"""Pure-PyTorch reference of every moetriton op: vectorised, differentiable, independent of the kernels.

Used as the test oracle, as the CPU fallback when the Triton interpreter is off, and as the benchmark
baseline. Row maps are built with a stable argsort (the kernels count and scan), combine accumulates in
fp32 in ascending slot order like the kernels, so data movement matches bit for bit.

The op-level functions (`dispatch`, `combine`, ...) return what the moetriton::* custom ops return; the
public-API mirrors (`token_dispatch`, `token_combine`, `sort_chunks_by_index`) are what tests differentiate.
"""

from __future__ import annotations

import torch

from moetriton.kernels import buffer_rows, row_map_slots
from moetriton.kernels.rules import permutation as rules
from moetriton.kernels.rules.activation import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from moetriton.kernels.rules.layout import bitmap_columns, round_up

_BIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(x: torch.Tensor) -> torch.Tensor:
    """Same-width integer view, for moving payloads (fp8 included) bit for bit."""
    return x.view(_BIT_DTYPES[x.element_size()])


def _move_rows(values: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, num_rows: int) -> torch.Tensor:
    """out[dst[i]] = values[src[i]], every other row zero; differentiable for float payloads."""
    if values.dtype.is_floating_point and values.element_size() > 1:
        out = values.new_zeros((num_rows, *values.shape[1:]))
        return out.index_put((dst,), values[src])
    out = _raw(values).new_zeros((num_rows, *values.shape[1:]))
    return out.index_put((dst,), _raw(values)[src]).view(values.dtype)


def pack_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, E] -> uint8 [T, ceil(E / 8)]: bit e % 8 of byte e // 8 is mask[:, e] (LSB first), unused high
    bits 0."""
    num_tokens, num_experts = mask.shape
    columns = bitmap_columns(num_experts)
    padded = torch.nn.functional.pad(mask.to(torch.int32), (0, columns * 8 - num_experts))
    weights = 2 ** torch.arange(8, dtype=torch.int32, device=mask.device)
    return (padded.reshape(num_tokens, columns, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bitmap(bitmap: torch.Tensor, num_experts: int) -> torch.Tensor:
    """uint8 [T, ceil(E / 8)] -> bool [T, E]: the first E bits of each row, LSB first (later bits ignored)."""
    experts = torch.arange(num_experts, device=bitmap.device)
    return ((bitmap[:, experts // 8].to(torch.int32) >> (experts % 8)) & 1) != 0


def row_map(
    routing: torch.Tensor,
    num_experts: int,
    is_mask: bool,
    num_rows: int,
    align: int,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row map [T, 2S + 2], kept rows per expert [E] and pad offsets [E] (int32). With a capacity every
    expert's block has `capacity` rows and a slot ranked past it in its expert gets no row."""
    num_tokens, num_slots = routing.shape
    device = routing.device
    if is_mask:
        valid = routing != 0
        experts = torch.arange(num_slots, device=device).expand(num_tokens, num_slots)
    else:
        # Ids outside [0, E) have no expert (compared before any narrowing; ids are int32 or int64).
        valid = (routing >= 0) & (routing < num_experts)
        experts = routing.long()
    flat = torch.where(valid, experts, num_experts).reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    aligned = torch.full_like(counts, capacity) if capacity is not None else round_up(counts, align)
    start = torch.cumsum(aligned, 0) - aligned
    plain_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    rank = torch.arange(flat.numel(), device=device) - torch.cat([plain_start, zero])[sorted_experts]
    rows = torch.empty_like(flat)
    rows[order] = torch.cat([start, zero])[sorted_experts] + rank
    ranks = torch.empty_like(flat)
    ranks[order] = rank
    keep = valid.reshape(-1) & (rows < num_rows) & ((ranks < capacity) if capacity is not None else True)
    rows = torch.where(keep, rows, -1)
    end = aligned.sum().clamp(max=num_rows)
    kept = (num_rows - start).clamp(min=0).minimum(aligned)
    rows = rows.view(num_tokens, num_slots)
    has_row = rows >= 0
    # The lists: slots with a row first (ascending), then -1, and their rows in the same order.
    slot_ids = torch.arange(num_slots, device=device).expand(num_tokens, num_slots)
    listed = torch.sort(torch.where(has_row, slot_ids, num_slots + slot_ids), dim=1).values
    listed_rows = torch.gather(rows, 1, listed % num_slots) if num_slots else rows
    listed_rows = torch.where(listed < num_slots, listed_rows, -1)
    listed = torch.where(listed < num_slots, listed, -1)
    counts = has_row.sum(1, keepdim=True)
    full_map = torch.cat([listed_rows, listed, counts, end.expand(num_tokens, 1)], dim=1).int()
    return full_map, kept.int(), (start - plain_start).int()


def _lists(row_id_map: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row map's two lists, int64 [T, S] each: the rows of each token's slots that have one and those
    slots, in ascending slot order, then -1. Read by the index rule of the kernels (docs/design.md): only
    the first `count` entries (clamped into [0, S]) are listed, a row outside [0, num_rows) makes its entry
    unlisted, and a slot outside [0, S) reads as -1 (weight 0)."""
    num_slots = row_map_slots(row_id_map.shape[1])
    listed_rows = row_id_map[:, :num_slots].long()
    listed = row_id_map[:, num_slots : 2 * num_slots].long()
    count = row_id_map[:, 2 * num_slots : 2 * num_slots + 1].long().clamp(0, num_slots)
    positions = torch.arange(num_slots, device=row_id_map.device)
    live = (positions < count) & (listed_rows >= 0) & (listed_rows < num_rows)
    listed = torch.where((listed >= 0) & (listed < num_slots), listed, -1)
    return torch.where(live, listed_rows, -1), torch.where(live, listed, -1)


def _rows(row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T, S] destination rows of a row map's slots (-1: none), int64."""
    listed_rows, listed = _lists(row_id_map, num_rows)
    num_slots = listed.shape[1]
    # Padding entries (-1) land in an extra column that is cut off.
    rows = listed_rows.new_full((listed.shape[0], num_slots + 1), -1)
    rows.scatter_(1, torch.where(listed >= 0, listed, num_slots), listed_rows)
    return rows[:, :num_slots]


def _slots(row_id_map: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, row) of every listed entry, in (token, slot) order: the lists' order (slot -1 where
    the entry's slot is out of range)."""
    listed_rows, listed = _lists(row_id_map, num_rows)
    tokens, positions = torch.nonzero(listed_rows >= 0, as_tuple=True)
    return tokens, listed[tokens, positions], listed_rows[tokens, positions]


def dispatch(
    inp: torch.Tensor,
    routing: torch.Tensor,
    probs: torch.Tensor | None,
    scales: torch.Tensor | None,
    num_experts: int,
    is_mask: bool,
    num_out_tokens: int | None,
    align_size: int | None,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
) -> tuple[torch.Tensor, ...]:
    """moetriton::dispatch: (output, permuted_probs, permuted_scales, row_id_map, pad_offsets,
    tokens_per_expert); absent probs/scales give empty tensors. align_size / capacity None = none; a mask
    may come as a "bitmap" (uint8 [T, ceil(E / 8)]): its unpacked [T, E] bits route."""
    if routing_map_format == "bitmap":
        routing = unpack_bitmap(routing, num_experts)
    num_rows = buffer_rows(num_out_tokens, num_experts, align_size, capacity)
    full_map, kept, pad_offsets = row_map(routing, num_experts, is_mask, num_rows, align_size or 1, capacity)
    tokens, slots, rows = _slots(full_map, num_rows)
    output = _move_rows(inp, rows, tokens, num_rows)
    permuted_probs = (
        inp.new_empty(0, dtype=torch.float32)
        if probs is None
        else _move_rows(probs[tokens, slots], rows, torch.arange(rows.numel(), device=rows.device), num_rows)
    )
    permuted_scales = (
        inp.new_empty(0, dtype=torch.float32)
        if scales is None
        else _move_rows(scales, rows, tokens, num_rows)
    )
    return output, permuted_probs, permuted_scales, full_map, pad_offsets, kept


def combine(inp: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """moetriton::combine: per token, the sum over its slots in ascending order of w * inp[row], in fp32
    (fp64 for fp64 input), cast to inp.dtype."""
    acc_dtype = torch.float64 if inp.dtype == torch.float64 else torch.float32
    listed_rows, listed = _lists(row_id_map, inp.shape[0])
    num_tokens, num_slots = listed.shape
    acc = torch.zeros((num_tokens, inp.shape[1]), dtype=acc_dtype, device=inp.device)
    if inp.shape[0] == 0:
        return acc.to(inp.dtype)
    # Position k of every token's lists at once: the slots are listed in ascending order.
    for k in range(num_slots):
        row, slot = listed_rows[:, k], listed[:, k]
        has_row = row >= 0
        term = inp[row.clamp(min=0)].to(acc_dtype)
        if weights is not None:
            weight = weights.gather(1, slot.clamp(min=0)[:, None]).to(acc_dtype)
            term = term * torch.where(slot[:, None] >= 0, weight, 0)
        acc = torch.where(has_row[:, None], acc + term, acc)
    return acc.to(inp.dtype)


def dispatch_backward(
    grad_output: torch.Tensor, grad_permuted_probs: torch.Tensor | None, row_id_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """moetriton::dispatch_backward: (grad_inp [T, H], grad_probs [T, S] or empty)."""
    grad_inp = combine(grad_output, row_id_map, None)
    if grad_permuted_probs is None:
        return grad_inp, grad_output.new_empty(0, dtype=torch.float32)
    rows = _rows(row_id_map, grad_output.shape[0])
    gathered = grad_permuted_probs[rows.clamp(min=0)] if grad_permuted_probs.numel() else rows.float()
    return grad_inp, torch.where(rows >= 0, gathered, torch.zeros_like(gathered))


def scatter_rows(grad: torch.Tensor, row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """moetriton::scatter_rows: grad [T, H] copied to the rows of its slots; other rows zero."""
    tokens, _, rows = _slots(row_id_map, num_rows)
    return _move_rows(grad, rows, tokens, num_rows)


def combine_backward(
    grad: torch.Tensor, row_id_map: torch.Tensor, inp: torch.Tensor, weights: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """moetriton::combine_backward: grad_inp[row(t, s)] = g[t] * w[t, s] (other rows zero) and
    grad_weights[t, s] = <inp[row(t, s)], g[t]> (0 for slots without a row)."""
    acc_dtype = torch.float64 if inp.dtype == torch.float64 else torch.float32
    tokens, slots, rows = _slots(row_id_map, num_rows)
    has_slot = slots >= 0
    row_weights = torch.where(has_slot, weights[tokens, slots.clamp(min=0)].to(acc_dtype), 0)
    scaled = (grad[tokens].to(acc_dtype) * row_weights[:, None]).to(inp.dtype)
    grad_inp = inp.new_zeros((num_rows, inp.shape[1])).index_put((rows,), scaled)
    dots = (inp[rows].to(acc_dtype) * grad[tokens].to(acc_dtype)).sum(1)
    grad_weights = torch.zeros(weights.shape, dtype=acc_dtype, device=weights.device)
    grad_weights.index_put_((tokens[has_slot], slots[has_slot]), dots[has_slot], accumulate=True)
    return grad_inp, grad_weights.to(weights.dtype)


def is_partition(split_sizes: torch.Tensor, sorted_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Whether chunk sort's sizes and order describe a partition of at most `num_rows` rows: sizes in
    [0, N] summing to at most N, the order a permutation of [0, S) (a bool tensor, no host sync)."""
    num_splits = split_sizes.shape[0]
    sizes_ok = ((split_sizes >= 0) & (split_sizes <= num_rows)).all()
    total = torch.where(sizes_ok, split_sizes.long().sum(), 0)
    in_range = (sorted_indices >= 0) & (sorted_indices < num_splits)
    seen = torch.bincount(torch.where(in_range, sorted_indices.long(), num_splits), minlength=num_splits + 1)
    return sizes_ok & (total <= num_rows) & in_range.all() & (seen[:num_splits] == 1).all()


def chunk_sort_map(split_sizes: torch.Tensor, sorted_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Destination row [N] (int32) of every input row for chunk sort; rows past the chunks stay put.
    Sizes and order must describe a partition (`is_partition`)."""
    device = split_sizes.device
    sizes = split_sizes.long()
    order = sorted_indices.long()
    total = int(sizes.sum())
    src_start = torch.cumsum(sizes, 0) - sizes
    sorted_sizes = sizes[order]
    dst_start = torch.empty_like(sizes)
    dst_start[order] = torch.cumsum(sorted_sizes, 0) - sorted_sizes
    chunk = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes)
    rows = torch.arange(num_rows, device=device)
    dst = rows.clone()
    dst[:total] = dst_start[chunk] + rows[:total] - src_start[chunk]
    return dst.int()


def sort_chunks(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moetriton::sort_chunks: forward scatters row i to map[i]; backward gathers row i from map[i]. Sizes
    and an order that are not a partition move nothing: zero rows and probs, map -1 (the kernels' rule)."""
    num_rows = inp.shape[0]
    split_sizes, sorted_indices = split_sizes.to(inp.device), sorted_indices.to(inp.device)
    if not bool(is_partition(split_sizes, sorted_indices, num_rows)):
        output = torch.zeros_like(inp)
        permuted = inp.new_empty(0, dtype=torch.float32) if probs is None else torch.zeros_like(probs)
        row_map = inp.new_full((0,) if backward else (num_rows,), -1, dtype=torch.int32)
        return output, row_map, permuted
    dst = chunk_sort_map(split_sizes, sorted_indices, num_rows).long()
    rows = torch.arange(num_rows, device=inp.device)
    dst_rows, src_rows = (rows, dst) if backward else (dst, rows)
    output = _move_rows(inp, dst_rows, src_rows, num_rows)
    permuted = (
        inp.new_empty(0, dtype=torch.float32)
        if probs is None
        else _move_rows(probs, dst_rows, src_rows, num_rows)
    )
    return output, (inp.new_empty(0, dtype=torch.int32) if backward else dst.int()), permuted


# Public-API mirrors -------------------------------------------------------------------------------------


def token_dispatch(
    inp: torch.Tensor,
    routing_map: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    probs: torch.Tensor | None = None,
    align_size: int | None = None,
    *,
    indices: torch.Tensor | None = None,
    num_experts: int | None = None,
    scales: torch.Tensor | None = None,
    capacity: int | None = None,
    routing_map_format: str = "bytemap",
) -> tuple:
    """Reference of moetriton.torch.token_dispatch (same arguments and results)."""
    is_mask = routing_map is not None
    routing = routing_map if is_mask else indices
    config = rules.DispatchConfig(
        num_experts, is_mask, num_out_tokens, align_size, capacity, routing_map_format
    ).with_reference_defaults(tuple(routing.shape))
    results = dispatch(inp, routing, probs, scales, *config)
    return config.results(results, has_probs=probs is not None, has_scales=scales is not None)


def token_combine(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of moetriton.torch.token_combine."""
    return combine(inp, row_id_map, merging_probs)


def sort_chunks_by_index(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
) -> tuple:
    """Reference of moetriton.torch.sort_chunks_by_index."""
    output, dst, permuted = sort_chunks(inp, split_sizes, sorted_indices, probs, backward=False)
    return (output, dst) if probs is None else (output, dst, permuted)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gated activation (kernels/rules/activation.py), written as transformers' GptOssExperts."""
    gate = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
    up = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return (up + 1) * gate * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * gate)


#: Gated activations: a function of (gate, up), each [M, F]; plain ones: a function of hidden [M, F].
_GATED = {
    "swiglu": lambda gate, up: torch.nn.functional.silu(gate) * up,
    "geglu": lambda gate, up: torch.nn.functional.gelu(gate) * up,
    "clamped_swiglu": _clamped_swiglu,
}
_PLAIN = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}


def _activation(h32: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of h32 [M, 2F] ([gate | up]) or [M, F], in h32's dtype, differentiable."""
    if activation in _GATED:
        return _GATED[activation](*h32.chunk(2, dim=-1))
    return _PLAIN[activation](h32)


def activate(hidden: torch.Tensor, activation: str) -> torch.Tensor:
    """The expert activation of hidden [M, 2F] ([gate | up], "swiglu" / "geglu" / "clamped_swiglu") or
    [M, F] ("gelu" (exact) / "relu"), math in fp32, one rounding to hidden's dtype (the kernels' contract)."""
    return _activation(hidden.float(), activation).to(hidden.dtype)


def activate_backward(grad: torch.Tensor, hidden: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient of `activate` with respect to hidden, in fp32 by autograd, rounded to hidden's dtype."""
    with torch.enable_grad():
        h32 = hidden.detach().float().requires_grad_(True)
        (grad_hidden,) = torch.autograd.grad(_activation(h32, activation), h32, grad.float())
    return grad_hidden.to(hidden.dtype)
