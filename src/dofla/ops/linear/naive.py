"""Linear attention, the quadratic reference (tests only); semantics in ``dofla.ops``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_linear_inputs,
    compute_dtype,
    expand_kv_heads,
    mask_absent_keys,
)
from dofla.ops.state import exp_relative


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
    k = expand_kv_heads(k_features, group).to(dtype)  # (B, H, T, F)
    values = expand_kv_heads(v, group).to(dtype)  # (B, H, T, Dv)
    if k_log_scale is None:
        log_scale = torch.zeros(k.shape[:3], dtype=dtype, device=k.device)
    else:
        log_scale = expand_kv_heads(k_log_scale, group).to(dtype)  # (B, H, T)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    running_max = torch.cummax(log_scale, dim=-1).values  # (B, H, T): m_i
    key_log_weight = torch.where(causal, log_scale[:, :, None, :], float("-inf"))  # (B, H, T, T)
    weights = (q @ k.transpose(-1, -2)) * exp_relative(key_log_weight, running_max[..., None])  # (B, H, T, T)
    out = (weights @ values) / (weights.sum(-1, keepdim=True) + eps)
    return out.to(v.dtype)
