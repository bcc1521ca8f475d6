"""Sliding-window softmax attention (with sinks), the quadratic reference (tests only); semantics in ``dofla.ops``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_sink_query,
    check_window_inputs,
    compute_dtype,
    expand_kv_heads,
    present_keys,
    soft_cap,
)
from dofla.ops.inputs import WindowInputs, WindowOptions
from dofla.ops.sinks import sink_flags
from dofla.ops.state import log_sum_exp


def softmax_part_weights(
    query: Tensor, keys: Tensor, present: Tensor, options: WindowOptions, sink_query: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The window part: query (B, H, T, D), keys (B, H, T, D), present (B, H, T) bool, compute dtype;
    sink_query (B, H, T, D) or None: the queries that score the sinks.

    Returns weights (B, H, T, T) = exp(score - c_i) on the softmax set W_i (window and sinks), 0 elsewhere,
    is_sink (B, H, T), which keys are sinks, and c_i (B, H, T, 1) (0 where W_i is empty).
    """
    scaling, window, softcap = options.scaling, int(options.window), options.softcap
    length = query.shape[2]
    position = torch.arange(length, device=query.device)
    query_index, key_index = position[:, None], position[None, :]
    in_window = (key_index <= query_index) & (key_index > query_index - window)  # (T, T)
    is_sink, _ = sink_flags(present, torch.zeros_like(present[..., 0], dtype=torch.long), int(options.sinks))
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


def window_attention(inputs: WindowInputs, options: WindowOptions, *, return_lse: bool = False):
    """Sliding-window softmax attention with ``options.sinks`` attention-sink keys, quadratic reference.

    inputs: the call's tensors (shapes in ``WindowInputs``). Returns (B, H, T, Dv) in v's dtype; a query
    with no visible key gets 0. With ``return_lse`` also the log-sum-exp of each query's softmax scores,
    (B, H, T) in the compute dtype (-inf when it sees no key).
    """
    query, key, v = inputs.query, inputs.key, inputs.v
    key_mask, sink_query = inputs.key_mask, inputs.sink_query
    group = check_window_inputs(query, key, v, options.window, options.sinks)
    check_sink_query(query, sink_query)
    present = present_keys(key_mask, key)
    dtype = compute_dtype(query, key, v)
    keys = expand_kv_heads(key, group).to(dtype)  # (B, H, T, D)
    values = expand_kv_heads(v.masked_fill(~present[..., None], 0), group).to(dtype)  # (B, H, T, Dv)
    weights, _, window_max = softmax_part_weights(
        query.to(dtype),
        keys,
        expand_kv_heads(present, group),
        options,
        None if sink_query is None else sink_query.to(dtype),
    )  # (B, H, T, T)
    total = weights.sum(-1, keepdim=True)
    out = ((weights @ values) / torch.where(total > 0, total, torch.ones_like(total))).to(v.dtype)
    if not return_lse:
        return out
    return out, log_sum_exp(total, window_max)[..., 0]
