"""Decoding form: one token at a time (any T is looped), memory constant in the context length.

Same semantics as ``dofla.ops.naive`` (see its docstring); the state's ``log_offset`` is the running
maximum m of the keys' log scales, so the per-token offsets agree exactly with the other forms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_hybrid_inputs,
    check_linear_inputs,
    check_sink_query,
    check_sinks,
    check_state_window,
    check_window_inputs,
    compute_dtype,
    mask_absent_keys,
    present_keys,
    soft_cap,
    stack_tokens,
)
from dofla.ops.sinks import add_sinks
from dofla.ops.state import HybridState, LinearState, WindowState, exp_relative, log_sum_exp


def update_linear_state(state: LinearState, k_features: Tensor, v: Tensor, log_scale: Tensor) -> LinearState:
    """Add one key per head: k_features (B, Hk, F), v (B, Hk, Dv), log_scale (B, Hk). Returns a new state."""
    batch, num_kv_heads, feature_dim = k_features.shape
    log_offset = torch.maximum(state.log_offset, log_scale)  # (B, Hk)
    # exp_relative of the old offset and of the key against the new one, sharing its clamp
    finite_offset = log_offset.clamp_min(torch.finfo(log_offset.dtype).min)
    decay = torch.exp(state.log_offset - finite_offset).view(batch, num_kv_heads, 1)  # (B, Hk, 1), <= 1
    weighted_key = k_features * torch.exp(log_scale - finite_offset).view(
        batch, num_kv_heads, 1
    )  # (B, Hk, F)
    kv = torch.addcmul(
        state.kv * decay.unsqueeze(-1), weighted_key.unsqueeze(-1), v.unsqueeze(-2)
    )  # (B, Hk, F, Dv)
    normalizer = torch.addcmul(weighted_key, state.normalizer, decay)  # (B, Hk, F)
    return LinearState(kv, normalizer, log_offset, state.num_tokens + 1)


def _read_linear_state(state: LinearState, q_features: Tensor) -> tuple[Tensor, Tensor]:
    """q_features (B, Hk, G, F) -> numerator (B, Hk, G, Dv), denominator (B, Hk, G), relative to the offset."""
    numerator = q_features @ state.kv  # (B, Hk, G, Dv)
    denominator = torch.linalg.vecdot(q_features, state.normalizer.unsqueeze(-2))  # (B, Hk, G)
    return numerator, denominator


def linear_decode_step(
    state: LinearState,
    q_features: Tensor,
    k_features: Tensor,
    v: Tensor,
    log_scale: Tensor,
    eps: float = 1e-6,
) -> tuple[Tensor, LinearState]:
    """One token of ``recurrent_linear_attention``: q_features (B, Hk, G, F), k_features (B, Hk, F),
    v (B, Hk, Dv), log_scale (B, Hk), all in the state's dtype -> out (B, Hk, G, Dv) and the new state."""
    state = update_linear_state(state, k_features, v, log_scale)
    numerator, denominator = _read_linear_state(state, q_features)
    return numerator / (denominator.unsqueeze(-1) + eps), state


def _log_scale_or_zeros(k_log_scale: Tensor | None, k_features: Tensor, dtype: torch.dtype) -> Tensor:
    if k_log_scale is None:
        return torch.zeros(k_features.shape[:3], dtype=dtype, device=k_features.device)
    return k_log_scale.to(dtype)


def recurrent_linear_attention(
    q_features: Tensor,
    k_features: Tensor,
    v: Tensor,
    *,
    k_log_scale: Tensor | None = None,
    state: LinearState | None = None,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, LinearState]:
    """Causal linear attention token by token.

    q_features (B, H, T, F), k_features (B, Hk, T, F), v (B, Hk, T, Dv), k_log_scale (B, Hk, T) or None;
    state from an earlier call (recurrent or chunked with return_state=True) or None.
    key_mask (B, T) bool, True for real tokens: absent keys take no part (see ``dofla.ops.naive``).
    Returns out (B, H, T, Dv) in v's dtype and the state after the T tokens (float32, or float64 inputs).
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, value_dim = k_features.shape[1], v.shape[-1]
    if state is None:
        state = LinearState.empty(batch, num_kv_heads, feature_dim, value_dim, q_features.device, dtype)
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)  # (B, Hk, G, T, F)
    k, values = k_features.to(dtype), v.to(dtype)
    log_scale = _log_scale_or_zeros(k_log_scale, k_features, dtype)  # (B, Hk, T)
    outputs = []
    for t in range(length):
        output, state = linear_decode_step(
            state, q[:, :, :, t], k[:, :, t], values[:, :, t], log_scale[:, :, t], eps
        )
        outputs.append(output)  # (B, Hk, G, Dv)
    out = stack_tokens(outputs).reshape(batch, num_heads, length, value_dim)
    return out.to(v.dtype), state


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


def advance_window(
    state: WindowState, key: Tensor, value: Tensor, present: Tensor
) -> tuple[WindowState, Tensor]:
    """Add one key: key (B, Hk, 1, D), value (B, Hk, 1, Dv), present (B, Hk, 1) bool.

    A sink goes to the sink buffer (and is marked not present in the window); the oldest key drops out
    once the window is full. Returns the new state and is_sink (B, Hk, 1).
    """
    if state.sinks:
        sink = add_sinks(state.sink_keys, state.sink_values, state.sink_count, key, value, present)
        is_sink, sinks = sink.is_sink, (sink.keys, sink.values, sink.count)
        present = present & ~is_sink
    else:  # no sink bookkeeping: a decoding step's cost is its number of small operators
        is_sink, sinks = torch.zeros_like(present), (state.sink_keys, state.sink_values, state.sink_count)
    keys = torch.cat([state.keys, key.to(state.keys.dtype)], dim=2)  # (B, Hk, L + 1, D)
    values = torch.cat([state.values, value.to(state.values.dtype)], dim=2)
    key_present = torch.cat([state.key_present, present], dim=2)
    if keys.shape[2] > state.window:
        keys, values, key_present = keys[:, :, 1:], values[:, :, 1:], key_present[:, :, 1:]
    new_state = WindowState(keys, values, key_present, *sinks, state.window, state.num_tokens + 1)
    return new_state, is_sink


def read_window(
    state: WindowState,
    queries: Tensor,
    *,
    scaling: float,
    softcap: float | None,
    sink_queries: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """queries (B, Hk, G, D) in the compute dtype -> numerator (B, Hk, G, Dv), denominator (B, Hk, G) of
    exp(score - max) over the window's present keys and the filled sink slots, and that max (B, Hk, G)
    (-inf for a query that sees no key); sink_queries (B, Hk, G, D) score the sinks (None: queries)."""
    dtype = queries.dtype
    keys, values, visible = state.keys, state.values, state.key_present  # (B, Hk, L, ...)
    own_sink_scores = bool(state.sinks) and sink_queries is not None
    if state.sinks:
        filled = torch.arange(state.sinks, device=keys.device) < state.sink_count[..., None]  # (B, Hk, S)
        if not own_sink_scores:  # one product for both
            keys = torch.cat([keys, state.sink_keys.to(keys.dtype)], dim=2)
        values = torch.cat([values, state.sink_values.to(values.dtype)], dim=2)
        visible = torch.cat([visible, filled], dim=2)
    scores = queries @ keys.to(dtype).transpose(-1, -2)  # (B, Hk, G, L (+ S))
    if own_sink_scores:
        sink_scores = sink_queries @ state.sink_keys.to(dtype).transpose(-1, -2)  # (B, Hk, G, S)
        scores = torch.cat([scores, sink_scores], dim=-1)
    scores = soft_cap(scaling * scores, softcap)  # (B, Hk, G, L + S)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))  # absent keys
    # exp_relative: a query that sees no key has max -inf, and all its weights 0
    maximum = scores.amax(-1, keepdim=True)
    weights = exp_relative(scores, maximum)
    return weights @ values.to(dtype), weights.sum(-1), maximum[..., 0]


def recurrent_hybrid_attention(
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
    state: HybridState | None = None,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    eps: float = 1e-6,
    sink_query: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """Sliding-window softmax (plus ``sinks`` sink keys) + linear attention token by token (semantics in
    ``dofla.ops.naive``).

    query (B, H, T, D), key (B, Hk, T, D), window_factor (H,), sink_query (B, H, T, D) the queries that
    score the sinks (None: query). The state keeps the last ``window`` keys,
    values, key features and log scales, the sink keys and values, and the linear state of everything
    older. Returns out (B, H, T, Dv) in v's dtype and the new HybridState.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    check_hybrid_inputs(query, key, q_features, window, window_factor)
    check_sink_query(query, sink_query)
    window, sinks = int(window), check_sinks(sinks)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, head_dim, value_dim = key.shape[1], key.shape[-1], v.shape[-1]
    log_scale = _log_scale_or_zeros(k_log_scale, k_features, dtype)  # (B, Hk, T)
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
    sink_queries = None if sink_query is None else sink_query.to(dtype).view_as(queries)
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

        linear_numerator, linear_denominator = _read_linear_state(
            linear, q[:, :, :, t]
        )  # (B,Hk,G,Dv), (B,Hk,G)
        window_numerator, window_denominator, _ = read_window(
            window_state,
            queries[:, :, :, t],
            scaling=scaling,
            softcap=softcap,
            sink_queries=None if sink_queries is None else sink_queries[:, :, :, t],
        )
        numerator = gamma[..., None] * window_numerator + (1 - gamma[..., None]) * linear_numerator
        denominator = gamma * window_denominator + (1 - gamma) * linear_denominator  # (B, Hk, G)
        outputs.append(numerator / (denominator[..., None] + eps))
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


def recurrent_window_attention(
    query: Tensor,
    key: Tensor,
    v: Tensor,
    *,
    scaling: float,
    window: int,
    sinks: int = 0,
    state: WindowState | None = None,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    sink_query: Tensor | None = None,
):
    """Sliding-window softmax attention with ``sinks`` sink keys, token by token (semantics in
    ``dofla.ops.naive``).

    query (B, H, T, D), key (B, Hk, T, D) after rotary, v (B, Hk, T, Dv), key_mask (B, T) True for real
    tokens, sink_query (B, H, T, D) the queries that score the sinks (None: query); state from an earlier
    call of either form, or None. Returns out (B, H, T, Dv) in v's dtype and
    the new WindowState (memory bounded by window + sinks keys); with ``return_lse`` (out, lse, state),
    lse (B, H, T) the log-sum-exp of each query's softmax scores (-inf when it sees no key).
    """
    group = check_window_inputs(query, key, v, window, sinks)
    check_sink_query(query, sink_query)
    window, sinks = int(window), int(sinks)
    present = present_keys(key_mask, key)  # (B, Hk, T)
    if key_mask is not None:
        v = v.masked_fill(~present[..., None], 0)
    dtype = compute_dtype(query, key, v)
    batch, num_heads, length, head_dim = query.shape
    if state is None:
        state = WindowState.empty_like(key, v, window, sinks)
    else:
        check_state_window(state, window, sinks)
    queries = query.to(dtype).view(batch, key.shape[1], group, length, head_dim)  # (B, Hk, G, T, D)
    sink_queries = None if sink_query is None else sink_query.to(dtype).view_as(queries)
    outputs, lses = [], []
    for t in range(length):
        step = slice(t, t + 1)
        state, _ = advance_window(state, key[:, :, step], v[:, :, step], present[:, :, step])
        numerator, denominator, maximum = read_window(
            state,
            queries[:, :, :, t],
            scaling=scaling,
            softcap=softcap,
            sink_queries=None if sink_queries is None else sink_queries[:, :, :, t],
        )
        # a visible key contributes exp(0) = 1, so the sum is 0 (nothing seen: output 0) or >= 1
        outputs.append(numerator / denominator.clamp_min(1.0)[..., None])  # (B, Hk, G, Dv)
        lses.append(log_sum_exp(denominator, maximum))  # (B, Hk, G)
    out = stack_tokens(outputs).reshape(batch, num_heads, length, v.shape[-1]).to(v.dtype)
    if not return_lse:
        return out, state
    return out, torch.stack(lses, dim=-1).reshape(batch, num_heads, length), state
