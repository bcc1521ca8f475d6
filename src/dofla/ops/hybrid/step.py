"""Hybrid attention's one-token steps on the ring layout (generation): the general step, and the step over
Hedgehog features in the steady state that a compiled whole decoding step traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dofla.ops.state import BatchedState, HybridState, LinearState
from dofla.ops.steps import product, sinks_turned, turned
from dofla.ops.window.step import (
    RingWindow,
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


def _absorb_oldest_key(state: RingHybridState, source: RingHybridState) -> None:
    """The key in the ring's next slot (the oldest, the window being full) joins the linear sums, in place:
    ``update_linear_state`` on the (kv | normalizer) sums, its value's column of ones giving the normalizer.
    The key is read from ``source``: ``state`` itself without autograd, else the state before its copy
    (autograd keeps what it reads, and the new key overwrites the slot in ``state``)."""
    slot = state.ring.next_slot
    old = slot - state.ring.sinks
    scale = source.key_log_scales[:, :, old]  # (B, Hk): -inf for sinks and absent keys
    log_offset = torch.maximum(state.log_offset, scale)
    # exp_relative of the old offset and of the key against the new one, sharing its clamp
    finite_offset = log_offset.clamp_min(torch.finfo(log_offset.dtype).min)
    decay = torch.exp(state.log_offset - finite_offset)  # (B, Hk) <= 1
    weight = torch.exp(scale - finite_offset).unsqueeze(-1)  # (B, Hk, 1)
    weighted_key = source.key_features[:, :, old] * weight  # (B, Hk, F)
    value = source.ring.values[:, :, slot]  # (B, Hk, Dv + 1): its last column, 1, adds to the normalizer
    state.sums.mul_(decay[..., None, None]).addcmul_(weighted_key.unsqueeze(-1), value.unsqueeze(-2))
    state.log_offset = log_offset


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
) -> tuple[Tensor, RingHybridState]:
    """One present token of ``recurrent_hybrid_attention`` (sinks included, no soft-capping) on the ring
    layout: queries (B, Hk, G, D), q_features (B, Hk, G, F), key (B, Hk, D), k_features (B, Hk, F),
    value (B, Hk, Dv), log_scale (B, Hk) finite, window_factor (Hk, G, 1), sink_queries (B, Hk, G, D) or
    None (the queries that score the sinks; or ``sink_key_turn``, see ``ring_window_step``); every tensor
    and the state's buffers in one dtype -> out
    (B, Hk, G, Dv) and the state after the token (a general ``HybridState`` is converted first; a ring
    state's buffers are updated in place without autograd)."""
    source = ring_hybrid_state(state) if isinstance(state, HybridState) else state
    state = owned_state(source, source.sums)
    ring = state.ring
    batch, heads, group, _ = queries.shape
    if ring.num_tokens >= ring.window:  # the oldest key leaves the window and joins the linear sums
        _absorb_oldest_key(state, source)
    old = ring.next_slot - ring.sinks
    is_sink = write_key(ring, key, value)
    state.key_features[:, :, old] = k_features
    if is_sink is None:
        state.key_log_scales[:, :, old] = log_scale
    else:  # a sink never reaches the linear state
        state.key_log_scales[:, :, old] = log_scale.masked_fill(is_sink, NEGATIVE_INFINITY)
    ring.num_tokens += 1

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


def hedgehog_window_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_decay_total: Tensor | None,
    signed_weight: Tensor,
    decay_weight: Tensor | None,
    decay_bias: Tensor | None,
    mix_logit: Tensor,
    ring_keys: Tensor,
    ring_values: Tensor,
    key_features: Tensor,
    key_log_scales: Tensor,
    sums: Tensor,
    log_offset: Tensor,
    slot: Tensor,
    oldest: Tensor,
    memory_cos: Tensor | None,
    memory_sin: Tensor | None,
    sink_cos: Tensor | None,
    sink_sin: Tensor | None,
    scaling: float,
    sinks: int,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One token of linear attention over Hedgehog features sharing its normalisation with the window's
    softmax, with forgetting (the ``gla`` cell) or without (the ``linear`` cell): the hybrid step of
    ``dofla.ops.hybrid.step.hybrid_decode_step``, its window full and every sink kept. Returns the output
    (B, 1, H, Dv), the new running log decay (B, Hs) (None without forgetting) and the sums' new log offset;
    the sums, the ring and the window's key features and log scales are updated in place.

    query (B, H, 1, D), key and value (B, Hs, 1, D); the map's columns interleaved with their negations
    (Hs, D, F) (phi = softmax over each pair's sign, then over the F/2 columns); with forgetting,
    ``log_decay_total`` A (B, Hs) before the token and the decay gate's weight (Hs, Dv) and bias (Hs,) (the
    key's log scale is then -A_t), else all three None (log scale 0); gamma = sigmoid(``mix_logit`` (H,)); the
    ring's keys (B, Hs, S + W, D) and values with their column of ones (B, Hs, S + W, Dv + 1); the window
    slots' key features (B, Hs, W, F) and log scales (B, Hs, W); the sums (B, Hs, F, Dv + 1) of the keys
    that left the window, relative to ``log_offset`` (B, Hs); ``slot`` the ring slot this token takes and
    ``oldest`` (slot - S) the window slot whose key leaves for the sums (1-element int64 each); the turns as
    in ``gated_delta_window_step``.
    """
    batch, heads, _, dim = query.shape
    state_heads = key.shape[1]
    group = heads // state_heads
    queries = query.reshape(batch, state_heads, group, dim)
    both = torch.cat([queries, key], dim=2)  # (B, Hs, G + 1, D)
    projection = product(turned(both, memory_cos, memory_sin), signed_weight)  # (B, Hs, G + 1, F)
    features = torch.softmax(projection.unflatten(-1, (-1, 2)), dim=-2).flatten(-2)
    values = value[:, :, 0]  # (B, Hs, Dv)
    if decay_weight is None:
        total, log_scale = None, torch.zeros_like(log_offset)  # Hedgehog's log scale s_t = 0
    else:
        gate = (values * decay_weight).sum(-1) * values.shape[-1] ** -0.5 + decay_bias
        total = log_decay_total + torch.nn.functional.logsigmoid(gate)  # (B, Hs): A_t
        log_scale = -total  # the key's log scale s_t - A_t
    # the oldest window key joins the sums (read before this token overwrites its slots)
    leaving_scale = key_log_scales.index_select(2, oldest)[:, :, 0]  # (B, Hs)
    new_offset = torch.maximum(log_offset, leaving_scale)
    finite_offset = new_offset.clamp_min(torch.finfo(new_offset.dtype).min)
    decay = torch.exp(log_offset - finite_offset)[..., None, None]
    weight = torch.exp(leaving_scale - finite_offset)[..., None]  # (B, Hs, 1)
    leaving_key = key_features.index_select(2, oldest)[:, :, 0] * weight  # (B, Hs, F)
    leaving_value = ring_values.index_select(2, slot)  # (B, Hs, 1, Dv + 1)
    sums.copy_(sums * decay + leaving_key[..., None] * leaving_value)
    ring_keys.index_copy_(2, slot, key)
    ring_values.index_copy_(2, slot, torch.cat([value, torch.ones_like(value[..., :1])], dim=-1))
    key_features.index_copy_(2, oldest, features[:, :, -1:])
    key_log_scales.index_copy_(2, oldest, log_scale[..., None])
    keys = sinks_turned(ring_keys, sink_cos, sink_sin, sinks)
    scores = product(queries, keys.transpose(-1, -2)) * scaling  # (B, Hs, G, S + W)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    window_sums = product(weights, ring_values)  # (B, Hs, G, Dv + 1): numerators, then denominators
    linear_sums = product(features[:, :, :-1], sums)  # relative to the offset
    mixed = torch.lerp(linear_sums, window_sums, torch.sigmoid(mix_logit).view(state_heads, group, 1))
    output = mixed[..., :-1] / (mixed[..., -1:] + eps)
    return output.reshape(batch, 1, heads, -1), total, new_offset
