"""The recall cache's fast form (see the package docstring): chunks of queries, each reading the cache as the
previous chunk left it plus the tokens that leave the window inside the chunk; a decoding step is a chunk of
one token. Per chunk of C queries the work is (budget + C)^2 comparisons and C x (budget + C) scores, so a
forward is linear in its length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dofla.ops._checks import compute_dtype, soft_cap
from dofla.ops.state import BatchedState, WindowState

EMPTY_POSITION = 2**62  # the position of an empty slot: after every token, so it never wins a tie
DEFAULT_CHUNK_SIZE = 64


@dataclass
class RecallCache(BatchedState):
    """The kept tokens of one layer, ``budget`` slots per state head.

    keys (B, Hs, K, D), values (B, Hs, K, Dv): the kept tokens' keys (after rotary) and values, input dtype;
    scores (B, Hs, K, S) float32: their S scores (the recall error, the attention they drew:
    ``dofla.ops.recall_cache.attention``), -inf in empty slots; positions (B, Hs, K) int64: their token
    positions (ties go to the older token), ``EMPTY_POSITION`` in empty slots. attention (B, Hs, W) float32:
    for a cache with an attention score, the attention sums so far of the tokens in the window (token p in
    slot p % W); else None.
    """

    keys: Tensor
    values: Tensor
    scores: Tensor
    positions: Tensor
    attention: Tensor | None = None

    @property
    def slots(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The kept tokens' tensors: keys, values, scores, positions."""
        return self.keys, self.values, self.scores, self.positions

    @property
    def budget(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def empty(
        cls, key: Tensor, value: Tensor, budget: int, window: int | None = None, kinds: int = 1
    ) -> RecallCache:
        """A cache with every slot empty for ``kinds`` scores, in the dtype and device of key (B, Hs, T, D)
        and value (B, Hs, T, Dv); with ``window``, with attention sums (zero)."""
        batch, heads = key.shape[:2]
        return cls(
            keys=key.new_zeros(batch, heads, int(budget), key.shape[-1]),
            values=value.new_zeros(batch, heads, int(budget), value.shape[-1]),
            scores=torch.full((batch, heads, int(budget), int(kinds)), float("-inf"), device=key.device),
            positions=torch.full((batch, heads, int(budget)), EMPTY_POSITION, device=key.device),
            attention=None if window is None else torch.zeros(batch, heads, int(window), device=key.device),
        )


def leaving_tokens(
    keys: Tensor, values: Tensor, window_state: WindowState | None, window: int, sinks: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The token that leaves the window at each of this call's steps: step t (token n = N + t, N tokens seen
    before) leaves token n - W, the first one its query no longer sees in the window.

    keys (B, Hs, T, D), values (B, Hs, T, Dv): this call's; window_state: the window before it (None: the
    call starts the sequence). Returns the leaving keys (B, Hs, T, D) and values (B, Hs, T, Dv), their
    positions (T,) int64 and which steps have one (T,) bool: none before the window is full, and sinks
    never leave (the window keeps seeing them). Sequences without padding only.
    """
    before = 0 if window_state is None else window_state.num_tokens
    if window_state is not None:  # the window's last L keys, oldest first, then this call's
        keys = torch.cat([window_state.keys.to(keys.dtype), keys], dim=2)
        values = torch.cat([window_state.values.to(values.dtype), values], dim=2)
        held = window_state.keys.shape[2]
    else:
        held = 0
    length = keys.shape[2] - held
    positions = torch.arange(before, before + length, device=keys.device) - int(window)  # (T,)
    valid = positions >= int(sinks)
    index = (positions - (before - held)).clamp_min(0)  # in the joined keys
    return keys[:, :, index], values[:, :, index], positions, valid


def recall_errors(recalled: Tensor, values: Tensor, valid: Tensor) -> Tensor:
    """The self-recall error ``|| recalled - value ||^2``: recalled and values (B, Hs, T, Dv), valid (T,) bool
    -> (B, Hs, T) float32, -inf where no token leaves (never kept). Without gradients: it only selects."""
    with torch.no_grad():
        dtype = torch.promote_types(values.dtype, torch.float32)
        errors = (recalled.to(dtype) - values.to(dtype)).square().sum(-1).float()
        return errors.masked_fill(~valid, float("-inf"))


def masked_softmax_read(scores: Tensor, visible: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the visible keys: scores (..., Q, N), visible broadcastable to them, values (..., N, Dv)
    -> out (..., Q, Dv) and the log-sum-exp (..., Q); a query that sees no key gets 0 and -inf (with finite
    gradients)."""
    scores = scores.masked_fill(~visible, float("-inf"))
    maximum = scores.amax(-1, keepdim=True)
    maximum = torch.where(torch.isfinite(maximum), maximum, torch.zeros_like(maximum)).detach()
    weights = torch.exp(scores - maximum)
    total = weights.sum(-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    out = (weights @ values) / total
    lse = torch.where(seen, maximum + torch.log(total), torch.full_like(total, float("-inf")))
    return out, lse[..., 0]


def merge_softmax_parts(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two softmaxes over disjoint key sets as one over their union: outs (..., T, Dv), log-sum-exps (..., T)
    (-inf: no key) -> out (..., T, Dv) and lse (..., T)."""
    maximum = torch.maximum(lse_a, lse_b)
    maximum = torch.where(torch.isfinite(maximum), maximum, torch.zeros_like(maximum)).detach()
    weight_a, weight_b = torch.exp(lse_a - maximum), torch.exp(lse_b - maximum)
    total = weight_a + weight_b
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    out = (weight_a[..., None] * out_a + weight_b[..., None] * out_b) / safe[..., None]
    lse = torch.where(seen, maximum + torch.log(safe), torch.full_like(total, float("-inf")))
    return out, lse


def _take(tensor: Tensor, order: Tensor) -> Tensor:
    """tensor (B, Hs, N) or (B, Hs, N, X) at the slots ``order`` (B, Hs, K) -> (B, Hs, K[, X])."""
    index = order if tensor.dim() == 3 else order[..., None].expand(-1, -1, -1, tensor.shape[-1])
    return tensor.gather(2, index)


def kept_candidates(candidates: RecallCache, kept: Tensor, budget: int) -> RecallCache:
    """The cache of ``budget`` slots the kept candidates make: candidates (N >= budget slots) and kept
    (B, Hs, N) bool, at most ``budget`` per head; the kept ones first in candidate order, then empty slots.
    The attention sums are the candidates' (the caller moves them on)."""
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)[..., :budget]  # kept ones first
    kept = kept.gather(-1, order)
    return RecallCache(
        keys=_take(candidates.keys, order),
        values=_take(candidates.values, order),
        scores=_take(candidates.scores, order).masked_fill(~kept[..., None], float("-inf")),
        positions=_take(candidates.positions, order).masked_fill(~kept, EMPTY_POSITION),
        attention=candidates.attention,
    )


def score_columns(scores: Tensor, budgets, budget: int) -> tuple[Tensor, tuple[int, ...]]:
    """scores (B, Hs, T) of one kind or (B, Hs, T, S) -> (B, Hs, T, S) float32, and the slots each kind
    keeps (``budgets``; None: one kind with all ``budget`` slots), which must sum to ``budget``."""
    scores = scores[..., None] if scores.dim() == 3 else scores
    budgets = (int(budget),) if budgets is None else tuple(int(b) for b in budgets)
    if len(budgets) != scores.shape[-1] or sum(budgets) != int(budget):
        raise ValueError(f"{scores.shape[-1]} scores with budgets {budgets} for a cache of {budget} slots")
    return scores.float(), budgets


def kept_by_rank(
    scores: Tensor, positions: Tensor, budgets: tuple[int, ...], held: int, steps: int
) -> Tensor:
    """Which candidates each of ``steps`` queries sees: scores (B, Hs, N, S) (-inf: no candidate) and
    positions (B, Hs, N) of the ``held`` tokens a cache holds, then one new candidate per step. A candidate
    is seen from the step it arrives when, for some kind s, fewer than ``budgets[s]`` candidates that have
    arrived rank above it by score s (a higher score, or as high and older). -> (B, Hs, steps, N) bool.
    Ranks among the held tokens and the new ones are ranks among every token that ever left: a token
    outside the cache ranks below ``budgets[s]`` others by every score."""
    valid = torch.isfinite(scores[..., 0])  # (B, Hs, N)
    step = torch.arange(steps, device=scores.device)
    left = torch.cat(
        [torch.ones(steps, held, dtype=torch.bool, device=scores.device), step[None, :] <= step[:, None]],
        dim=-1,
    )  # (C, N)
    chosen = torch.zeros(*valid.shape[:2], steps, valid.shape[-1], dtype=torch.bool, device=scores.device)
    position_i, position_j = positions[..., :, None], positions[..., None, :]
    for kind, budget in enumerate(budgets):
        score_i, score_j = scores[..., kind, None], scores[..., None, :, kind]
        # beats[i, j]: candidate i ranks above candidate j
        beats = valid[..., :, None] & (
            (score_i > score_j) | ((score_i == score_j) & (position_i < position_j))
        )
        rank = beats[:, :, :held].sum(2)[:, :, None, :] + beats[:, :, held:].cumsum(2)  # (B, Hs, C, N)
        chosen |= rank < budget
    return valid[:, :, None, :] & left & chosen


def recall_cache_attention(
    query: Tensor,
    leaving_keys: Tensor,
    leaving_values: Tensor,
    scores: Tensor,
    positions: Tensor,
    cache: RecallCache,
    *,
    scaling: float,
    softcap: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    budgets=None,
) -> tuple[Tensor, Tensor, RecallCache]:
    """The cache part of the window's softmax for T queries, the cache updated as tokens leave the window.

    query (B, H, T, D); leaving_keys (B, Hs, T, D), leaving_values (B, Hs, T, Dv), scores (B, Hs, T) or
    (B, Hs, T, S) (-inf: no token leaves at that step) and positions (T,) from ``leaving_tokens`` and the
    scores' functions; cache before the call. Query t sees the ``budget`` best-scored tokens that left the
    window at steps <= t (ties: the older token); with S scores, the union of the ``budgets[s]`` best by
    each (``kept_by_rank``). Returns out (B, H, T, Dv) and the log-sum-exp (B, H, T) (0 and -inf where the
    cache is empty) in the compute dtype, and the cache after the call (its attention sums as given). The
    same for any ``chunk_size``.
    """
    batch, heads, length, head_dim = leaving_keys.shape
    group = query.shape[1] // heads
    dtype = compute_dtype(query, leaving_keys, leaving_values)
    queries = query.to(dtype).view(batch, heads, group, length, head_dim)  # (B, Hs, G, T, D)
    budget = cache.budget
    scores, budgets = score_columns(scores, budgets, budget)
    outs, lses = [], []
    for start in range(0, length, int(chunk_size)):
        stop = min(length, start + int(chunk_size))
        steps = stop - start
        keys = torch.cat(
            [cache.keys, leaving_keys[:, :, start:stop].to(cache.keys.dtype)], dim=2
        )  # (B, Hs, N, D)
        values = torch.cat([cache.values, leaving_values[:, :, start:stop].to(cache.values.dtype)], dim=2)
        candidate_scores = torch.cat([cache.scores, scores[:, :, start:stop]], dim=2)  # (B, Hs, N, S)
        candidate_positions = torch.cat(
            [cache.positions, positions[start:stop].expand(batch, heads, steps)], dim=-1
        )
        visible = kept_by_rank(candidate_scores, candidate_positions, budgets, budget, steps)  # (B, Hs, C, N)
        logits = soft_cap(
            scaling * (queries[:, :, :, start:stop] @ keys.to(dtype)[:, :, None].transpose(-1, -2)), softcap
        )
        out, lse = masked_softmax_read(logits, visible[:, :, None], values.to(dtype)[:, :, None])
        outs.append(out)  # (B, Hs, G, C, Dv)
        lses.append(lse)
        candidates = RecallCache(keys, values, candidate_scores, candidate_positions, cache.attention)
        cache = kept_candidates(candidates, visible[:, :, -1], budget)  # at most ``budget`` kept
    out = torch.cat(outs, dim=3).reshape(batch, heads * group, length, -1)
    lse = torch.cat(lses, dim=3).reshape(batch, heads * group, length)
    return out, lse, cache
