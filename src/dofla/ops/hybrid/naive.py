"""Hybrid attention (linear sums plus the sliding-window softmax), the quadratic reference (tests only);
semantics in ``dofla.ops``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import compute_dtype, expand_kv_heads, prepare_hybrid_inputs
from dofla.ops.inputs import HybridInputs, HybridOptions
from dofla.ops.state import exp_relative
from dofla.ops.window.naive import softmax_part_weights


def hybrid_attention(inputs: HybridInputs, options: HybridOptions) -> Tensor:
    """Sliding-window softmax (plus ``options.sinks`` attention-sink keys) + linear attention (LoLCATs),
    quadratic.

    inputs: the call's tensors (shapes in ``HybridInputs``); the soft-capping of ``options`` applies to the
    window's softmax scores. Returns (B, H, T, Dv) in v's dtype.
    """
    group, window, _, inputs = prepare_hybrid_inputs(inputs, options)
    query, key, v, window_factor = inputs.query, inputs.key, inputs.v, inputs.window_factor
    q_features, k_features, k_log_scale = inputs.q_features, inputs.k_features, inputs.k_log_scale
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
    sink_query = inputs.sink_query
    window_weights, is_sink, _ = softmax_part_weights(
        query.to(dtype), keys, present, options, None if sink_query is None else sink_query.to(dtype)
    )  # (B, H, T, T), 0 outside the softmax set

    position = torch.arange(length, device=q.device)
    left_window = position[None, :] <= position[:, None] - window  # (T, T)
    linear_part = left_window & ~is_sink[:, :, None, :]  # (B, H, T, T)
    old_log_weight = torch.where(linear_part, log_scale[:, :, None, :], float("-inf"))  # (B, H, T, T)
    old_offset = old_log_weight.amax(-1, keepdim=True)  # (B, H, T, 1): -inf while no key has left
    linear_weights = (q @ k.transpose(-1, -2)) * exp_relative(old_log_weight, old_offset)

    gamma = window_factor.to(dtype).view(1, num_heads, 1, 1)
    weights = gamma * window_weights + (1 - gamma) * linear_weights  # (B, H, T, T)
    out = (weights @ values) / (weights.sum(-1, keepdim=True) + options.eps)
    return out.to(v.dtype)
