"""Hybrid attention's chunked form (training and prefill); semantics in ``dofla.ops``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dofla.ops._checks import compute_dtype, prepare_hybrid_inputs
from dofla.ops.chunk_sizes import check_chunk_size
from dofla.ops.fla_backend import SimpleGLAKernel
from dofla.ops.inputs import HybridInputs, HybridOptions
from dofla.ops.linear.chunked import linear_sums_by
from dofla.ops.state import HybridState
from dofla.ops.window.chunked import grouped_queries, window_part_sums

NEGATIVE_INFINITY = float("-inf")


def chunked_hybrid_attention(
    inputs: HybridInputs,
    options: HybridOptions,
    *,
    chunk_size: int = 64,
    initial_state: HybridState | None = None,
    return_state: bool = False,
    kernel: SimpleGLAKernel | None = None,
):
    """Sliding-window softmax (plus ``options.sinks`` sink keys) + linear attention (LoLCATs), chunked;
    semantics in ``dofla.ops``.

    inputs: the call's tensors (shapes in ``HybridInputs``). The linear part is linear attention on keys
    delayed by ``window`` tokens (sinks get log scale -inf there, i.e. take no part), on fla's ``kernel``
    when one is given (the window part is always PyTorch).
    Returns out (B, H, T, Dv) in v's dtype, or (out, HybridState) when return_state.
    """
    group, window, sinks, inputs = prepare_hybrid_inputs(inputs, options)
    size = check_chunk_size(chunk_size)
    query, key, v, window_factor = inputs.query, inputs.key, inputs.v, inputs.window_factor
    q_features, k_features, k_log_scale = inputs.q_features, inputs.k_features, inputs.k_log_scale
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, head_dim, value_dim = key.shape[1], key.shape[-1], v.shape[-1]
    if k_log_scale is None:
        log_scale = torch.zeros(k_features.shape[:3], dtype=dtype, device=k_features.device)
    else:
        log_scale = k_log_scale.to(dtype)

    # Window part: the state's last keys and sinks, then this call's keys.
    queries = query.to(dtype).view(batch, num_kv_heads, group, length, head_dim)  # (B, Hk, G, T, D)
    window_numerator, window_denominator, _, is_sink, window_state = window_part_sums(
        queries,
        key,
        v,
        ~torch.isneginf(log_scale),
        None if initial_state is None else initial_state.window_state(),
        options,
        chunk_size=size,
        sink_queries=grouped_queries(inputs.sink_query, dtype, num_kv_heads),
    )
    if sinks:
        log_scale = log_scale.masked_fill(is_sink, NEGATIVE_INFINITY)  # sinks never reach the linear part

    # Linear part over the keys that left the window: the state's buffered keys, then this call's.
    if initial_state is None:
        all_features, all_values, all_scales, linear_state = k_features, v, log_scale, None
    else:
        all_features = torch.cat([initial_state.key_features.to(k_features.dtype), k_features], dim=2)
        all_values = torch.cat([initial_state.values.to(v.dtype), v], dim=2)
        all_scales = torch.cat([initial_state.key_log_scales.to(dtype), log_scale], dim=2)
        linear_state = initial_state.linear
    buffered = all_features.shape[2] - length  # L <= window

    # Query t sees keys at joined positions <= buffered + t - window, i.e. the joined sequence delayed by
    # (window - buffered) tokens; delayed-in slots have zero features, values and log scale -inf.
    delay = window - buffered
    old_features = F.pad(all_features.to(dtype), (0, 0, delay, 0))[:, :, :length]  # (B, Hk, T, F)
    old_values = F.pad(all_values.to(dtype), (0, 0, delay, 0))[:, :, :length]
    old_scales = F.pad(all_scales.to(dtype), (delay, 0), value=NEGATIVE_INFINITY)[:, :, :length]
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)
    linear_numerator, linear_denominator, new_linear = linear_sums_by(kernel)(
        q, old_features, old_values, old_scales, linear_state, size
    )
    previous_linear_tokens = 0 if initial_state is None else initial_state.linear.num_tokens
    new_linear.num_tokens = previous_linear_tokens + max(0, length - delay)  # delayed-in slots are not keys

    gamma = window_factor.to(dtype).view(1, num_kv_heads, group, 1)  # (1, Hk, G, 1)
    numerator = gamma[..., None] * window_numerator + (1 - gamma[..., None]) * linear_numerator
    denominator = gamma * window_denominator + (1 - gamma) * linear_denominator
    out = (
        (numerator / (denominator[..., None] + options.eps))
        .reshape(batch, num_heads, length, value_dim)
        .to(v.dtype)
    )
    if not return_state:
        return out
    keep = window_state.keys.shape[2]
    state = HybridState(
        linear=new_linear,
        keys=window_state.keys,
        values=window_state.values,
        key_features=all_features[:, :, -keep:].clone(),  # copies, as in window_part_sums
        key_log_scales=all_scales[:, :, -keep:].clone(),
        sink_keys=window_state.sink_keys,
        sink_values=window_state.sink_values,
        sink_count=window_state.sink_count,
        window=window,
    )
    return out, state
