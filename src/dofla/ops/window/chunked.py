"""Sliding-window softmax attention's chunked form (training and prefill); semantics in ``dofla.ops``.

The softmax part of window and hybrid attention is one function, ``window_part_sums``: a blocked softmax
over the last ``window`` keys, merged (at a common maximum) with a small block over the sink keys, which
queries of their own may score (``sink_query``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.ops._checks import (
    check_sink_query,
    check_state_window,
    check_window_inputs,
    compute_dtype,
    present_keys,
    soft_cap,
)
from dofla.ops.chunk_sizes import check_chunk_size
from dofla.ops.inputs import WindowInputs, WindowOptions
from dofla.ops.sinks import SinkUpdate, add_sinks
from dofla.ops.state import WindowState, exp_relative, log_sum_exp

NEGATIVE_INFINITY = float("-inf")


def _finite_or_zero(maximum: Tensor) -> Tensor:
    """A softmax maximum to subtract: -inf (nothing visible) becomes finite so that no -inf - -inf appears."""
    return maximum.clamp_min(torch.finfo(maximum.dtype).min)  # as in exp_relative: -inf - it stays -inf


def sliding_window_sums(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    present: Tensor,
    *,
    scaling: float,
    window: int,
    chunk_size: int,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax over the last ``window`` keys (the query's own included), blocked by chunks.

    queries (B, Hk, G, T, D), keys (B, Hk, T, D), values (B, Hk, T, Dv) in the compute dtype;
    present (B, Hk, T) bool: the keys the window may see.
    Returns numerator (B, Hk, G, T, Dv) and denominator (B, Hk, G, T) of exp(score - window max), and the
    window max (B, Hk, G, T) itself (-inf for a query that sees no key; the sums then are 0).
    """
    batch, num_kv_heads, group, length, head_dim = queries.shape
    value_dim = values.shape[-1]
    size = chunk_size
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    span = size + window - 1  # keys a chunk of queries can see
    # The G query heads of a key/value head are rows of one product per chunk (B, Hk, N, G * C, D), so the
    # chunk's key and value blocks are read as they are (broadcasting them over G would copy them G times).
    queries = (
        F.pad(queries, (0, 0, 0, pad))
        .view(batch, num_kv_heads, group, num_chunks, size, head_dim)
        .transpose(2, 3)
        .reshape(batch, num_kv_heads, num_chunks, group * size, head_dim)
    )
    # Keys shifted right by window - 1 so that block n starts at absolute position n * C - (window - 1).
    key_blocks = F.pad(keys, (0, 0, window - 1, pad)).unfold(2, span, size)  # (B, Hk, N, D, S)
    value_blocks = (
        F.pad(values, (0, 0, window - 1, pad)).unfold(2, span, size).transpose(-1, -2)
    )  # (B,Hk,N,S,Dv)
    row = torch.arange(size, device=queries.device)[:, None]  # query r in its chunk
    column = torch.arange(span, device=queries.device)[None, :]  # key u in the block
    chunk_start = (torch.arange(num_chunks, device=queries.device) * size)[:, None, None]
    visible = (
        (column >= row) & (column <= row + window - 1) & (chunk_start + column - (window - 1) >= 0)
    )  # (N, C, S)
    absent = F.pad(~present, (window - 1, pad), value=True).unfold(2, span, size)  # (B,Hk,N,S)
    visible = visible & ~absent[:, :, :, None, :]  # (B, Hk, N, C, S)
    scores = soft_cap(scaling * (queries @ key_blocks), softcap).view(
        batch, num_kv_heads, num_chunks, group, size, span
    )  # (B, Hk, N, G, C, S)
    scores = scores.masked_fill(~visible.unsqueeze(3), NEGATIVE_INFINITY)
    window_max = scores.amax(-1, keepdim=True)  # -inf only for a query whose whole window is absent
    weights = torch.exp(scores - _finite_or_zero(window_max))
    numerator = (weights.view(batch, num_kv_heads, num_chunks, group * size, span) @ value_blocks).view(
        batch, num_kv_heads, num_chunks, group, size, value_dim
    )
    denominator = weights.sum(-1, keepdim=True)  # (B, Hk, N, G, C, 1)

    def by_token(tensor: Tensor) -> Tensor:  # (B, Hk, N, G, C, W) -> (B, Hk, G, T, W)
        return tensor.transpose(2, 3).reshape(batch, num_kv_heads, group, num_chunks * size, -1)[
            :, :, :, :length
        ]

    return by_token(numerator), by_token(denominator)[..., 0], by_token(window_max)[..., 0]


def sink_sums(
    queries: Tensor, sink: SinkUpdate, *, scaling: float, softcap: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax sums over the sink keys each query has seen: queries (B, Hk, G, T, D) in the compute dtype.

    Returns numerator (B, Hk, G, T, Dv), denominator (B, Hk, G, T) of exp(score - sink max), and the max.
    """
    length = queries.shape[3]
    keys = sink.keys.to(queries.dtype).unsqueeze(2)  # (B, Hk, 1, S, D)
    scores = soft_cap(scaling * (queries @ keys.transpose(-1, -2)), softcap)  # (B, Hk, G, T, S)
    token = torch.arange(length, device=queries.device)[:, None]
    visible = sink.position[:, :, None, :] <= token  # (B, Hk, T, S): sinks of this call only from their token
    scores = scores.masked_fill(~visible.unsqueeze(2), NEGATIVE_INFINITY)
    sink_max = scores.amax(-1)  # (B, Hk, G, T)
    weights = torch.exp(scores - _finite_or_zero(sink_max)[..., None])
    return weights @ sink.values.to(queries.dtype).unsqueeze(2), weights.sum(-1), sink_max


def merge_softmax_sums(
    first: tuple[Tensor, Tensor, Tensor], second: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Two (numerator (..., Dv), denominator (...), max (...)) softmax sums over disjoint keys -> one
    numerator and denominator relative to their common maximum (exact rescaling, exponents <= 0), and that
    maximum."""
    top = torch.maximum(first[2], second[2])
    first_scale, second_scale = exp_relative(first[2], top), exp_relative(second[2], top)
    numerator = first[0] * first_scale[..., None] + second[0] * second_scale[..., None]
    return numerator, first[1] * first_scale + second[1] * second_scale, top


def _window_keys(
    state: WindowState | None, key: Tensor, value: Tensor, present: Tensor, window: int, sinks: int
) -> tuple[WindowState, SinkUpdate, Tensor, Tensor, Tensor]:
    """Everything a call's window can see: the state before it (an empty one for None, else checked), the
    sinks after adding the call's keys, and the state's last keys then the call's keys, values and presence
    (B, Hk, L + T, ...); sinks count as absent there (they are read from the sink slots only)."""
    if state is None:
        state = WindowState.empty_like(key, value, window, sinks)
    else:
        check_state_window(state, window, sinks)
    sink = add_sinks(state.sink_keys, state.sink_values, state.sink_count, key, value, present)
    all_keys = torch.cat([state.keys.to(key.dtype), key], dim=2)  # (B, Hk, L + T, D)
    all_values = torch.cat([state.values.to(value.dtype), value], dim=2)
    all_present = torch.cat([state.key_present, present & ~sink.is_sink], dim=2)
    return state, sink, all_keys, all_values, all_present


def _window_state_after(
    state: WindowState,
    all_keys: Tensor,
    all_values: Tensor,
    all_present: Tensor,
    sink: SinkUpdate,
    length: int,
) -> WindowState:
    """The WindowState after a call of ``length`` tokens: the last ``window`` of the state's and the call's
    keys (joined, (B, Hk, L + T, ...)) and the sinks ``sink`` holds."""
    keep = min(state.window, all_keys.shape[2])
    return WindowState(
        # copies: views of the call's keys would keep every key of a long prefill alive in the state
        keys=all_keys[:, :, -keep:].clone(),
        values=all_values[:, :, -keep:].clone(),
        key_present=all_present[:, :, -keep:].clone(),
        sink_keys=sink.keys,
        sink_values=sink.values,
        sink_count=sink.count,
        window=state.window,
        num_tokens=state.num_tokens + length,
    )


def window_part_sums(
    queries: Tensor,
    key: Tensor,
    value: Tensor,
    present: Tensor,
    state: WindowState | None,
    options: WindowOptions,
    *,
    chunk_size: int,
    sink_queries: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, WindowState]:
    """The softmax part shared by window and hybrid attention: the last ``options.window`` keys plus the
    sinks.

    queries (B, Hk, G, T, D) in the compute dtype; key (B, Hk, T, D), value (B, Hk, T, Dv) as given;
    present (B, Hk, T) bool; state: the window state before this call (None: nothing seen); sink_queries
    (B, Hk, G, T, D) in the compute dtype, the queries that score the sinks (None: ``queries``).
    Returns numerator (B, Hk, G, T, Dv), denominator (B, Hk, G, T) relative to each query's softmax
    maximum, that maximum (B, Hk, G, T) (-inf for a query that sees no key), is_sink (B, Hk, T) (the keys
    that became sinks) and the state after the call.
    """
    window, sinks = int(options.window), int(options.sinks)
    dtype, length = queries.dtype, queries.shape[3]
    state, sink, all_keys, all_values, all_present = _window_keys(state, key, value, present, window, sinks)
    buffered = state.keys.shape[2]  # L <= window; its positions get dummy queries that are dropped
    padded_queries = F.pad(queries, (0, 0, buffered, 0))
    numerator, denominator, window_max = sliding_window_sums(
        padded_queries,
        all_keys.to(dtype),
        all_values.to(dtype),
        all_present,
        scaling=options.scaling,
        window=window,
        chunk_size=chunk_size,
        softcap=options.softcap,
    )
    numerator, denominator = numerator[..., buffered:, :], denominator[..., buffered:]
    maximum = window_max[..., buffered:]
    if sinks:
        numerator, denominator, maximum = merge_softmax_sums(
            (numerator, denominator, maximum),
            sink_sums(
                queries if sink_queries is None else sink_queries,
                sink,
                scaling=options.scaling,
                softcap=options.softcap,
            ),
        )
    new_state = _window_state_after(state, all_keys, all_values, all_present, sink, length)
    return numerator, denominator, maximum, sink.is_sink, new_state


def grouped_queries(query: Tensor | None, dtype: torch.dtype, num_kv_heads: int) -> Tensor | None:
    """query (B, H, T, D) -> (B, Hk, G, T, D) in ``dtype``; None stays None."""
    if query is None:
        return None
    batch, num_heads, length, head_dim = query.shape
    return query.to(dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, length, head_dim)


def _rows_alike(tensor: Tensor) -> bool:
    """Whether every (B, Hk) row of ``tensor`` (B, Hk, ...) equals the first."""
    return tensor.shape[0] * tensor.shape[1] == 1 or bool((tensor == tensor[:1, :1]).all())


def _fused_window_attention(
    inputs: WindowInputs,
    state: WindowState | None,
    options: WindowOptions,
    *,
    chunk_size: int,
    return_lse: bool = False,
):
    """``chunked_window_attention`` with every key of the call present and no soft-capping, from ``state``
    (None: nothing seen): per chunk of C queries, one fused softmax attention call over the sink slots and
    the C + window - 1 window keys the chunk can see. Sinks scored by their own ``sink_query`` join the same
    call: queries ``[q, q_sink]`` against window keys ``[k, 0]`` and sink keys ``[0, k_sink]`` give each
    score from its own query (the added zeros change nothing); without gradients to track on the CPU, the
    window is one fused call that returns its log-sum-exp instead, and the sinks a small block merged into it
    (``_merged_sink_sums``: the doubled key width cost a sixth of a prefill). Every query sees its own key
    (in the window, or as a sink), so no real query's row is empty; the rows of padding queries past the end see every key
    (finite, then dropped). Returns out (B, H, T, Dv) in v's dtype (a transposed view of a (B, T, H, Dv)
    tensor) and the WindowState after the call; with ``return_lse`` (out, lse (B, H, T), state) from
    PyTorch's fused CPU kernel, which gives the log-sum-exp but no gradient for it (see ``takes_fused_lse``)."""
    query, key, v, sink_query = inputs.query, inputs.key, inputs.v, inputs.sink_query
    scaling, window, sinks = options.scaling, int(options.window), int(options.sinks)
    dtype = compute_dtype(query, key, v)
    batch, num_heads, length, head_dim = query.shape
    num_kv_heads, value_dim = key.shape[1], v.shape[-1]
    group, size = num_heads // num_kv_heads, min(chunk_size, length)
    own_sink_scores = bool(sinks) and sink_query is not None
    # sinks with their own queries apart from the window (its log-sum-exp from the kernel, no gradient)
    apart = own_sink_scores and takes_fused_lse(query, key, v) and not _tracked(sink_query)
    doubled = own_sink_scores and not apart  # [q, q_sink] against [k, 0] and [0, k_sink] in one call
    num_chunks = -(-length // size)
    pad, span = num_chunks * size - length, size + window - 1  # span: the window keys one chunk can see
    present = torch.ones(batch, num_kv_heads, length, dtype=torch.bool, device=key.device)
    fresh = state is None  # every key of the call present and the sinks its first tokens: rows alike
    state, sink, all_keys, all_values, all_present = _window_keys(state, key, v, present, window, sinks)
    buffered = state.keys.shape[2]
    # which keys a query sees depends on its (B, Hk) row only through the presence and sink positions:
    # where every row has the same, one mask serves all rows (broadcast by the kernel, built once); from a
    # fresh state that holds without looking (no value read back: training steps can be CUDA graphs)
    alike = fresh or (_rows_alike(all_present) and (not sinks or _rows_alike(sink.position)))
    mask_present = all_present[:1, :1] if alike else all_present
    sink_positions = sink.position[:1, :1] if alike else sink.position

    def blocks(tensor: Tensor, fill) -> Tensor:
        """(B, Hk, L + T, ...) -> (B, Hk, N, ..., S): block n starts window - 1 keys before call token n * C."""
        shift = (0, 0) * (tensor.dim() - 3) + (window - 1, pad)
        return F.pad(tensor, shift, value=fill)[:, :, buffered:].unfold(2, span, size)

    joined = torch.cat([query.to(dtype), sink_query.to(dtype)], dim=-1) if doubled else query
    width_qk = joined.shape[-1]  # D, or 2 D with the sink queries
    queries = (
        F.pad(joined.to(dtype), (0, 0, 0, pad))
        .view(batch, num_kv_heads, group, num_chunks, size, width_qk)
        .transpose(2, 3)
        .reshape(batch, num_kv_heads, num_chunks, group * size, width_qk)
    )  # (B, Hk, N, G * C, D): a chunk's queries of a key/value head are rows of one call
    row = torch.arange(size, device=query.device)[:, None]  # query r in its chunk
    column = torch.arange(span, device=query.device)[None, :]  # key u in the block
    token = torch.arange(num_chunks * size, device=query.device).view(num_chunks, size, 1)  # (N, C, 1)
    visible = (column >= row) & (column <= row + window - 1) & blocks(mask_present, False)[:, :, :, None, :]
    window_keys, sink_keys = all_keys.to(dtype), sink.keys.to(dtype)
    if doubled:
        window_keys, sink_keys = F.pad(window_keys, (0, head_dim)), F.pad(sink_keys, (head_dim, 0))
    keys = blocks(window_keys, 0.0).transpose(-1, -2)  # (B, Hk, N, S, D)
    values = blocks(all_values.to(dtype), 0.0).transpose(-1, -2)
    if sinks and not apart:  # the sink slots first: slot s is seen from call token position[s] on
        sink_visible = sink_positions[:, :, None, None, :] <= token  # (B, Hk, N, C, sinks)
        visible = torch.cat([sink_visible, visible], dim=-1)
        keys = torch.cat([sink_keys[:, :, None].expand(-1, -1, num_chunks, -1, -1), keys], dim=3)
        values = torch.cat(
            [sink.values.to(dtype)[:, :, None].expand(-1, -1, num_chunks, -1, -1), values], dim=3
        )
    # a query may see no window key only apart from its sinks (one that is a sink itself): the kernel gives
    # that row 0 and a log-sum-exp of 0, so which rows saw something is kept here
    window_seen = visible.any(-1).flatten(-2)[:, :, None, :length] if apart else None  # (B, Hk, 1, T)
    visible = visible | (token >= length)  # padding queries: see everything, dropped below
    rows, width = batch * num_kv_heads, keys.shape[3]  # 4-D inputs: PyTorch's fused CPU kernel takes them
    if return_lse and values.shape[-1] < width_qk:  # the kernel takes values as wide as the keys
        values = F.pad(values, (0, width_qk - values.shape[-1]))
    arguments = (
        queries.reshape(rows, num_chunks, group * size, width_qk),
        keys.reshape(rows, num_chunks, width, width_qk),
        values.reshape(rows, num_chunks, width, values.shape[-1]),
    )
    mask_rows = visible.shape[0] * visible.shape[1]  # B * Hk, or 1 when the rows are alike
    hidden = ~(
        visible.unsqueeze(3)  # rows g * C + r, as the queries
        .expand(-1, -1, -1, group, -1, -1)
        .reshape(mask_rows, num_chunks, group * size, width)
    )
    # an additive mask: a boolean one is converted inside the attention call, for every call
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, NEGATIVE_INFINITY
    )
    if return_lse or apart:  # the kernel's own entry point returns the log-sum-exp
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *arguments, attn_mask=bias, scale=scaling
        )  # (B * Hk, N, G * C, Dv), (B * Hk, N, G * C)
    else:
        out = F.scaled_dot_product_attention(*arguments, attn_mask=bias, scale=scaling)
    new_state = _window_state_after(state, all_keys, all_values, all_present, sink, length)
    if apart:
        shape = (batch, num_kv_heads, num_chunks, group, size)
        out, lse = _merged_sink_sums(
            out.view(*shape, value_dim)
            .transpose(2, 3)
            .reshape(*shape[:2], group, -1, value_dim)[..., :length, :],
            lse.view(shape).transpose(2, 3).reshape(*shape[:2], group, -1)[..., :length],
            window_seen,
            grouped_queries(sink_query, dtype, num_kv_heads),
            sink,
            scaling,
        )  # (B, Hk, G, T, Dv), (B, Hk, G, T)
        out = out.reshape(batch, num_heads, length, value_dim).to(v.dtype)
        if not return_lse:
            return out, new_state
        return out, lse.reshape(batch, num_heads, length), new_state
    out = (
        out[..., :value_dim]
        .reshape(batch, num_kv_heads, num_chunks, group, size, value_dim)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(batch, num_chunks * size, num_heads, value_dim)[:, :length]
    )  # (B, T, H, Dv)
    if not return_lse:
        return out.transpose(1, 2).to(v.dtype), new_state
    lse = (
        lse.view(batch, num_kv_heads, num_chunks, group, size)
        .transpose(2, 3)
        .reshape(batch, num_heads, num_chunks * size)[:, :, :length]
    )
    return out.transpose(1, 2).to(v.dtype), lse, new_state


def _merged_sink_sums(
    window_out: Tensor,
    window_lse: Tensor,
    seen: Tensor,
    sink_queries: Tensor,
    sink: SinkUpdate,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """A window softmax's normalised output (B, Hk, G, T, Dv) and log-sum-exp (B, Hk, G, T) merged with the
    sinks scored by ``sink_queries`` (B, Hk, G, T, D): the output and log-sum-exp over both. ``seen``
    (broadcast to (B, Hk, G, T)): the window rows that saw a key; the others add nothing."""
    seen = seen.expand_as(window_lse)
    window_lse = window_lse.masked_fill(~seen, NEGATIVE_INFINITY)
    window_out = torch.where(seen[..., None], window_out, torch.zeros_like(window_out))
    window = (window_out, torch.ones_like(window_lse), window_lse)
    numerator, denominator, maximum = merge_softmax_sums(
        window, sink_sums(sink_queries, sink, scaling=scaling)
    )
    return numerator / denominator[..., None], log_sum_exp(denominator, maximum)


def _tracked(tensor: Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


def takes_fused_lse(query: Tensor, key: Tensor, v: Tensor) -> bool:
    """Whether the fused window path may return the log-sum-exp: on CPU (PyTorch's fused CPU kernel, which
    needs values as wide as the keys) and without gradients to track, as the kernel gives none for it
    (training takes the blocked path)."""
    tensors = (query, key, v)
    on_cpu = all(tensor.device.type == "cpu" for tensor in tensors)
    tracked = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)
    fused = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return on_cpu and not tracked and fused and v.shape[-1] == key.shape[-1]


def chunked_window_attention(
    inputs: WindowInputs,
    options: WindowOptions,
    *,
    chunk_size: int = 64,
    initial_state: WindowState | None = None,
    return_state: bool = False,
    return_lse: bool = False,
):
    """Sliding-window softmax attention with ``options.sinks`` sink keys, chunked; semantics in ``dofla.ops``.

    inputs: the call's tensors (shapes in ``WindowInputs``); initial_state: a WindowState from an earlier
    call of either form. Returns out (B, H, T, Dv) in v's dtype, or (out, WindowState) when return_state;
    ``return_lse`` puts lse (B, H, T), the log-sum-exp of each query's softmax scores in the compute dtype
    (-inf when it sees no key), after out.
    """
    query, key, v = inputs.query, inputs.key, inputs.v
    key_mask, sink_query = inputs.key_mask, inputs.sink_query
    group = check_window_inputs(query, key, v, options.window, options.sinks)
    check_sink_query(query, sink_query)
    size = check_chunk_size(chunk_size)
    if not options.softcap and key_mask is None and (not return_lse or takes_fused_lse(query, key, v)):
        *results, state = _fused_window_attention(
            inputs, initial_state, options, chunk_size=size, return_lse=return_lse
        )
        results = (*results, state) if return_state else tuple(results)
        return results if len(results) > 1 else results[0]
    present = present_keys(key_mask, key)  # (B, Hk, T)
    if key_mask is not None:
        v = v.masked_fill(~present[..., None], 0)
    dtype = compute_dtype(query, key, v)
    batch, num_heads, length, head_dim = query.shape
    queries = query.to(dtype).view(batch, key.shape[1], group, length, head_dim)  # (B, Hk, G, T, D)
    numerator, denominator, maximum, _, state = window_part_sums(
        queries,
        key,
        v,
        present,
        initial_state,
        options,
        chunk_size=size,
        sink_queries=grouped_queries(sink_query, dtype, key.shape[1]),
    )
    results = [None]
    if return_lse:
        results.append(log_sum_exp(denominator, maximum).reshape(batch, num_heads, length))
    denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))  # 0 / 1 if empty
    out = (numerator / denominator[..., None]).reshape(batch, num_heads, length, v.shape[-1]).to(v.dtype)
    results[0] = out
    if return_state:
        results.append(state)
    return tuple(results) if len(results) > 1 else out
