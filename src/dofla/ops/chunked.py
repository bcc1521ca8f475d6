"""Chunked parallel form for training and prefill: pure PyTorch, batched matrix products, fast on CPU.

Same semantics as ``dofla.ops.naive`` (see its docstring). The sequence is cut into chunks of C tokens:
inside a chunk the (C, C) interactions are computed directly; between chunks the contribution of all
earlier chunks is a state (F, Dv) per key/value head, as in the recurrent form. Key log scales are handled
with the running maximum m_t (the same offsets as the recurrent state), so every exponent is <= 0.
Query heads of a key/value group are kept as a separate axis (B, Hk, G, ...) and read one shared state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

NEGATIVE_INFINITY = float("-inf")


def _check_chunk_size(chunk_size: int) -> int:
    if int(chunk_size) <= 0:
        raise DoflaError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    return int(chunk_size)


def linear_attention_sums(
    q: Tensor, k: Tensor, v: Tensor, log_scale: Tensor | None, state: LinearState | None, chunk_size: int
) -> tuple[Tensor, Tensor, LinearState]:
    """Unnormalised causal linear attention in chunks.

    q (B, Hk, G, T, F), k (B, Hk, T, F), v (B, Hk, T, Dv), log_scale (B, Hk, T) or None (all 0, only
    allowed without a state), all in the compute dtype. Returns numerator (B, Hk, G, T, Dv) and
    denominator (B, Hk, G, T), both divided by exp(m_t) with m_t the running maximum of the log scales
    (including the state's offset), and the state after the last token.
    """
    batch, num_kv_heads, group, length, feature_dim = q.shape
    value_dim = v.shape[-1]
    size = chunk_size
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    if pad:  # padded keys have zero features and log scale -inf: they add nothing anywhere
        q, k, v = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        if log_scale is not None:
            log_scale = F.pad(log_scale, (0, pad), value=NEGATIVE_INFINITY)
    q_chunks = q.view(batch, num_kv_heads, group, num_chunks, size, feature_dim)  # (B, Hk, G, N, C, F)
    k_chunks = k.view(batch, num_kv_heads, num_chunks, size, feature_dim)  # (B, Hk, N, C, F)
    v_chunks = v.view(batch, num_kv_heads, num_chunks, size, value_dim)  # (B, Hk, N, C, Dv)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # [query r, key u]: u <= r
    scores = q_chunks @ k_chunks.unsqueeze(2).transpose(-1, -2)  # (B, Hk, G, N, C, C)

    if log_scale is None:
        if state is not None:
            raise ValueError("linear_attention_sums needs explicit log scales when continuing from a state")
        intra = scores.masked_fill(~causal, 0.0)
        kv_chunks = k_chunks.transpose(-1, -2) @ v_chunks  # (B, Hk, N, F, Dv)
        normalizer_chunks = k_chunks.sum(-2)  # (B, Hk, N, F)
        kv_inclusive = kv_chunks.cumsum(2)
        normalizer_inclusive = normalizer_chunks.cumsum(2)
        kv_entering = kv_inclusive - kv_chunks  # state before each chunk, (B, Hk, N, F, Dv)
        normalizer_entering = normalizer_inclusive - normalizer_chunks
        inter_numerator = q_chunks @ kv_entering.unsqueeze(2)  # (B, Hk, G, N, C, Dv)
        inter_denominator = (q_chunks @ normalizer_entering.unsqueeze(2).unsqueeze(-1)).squeeze(-1)
        final = LinearState(
            kv_inclusive[:, :, -1],
            normalizer_inclusive[:, :, -1],
            torch.zeros(batch, num_kv_heads, dtype=q.dtype, device=q.device),
            length,
        )
    else:
        if state is None:
            initial_offset = torch.full(
                (batch, num_kv_heads), NEGATIVE_INFINITY, dtype=q.dtype, device=q.device
            )
        else:
            initial_offset = state.log_offset.to(q.dtype)
        running_max = torch.maximum(
            torch.cummax(log_scale, -1).values, initial_offset[..., None]
        )  # (B, Hk, NC)
        scale_chunks = log_scale.view(batch, num_kv_heads, num_chunks, size)  # (B, Hk, N, C)
        max_chunks = running_max.view(batch, num_kv_heads, num_chunks, size)  # (B, Hk, N, C): m per token
        chunk_end = max_chunks[..., -1]  # (B, Hk, N): offset after each chunk
        entering = torch.cat([initial_offset[..., None], chunk_end], dim=-1)  # (B, Hk, N + 1): offset before

        key_log_weight = torch.where(
            causal, scale_chunks[..., None, :], NEGATIVE_INFINITY
        )  # (B, Hk, N, C, C)
        intra = scores * exp_relative(key_log_weight, max_chunks[..., :, None]).unsqueeze(2)

        # Each chunk's own sums relative to the offset at its end, then mixed into the state entering
        # chunk n: sum_{c < n} chunk_c * exp(end_c - entering_n) (+ initial state * exp(offset_0 - entering_n)).
        weighted_keys = (
            k_chunks * exp_relative(scale_chunks, chunk_end[..., None])[..., None]
        )  # (B, Hk, N, C, F)
        kv_chunks = weighted_keys.transpose(-1, -2) @ v_chunks  # (B, Hk, N, F, Dv)
        normalizer_chunks = weighted_keys.sum(-2)  # (B, Hk, N, F)
        state_index = torch.arange(num_chunks + 1, device=q.device)[:, None]
        chunk_index = torch.arange(num_chunks, device=q.device)[None, :]
        mix_log = torch.where(
            chunk_index < state_index, chunk_end[..., None, :], NEGATIVE_INFINITY
        )  # (B,Hk,N+1,N)
        mix = exp_relative(mix_log, entering[..., None])
        kv_states = torch.einsum("bhnc,bhcfd->bhnfd", mix, kv_chunks)  # (B, Hk, N + 1, F, Dv)
        normalizer_states = torch.einsum("bhnc,bhcf->bhnf", mix, normalizer_chunks)  # (B, Hk, N + 1, F)
        if state is not None:
            carry = exp_relative(initial_offset[..., None], entering)  # (B, Hk, N + 1)
            kv_states = kv_states + carry[..., None, None] * state.kv.to(q.dtype)[:, :, None]
            normalizer_states = (
                normalizer_states + carry[..., None] * state.normalizer.to(q.dtype)[:, :, None]
            )

        inter_scale = exp_relative(entering[..., :-1, None], max_chunks).unsqueeze(2)  # (B, Hk, 1, N, C)
        inter_numerator = (q_chunks @ kv_states[:, :, None, :-1]) * inter_scale[..., None]
        inter_denominator = (q_chunks @ normalizer_states[:, :, None, :-1, :, None]).squeeze(-1) * inter_scale
        previous_tokens = 0 if state is None else state.num_tokens
        final = LinearState(
            kv_states[:, :, -1], normalizer_states[:, :, -1], entering[..., -1], previous_tokens + length
        )

    numerator = intra @ v_chunks.unsqueeze(2) + inter_numerator  # (B, Hk, G, N, C, Dv)
    denominator = intra.sum(-1) + inter_denominator  # (B, Hk, G, N, C)
    numerator = numerator.reshape(batch, num_kv_heads, group, num_chunks * size, value_dim)[..., :length, :]
    denominator = denominator.reshape(batch, num_kv_heads, group, num_chunks * size)[..., :length]
    return numerator, denominator, final


def chunked_linear_attention(
    q_features: Tensor,
    k_features: Tensor,
    v: Tensor,
    *,
    k_log_scale: Tensor | None = None,
    chunk_size: int = 64,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
):
    """Causal linear attention, chunked.

    q_features (B, H, T, F), k_features (B, Hk, T, F), v (B, Hk, T, Dv), k_log_scale (B, Hk, T) or None.
    initial_state: a LinearState from an earlier call of either form. Returns out (B, H, T, Dv) in v's
    dtype, or (out, LinearState) when return_state.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    size = _check_chunk_size(chunk_size)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads = k_features.shape[1]
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)  # (B, Hk, G, T, F)
    log_scale = None if k_log_scale is None else k_log_scale.to(dtype)
    if log_scale is None and initial_state is not None:
        log_scale = torch.zeros(k_features.shape[:3], dtype=dtype, device=k_features.device)
    numerator, denominator, state = linear_attention_sums(
        q, k_features.to(dtype), v.to(dtype), log_scale, initial_state, size
    )
    out = (
        (numerator / (denominator[..., None] + eps))
        .reshape(batch, num_heads, length, v.shape[-1])
        .to(v.dtype)
    )
    return (out, state) if return_state else out


def sliding_window_sums(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    log_scales: Tensor,
    *,
    scaling: float,
    window: int,
    chunk_size: int,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax over the last ``window`` keys (the query's own included), blocked by chunks.

    queries (B, Hk, G, T, D), keys (B, Hk, T, D), values (B, Hk, T, Dv) in the compute dtype;
    log_scales (B, Hk, T): keys with log scale -inf are absent.
    Returns numerator (B, Hk, G, T, Dv) and denominator (B, Hk, G, T) of exp(score - window max).
    """
    batch, num_kv_heads, group, length, head_dim = queries.shape
    value_dim = values.shape[-1]
    size = chunk_size
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    span = size + window - 1  # keys a chunk of queries can see
    queries = F.pad(queries, (0, 0, 0, pad)).view(batch, num_kv_heads, group, num_chunks, size, head_dim)
    # Keys shifted right by window - 1 so that block n starts at absolute position n * C - (window - 1).
    key_blocks = F.pad(keys, (0, 0, window - 1, pad)).unfold(2, span, size).transpose(-1, -2)  # (B,Hk,N,S,D)
    value_blocks = (
        F.pad(values, (0, 0, window - 1, pad)).unfold(2, span, size).transpose(-1, -2)
    )  # (B,Hk,N,S,Dv)
    row = torch.arange(size, device=queries.device)[:, None]  # query r in its chunk
    column = torch.arange(span, device=queries.device)[None, :]  # key u in the block
    chunk_start = (torch.arange(num_chunks, device=queries.device) * size)[:, None, None]
    visible = (
        (column >= row) & (column <= row + window - 1) & (chunk_start + column - (window - 1) >= 0)
    )  # (N, C, S)
    absent = F.pad(torch.isneginf(log_scales), (window - 1, pad), value=True).unfold(
        2, span, size
    )  # (B,Hk,N,S)
    visible = visible & ~absent[:, :, :, None, :]  # (B, Hk, N, C, S)
    scores = soft_cap(
        scaling * (queries @ key_blocks.unsqueeze(2).transpose(-1, -2)), softcap
    )  # (B,Hk,G,N,C,S)
    scores = scores.masked_fill(~visible.unsqueeze(2), NEGATIVE_INFINITY)
    window_max = scores.amax(-1, keepdim=True)  # -inf only for a query whose whole window is absent
    window_max = torch.where(torch.isfinite(window_max), window_max, torch.zeros_like(window_max))
    weights = torch.exp(scores - window_max)
    numerator = weights @ value_blocks.unsqueeze(2)  # (B, Hk, G, N, C, Dv)
    denominator = weights.sum(-1)
    numerator = numerator.reshape(batch, num_kv_heads, group, num_chunks * size, value_dim)[..., :length, :]
    denominator = denominator.reshape(batch, num_kv_heads, group, num_chunks * size)[..., :length]
    return numerator, denominator


def chunked_hybrid_attention(
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
    chunk_size: int = 64,
    initial_state: HybridState | None = None,
    return_state: bool = False,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    eps: float = 1e-6,
):
    """Sliding-window softmax + linear attention (LoLCATs), chunked; semantics in ``dofla.ops.naive``.

    query (B, H, T, D), key (B, Hk, T, D) after rotary, features and v as in ``chunked_linear_attention``,
    window_factor (H,) = gamma. The linear part is linear attention on keys delayed by ``window`` tokens.
    Returns out (B, H, T, Dv) in v's dtype, or (out, HybridState) when return_state.
    """
    group = check_linear_inputs(q_features, k_features, v, k_log_scale)
    check_hybrid_inputs(query, key, q_features, window, window_factor)
    size = _check_chunk_size(chunk_size)
    window = int(window)
    k_features, v, k_log_scale = mask_absent_keys(k_features, v, k_log_scale, key_mask)
    dtype = compute_dtype(query, key, q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, head_dim, value_dim = key.shape[1], key.shape[-1], v.shape[-1]
    if k_log_scale is None:
        log_scale = torch.zeros(k_features.shape[:3], dtype=dtype, device=k_features.device)
    else:
        log_scale = k_log_scale.to(dtype)

    # Everything the window can still see: the state's last keys, then this call's keys.
    if initial_state is None:
        all_keys, all_values, all_features, all_scales, linear_state = key, v, k_features, log_scale, None
    else:
        if initial_state.window != window:
            raise DoflaError(
                f"the state was built with window {initial_state.window}, this call uses {window}."
            )

        def joined(buffer: Tensor, new: Tensor) -> Tensor:
            return torch.cat([buffer.to(new.dtype), new], dim=2)

        all_keys, all_values = joined(initial_state.keys, key), joined(initial_state.values, v)
        all_features = joined(initial_state.key_features, k_features)
        all_scales = joined(initial_state.key_log_scales, log_scale)
        linear_state = initial_state.linear
    buffered = all_keys.shape[2] - length  # L <= window

    # Linear part: query t sees keys at joined positions <= buffered + t - window, i.e. the joined
    # sequence delayed by (window - buffered) tokens; delayed-in slots have zero features, log scale -inf.
    delay = window - buffered
    old_features = F.pad(all_features.to(dtype), (0, 0, delay, 0))[:, :, :length]  # (B, Hk, T, F)
    old_values = F.pad(all_values.to(dtype), (0, 0, delay, 0))[:, :, :length]
    old_scales = F.pad(all_scales.to(dtype), (delay, 0), value=NEGATIVE_INFINITY)[:, :, :length]
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)
    linear_numerator, linear_denominator, new_linear = linear_attention_sums(
        q, old_features, old_values, old_scales, linear_state, size
    )
    previous_linear_tokens = 0 if initial_state is None else initial_state.linear.num_tokens
    new_linear.num_tokens = previous_linear_tokens + max(0, length - delay)  # delayed-in slots are not keys

    # Window part over the joined keys; the buffered positions get dummy queries that are dropped.
    queries = F.pad(query.to(dtype), (0, 0, buffered, 0)).view(
        batch, num_kv_heads, group, buffered + length, head_dim
    )
    window_numerator, window_denominator = sliding_window_sums(
        queries,
        all_keys.to(dtype),
        all_values.to(dtype),
        all_scales.to(dtype),
        scaling=scaling,
        window=window,
        chunk_size=size,
        softcap=softcap,
    )
    window_numerator, window_denominator = (
        window_numerator[..., buffered:, :],
        window_denominator[..., buffered:],
    )

    gamma = window_factor.to(dtype).view(1, num_kv_heads, group, 1)  # (1, Hk, G, 1)
    numerator = gamma[..., None] * window_numerator + (1 - gamma[..., None]) * linear_numerator
    denominator = gamma * window_denominator + (1 - gamma) * linear_denominator
    out = (
        (numerator / (denominator[..., None] + eps)).reshape(batch, num_heads, length, value_dim).to(v.dtype)
    )
    if not return_state:
        return out
    keep = min(window, all_keys.shape[2])
    state = HybridState(
        linear=new_linear,
        keys=all_keys[:, :, -keep:],
        values=all_values[:, :, -keep:],
        key_features=all_features[:, :, -keep:],
        key_log_scales=all_scales[:, :, -keep:],
        window=window,
    )
    return out, state
