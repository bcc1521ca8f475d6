"""The teacher with a bounded heavy-hitter KV cache (H2O): a no-training baseline at a fixed cache budget.

Each softmax layer keeps at most ``budget`` keys per key/value head: the first ``sinks`` tokens, the most
recent ones, and the keys that have drawn the most attention so far (accumulated attention: the sum of the
softmax weights every query, of every query head sharing the key/value head, gave the key while it was
cached). Tokens enter in blocks of ``block`` (a prompt) or one at a time (decoding): the queries of a block
see the kept keys and the block's own keys up to themselves, then the cache is cut back to
``budget - block`` keys, so no query ever sees more than ``budget`` keys. Of the ``budget - block`` kept,
the sinks and the most recent half of the rest are always kept; the other half are the heavy hitters.
Eviction runs during the prompt as during decoding, so perplexity and the pass key see the same policy.

:func:`heavy_hitter_reference` is the slow obvious form (one query at a time, Python sets); the block form
:func:`heavy_hitter_attention` is compared with it in tests. Under :func:`heavy_hitter_restricted` the
teacher's softmax layers (dispatched by :mod:`dofla.dispatch`) run it; transformers' own cache still stores
every key, so the bytes the policy keeps are computed (:mod:`dofla.evaluation.equal_bytes`), not held.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dofla import dispatch
from dofla.errors import DoflaError
from dofla.evaluation.window_baseline import visible_keys

DEFAULT_BLOCK = 16  # prompt tokens per eviction (decoding evicts after every token)


def check_budget(budget: int, sinks: int, block: int) -> None:
    """A budget that leaves room for the sinks, one recent key and a block of new tokens, else a DoflaError."""
    if int(block) < 1:
        raise DoflaError(f"the heavy-hitter block must be at least 1 token, got {block}.")
    if int(sinks) < 0:
        raise DoflaError(f"the number of sink tokens cannot be negative, got {sinks}.")
    if int(budget) < int(sinks) + int(block) + 1:
        raise DoflaError(
            f"a heavy-hitter cache of {budget} tokens cannot hold {sinks} sinks, a block of {block} new tokens "
            f"and a recent key; give a budget of at least {int(sinks) + int(block) + 1} tokens."
        )


def kept_split(budget: int, sinks: int, block: int) -> tuple[int, int, int]:
    """(sinks, recent, heavy hitters) kept between blocks: together ``budget - block`` keys."""
    between = int(budget) - int(block)
    recent = (between - int(sinks) + 1) // 2
    return int(sinks), recent, between - int(sinks) - recent


@dataclass
class HeavyHitterState:
    """What one layer's cache keeps between calls: positions (B, Hkv, K) of the kept keys (ascending), their
    accumulated attention (B, Hkv, K) float32, and how many tokens it has seen."""

    positions: torch.Tensor
    scores: torch.Tensor
    seen: int


def heavy_hitter_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    budget: int,
    sinks: int,
    scaling: float,
    block: int = DEFAULT_BLOCK,
    state: HeavyHitterState | None = None,
) -> tuple[torch.Tensor, HeavyHitterState]:
    """Softmax attention through a heavy-hitter cache (module docstring), for unpadded rows.

    query (B, H, T, D) for positions S - T .. S - 1; key and value (B, Hkv, S, D): every key so far (the
    kept ones are gathered from them; ``state`` None: S = T, a fresh sequence). Returns the output
    (B, T, H, Dv) and the state after the T new tokens.
    """
    check_budget(budget, sinks, block)
    batch, heads, length, head_dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    start = total - length
    exact = torch.promote_types(query.dtype, torch.float32)  # scores in float32 at least
    if state is None:
        if start != 0:
            raise DoflaError("the heavy-hitter cache lost its state; start a fresh cache for a new sequence.")
        empty = torch.zeros(batch, kv_heads, 0, device=query.device)
        state = HeavyHitterState(positions=empty.long(), scores=empty.to(exact), seen=0)
    if state.seen != start:
        raise DoflaError(
            f"the heavy-hitter cache has seen {state.seen} tokens, the call continues from {start}."
        )
    sink_count, recent, heavy = kept_split(budget, sinks, block)
    positions, scores = state.positions, state.scores
    grouped = query.view(batch, kv_heads, groups, length, head_dim)
    outputs = []
    for first in range(start, total, int(block)):
        last = min(first + int(block), total)
        new = torch.arange(first, last, device=query.device).expand(batch, kv_heads, -1)
        candidates = torch.cat([positions, new], dim=2)  # (B, Hkv, K + n)
        index = candidates[..., None].expand(-1, -1, -1, head_dim)
        keys, values = key.gather(2, index), value.gather(2, index.expand(-1, -1, -1, value.shape[-1]))
        rows = grouped[:, :, :, first - start : last - start]  # (B, Hkv, G, n, D)
        weights = torch.einsum("bhgqd,bhkd->bhgqk", rows.to(exact), keys.to(exact)) * scaling
        seen = candidates[:, :, None, None, :] <= torch.arange(first, last, device=query.device)[:, None]
        weights = torch.softmax(weights.masked_fill(~seen, float("-inf")), dim=-1)  # (B, Hkv, G, n, K + n)
        outputs.append(torch.einsum("bhgqk,bhkd->bhgqd", weights, values.to(exact)).to(query.dtype))
        totals = torch.cat([scores, scores.new_zeros(new.shape)], dim=2) + weights.sum((2, 3))
        positions, scores = _evict(candidates, totals, last, sink_count, recent, heavy)
    output = torch.cat(outputs, dim=3).flatten(1, 2)  # (B, H, T, Dv)
    return output.transpose(1, 2).contiguous(), HeavyHitterState(positions, scores, total)


def _evict(positions, scores, seen: int, sinks: int, recent: int, heavy: int):
    """Keep the sinks, the ``recent`` latest and the ``heavy`` highest-scoring others of (B, Hkv, K) keys."""
    if positions.shape[2] <= sinks + recent + heavy:
        return positions, scores
    protected = (positions < sinks) | (positions >= seen - recent)
    rank = torch.where(protected, torch.full_like(scores, float("inf")), scores)
    # protected keys first, then by score; ties go to the earlier key (a stable sort on descending rank)
    order = torch.sort(rank, dim=2, descending=True, stable=True).indices[:, :, : sinks + recent + heavy]
    kept = positions.gather(2, order)
    ascending = kept.sort(dim=2).indices
    return kept.gather(2, ascending), scores.gather(2, order).gather(2, ascending)


def heavy_hitter_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    budget: int,
    sinks: int,
    scaling: float,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """The slow obvious heavy-hitter cache for a whole sequence: query (B, H, T, D), key and value
    (B, Hkv, T, D) -> (B, T, H, Dv), one query at a time with a Python set of cached positions per row
    and key/value head (float64)."""
    check_budget(budget, sinks, block)
    batch, heads, length, _ = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    sink_count, recent, heavy = kept_split(budget, sinks, block)
    output = torch.zeros(batch, length, heads, value.shape[-1], dtype=torch.float64)
    for row in range(batch):
        for kv_head in range(kv_heads):
            cached: set[int] = set()
            score: dict[int, float] = {}
            for position in range(length):
                cached.add(position)
                score.setdefault(position, 0.0)
                visible = sorted(cached)
                assert len(visible) <= budget
                keys = key[row, kv_head, visible].double()
                values = value[row, kv_head, visible].double()
                for head in range(kv_head * groups, (kv_head + 1) * groups):
                    weights = torch.softmax(keys @ query[row, head, position].double() * scaling, dim=0)
                    output[row, position, head] = weights @ values
                    for slot, kept in enumerate(visible):
                        score[kept] += float(weights[slot])
                if (position + 1) % block == 0 or position + 1 == length:  # a block ends: evict
                    always = {p for p in cached if p < sink_count or p >= position + 1 - recent}
                    others = sorted(cached - always, key=lambda p: (-score[p], p))
                    cached = always | set(others[:heavy])
    return output.to(query.dtype)


class _HeavyHitterSoftmax:
    """Runs in place of one layer's softmax (dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE), keeping that layer's
    heavy-hitter state from the prompt through every decoding step."""

    def __init__(self, budget: int, sinks: int, block: int) -> None:
        self.budget, self.sinks, self.block = budget, sinks, block
        self.state: HeavyHitterState | None = None

    def __call__(
        self, module, query, key, value, attention_mask, *, teacher_kind, scaling, dropout=0.0, **kwargs
    ):
        length, total = query.shape[2], key.shape[2]
        if any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "sliding_window")):
            raise DoflaError(
                "the heavy-hitter baseline runs plain softmax layers (no soft-capping or own windows)."
            )
        visible = visible_keys(attention_mask, length, total).to(query.device)
        causal = (
            torch.arange(total, device=query.device)
            <= torch.arange(total - length, total, device=query.device)[:, None]
        )
        if not bool((visible == causal).all()):
            raise DoflaError(
                "the heavy-hitter baseline runs on unpadded rows; evaluate one row at a time or unpadded."
            )
        state = self.state if total > length else None
        output, self.state = heavy_hitter_attention(
            query, key, value, self.budget, self.sinks, scaling, self.block, state
        )
        return output, None


@contextmanager
def heavy_hitter_restricted(
    model: torch.nn.Module,
    budget: int,
    sinks: int = 4,
    layers: Sequence[int] | None = None,
    *,
    block: int = DEFAULT_BLOCK,
) -> Iterator[torch.nn.Module]:
    """Within this block the model's softmax layers (``layers``: indices, default all) attend through a
    heavy-hitter cache of ``budget`` keys with ``sinks`` sink tokens (module docstring). A call without
    cached keys starts a fresh sequence; decoding continues the state its prompt left."""
    from dofla.models import get_adapter

    check_budget(budget, sinks, block)
    dispatch.install(model)
    modules = list(get_adapter(model).attention_modules(model))
    if layers is not None:
        modules = [modules[int(layer)] for layer in sorted({int(layer) for layer in layers})]
    if any(getattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE, None) for module in modules):
        raise DoflaError("this model already runs a softmax baseline; leave that block first.")
    for module in modules:
        setattr(
            module,
            dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE,
            _HeavyHitterSoftmax(int(budget), int(sinks), int(block)),
        )
    try:
        yield model
    finally:
        for module in modules:
            delattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE)
