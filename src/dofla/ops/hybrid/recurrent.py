"""Hybrid attention's recurrent form (decoding), one token at a time; semantics in ``dofla.ops``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_state_window,
    compute_dtype,
    prepare_hybrid_inputs,
    stack_tokens,
)
from dofla.ops.inputs import HybridInputs, HybridOptions
from dofla.ops.linear.step import log_scale_or_zeros, read_linear_state, update_linear_state
from dofla.ops.state import HybridState, LinearState, WindowState
from dofla.ops.window.recurrent import advance_window, read_window


def empty_hybrid_state(
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    feature_dim: int,
    value_dim: int,
    window: int,
    *,
    sinks: int = 0,
    device=None,
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
) -> HybridState:
    """A hybrid state that has seen nothing; buffers in ``dtype``, linear sums in ``state_dtype``."""

    def buffer(*shape, kind=dtype):
        return torch.zeros(batch, num_kv_heads, 0, *shape, device=device, dtype=kind)

    window_state = WindowState.empty(
        batch, num_kv_heads, head_dim, value_dim, window, sinks, device=device, dtype=dtype
    )
    return HybridState(
        linear=LinearState.empty(batch, num_kv_heads, feature_dim, value_dim, device, state_dtype),
        keys=window_state.keys,
        values=window_state.values,
        key_features=buffer(feature_dim),
        key_log_scales=buffer(kind=state_dtype),
        sink_keys=window_state.sink_keys,
        sink_values=window_state.sink_values,
        sink_count=window_state.sink_count,
        window=int(window),
    )


def recurrent_hybrid_attention(
    inputs: HybridInputs, options: HybridOptions, *, state: HybridState | None = None
) -> tuple[Tensor, HybridState]:
    """Sliding-window softmax (plus ``options.sinks`` sink keys) + linear attention token by token
    (semantics in ``dofla.ops``).

    inputs: the call's tensors (shapes in ``HybridInputs``). The state keeps the last ``window`` keys,
    values, key features and log scales, the sink keys and values, and the linear state of everything
    older. Returns out (B, H, T, Dv) in v's dtype and the new HybridState.
    """
    group, window, sinks, inputs = prepare_hybrid_inputs(inputs, options)
    query, key, v, window_factor = inputs.query, inputs.key, inputs.v, inputs.window_factor
    q_features, k_features, k_log_scale = inputs.q_features, inputs.k_features, inputs.k_log_scale
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, head_dim, value_dim = key.shape[1], key.shape[-1], v.shape[-1]
    log_scale = log_scale_or_zeros(k_log_scale, k_features, dtype)  # (B, Hk, T)
    present = ~torch.isneginf(log_scale)
    if state is None:  # empty buffers keep each input's own dtype
        linear = LinearState.empty(batch, num_kv_heads, feature_dim, value_dim, query.device, dtype)
        window_state = WindowState.empty_like(key, v, window, sinks)
        features, scales = k_features[:, :, :0], log_scale[:, :, :0]
    else:
        check_state_window(state, window, sinks)
        linear, window_state = state.linear, state.window_state()
        features, scales = state.key_features, state.key_log_scales

    gamma = window_factor.to(dtype).view(num_kv_heads, group)  # (Hk, G)
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)  # (B, Hk, G, T, F)
    queries = query.to(dtype).view(batch, num_kv_heads, group, length, head_dim)  # (B, Hk, G, T, D)
    sink_queries = None if inputs.sink_query is None else inputs.sink_query.to(dtype).view_as(queries)
    outputs = []
    for t in range(length):
        if scales.shape[2] == window:  # the oldest key leaves the window and joins the linear state
            linear = update_linear_state(
                linear,
                features[:, :, 0].to(dtype),
                window_state.values[:, :, 0].to(dtype),
                scales[:, :, 0].to(dtype),
            )
            features, scales = features[:, :, 1:], scales[:, :, 1:]
        step = slice(t, t + 1)
        window_state, is_sink = advance_window(
            window_state, key[:, :, step], v[:, :, step], present[:, :, step]
        )
        scale = log_scale[:, :, step].masked_fill(is_sink, float("-inf")) if sinks else log_scale[:, :, step]
        features = torch.cat([features, k_features[:, :, step].to(features.dtype)], dim=2)  # (B, Hk, L, F)
        scales = torch.cat([scales, scale.to(scales.dtype)], dim=2)  # sinks: -inf, never in the linear state

        linear_numerator, linear_denominator = read_linear_state(
            linear, q[:, :, :, t]
        )  # (B,Hk,G,Dv), (B,Hk,G)
        window_numerator, window_denominator, _ = read_window(
            window_state,
            queries[:, :, :, t],
            options,
            None if sink_queries is None else sink_queries[:, :, :, t],
        )
        numerator = gamma[..., None] * window_numerator + (1 - gamma[..., None]) * linear_numerator
        denominator = gamma * window_denominator + (1 - gamma) * linear_denominator  # (B, Hk, G)
        outputs.append(numerator / (denominator[..., None] + options.eps))
    out = stack_tokens(outputs).reshape(batch, num_heads, length, value_dim)
    new_state = HybridState(
        linear=linear,
        keys=window_state.keys,
        values=window_state.values,
        key_features=features,
        key_log_scales=scales,
        sink_keys=window_state.sink_keys,
        sink_values=window_state.sink_values,
        sink_count=window_state.sink_count,
        window=window,
    )
    return out.to(v.dtype), new_state
