"""The router family: fused top-k with score functions (`topk`), the aux-loss scores and the aux loss
(`aux_loss`), what their token-block kernels share (`scores`) and the routing map's bitmap (`bitmap`).

Symbols: T tokens, E experts, K = topk, G groups of GS = E / G experts, R x C the aux-loss probs.

Semantics (per token, x = fp32(logits[t]); all math in fp32, outputs in the logits dtype):
    softmax, pre:  s = softmax(x)            select on s,          w = s[selected]
    softmax, post: -                          select on x,          w = softmax(x[selected])
    sigmoid:       a = sigmoid(x)             select on a + bias,   w = a[selected]
    sqrtsoftplus:  a = sqrt(softplus(x))      select on a + bias,   w = a[selected]
    (sigmoid / sqrtsoftplus with K > 1: w = w / (sum(w) + 1e-20))
    probs[t, selected] = scaling_factor * w; routing_map[t, selected] = True; everything else 0 / False.
softplus follows PyTorch (x > 20 -> x). The weights use the unbiased score a itself, not TE's
(a + bias) - bias. Group-limited top-k: a group's score is the sum of its top (K / group_topk) selection
scores (added in descending order); the group_topk best groups are kept and the K experts are chosen only
inside them.

Order. Every selection (experts, groups) ranks by score descending and breaks ties by the LOWEST index.
NaN ranks below every number, -inf included, so a NaN score is only chosen when a token has fewer than K
non-NaN candidates; -0.0 ties with +0.0. Values follow IEEE arithmetic: a NaN or +inf that enters a
softmax or a normalisation makes the affected probs NaN (as the framework references do); outside the
selection probs are exactly 0 regardless.

Ranking works on int64 keys, one per candidate: the fp32 score mapped to an order-preserving int32 in the
high word and (WIDTH - column) in the low word. Keys are unique within a row, so the K-th largest key is
found by K rounds of "largest key below the previous one" (one integer max-reduction each), and the
selection is "key >= K-th key". Excluded candidates (padding, unchosen groups) get the smallest int64.

Layout. One program owns BLOCK_T tokens and holds their scores in registers as a [BLOCK_T, WIDTH] tile.
Without groups WIDTH = next_pow2(E). With groups, column c holds expert (c // GS_POW2) * GS + c % GS_POW2,
so that a reshape to [BLOCK_T, G_POW2, GS_POW2] gives per-group rows; WIDTH = G_POW2 * GS_POW2.
Backward kernels recompute the scores from the logits and the routing map, so nothing fp32 is saved.

Aux loss (TE's definition): loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c],
C = num_experts * coeff / (topk * total_num_tokens^2), and 0 when total_num_tokens is below 1 (a device
total of no tokens). It is reduced without atomics: every program of a
fixed, shape-only grid sums its row stripe to one fp32 partial, and a single program adds the partials in a
fixed order, so the result is bitwise reproducible run to run.
"""

from .aux_loss import AUX_SCORES_BACKWARD_SPACE, AUX_SCORES_SPACE
from .topk import TOPK_BACKWARD_SPACE, TOPK_SPACE

#: The family's search spaces (moetriton.kernels.SEARCH_SPACES gathers every family's); its plan builders
#: and output shapes are moetriton.kernels' names.
SEARCH_SPACES = (TOPK_SPACE, TOPK_BACKWARD_SPACE, AUX_SCORES_SPACE, AUX_SCORES_BACKWARD_SPACE)
