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

from dofla.ops.recall_cache.chunked import RecallCache, kept_candidates


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
    new_position = torch.full_like(score, position, dtype=cache.positions.dtype)
    candidates = RecallCache(
        *(
            torch.cat([held, new.to(held.dtype)[:, :, None]], dim=2)
            for held, new in zip(cache.tensors(), (key, value, score, new_position), strict=True)
        )
    )
    return kept_candidates(candidates, kept, budget)
