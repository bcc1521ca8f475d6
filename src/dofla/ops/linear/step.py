"""Linear attention's one-token step (generation)."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.state import LinearState


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
    numerator, denominator = read_linear_state(state, q_features)
    return numerator / (denominator.unsqueeze(-1) + eps), state


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


def read_linear_state(state: LinearState, q_features: Tensor) -> tuple[Tensor, Tensor]:
    """q_features (B, Hk, G, F) -> numerator (B, Hk, G, Dv), denominator (B, Hk, G), relative to the offset."""
    numerator = q_features @ state.kv  # (B, Hk, G, Dv)
    denominator = torch.linalg.vecdot(q_features, state.normalizer.unsqueeze(-2))  # (B, Hk, G)
    return numerator, denominator


def log_scale_or_zeros(k_log_scale: Tensor | None, k_features: Tensor, dtype: torch.dtype) -> Tensor:
    if k_log_scale is None:
        return torch.zeros(k_features.shape[:3], dtype=dtype, device=k_features.device)
    return k_log_scale.to(dtype)
