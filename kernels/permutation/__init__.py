"""The permutation family: token dispatch and combine kernels and their launch plans, in three modules:
`row_map` (assigning rows: the first two dispatch launches, and the row map's format helpers), `dispatch`
(moving tokens to their rows) and `combine` (gathering them back, and the backwards).

Symbols: T tokens, H hidden, E experts, S slots per token, N rows of the permuted buffer, A alignment.

Slots. A routing input gives every token S slots: a mask [T, E] has one slot per expert (slot e -> expert e);
an index map [T, K] has one slot per top-k position (slot k -> expert indices[t, k], -1 = none). Per-slot
tensors (probs, merging probs, their gradients) have the routing input's layout: [T, E] or [T, K].

Row map. `row_id_map` is int32 [T, 2S + 2] (`row_map_columns`), two lists and two counts per token.
Columns 0 .. S - 1 list the destination rows (padding applied) of the token's slots that have a row, in
ascending slot order, then -1; columns S .. 2S - 1 list those slots, in the same order, then -1. A slot has
no row when it is not routed or falls past the end of the buffer. Column 2S holds the number of listed
slots; column 2S + 1 holds `end`, the number of leading buffer rows that carry tokens or padding (the same
value on every token row, so each token shard can read it locally). The combine kernels walk the lists: a
step reads one row entry (and, independently, its slot where weights or probs need it), never a search over
S slots and never a chain of two dependent loads (TE's map is compact the same way). Rows are expert-major
and stable in (token, slot) order:
    row(t, s) = start[e] + #{(t', s') < (t, s) : expert(t', s') == e},    e = expert(t, s)
where start[e] is the exclusive prefix sum of the per-expert counts, each rounded up to A when padding.

Capacity. With a capacity C instead of padding, every expert owns exactly C rows (start[e] = e * C,
N = E * C): a slot keeps its row only when it is among the first C slots of its expert in (token, slot)
order, and the expert's unused rows are padding. The layout is static, e.g. for fixed-size all-to-all
exchanges.

Buffer rows that receive no token (padding and the tail past `end`) are written with zeros by extra "fill"
programs appended to the grid of the kernels that produce permuted buffers; nothing is pre-zeroed.

Token inputs ([T, H] and [N, H]) are read through a row stride (`RowStride` in the plans), so row-sliced views
reach the kernels without a copy; their columns are unit stride. Outputs are dense.
"""

from .combine import COMBINE_BACKWARD_SPACE, COMBINE_SPACE
from .dispatch import DISPATCH_SPACE
from .row_map import ROW_MAP_SPACE

#: The family's search spaces (moetriton.kernels.SEARCH_SPACES gathers every family's); its plan builders
#: and output shapes are moetriton.kernels' names.
SEARCH_SPACES = (ROW_MAP_SPACE, DISPATCH_SPACE, COMBINE_SPACE, COMBINE_BACKWARD_SPACE)
