"""Linear attention's chunked form (training and prefill); semantics in ``dofla.ops``."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.ops._checks import compute_dtype, prepare_linear_inputs
from dofla.ops.chunk_sizes import check_chunk_size
from dofla.ops.fla_backend import SimpleGLAKernel, kernel_linear_attention_sums
from dofla.ops.inputs import LinearInputs
from dofla.ops.state import LinearState, exp_relative

NEGATIVE_INFINITY = float("-inf")


SCAN_ABOVE_CHUNKS = 16  # more chunks than this: the states entering them by a scan, not an (N, N) product


def linear_attention_sums(
    q: Tensor, k: Tensor, v: Tensor, log_scale: Tensor | None, state: LinearState | None, chunk_size: int
) -> tuple[Tensor, Tensor, LinearState]:
    """Unnormalised causal linear attention in chunks.

    q (B, Hk, G, T, F), k (B, Hk, T, F), v (B, Hk, T, Dv), log_scale (B, Hk, T) or None (all 0, only
    allowed without a state), all in the compute dtype. Returns numerator (B, Hk, G, T, Dv) and
    denominator (B, Hk, G, T), both divided by exp(m_t) with m_t the running maximum of the log scales
    (including the state's offset), and the state after the last token.
    """
    sums, final = linear_attention_chunk_sums(q, k, v, log_scale, state, chunk_size)
    batch, num_kv_heads, num_chunks, group, size, width = sums.shape
    sums = sums.transpose(2, 3).reshape(batch, num_kv_heads, group, num_chunks * size, width)
    length = q.shape[3]
    return sums[..., :length, :-1], sums[..., :length, -1], final


def linear_attention_chunk_sums(
    q: Tensor, k: Tensor, v: Tensor, log_scale: Tensor | None, state: LinearState | None, chunk_size: int
) -> tuple[Tensor, LinearState]:
    """``linear_attention_sums`` in the chunks' own layout: sums (B, Hk, N, G, C, Dv + 1) with the
    numerator in the first Dv columns and the denominator in the last (tokens past T are padding), and
    the state after the last token; a caller that reorders the output anyway saves one copy."""
    batch, num_kv_heads, group, length, feature_dim = q.shape
    value_dim = v.shape[-1]
    size = chunk_size
    num_chunks = -(-length // size)
    pad = num_chunks * size - length
    if pad:  # padded keys have zero features and log scale -inf: they add nothing anywhere
        q, k, v = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        if log_scale is not None:
            log_scale = F.pad(log_scale, (0, pad), value=NEGATIVE_INFINITY)
    # The G query heads of a key/value head are rows of one matrix per chunk (B, Hk, N, G * C, F), so that
    # every product reads the chunk's keys, values and states as they are (broadcasting them over G would
    # copy them G times); values carry a column of ones, so one product gives numerator and denominator.
    q_chunks = (
        q.view(batch, num_kv_heads, group, num_chunks, size, feature_dim)
        .transpose(2, 3)
        .reshape(batch, num_kv_heads, num_chunks, group * size, feature_dim)
    )  # (B, Hk, N, G * C, F)
    k_chunks = k.view(batch, num_kv_heads, num_chunks, size, feature_dim)  # (B, Hk, N, C, F)
    v_chunks = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1).view(
        batch, num_kv_heads, num_chunks, size, value_dim + 1
    )  # (B, Hk, N, C, Dv + 1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # [query r, key u]: u <= r
    scores = (q_chunks @ k_chunks.transpose(-1, -2)).view(
        batch, num_kv_heads, num_chunks, group, size, size
    )  # (B, Hk, N, G, C, C)

    if log_scale is None:
        if state is not None:
            raise ValueError("linear_attention_sums needs explicit log scales when continuing from a state")
        intra = scores.masked_fill(~causal, 0.0)
        sum_chunks = k_chunks.transpose(-1, -2) @ v_chunks  # (B, Hk, N, F, Dv + 1): kv and normalizer
        inclusive = sum_chunks.cumsum(2)
        states = torch.cat(
            [torch.zeros_like(inclusive[:, :, :1]), inclusive], dim=2
        )  # (B, Hk, N + 1, F, Dv + 1)
        inter = q_chunks @ states[:, :, :-1]  # (B, Hk, N, G * C, Dv + 1)
        final_offset = torch.zeros(batch, num_kv_heads, dtype=q.dtype, device=q.device)
        previous_tokens = 0
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
        intra = scores * exp_relative(key_log_weight, max_chunks[..., :, None]).unsqueeze(3)

        # Each chunk's own sums relative to the offset at its end, then mixed into the state entering
        # chunk n: sum_{c < n} chunk_c * exp(end_c - entering_n) (+ initial state * exp(offset_0 - entering_n)).
        weighted_keys = (
            k_chunks * exp_relative(scale_chunks, chunk_end[..., None])[..., None]
        )  # (B, Hk, N, C, F)
        sum_chunks = weighted_keys.transpose(-1, -2) @ v_chunks  # (B, Hk, N, F, Dv + 1): kv and normalizer
        if num_chunks <= SCAN_ABOVE_CHUNKS:
            states = _mix_chunk_states(sum_chunks, entering, state)
        else:
            states = _scan_chunk_states(sum_chunks, entering, state)  # (B, Hk, N + 1, F, Dv + 1)

        inter_scale = exp_relative(entering[..., :-1, None], max_chunks)  # (B, Hk, N, C)
        inter = (q_chunks @ states[:, :, :-1]).view(
            batch, num_kv_heads, num_chunks, group, size, value_dim + 1
        ) * inter_scale[:, :, :, None, :, None]
        final_offset = entering[..., -1].clone()
        previous_tokens = 0 if state is None else state.num_tokens

    rows, width = batch * num_kv_heads * num_chunks, value_dim + 1
    sums = torch.baddbmm(
        inter.reshape(rows, group * size, width),
        intra.reshape(rows, group * size, size),
        v_chunks.reshape(rows, size, width),
    ).view(batch, num_kv_heads, num_chunks, group, size, width)  # (B, Hk, N, G, C, Dv + 1)
    final = LinearState(
        states[:, :, -1, :, :value_dim].clone(),  # copies: a view would keep all N + 1 states alive
        states[:, :, -1, :, value_dim].clone(),
        final_offset,
        previous_tokens + length,
    )
    return sums, final


def linear_sums_by(kernel: SimpleGLAKernel | None):
    """``linear_attention_sums`` in PyTorch (kernel None), or by fla's simple GLA ``kernel`` (same results)."""
    if kernel is None:
        return linear_attention_sums
    return functools.partial(kernel_linear_attention_sums, kernel=kernel)


def _mix_chunk_states(sum_chunks: Tensor, entering: Tensor, state: LinearState | None) -> Tensor:
    """The state entering each chunk as one (N + 1, N) mixing product: few operators, O(N^2) work.

    sum_chunks (B, Hk, N, F, Dv + 1): chunk n's own kv sums and (last column) normalizer, relative to the
    offset at its end, entering[n + 1]; entering (B, Hk, N + 1) the offsets before each chunk (and after the
    last). Returns the states (B, Hk, N + 1, F, Dv + 1) relative to ``entering``.
    """
    num_chunks, device = sum_chunks.shape[2], sum_chunks.device
    chunk_end = entering[..., 1:]
    state_index = torch.arange(num_chunks + 1, device=device)[:, None]
    chunk_index = torch.arange(num_chunks, device=device)[None, :]
    mix_log = torch.where(
        chunk_index < state_index, chunk_end[..., None, :], NEGATIVE_INFINITY
    )  # (B,Hk,N+1,N)
    mix = exp_relative(mix_log, entering[..., None])
    states = torch.einsum("bhnc,bhcfd->bhnfd", mix, sum_chunks)  # (B, Hk, N + 1, F, Dv + 1)
    if state is not None:
        carry = exp_relative(entering[..., :1], entering)  # (B, Hk, N + 1)
        states = states + carry[..., None, None] * _joined_state(state, sum_chunks.dtype)[:, :, None]
    return states


def _scan_chunk_states(sum_chunks: Tensor, entering: Tensor, state: LinearState | None) -> Tensor:
    """``_mix_chunk_states`` as a scan over chunks, S_{n+1} = S_n exp(entering_n - entering_{n+1}) + chunk_n:
    O(N) work for long inputs (at 16k tokens the mixing product is 256 x 256 chunks) at N small operators."""
    batch, num_kv_heads, _, feature_dim, width = sum_chunks.shape
    decay = exp_relative(entering[..., :-1], entering[..., 1:])  # (B, Hk, N): <= 1
    if state is None:
        current = sum_chunks.new_zeros(batch, num_kv_heads, feature_dim, width)
    else:
        current = _joined_state(state, sum_chunks.dtype)
    states = [current]
    # unbind, not indexing: one backward node per tensor rather than a full-size zero tensor per chunk
    for chunk, chunk_decay in zip(sum_chunks.unbind(2), decay.unbind(2), strict=True):
        current = torch.addcmul(chunk, current, chunk_decay[..., None, None])
        states.append(current)
    return torch.stack(states, dim=2)  # (B, Hk, N + 1, F, Dv + 1)


def _joined_state(state: LinearState, dtype: torch.dtype) -> Tensor:
    """A LinearState's kv (B, Hk, F, Dv) and normalizer (B, Hk, F) as one (B, Hk, F, Dv + 1) tensor."""
    return torch.cat([state.kv, state.normalizer[..., None]], dim=-1).to(dtype)


def chunked_linear_attention(
    inputs: LinearInputs,
    *,
    chunk_size: int = 64,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
    kernel: SimpleGLAKernel | None = None,
):
    """Causal linear attention, chunked.

    inputs: the call's tensors (shapes in ``LinearInputs``); initial_state: a LinearState from an earlier
    call of either form. Returns out (B, H, T, Dv) in v's dtype, or (out, LinearState) when return_state.
    kernel: fla's simple GLA kernel to compute the sums (``dofla.ops.fla_backend``), None for PyTorch.
    """
    q_features = inputs.q_features
    group, k_features, v, k_log_scale = prepare_linear_inputs(inputs)
    size = check_chunk_size(chunk_size)
    dtype = compute_dtype(q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads = k_features.shape[1]
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)  # (B, Hk, G, T, F)
    log_scale = None if k_log_scale is None else k_log_scale.to(dtype)
    if log_scale is None and initial_state is not None:
        log_scale = torch.zeros(k_features.shape[:3], dtype=dtype, device=k_features.device)
    keys, values = k_features.to(dtype), v.to(dtype)
    if kernel is not None:
        numerator, denominator, state = linear_sums_by(kernel)(
            q, keys, values, log_scale, initial_state, size
        )
        out = (numerator / (denominator[..., None] + eps)).reshape(batch, num_heads, length, v.shape[-1])
        return (out.to(v.dtype), state) if return_state else out.to(v.dtype)
    sums, state = linear_attention_chunk_sums(q, keys, values, log_scale, initial_state, size)
    # one copy into (B, T, H, Dv + 1), the layout the attention module returns (its transpose is then free);
    # padded tokens are cut before dividing (their 0 / 0 would poison the gradients)
    sums = sums.permute(0, 2, 4, 1, 3, 5).reshape(batch, -1, num_heads, sums.shape[-1])[:, :length]
    out = (sums[..., :-1] / (sums[..., -1:] + eps)).transpose(1, 2).to(v.dtype)  # (B, H, T, Dv)
    return (out, state) if return_state else out
