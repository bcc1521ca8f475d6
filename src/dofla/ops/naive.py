"""The obviously-correct quadratic references: every pair (query i, key j) written out. Tests only.

Semantics shared exactly by the chunked and recurrent forms:

Linear attention. Key j's features are ``phi(k_j) * exp(s_j)`` with s = ``k_log_scale`` (0 when None).
For query i let ``m_i = max_{j<=i} s_j`` (the running maximum, which the states keep as their offset), and
``a_ij = phi(q_i).phi(k_j) * exp(s_j - m_i)`` for j <= i. Then
``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)``.
Dividing by ``exp(m_i)`` changes nothing but the size of eps relative to the sums: eps is measured against
the largest-scaled key, so it is independent of how large the log scales are (scale-robust), and it only
matters when all features of a query are (nearly) orthogonal to those of its keys (e.g. ReLU features).

Hybrid attention (LoLCATs). Keys j in (i - window, i] get ``gamma_h * exp(scaling q_i.k_j - c_i)`` with
``c_i`` the maximum of ``scaling q_i.k_j`` over that window; older keys j <= i - window get
``(1 - gamma_h) * phi(q_i).phi(k_j) * exp(s_j - m_i)`` where here ``m_i = max_{j <= i - window} s_j``, the
running maximum over the keys that have left the window (which is the hybrid state's linear offset).
``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)``. Both parts are thus normalised by their own maximum, as
LoLCATs does: the relative scale of the two parts is what gamma and the feature maps learn.

Absent keys (padding). ``key_mask`` (B, T), True for real tokens, gives absent keys log scale -inf (and
zero features and values): they take part nowhere, neither in the linear sums nor in the window. A key
whose given log scale is -inf is absent in the same way. A query with no present key returns 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_hybrid_inputs,
    check_linear_inputs,
    compute_dtype,
    mask_absent_keys,
    soft_cap,
)
from dofla.ops.state import exp_relative


def _expand_kv_heads(tensor: Tensor | None, group: int) -> Tensor | None:
    """(B, Hk, ...) -> (B, H, ...): query head h reads key/value head h // group."""
    return None if tensor is None else tensor.repeat_interleave(group, dim=1)


def linear_attention(
    q_features: Tensor,
    k_features: Tensor,
    v: Tensor,
    *,
    k_log_scale: Tensor | None = None,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Causal linear attention, quadratic reference.

    q_features (B, H, T, F) >= 0, k_features (B, Hk, T, F) >= 0, v (B, Hk, T, Dv), k_log_scale (B, Hk, T).
    Returns (B, H, T, Dv) in v's dtype; computed in float64 when any input is float64, else float32.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(q_features, k_features, v, k_log_scale)
    length = q_features.shape[2]
    q = q_features.to(dtype)  # (B, H, T, F)
    k = _expand_kv_heads(k_features, group).to(dtype)  # (B, H, T, F)
    values = _expand_kv_heads(v, group).to(dtype)  # (B, H, T, Dv)
    if k_log_scale is None:
        log_scale = torch.zeros(k.shape[:3], dtype=dtype, device=k.device)
    else:
        log_scale = _expand_kv_heads(k_log_scale, group).to(dtype)  # (B, H, T)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    running_max = torch.cummax(log_scale, dim=-1).values  # (B, H, T): m_i
    key_log_weight = torch.where(causal, log_scale[:, :, None, :], float("-inf"))  # (B, H, T, T)
    weights = (q @ k.transpose(-1, -2)) * exp_relative(key_log_weight, running_max[..., None])  # (B, H, T, T)
    out = (weights @ values) / (weights.sum(-1, keepdim=True) + eps)
    return out.to(v.dtype)


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
    k_log_scale: Tensor | None = None,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Sliding-window softmax + linear attention (LoLCATs), quadratic reference.

    query (B, H, T, D), key (B, Hk, T, D) after rotary; features as in ``linear_attention``;
    window_factor (H,) = gamma in (0, 1); softcap: the teacher's logit soft-capping (Gemma-2), applied to
    the window's softmax scores. Returns (B, H, T, Dv) in v's dtype.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    check_hybrid_inputs(query, key, q_features, window, window_factor)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    length = q_features.shape[2]
    num_heads = q_features.shape[1]
    q = q_features.to(dtype)
    k = _expand_kv_heads(k_features, group).to(dtype)
    values = _expand_kv_heads(v, group).to(dtype)
    keys = _expand_kv_heads(key, group).to(dtype)  # (B, H, T, D)
    if k_log_scale is None:
        log_scale = torch.zeros(k.shape[:3], dtype=dtype, device=k.device)
    else:
        log_scale = _expand_kv_heads(k_log_scale, group).to(dtype)

    position = torch.arange(length, device=q.device)
    query_index, key_index = position[:, None], position[None, :]
    in_window = (key_index <= query_index) & (key_index > query_index - window)  # (T, T)
    left_window = key_index <= query_index - window  # (T, T)

    scores = soft_cap(scaling * (query.to(dtype) @ keys.transpose(-1, -2)), softcap)  # (B, H, T, T)
    present = ~torch.isneginf(log_scale)[:, :, None, :]  # (B, H, 1, T): absent keys have log scale -inf
    scores = torch.where(in_window & present, scores, float("-inf"))
    window_max = scores.amax(-1, keepdim=True)
    window_max = torch.where(torch.isfinite(window_max), window_max, torch.zeros_like(window_max))
    window_weights = torch.exp(scores - window_max)  # 0 outside the window

    old_log_weight = torch.where(left_window, log_scale[:, :, None, :], float("-inf"))  # (B, H, T, T)
    old_offset = old_log_weight.amax(-1, keepdim=True)  # (B, H, T, 1): -inf while no key has left
    linear_weights = (q @ k.transpose(-1, -2)) * exp_relative(old_log_weight, old_offset)

    gamma = window_factor.to(dtype).view(1, num_heads, 1, 1)
    weights = gamma * window_weights + (1 - gamma) * linear_weights  # (B, H, T, T)
    out = (weights @ values) / (weights.sum(-1, keepdim=True) + eps)
    return out.to(v.dtype)
