"""Hybrid attention (linear sums plus the sliding-window softmax), the quadratic reference (tests only);
semantics in ``dofla.ops``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_hybrid_inputs,
    check_linear_inputs,
    check_sink_query,
    check_sinks,
    compute_dtype,
    expand_kv_heads,
    mask_absent_keys,
)
from dofla.ops.state import exp_relative
from dofla.ops.window.naive import softmax_part_weights


def hybrid_attention(
    query: Tensor,
    key: Tensor,
    q_features: Tensor,
    k_features: Tensor,
    v: Tensor,
    *,
    scaling: float,
    window: int,
    window_factor: Tensor,
    sinks: int = 0,
    k_log_scale: Tensor | None = None,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    eps: float = 1e-6,
    sink_query: Tensor | None = None,
) -> Tensor:
    """Sliding-window softmax (plus ``sinks`` attention-sink keys) + linear attention (LoLCATs), quadratic.

    query (B, H, T, D), key (B, Hk, T, D) after rotary; features as in ``linear_attention``;
    window_factor (H,) = gamma in (0, 1); softcap: the teacher's logit soft-capping (Gemma-2), applied to
    the window's softmax scores; sink_query (B, H, T, D): the queries that score the sinks (None: query).
    Returns (B, H, T, Dv) in v's dtype.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    check_hybrid_inputs(query, key, q_features, window, window_factor)
    check_sink_query(query, sink_query)
    sinks = check_sinks(sinks)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    length = q_features.shape[2]
    num_heads = q_features.shape[1]
    q = q_features.to(dtype)
    k = expand_kv_heads(k_features, group).to(dtype)
    values = expand_kv_heads(v, group).to(dtype)
    keys = expand_kv_heads(key, group).to(dtype)  # (B, H, T, D)
    if k_log_scale is None:
        log_scale = torch.zeros(k.shape[:3], dtype=dtype, device=k.device)
    else:
        log_scale = expand_kv_heads(k_log_scale, group).to(dtype)

    present = ~torch.isneginf(log_scale)  # (B, H, T): absent keys have log scale -inf
    window_weights, is_sink, _ = softmax_part_weights(
        query.to(dtype),
        keys,
        present,
        scaling=scaling,
        window=window,
        sinks=sinks,
        softcap=softcap,
        sink_query=None if sink_query is None else sink_query.to(dtype),
    )  # (B, H, T, T), 0 outside the softmax set

    position = torch.arange(length, device=q.device)
    left_window = position[None, :] <= position[:, None] - window  # (T, T)
    linear_part = left_window & ~is_sink[:, :, None, :]  # (B, H, T, T)
    old_log_weight = torch.where(linear_part, log_scale[:, :, None, :], float("-inf"))  # (B, H, T, T)
    old_offset = old_log_weight.amax(-1, keepdim=True)  # (B, H, T, 1): -inf while no key has left
    linear_weights = (q @ k.transpose(-1, -2)) * exp_relative(old_log_weight, old_offset)

    gamma = window_factor.to(dtype).view(1, num_heads, 1, 1)
    weights = gamma * window_weights + (1 - gamma) * linear_weights  # (B, H, T, T)
    out = (weights @ values) / (weights.sum(-1, keepdim=True) + eps)
    return out.to(v.dtype)
