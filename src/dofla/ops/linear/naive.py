"""Linear attention, the quadratic reference (tests only); semantics in ``dofla.ops``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import compute_dtype, expand_kv_heads, prepare_linear_inputs
from dofla.ops.inputs import LinearInputs
from dofla.ops.state import exp_relative


def linear_attention(inputs: LinearInputs, *, eps: float = 1e-6) -> Tensor:
    """Causal linear attention, quadratic reference.

    inputs: the call's tensors (shapes in ``LinearInputs``). Returns (B, H, T, Dv) in v's dtype; computed
    in float64 when any input is float64, else float32.
    """
    q_features = inputs.q_features
    group, k_features, v, k_log_scale = prepare_linear_inputs(inputs)
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
