"""Sliding-window softmax attention's recurrent form (decoding), one token at a time; semantics in ``dofla.ops``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    check_sink_query,
    check_state_window,
    check_window_inputs,
    compute_dtype,
    present_keys,
    soft_cap,
    stack_tokens,
)
from dofla.ops.inputs import WindowInputs, WindowOptions
from dofla.ops.sinks import add_sinks
from dofla.ops.state import WindowState, exp_relative, log_sum_exp


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
    # a full window drops its oldest key before joining the new one: a slice after the join would keep the
    # storage of one key more than the window alive
    drop = 1 if state.keys.shape[2] + 1 > state.window else 0
    keys = torch.cat([state.keys[:, :, drop:], key.to(state.keys.dtype)], dim=2)  # (B, Hk, min(L + 1, w), D)
    values = torch.cat([state.values[:, :, drop:], value.to(state.values.dtype)], dim=2)
    key_present = torch.cat([state.key_present[:, :, drop:], present], dim=2)
    new_state = WindowState(keys, values, key_present, *sinks, state.window, state.num_tokens + 1)
    return new_state, is_sink


def read_window(
    state: WindowState, queries: Tensor, options: WindowOptions, sink_queries: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """queries (B, Hk, G, D) in the compute dtype -> numerator (B, Hk, G, Dv), denominator (B, Hk, G) of
    exp(score - max) over the window's present keys and the filled sink slots (scored with ``options``'
    scaling and soft-capping), and that max (B, Hk, G) (-inf for a query that sees no key); sink_queries
    (B, Hk, G, D) score the sinks (None: queries)."""
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
    scores = soft_cap(options.scaling * scores, options.softcap)  # (B, Hk, G, L + S)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))  # absent keys
    # exp_relative: a query that sees no key has max -inf, and all its weights 0
    maximum = scores.amax(-1, keepdim=True)
    weights = exp_relative(scores, maximum)
    return weights @ values.to(dtype), weights.sum(-1), maximum[..., 0]


def recurrent_window_attention(
    inputs: WindowInputs,
    options: WindowOptions,
    *,
    state: WindowState | None = None,
    return_lse: bool = False,
):
    """Sliding-window softmax attention with ``options.sinks`` sink keys, token by token (semantics in
    ``dofla.ops``).

    inputs: the call's tensors (shapes in ``WindowInputs``); state from an earlier call of either form, or
    None. Returns out (B, H, T, Dv) in v's dtype and the new WindowState (memory bounded by window + sinks
    keys); with ``return_lse`` (out, lse, state), lse (B, H, T) the log-sum-exp of each query's softmax
    scores (-inf when it sees no key).
    """
    query, key, v = inputs.query, inputs.key, inputs.v
    key_mask, sink_query = inputs.key_mask, inputs.sink_query
    group = check_window_inputs(query, key, v, options.window, options.sinks)
    check_sink_query(query, sink_query)
    window, sinks = int(options.window), int(options.sinks)
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
            state, queries[:, :, :, t], options, None if sink_queries is None else sink_queries[:, :, :, t]
        )
        # a visible key contributes exp(0) = 1, so the sum is 0 (nothing seen: output 0) or >= 1
        outputs.append(numerator / denominator.clamp_min(1.0)[..., None])  # (B, Hk, G, Dv)
        lses.append(log_sum_exp(denominator, maximum))  # (B, Hk, G)
    out = stack_tokens(outputs).reshape(batch, num_heads, length, v.shape[-1]).to(v.dtype)
    if not return_lse:
        return out, state
    return out, torch.stack(lses, dim=-1).reshape(batch, num_heads, length), state
