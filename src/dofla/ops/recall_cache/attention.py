"""The recall cache's heavy hitters (cell option ``heavy_hitters``): the tokens that drew the most attention.

Beside (or in place of) the memory's recall error, a token leaving the window is scored by the attention it
drew while in it: the weight every query head of its state head gave it in the window's softmax (its keys and sinks,
the recall cache left out), summed over the W queries that saw it. Every token is scored at the same age W,
so the score ranks how much the text around a token looked at it, as H2O's accumulated attention does, and
the cache keeps the best-scored tokens as it keeps the worst recalled (:mod:`dofla.ops.recall_cache`; with
both scores, the union of each one's best).
The window's softmax alone normalises the weights, so a token's score does not depend on what the cache
holds: the chunked form scores a whole call's leaving tokens before reading the cache.

The sums of the tokens still in the window are carried between calls in the cache's ``attention`` buffer
(B, Hs, W) float32, token p in slot ``p % W``: W floats per head beside the cache's ``budget`` keys and
values. ``naive`` scores by token from the dense loop (references, tests only); ``window_attention_scores``
a call's leaving tokens (the cells' chunked and recurrent forms); ``ring_attention_weights`` one decoding
step's weights on the ring's window slots, in the same slot order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import soft_cap


def attention_scores_naive(
    query: Tensor, keys: Tensor, lse: Tensor, *, scaling: float, window: int, sinks: int, softcap=None
) -> Tensor:
    """Each token's attention score, written out query by query: query (B, H, T, D), keys (B, Hs, T, D),
    lse (B, H, T) each query's log-sum-exp over its window and sinks -> (B, Hs, T) float32 indexed by token:
    the summed ``exp(score(q, j) - lse(q))`` of queries q = j .. j + W - 1 over the query heads of j's state
    head; -inf for sinks and for tokens still in the window at the end (never scored)."""
    query, keys, lse = query.detach(), keys.detach(), lse.detach()  # the score only selects
    batch, heads, length, _ = keys.shape
    group = query.shape[1] // heads
    scores = torch.full((batch, heads, length), float("-inf"))
    for token in range(sinks, length - window):
        total = torch.zeros(batch, heads, dtype=torch.float64)
        for q in range(token, token + window):
            for head in range(heads * group):
                logit = soft_cap(
                    scaling * (query[:, head, q].double() * keys[:, head // group, token].double()).sum(-1),
                    softcap,
                )
                total[:, head // group] += torch.exp(logit - lse[:, head, q].double())
        scores[:, :, token] = total.float()
    return scores


def window_attention_scores(
    query: Tensor,
    keys: Tensor,
    lse: Tensor,
    pending: Tensor,
    num_before: int,
    *,
    scaling: float,
    window: int,
    sinks: int,
    softcap=None,
    block: int = 256,
) -> tuple[Tensor, Tensor]:
    """The attention score of the token leaving the window at each step of a call, and the sums carried on.

    query (B, H, T, D) the call's queries (tokens N .. N + T - 1, N = ``num_before``); keys (B, Hs, L + T, D)
    the window's last L = min(N, W) keys before the call, then the call's; lse (B, H, T) each query's
    log-sum-exp over its window and sinks; pending (B, Hs, W) float32 the sums so far of the tokens in the
    window before the call (slot p % W). Returns the scores (B, Hs, T) float32 by step (step t scores token
    t - W; -inf where none leaves: t < W, or a sink) and the sums of the tokens in the window after the call
    (B, Hs, W). Work per call: (T + W) x T / ``block`` blocks of ``block`` keys, each against the
    ``block + W - 1`` queries that can see them.
    """
    batch, heads, total, head_dim = keys.shape
    length = query.shape[2]
    held = total - length
    group = query.shape[1] // heads
    queries = query.float().view(batch, heads, group, length, head_dim)
    lse = lse.float().view(batch, heads, group, length)
    first = int(num_before) - held  # position of keys[:, :, 0]
    added = torch.zeros(batch, heads, total, device=keys.device)  # each key's weight from this call's queries
    for start in range(0, total, int(block)):
        stop = min(total, start + int(block))
        # the queries (call index) that can see keys start .. stop - 1
        q_start = max(0, first + start - int(num_before))
        q_stop = min(length, first + stop - 1 + int(window) - int(num_before))
        if q_start >= q_stop:
            continue
        logits = scaling * (
            queries[:, :, :, q_start:q_stop] @ keys[:, :, None, start:stop].float().transpose(-1, -2)
        )
        logits = soft_cap(logits, softcap)  # (B, Hs, G, Q, C)
        query_position = torch.arange(q_start, q_stop, device=keys.device) + int(num_before)
        key_position = torch.arange(start, stop, device=keys.device) + first
        distance = query_position[:, None] - key_position[None, :]
        seen = (distance >= 0) & (distance < int(window))
        weights = torch.exp(logits - lse[:, :, :, q_start:q_stop, None]).masked_fill(~seen, 0.0)
        added[:, :, start:stop] = weights.sum((2, 3))
    positions = torch.arange(total, device=keys.device) + first  # of keys
    carried = torch.where(
        positions < int(num_before), pending[:, :, positions.remainder(int(window))], torch.zeros_like(added)
    )
    sums = carried + added  # (B, Hs, L + T): each key's score once every query that sees it has run
    steps = torch.arange(length, device=keys.device) + int(num_before)
    leaving = steps - int(window)
    scores = sums[:, :, (leaving - first).clamp_min(0)].masked_fill(~(leaving >= int(sinks)), float("-inf"))
    in_window = positions >= int(num_before) + length - int(window)
    new_pending = pending.clone()
    slots = positions[in_window].remainder(int(window))
    new_pending[:, :, slots] = sums[:, :, in_window]
    return scores, new_pending


def ring_attention_weights(scores: Tensor, sinks: int) -> Tensor:
    """One decoding step's weights on the ring's window slots: scores (B * Hs, G, S + W) the window's
    softmax scores over every ring slot (``dofla.ops.window.step.window_scores``, hidden slots -inf) ->
    (B * Hs, W) the softmax weights summed over the G query heads, slot s holding token p with s = p % W."""
    weights = torch.softmax(scores.float(), dim=-1)
    return weights[..., int(sinks) :].sum(1)
