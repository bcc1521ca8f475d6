"""The recall cache's decoding step: one token's candidate joins the cache in O(budget) small operators.

The chunked form (``recall_cache_attention``) decodes a token as a chunk of one: it ranks every candidate
against every other, (budget + 1)^2 comparisons and some thirty operators per layer. One new candidate
needs less: it is kept exactly when its score is above the lowest kept one (a tie goes to the older token,
already kept), and then the lowest (the newest of those tied lowest) leaves. The slots come out in the
chunked form's order (the kept ones in candidate order, then the empty ones), so the two forms' caches are
equal tensor for tensor. The cells' decoding step reads the cache in the window's own fused softmax
(``dofla.ops.window.step.ring_window_step``'s ``extra`` keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.recall_cache.chunked import EMPTY_POSITION, RecallCache


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
