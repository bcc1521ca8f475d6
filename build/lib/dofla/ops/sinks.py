"""Attention sinks: which new keys become sinks, and the fixed buffer of S slots that keeps them.

The sinks of a sequence are its first S present keys, counted per batch row and key/value head from the
start of the sequence (across calls); absent (padding) keys do not count, so left padding changes nothing.
Slot s holds the s-th present key. The chunked and recurrent forms of the window and hybrid ops share
this bookkeeping (the recurrent form calls it with one token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SinkUpdate:
    """The sink buffers after one call, and where the call's keys went.

    is_sink: (B, Hk, T) bool, the call's keys that became sinks.
    keys: (B, Hk, S, D), values: (B, Hk, S, Dv) all sinks so far (zeros in unfilled slots), buffer dtype.
    count: (B, Hk) int64 filled slots.
    position: (B, Hk, S) the token index in this call of each slot's key: -1 for sinks from earlier calls,
    T for unfilled slots, so query t sees slot s exactly when position <= t.
    """

    is_sink: Tensor
    keys: Tensor
    values: Tensor
    count: Tensor
    position: Tensor


def sink_flags(present: Tensor, count: Tensor, sinks: int) -> tuple[Tensor, Tensor]:
    """present (B, Hk, T) bool, count (B, Hk) sinks already held -> is_sink (B, Hk, T), rank (B, Hk, T).

    rank is each key's index among the present keys of the sequence (meaningful where present).
    """
    rank = count[..., None] + present.long().cumsum(-1) - 1
    return present & (rank < sinks), rank


def add_sinks(
    sink_keys: Tensor, sink_values: Tensor, count: Tensor, key: Tensor, value: Tensor, present: Tensor
) -> SinkUpdate:
    """Put the call's first present keys into the free sink slots.

    sink_keys (B, Hk, S, D), sink_values (B, Hk, S, Dv), count (B, Hk): the buffers so far;
    key (B, Hk, T, D), value (B, Hk, T, Dv), present (B, Hk, T) bool: the call's keys.
    """
    batch, num_kv_heads, length = present.shape
    sinks = sink_keys.shape[2]
    if sinks == 0:
        no_slots = count.new_zeros(batch, num_kv_heads, 0)
        return SinkUpdate(torch.zeros_like(present), sink_keys, sink_values, count, no_slots)
    slot = torch.arange(sinks, device=present.device)
    held = slot < count[..., None]  # (B, Hk, S): filled by earlier calls
    is_sink, rank = sink_flags(present, count, sinks)
    hit = is_sink[..., :, None] & (rank[..., :, None] == slot)  # (B, Hk, T, S): key t fills slot s
    filled = hit.any(2)  # (B, Hk, S)
    token = torch.arange(length, device=present.device)[:, None]
    source = (hit.long() * token).sum(2)  # (B, Hk, S): the token filling each slot (0 where none)

    def gather(buffer: Tensor, new: Tensor) -> Tensor:
        taken = new.gather(2, source[..., None].expand(-1, -1, -1, new.shape[-1]))  # (B, Hk, S, X)
        return torch.where(filled[..., None], taken.to(buffer.dtype), buffer)

    position = torch.where(held, -1, torch.where(filled, source, length))
    return SinkUpdate(
        is_sink, gather(sink_keys, key), gather(sink_values, value), count + filled.sum(-1), position
    )
