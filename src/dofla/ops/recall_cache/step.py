"""The recall cache's decoding step: one token in O(budget) small operators.

The chunked form (``recall_cache_attention``) decodes a token as a chunk of one: it ranks every candidate
against every other, (budget + 1)^2 comparisons and some thirty operators per layer. One new candidate
needs less: it is kept exactly when its score is above the lowest kept one (a tie goes to the older token,
already kept), and then the lowest (the newest of those tied lowest) leaves. The slots come out in the
chunked form's order (the kept ones in candidate order, then the empty ones), so the two forms' caches are
equal tensor for tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import compute_dtype
from dofla.ops.recall_cache.chunked import EMPTY_POSITION, RecallCache, masked_softmax_read


def insert_recall_candidate(
    cache: RecallCache, key: Tensor, value: Tensor, score: Tensor, position: int
) -> RecallCache:
    """The cache after the token leaving the window at this step: key (B, Hs, D), value (B, Hs, Dv), its
    recall error score (B, Hs) (non-finite: not a candidate) at token ``position``. New tensors (the cache
    given is not changed)."""
    scores = cache.scores
    budget = scores.shape[-1]
    score = score.float()
    lowest = scores.amin(-1, keepdim=True)  # (B, Hs, 1); -inf while a slot is empty
    keep_new = score[..., None] > lowest  # a tie keeps the older token
    # the slot that gives way: the newest of the lowest-scored (the first empty one while any is)
    evicted = torch.where(scores == lowest, cache.positions, -1).argmax(-1, keepdim=True)  # (B, Hs, 1)
    slots = torch.arange(budget, device=scores.device)
    kept = torch.cat([torch.isfinite(scores) & ~(keep_new & (slots == evicted)), keep_new], dim=-1)
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)[..., :budget]  # kept first
    kept = kept.gather(-1, order)

    def joined(held: Tensor, new: Tensor) -> Tensor:
        candidates = torch.cat([held, new.to(held.dtype)[:, :, None]], dim=2)
        index = order if held.dim() == 3 else order[..., None].expand(-1, -1, -1, held.shape[-1])
        return candidates.gather(2, index)

    new_position = torch.full_like(score, position, dtype=cache.positions.dtype)
    return RecallCache(
        keys=joined(cache.keys, key),
        values=joined(cache.values, value),
        scores=joined(scores, score).masked_fill(~kept, float("-inf")),
        positions=joined(cache.positions, new_position).masked_fill(~kept, EMPTY_POSITION),
    )


def recall_cache_step(
    cache: RecallCache,
    queries: Tensor,
    leaving: tuple[Tensor, Tensor, Tensor, int] | None,
    *,
    scaling: float,
) -> tuple[Tensor, Tensor, RecallCache]:
    """One token of ``recall_cache_attention``: queries (B, Hs, G, D); ``leaving`` the token that leaves the
    window at this step as (key (B, Hs, D), value (B, Hs, Dv), recall error (B, Hs), position), None where
    none does. Returns the cache part of the window's softmax, out (B, Hs, G, Dv) and log-sum-exp
    (B, Hs, G) (0 and -inf while the cache is empty), in the compute dtype, and the cache after the token.
    No soft-capping (the cells' steps take none)."""
    if leaving is not None:
        cache = insert_recall_candidate(cache, *leaving)
    dtype = compute_dtype(queries, cache.keys, cache.values)
    logits = scaling * (queries.to(dtype) @ cache.keys.to(dtype).transpose(-1, -2))  # (B, Hs, G, K)
    visible = torch.isfinite(cache.scores)[:, :, None, :]
    out, lse = masked_softmax_read(logits, visible, cache.values.to(dtype))
    return out, lse, cache
