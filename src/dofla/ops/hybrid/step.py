"""Hybrid attention's one-token step on the ring layout (generation, and the frozen decoding steps of
``dofla.graph_decode``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from dofla.ops.state import BatchedState, HybridState, LinearState
from dofla.ops.window.step import (
    RingWindow,
    advance_slot,
    ordered_slots,
    owned_state,
    ring_slots,
    ring_window,
    sink_seen_keys,
    window_scores,
    write_key,
)

NEGATIVE_INFINITY = float("-inf")


@dataclass
class RingHybridState(BatchedState):
    """``HybridState`` in the decoding layout: the window and sinks as a ``RingWindow`` (values with a column of
    ones), the window slots' key features and log scales, and the linear sums of the keys that left.

    sums: (B, Hk, F, Dv + 1) the linear state's kv with its normalizer as the last column (one product reads
    both); log_offset: (B, Hk) as in ``LinearState``.
    key_features: (B, Hk, W, F), key_log_scales: (B, Hk, W) of the window slots (-inf: empty, absent, sink).
    """

    ring: RingWindow
    key_features: Tensor
    key_log_scales: Tensor
    sums: Tensor
    log_offset: Tensor

    @property
    def num_tokens(self) -> int:
        return self.ring.num_tokens

    @property
    def window(self) -> int:
        return self.ring.window

    @property
    def sinks(self) -> int:
        return self.ring.sinks

    def general_layout(self) -> HybridState:
        """The ``HybridState`` this holds (copies)."""
        window_state, window = self.ring.general_layout(), self.ring.window
        tokens = self.num_tokens
        linear = LinearState(
            kv=self.sums[..., :-1].clone(),
            normalizer=self.sums[..., -1].clone(),
            log_offset=self.log_offset.clone(),
            num_tokens=max(0, tokens - window),
        )
        return HybridState(
            linear=linear,
            keys=window_state.keys,
            values=window_state.values,
            key_features=ordered_slots(self.key_features, tokens, window),
            key_log_scales=ordered_slots(self.key_log_scales, tokens, window),
            sink_keys=window_state.sink_keys,
            sink_values=window_state.sink_values,
            sink_count=window_state.sink_count,
            window=window,
        )


def ring_hybrid_state(state: HybridState) -> RingHybridState:
    """A general hybrid state in the decoding layout (new buffers)."""
    tokens, window = state.num_tokens, state.window
    linear = state.linear
    return RingHybridState(
        ring=ring_window(state.window_state(), tokens, ones_column=True),
        key_features=ring_slots(state.key_features, tokens, window, 0.0),
        key_log_scales=ring_slots(state.key_log_scales, tokens, window, NEGATIVE_INFINITY),
        sums=torch.cat([linear.kv, linear.normalizer.unsqueeze(-1)], dim=-1),
        log_offset=linear.log_offset.clone(),
    )


def _at(buffer: Tensor, slot: int | Tensor) -> Tensor:
    """buffer (B, Hk, N, ...)'s slot (an int, or a (1,) int64 tensor) -> (B, Hk, ...)."""
    return buffer[:, :, slot] if isinstance(slot, int) else buffer.index_select(2, slot).squeeze(2)


def _put(buffer: Tensor, slot: int | Tensor, value: Tensor) -> None:
    """Write value (B, Hk, ...) into buffer (B, Hk, N, ...)'s slot (as in ``_at``), in place."""
    if isinstance(slot, int):
        buffer[:, :, slot] = value
    else:
        buffer.index_copy_(2, slot, value.unsqueeze(2))


def _absorb_oldest_key(state: RingHybridState, source: RingHybridState, slot: int | Tensor) -> Tensor:
    """The key in the ring's next slot ``slot`` (the oldest, the window being full) joins the linear sums, in
    place: ``update_linear_state`` on the (kv | normalizer) sums, its value's column of ones giving the
    normalizer; returns the sums' new log offset (B, Hk). The key is read from ``source``: ``state`` itself without autograd, else the state before its
    copy (autograd keeps what it reads, and the new key overwrites the slot in ``state``)."""
    old = slot - state.ring.sinks
    scale = _at(source.key_log_scales, old)  # (B, Hk): -inf for sinks and absent keys
    log_offset = torch.maximum(state.log_offset, scale)
    # exp_relative of the old offset and of the key against the new one, sharing its clamp
    finite_offset = log_offset.clamp_min(torch.finfo(log_offset.dtype).min)
    decay = torch.exp(state.log_offset - finite_offset)  # (B, Hk) <= 1
    weight = torch.exp(scale - finite_offset).unsqueeze(-1)  # (B, Hk, 1)
    weighted_key = _at(source.key_features, old) * weight  # (B, Hk, F)
    value = _at(source.ring.values, slot)  # (B, Hk, Dv + 1): its last column, 1, adds to the normalizer
    state.sums.mul_(decay[..., None, None]).addcmul_(weighted_key.unsqueeze(-1), value.unsqueeze(-2))
    return log_offset


def hybrid_decode_step(
    state: HybridState | RingHybridState,
    queries: Tensor,
    q_features: Tensor,
    key: Tensor,
    k_features: Tensor,
    value: Tensor,
    log_scale: Tensor,
    window_factor: Tensor,
    *,
    scaling: float,
    eps: float = 1e-6,
    sink_queries: Tensor | None = None,
    sink_key_turn=None,
    slot: Tensor | None = None,
) -> tuple[Tensor, RingHybridState]:
    """One present token of ``recurrent_hybrid_attention`` (sinks included, no soft-capping) on the ring
    layout: queries (B, Hk, G, D), q_features (B, Hk, G, F), key (B, Hk, D), k_features (B, Hk, F),
    value (B, Hk, Dv), log_scale (B, Hk) finite, window_factor (Hk, G, 1), sink_queries (B, Hk, G, D) or
    None (the queries that score the sinks; or ``sink_key_turn``, see ``ring_window_step``); every tensor
    and the state's buffers in one dtype -> out
    (B, Hk, G, Dv) and the state after the token (a general ``HybridState`` is converted first; a ring
    state's buffers are updated in place without autograd). ``slot``: a frozen ring's next slot (see
    ``dofla.ops.window.step.write_key``; its window full), moved on in place."""
    source = ring_hybrid_state(state) if isinstance(state, HybridState) else state
    state = owned_state(source, source.sums)
    ring = state.ring
    batch, heads, group, _ = queries.shape
    next_slot = ring.next_slot if slot is None else slot
    if slot is not None or ring.num_tokens >= ring.window:  # the oldest key leaves for the linear sums
        # a new state object: a frozen decoding step keeps the one it was given
        state = replace(state, log_offset=_absorb_oldest_key(state, source, next_slot))
    old = next_slot - ring.sinks
    is_sink = write_key(ring, key, value, slot)
    _put(state.key_features, old, k_features)
    if is_sink is not None:  # a sink never reaches the linear state
        log_scale = log_scale.masked_fill(is_sink, NEGATIVE_INFINITY)
    _put(state.key_log_scales, old, log_scale)
    if slot is None:
        ring.num_tokens += 1
    else:
        advance_slot(slot, ring)

    keys = sink_seen_keys(ring, sink_key_turn)
    scores = window_scores(ring, queries, scaling, sink_queries, keys)  # (B * Hk, G, S + W)
    # the new key is visible (in the window or as a sink): every max is finite
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    # (B * Hk, G, Dv + 1): numerators, then denominators (the values' column of ones)
    window_sums = torch.bmm(weights, ring.values.flatten(0, 1))
    linear_sums = torch.bmm(q_features.flatten(0, 1), state.sums.flatten(0, 1))  # relative to the offset
    sums = torch.lerp(
        linear_sums.view(batch, heads, group, -1),
        window_sums.view(batch, heads, group, -1),
        window_factor,
    )  # (B, Hk, G, Dv + 1)
    return sums[..., :-1] / (sums[..., -1:] + eps), state
