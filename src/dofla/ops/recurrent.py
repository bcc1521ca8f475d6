"""Decoding form: one token at a time (any T is looped), memory constant in the context length.

Same semantics as ``dofla.ops.naive`` (see its docstring); the state's ``log_offset`` is the running
maximum m of the keys' log scales, so the per-token offsets agree exactly with the other forms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.errors import DoflaError
from dofla.ops._checks import (
    check_hybrid_inputs,
    check_linear_inputs,
    compute_dtype,
    mask_absent_keys,
    soft_cap,
)
from dofla.ops.state import HybridState, LinearState, exp_relative


def update_linear_state(state: LinearState, k_features: Tensor, v: Tensor, log_scale: Tensor) -> LinearState:
    """Add one key per head: k_features (B, Hk, F), v (B, Hk, Dv), log_scale (B, Hk). Returns a new state."""
    log_offset = torch.maximum(state.log_offset, log_scale)  # (B, Hk)
    decay = exp_relative(state.log_offset, log_offset)  # (B, Hk), <= 1
    weighted_key = k_features * exp_relative(log_scale, log_offset)[..., None]  # (B, Hk, F)
    kv = state.kv * decay[..., None, None] + weighted_key[..., :, None] * v[..., None, :]  # (B, Hk, F, Dv)
    normalizer = state.normalizer * decay[..., None] + weighted_key  # (B, Hk, F)
    return LinearState(kv, normalizer, log_offset, state.num_tokens + 1)


def _read_linear_state(state: LinearState, q_features: Tensor) -> tuple[Tensor, Tensor]:
    """q_features (B, Hk, G, F) -> numerator (B, Hk, G, Dv), denominator (B, Hk, G), relative to the offset."""
    numerator = torch.einsum("bhgf,bhfd->bhgd", q_features, state.kv)
    denominator = torch.einsum("bhgf,bhf->bhg", q_features, state.normalizer)
    return numerator, denominator


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
        state = update_linear_state(state, k[:, :, t], values[:, :, t], log_scale[:, :, t])
        numerator, denominator = _read_linear_state(state, q[:, :, :, t])
        outputs.append(numerator / (denominator[..., None] + eps))  # (B, Hk, G, Dv)
    out = torch.stack(outputs, dim=3).reshape(batch, num_heads, length, value_dim)
    return out.to(v.dtype), state


def empty_hybrid_state(
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    feature_dim: int,
    value_dim: int,
    window: int,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
) -> HybridState:
    """A hybrid state that has seen nothing; buffers in ``dtype``, linear sums in ``state_dtype``."""

    def buffer(*shape, kind=dtype):
        return torch.zeros(batch, num_kv_heads, 0, *shape, device=device, dtype=kind)

    return HybridState(
        linear=LinearState.empty(batch, num_kv_heads, feature_dim, value_dim, device, state_dtype),
        keys=buffer(head_dim),
        values=buffer(value_dim),
        key_features=buffer(feature_dim),
        key_log_scales=buffer(kind=state_dtype),
        window=int(window),
    )


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
    k_log_scale: Tensor | None = None,
    state: HybridState | None = None,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, HybridState]:
    """Sliding-window softmax + linear attention token by token (semantics in ``dofla.ops.naive``).

    query (B, H, T, D), key (B, Hk, T, D), window_factor (H,). The state keeps the last ``window`` keys,
    values, key features and log scales, and the linear state of everything older.
    Returns out (B, H, T, Dv) in v's dtype and the new HybridState.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    check_hybrid_inputs(query, key, q_features, window, window_factor)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, head_dim, value_dim = key.shape[1], key.shape[-1], v.shape[-1]
    log_scale = _log_scale_or_zeros(k_log_scale, k_features, dtype)  # (B, Hk, T)
    if state is None:  # empty buffers keep each input's own dtype
        linear = LinearState.empty(batch, num_kv_heads, feature_dim, value_dim, query.device, dtype)
        state = HybridState(
            linear, key[:, :, :0], v[:, :, :0], k_features[:, :, :0], log_scale[:, :, :0], window
        )
    elif state.window != int(window):
        raise DoflaError(f"the state was built with window {state.window}, this call uses window {window}.")

    gamma = window_factor.to(dtype).view(num_kv_heads, group)  # (Hk, G)
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)  # (B, Hk, G, T, F)
    queries = query.to(dtype).view(batch, num_kv_heads, group, length, head_dim)  # (B, Hk, G, T, D)
    linear = state.linear
    keys, values, features, scales = state.keys, state.values, state.key_features, state.key_log_scales
    outputs = []
    for t in range(length):
        keys = torch.cat([keys, key[:, :, t : t + 1].to(keys.dtype)], dim=2)  # (B, Hk, L + 1, D)
        values = torch.cat([values, v[:, :, t : t + 1].to(values.dtype)], dim=2)
        features = torch.cat([features, k_features[:, :, t : t + 1].to(features.dtype)], dim=2)
        scales = torch.cat([scales, log_scale[:, :, t : t + 1].to(scales.dtype)], dim=2)
        if keys.shape[2] > window:  # the oldest key leaves the window and joins the linear state
            linear = update_linear_state(
                linear, features[:, :, 0].to(dtype), values[:, :, 0].to(dtype), scales[:, :, 0].to(dtype)
            )
            keys, values, features, scales = (
                keys[:, :, 1:],
                values[:, :, 1:],
                features[:, :, 1:],
                scales[:, :, 1:],
            )
        linear_numerator, linear_denominator = _read_linear_state(
            linear, q[:, :, :, t]
        )  # (B,Hk,G,Dv), (B,Hk,G)
        scores = soft_cap(
            scaling * torch.einsum("bhgd,bhld->bhgl", queries[:, :, :, t], keys.to(dtype)), softcap
        )  # (B, Hk, G, L)
        scores = scores.masked_fill(torch.isneginf(scales)[:, :, None, :], float("-inf"))  # absent keys
        window_max = scores.amax(-1, keepdim=True)
        window_max = torch.where(torch.isfinite(window_max), window_max, torch.zeros_like(window_max))
        window_weights = torch.exp(scores - window_max)
        window_numerator = torch.einsum("bhgl,bhld->bhgd", window_weights, values.to(dtype))
        numerator = gamma[..., None] * window_numerator + (1 - gamma[..., None]) * linear_numerator
        denominator = gamma * window_weights.sum(-1) + (1 - gamma) * linear_denominator  # (B, Hk, G)
        outputs.append(numerator / (denominator[..., None] + eps))
    out = torch.stack(outputs, dim=3).reshape(batch, num_heads, length, value_dim)
    new_state = HybridState(linear, keys, values, features, scales, int(window))
    return out.to(v.dtype), new_state
