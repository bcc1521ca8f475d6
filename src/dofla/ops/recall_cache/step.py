"""The recall cache's decoding step: one token's candidate joins the cache in O(budget) small operators.

The chunked form (``recall_cache_attention``) decodes a token as a chunk of one: it ranks every candidate
against every other, (budget + 1)^2 comparisons and some thirty operators per layer. One new candidate
needs less: it is kept exactly when its score is above the lowest kept one (a tie goes to the older token,
already kept), and then the lowest (the newest of those tied lowest) leaves. The slots come out in the
chunked form's order (the kept ones in candidate order, then the empty ones), so the two forms' caches are
equal tensor for tensor. A cache kept by two scores (the worst recalled and the heavy hitters) takes the
chunked form's ranking over its slots and the new candidate instead. The cells' decoding step reads the
cache in the window's own fused softmax
(``dofla.ops.window.step.ring_window_step``'s ``extra`` keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.recall_cache.chunked import RecallCache, kept_by_rank, kept_candidates, score_columns


def insert_recall_candidate(
    cache: RecallCache, key: Tensor, value: Tensor, score: Tensor, position: int, budgets=None
) -> RecallCache:
    """The cache after the token leaving the window at this step: key (B, Hs, D), value (B, Hs, Dv), its
    score (B, Hs) or scores (B, Hs, S) (non-finite: not a candidate) at token ``position``; ``budgets`` the
    slots each score keeps (``recall_cache_attention``'s). New tensors (the cache given is not changed; its
    attention sums come back as they were: the caller moves them on). One score: in O(budget), below;
    several: the chunked form's ranks (``kept_by_rank``) over the cache and the one new candidate."""
    score = (score[..., None] if score.dim() == 2 else score).float()  # (B, Hs, S)
    budget = cache.budget
    _, budgets = score_columns(score[:, :, None], budgets, budget)
    new_position = torch.full_like(score[..., 0], position, dtype=cache.positions.dtype)
    candidates = RecallCache(
        *(
            torch.cat([held, new.to(held.dtype)[:, :, None]], dim=2)
            for held, new in zip(cache.slots, (key, value, score, new_position), strict=True)
        ),
        attention=cache.attention,
    )
    if len(budgets) > 1:
        kept = kept_by_rank(candidates.scores, candidates.positions, budgets, budget, 1)[:, :, 0]
        return kept_candidates(candidates, kept, budget)
    scores = cache.scores[..., 0]
    lowest = scores.amin(-1, keepdim=True)  # (B, Hs, 1); -inf while a slot is empty
    keep_new = score[..., 0, None] > lowest  # a tie keeps the older token
    # the slot that gives way: the newest of the lowest-scored (the first empty one while any is)
    evicted = torch.where(scores == lowest, cache.positions, -1).argmax(-1, keepdim=True)  # (B, Hs, 1)
    slots = torch.arange(budget, device=scores.device)
    kept = torch.cat([torch.isfinite(scores) & ~(keep_new & (slots == evicted)), keep_new], dim=-1)
    return kept_candidates(candidates, kept, budget)
