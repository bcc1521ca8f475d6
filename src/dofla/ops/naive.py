"""The obviously-correct quadratic references: every pair (query i, key j) written out. Tests only.

Semantics shared exactly by the chunked and recurrent forms:

Linear attention. Key j's features are ``phi(k_j) * exp(s_j)`` with s = ``k_log_scale`` (0 when None).
For query i let ``m_i = max_{j<=i} s_j`` (the running maximum, which the states keep as their offset), and
``a_ij = phi(q_i).phi(k_j) * exp(s_j - m_i)`` for j <= i. Then
``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)``.
Dividing by ``exp(m_i)`` changes nothing but the size of eps relative to the sums: eps is measured against
the largest-scaled key, so it is independent of how large the log scales are (scale-robust), and it only
matters when all features of a query are (nearly) orthogonal to those of its keys (e.g. ReLU features).

Hybrid attention (LoLCATs). Query i's softmax set is W_i = the keys j in (i - window, i] plus the sinks
j <= i (below). Keys in W_i get ``gamma_h * exp(scaling q_i.k_j - c_i)`` with ``c_i`` the maximum of
``scaling q_i.k_j`` over W_i; the other keys j <= i (older than the window, not sinks) get
``(1 - gamma_h) * phi(q_i).phi(k_j) * exp(s_j - m_i)`` where here ``m_i`` is the maximum of s_j over those
linear-part keys (the running maximum over the keys that have left the window, which is the hybrid
state's linear offset). ``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)``. Both parts are thus normalised by
their own maximum, as LoLCATs does: the relative scale of the two parts is what gamma and the feature maps
learn.

Window attention. Plain softmax over W_i: ``out_i = sum_{j in W_i} exp(scaling q_i.k_j - c_i) v_j /
sum_{j in W_i} exp(scaling q_i.k_j - c_i)`` (no eps; 0 when W_i is empty).

Attention sinks (``sinks`` = S >= 0). The first S present keys of the sequence (without padding: the keys
at positions 0 .. S-1) are in the softmax set of every query i >= j, however far back, and never in the
linear part. The count is per batch row and key/value head and runs from the start of the sequence
across calls (states carry it); absent keys do not count, so left padding gives the unpadded outputs.
S = 0 is plain sliding-window (hybrid) attention.

Sinks seen by other queries (``sink_query``, same shape as the queries, None: the queries). The sinks'
scores are ``scaling sink_query_i.k_j`` (soft-capped as the rest) instead of ``scaling q_i.k_j``; nothing
else changes. The attention module passes its queries turned back to the window's edge (position
``min(t, window + sinks)``), so that the sinks sit just before every window, where the teacher saw them
in training, instead of ever further away.

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
    check_sink_query,
    check_sinks,
    check_window_inputs,
    compute_dtype,
    mask_absent_keys,
    present_keys,
    soft_cap,
)
from dofla.ops.sinks import sink_flags
from dofla.ops.state import exp_relative, log_sum_exp


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


def softmax_part_weights(
    query: Tensor,
    keys: Tensor,
    present: Tensor,
    *,
    scaling: float,
    window: int,
    sinks: int,
    softcap: float | None,
    sink_query: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The window part: query (B, H, T, D), keys (B, H, T, D), present (B, H, T) bool, compute dtype;
    sink_query (B, H, T, D) or None: the queries that score the sinks.

    Returns weights (B, H, T, T) = exp(score - c_i) on the softmax set W_i (window and sinks), 0 elsewhere,
    is_sink (B, H, T), which keys are sinks, and c_i (B, H, T, 1) (0 where W_i is empty).
    """
    length = query.shape[2]
    position = torch.arange(length, device=query.device)
    query_index, key_index = position[:, None], position[None, :]
    in_window = (key_index <= query_index) & (key_index > query_index - window)  # (T, T)
    is_sink, _ = sink_flags(present, torch.zeros_like(present[..., 0], dtype=torch.long), sinks)
    sink_seen = is_sink[:, :, None, :] & (key_index <= query_index)  # (B, H, T, T)
    softmax_set = (in_window | sink_seen) & present[:, :, None, :]
    scores = soft_cap(scaling * (query @ keys.transpose(-1, -2)), softcap)  # (B, H, T, T)
    if sink_query is not None:  # the sinks' columns scored by the sink queries
        sink_scores = soft_cap(scaling * (sink_query @ keys.transpose(-1, -2)), softcap)
        scores = torch.where(is_sink[:, :, None, :], sink_scores, scores)
    scores = torch.where(softmax_set, scores, float("-inf"))
    window_max = scores.amax(-1, keepdim=True)  # c_i; -inf when W_i is empty
    window_max = torch.where(torch.isfinite(window_max), window_max, torch.zeros_like(window_max))
    return torch.exp(scores - window_max), is_sink, window_max


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
    k = _expand_kv_heads(k_features, group).to(dtype)
    values = _expand_kv_heads(v, group).to(dtype)
    keys = _expand_kv_heads(key, group).to(dtype)  # (B, H, T, D)
    if k_log_scale is None:
        log_scale = torch.zeros(k.shape[:3], dtype=dtype, device=k.device)
    else:
        log_scale = _expand_kv_heads(k_log_scale, group).to(dtype)

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


def window_attention(
    query: Tensor,
    key: Tensor,
    v: Tensor,
    *,
    scaling: float,
    window: int,
    sinks: int = 0,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    sink_query: Tensor | None = None,
):
    """Sliding-window softmax attention with ``sinks`` attention-sink keys, quadratic reference.

    query (B, H, T, D), key (B, Hk, T, D) after rotary, v (B, Hk, T, Dv), key_mask (B, T) True for real
    tokens, sink_query (B, H, T, D) the queries that score the sinks (None: query). Returns (B, H, T, Dv)
    in v's dtype; a query with no visible key gets 0. With ``return_lse`` also the log-sum-exp of each
    query's softmax scores, (B, H, T) in the compute dtype (-inf when it sees no key).
    """
    group = check_window_inputs(query, key, v, window, sinks)
    check_sink_query(query, sink_query)
    present = present_keys(key_mask, key)
    dtype = compute_dtype(query, key, v)
    keys = _expand_kv_heads(key, group).to(dtype)  # (B, H, T, D)
    values = _expand_kv_heads(v.masked_fill(~present[..., None], 0), group).to(dtype)  # (B, H, T, Dv)
    weights, _, window_max = softmax_part_weights(
        query.to(dtype),
        keys,
        _expand_kv_heads(present, group),
        scaling=scaling,
        window=int(window),
        sinks=int(sinks),
        softcap=softcap,
        sink_query=None if sink_query is None else sink_query.to(dtype),
    )  # (B, H, T, T)
    total = weights.sum(-1, keepdim=True)
    out = ((weights @ values) / torch.where(total > 0, total, torch.ones_like(total))).to(v.dtype)
    if not return_lse:
        return out
    return out, log_sum_exp(total, window_max)[..., 0]
