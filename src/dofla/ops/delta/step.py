"""The gated delta rule's one-token step, alone or mixed with the window (generation)."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.steps import product, sinks_turned, turned


def gated_delta_window_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    memory: Tensor,
    map_weight: Tensor,
    decay_weight: Tensor,
    decay_bias: Tensor,
    write_weight: Tensor,
    write_bias: Tensor,
    mix_logit: Tensor | None,
    ring_keys: Tensor | None,
    ring_values: Tensor | None,
    slot: Tensor | None,
    memory_cos: Tensor | None,
    memory_sin: Tensor | None,
    sink_cos: Tensor | None,
    sink_sin: Tensor | None,
    feature_mask: Tensor | None,
    conv_tail: Tensor | None,
    conv_weight: Tensor | None,
    out_gate_weight: Tensor | None,
    out_gate_bias: Tensor | None,
    scaling: float,
    sinks: int,
) -> tuple[Tensor, Tensor | None]:
    """One token of the gated delta rule over projected features, alone or mixed with the window's softmax
    (``GatedDeltaAttention``'s step, in its steady state): returns the output (B, 1, H, Dv) and the short
    convolution's new tail (or None); the memory is updated and the token's key and value written into the
    ring in place.

    query (B, H, 1, D), key and value (B, Hs, 1, D) (Hs state heads, the key/value heads; G = H // Hs), the
    memory S (B, Hs, F, Dv); the projection map's weight (Hs, D, F) and its head-wise mask (Hs, F) or None;
    the decay and write gates' weights (Hs, Dv) and biases (Hs,): a = sigmoid(v . w / sqrt(Dv) + b).
    ``conv_tail`` (B, W - 1, C) and ``conv_weight`` (W, C): the short convolution over the token's features
    and values (C channels: the features flattened, then the values) and its last W - 1 inputs; the output
    gate's weight (Hs, G, Dv, Dv) and bias (H, Dv) scale the memory's read-out by
    2 sigmoid(v W / sqrt(Dv) + b). Without a window (``ring_keys`` None) the memory's read-out is the
    output, else gamma = sigmoid(``mix_logit`` (H,)) mixes it per head with the window's softmax over
    ``ring_keys`` (B, Hs, S + W, D)
    and ``ring_values`` (B, Hs, S + W, Dv) after the token is written to ring slot ``slot`` (1-element
    int64); ``memory_cos``, ``memory_sin`` (B, 1, 1, r/2) turn the memory's q and k (a position period),
    ``sink_cos``, ``sink_sin`` the queries that score the ``sinks`` sinks, as the sink keys turned the
    opposite way (sinks seen from the window's edge); None: unturned.
    ``scaling``: the window softmax's logit scale.
    """
    batch, heads, _, dim = query.shape
    state_heads = key.shape[1]
    group = heads // state_heads
    queries = query.reshape(batch, state_heads, group, dim)
    both = torch.cat([queries, key], dim=2)  # (B, Hs, G + 1, D): each state head's queries, then its key
    features = product(turned(both, memory_cos, memory_sin), map_weight)  # (B, Hs, G + 1, F)
    if feature_mask is not None:
        features = features * feature_mask[:, None]
    values = value[:, :, 0]  # (B, Hs, Dv)
    written = value  # what the memory stores: the value, or its short convolution
    tail = None
    if conv_weight is not None:
        present = torch.cat([features.flatten(1), values.flatten(1)], dim=1)  # (B, C)
        recent = torch.cat([conv_tail, present[:, None]], dim=1)  # (B, W, C)
        mixed = (recent * conv_weight).sum(1)  # (B, C)
        features = mixed[:, : features[0].numel()].view(features.shape)
        written = mixed[:, features[0].numel() :].view(value.shape)
        tail = recent[:, 1:]
    norms = torch.linalg.vector_norm(features, dim=-1, keepdim=True).clamp_min(1e-12)
    features = features / norms
    scale = values.shape[-1] ** -0.5
    decay = torch.sigmoid((values * decay_weight).sum(-1) * scale + decay_bias)[
        ..., None, None
    ]  # (B, Hs, 1, 1)
    beta = torch.sigmoid((values * write_weight).sum(-1) * scale + write_bias)[..., None, None]
    key_features = features[:, :, -1:]  # (B, Hs, 1, F)
    recalled = product(key_features, memory)  # (B, Hs, 1, Dv): k^T S
    correction = (written - decay * recalled) * beta  # b (v - a k^T S)
    memory.copy_(memory * decay + key_features.transpose(-1, -2) * correction)  # a S + k (b (v - a k^T S))^T
    output = product(features[:, :, :-1], memory)  # (B, Hs, G, Dv)
    if out_gate_weight is not None:
        logits = product(values[:, :, None, None], out_gate_weight * scale).squeeze(-2)  # (B, Hs, G, Dv)
        output = output * (2 * torch.sigmoid(logits + out_gate_bias.view(state_heads, group, -1)))
    if ring_keys is not None:
        ring_keys.index_copy_(2, slot, key)
        ring_values.index_copy_(2, slot, value)
        keys = sinks_turned(ring_keys, sink_cos, sink_sin, sinks)
        scores = product(queries, keys.transpose(-1, -2)) * scaling  # (B, Hs, G, S + W)
        window = product(torch.softmax(scores, dim=-1), ring_values)  # (B, Hs, G, Dv)
        output = torch.lerp(output, window, torch.sigmoid(mix_logit).view(state_heads, group, 1))
    return output.reshape(batch, 1, heads, -1), tail
