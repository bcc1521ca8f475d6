"""The gated delta rule (Gated DeltaNet) in three forms with identical semantics.

One state S (K, Dv) per key/value head; per token t, with a_t = exp(log_decay_t) in (0, 1] and
beta_t in (0, 1):

    S_t = a_t (S_{t-1} - beta_t k_t (k_t^T S_{t-1})) + beta_t k_t v_t^T,    out_t = S_t^T q_t

(no normaliser; query head h reads the state of key/value head h // (H // Hk)). Keys should have unit
L2 norm (the caller normalises them, or passes ``normalize_keys=True``); then the update writes v_t
over what S held for k_t, by a fraction beta_t. Absent keys (``key_mask`` False) change nothing:
a = 1 and beta = 0 there; their queries still read the state.

``gated_delta_rule`` (the literal token loop, tests only), ``chunked_gated_delta_rule`` (training and
prefill), ``recurrent_gated_delta_rule`` (decoding). States (``DeltaState``) pass between the forms.

Chunked form. Inside a chunk that starts from state S_0, let g_t = sum of log_decay over the chunk's
tokens up to t (so gamma_t = exp(g_t) is the decay since the chunk start). Every S_t is then
``gamma_t S_0 + sum_{i <= t} (gamma_t / gamma_i) k_i u_i^T`` with pseudo-values u solving the unit lower
triangular system ``(I + A) U = diag(beta) V - diag(beta gamma) K S_0``,
``A_ti = beta_t (gamma_t / gamma_i) k_t.k_i`` for i < t (the WY / UT representation). So per chunk
one triangular inverse gives W = (I + A)^-1 diag(beta gamma) K and U' = (I + A)^-1 diag(beta) V, all chunks
at once, and a loop over chunks carries S: U = U' - W S_0, out = diag(gamma) Q S_0 + (causal
(gamma_t / gamma_i) q_t.k_i) U, S_C = gamma_C S_0 + K^T diag(gamma_C / gamma_i) U. Every exponent is a
difference g_t - g_i with i <= t, so <= 0 when log_decay <= 0: nothing overflows at any length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.errors import DoflaError
from dofla.ops._checks import check_delta_inputs, check_key_mask, compute_dtype, stack_tokens
from dofla.ops.fla_backend import GatedDeltaKernel, kernel_gated_delta_rule
from dofla.ops.state import DeltaState


def _prepare(q, k, v, log_decay, beta, key_mask, normalize_keys):
    """Checks, compute dtype, optional key normalisation and masking of absent keys (a = 1, beta = 0).

    Returns group H // Hk, q, k, v, log_decay, beta, all in the compute dtype.
    """
    group = check_delta_inputs(q, k, v, log_decay, beta)
    dtype = compute_dtype(q, k, v, log_decay, beta)
    q, k, v, log_decay, beta = (tensor.to(dtype) for tensor in (q, k, v, log_decay, beta))
    if normalize_keys:
        k = F.normalize(k, dim=-1, eps=1e-6)
    if key_mask is not None:
        absent = ~check_key_mask(key_mask, k.shape[0], k.shape[2])[:, None, :]  # (B, 1, T)
        log_decay, beta = log_decay.masked_fill(absent, 0.0), beta.masked_fill(absent, 0.0)
        k, v = k.masked_fill(absent[..., None], 0.0), v.masked_fill(absent[..., None], 0.0)
    return group, q, k, v, log_decay, beta


def _initial_kv(state: DeltaState | None, k: Tensor, value_dim: int) -> Tensor:
    """(B, Hk, K, Dv) in k's dtype: the state's memory, or zeros."""
    batch, num_kv_heads, _, key_dim = k.shape
    if state is None:
        return k.new_zeros(batch, num_kv_heads, key_dim, value_dim)
    if tuple(state.kv.shape) != (batch, num_kv_heads, key_dim, value_dim):
        raise DoflaError(
            f"the delta state {tuple(state.kv.shape)} does not fit (batch, kv heads, key dim, value dim) = "
            f"{(batch, num_kv_heads, key_dim, value_dim)}; continue with the state of the same layer."
        )
    return state.kv.to(k.dtype)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    *,
    initial_state: DeltaState | None = None,
    key_mask: Tensor | None = None,
    normalize_keys: bool = False,
) -> Tensor:
    """The literal token loop, one state per query head with the K x K transition written out. Tests only.

    q (B, H, T, K), k (B, Hk, T, K), v (B, Hk, T, Dv), log_decay (B, Hk, T) <= 0, beta (B, Hk, T) in (0, 1).
    Returns (B, H, T, Dv) in v's dtype.
    """
    group, q, k, v_in, log_decay, beta = _prepare(q, k, v, log_decay, beta, key_mask, normalize_keys)
    length, key_dim = q.shape[2], q.shape[3]

    def per_query_head(tensor: Tensor) -> Tensor:
        return tensor.repeat_interleave(group, dim=1)  # (B, Hk, ...) -> (B, H, ...)

    keys, values = per_query_head(k), per_query_head(v_in)
    decay, beta = per_query_head(log_decay).exp(), per_query_head(beta)
    memory = per_query_head(_initial_kv(initial_state, k, v.shape[-1]))  # (B, H, K, Dv)
    identity = torch.eye(key_dim, dtype=q.dtype, device=q.device)
    outputs = []
    for t in range(length):
        a, b = decay[:, :, t, None, None], beta[:, :, t, None, None]  # (B, H, 1, 1)
        key = keys[:, :, t, :, None]  # (B, H, K, 1)
        transition = a * (identity - b * key @ key.transpose(-1, -2))  # (B, H, K, K)
        memory = transition @ memory + b * key @ values[:, :, t, None, :]  # (B, H, K, Dv)
        outputs.append(memory.transpose(-1, -2) @ q[:, :, t, :, None])  # (B, H, Dv, 1)
    return torch.cat(outputs, dim=-1).transpose(-1, -2).to(v.dtype)


def update_delta_state(state: DeltaState, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor) -> DeltaState:
    """One token per head: k (B, Hk, K), v (B, Hk, Dv), the decay a = exp(log_decay) (B, Hk) in (0, 1] and
    beta (B, Hk). Returns a new state.

    ``a (S - b k (k^T S)) + b k v^T`` is computed as ``a S + k (b (v - a k^T S))^T``: one read, two
    fused multiply-adds (decoding is bound by its number of small operators).
    """
    memory = state.kv  # (B, Hk, K, Dv)
    batch, heads, key_dim, value_dim = memory.shape
    decay = decay[..., None]  # (B, Hk, 1)
    recalled = torch.bmm(k.reshape(-1, 1, key_dim), memory.reshape(-1, key_dim, value_dim))  # k^T S
    correction = torch.addcmul(v, decay, recalled.view_as(v), value=-1.0) * beta[..., None]  # b (v - a k^T S)
    memory = torch.addcmul(memory * decay[..., None], k[..., :, None], correction[..., None, :])
    return DeltaState(memory, state.num_tokens + 1)


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    *,
    state: DeltaState | None = None,
    key_mask: Tensor | None = None,
    normalize_keys: bool = False,
) -> tuple[Tensor, DeltaState]:
    """Token by token (decoding); shapes as in ``gated_delta_rule``, state from an earlier call of either
    form or None. Returns out (B, H, T, Dv) in v's dtype and the state (float32, float64 for float64 inputs).
    """
    group, q, k, v_in, log_decay, beta = _prepare(q, k, v, log_decay, beta, key_mask, normalize_keys)
    batch, num_heads, length, key_dim = q.shape
    num_kv_heads = k.shape[1]
    current = DeltaState(_initial_kv(state, k, v.shape[-1]), 0 if state is None else state.num_tokens)
    queries = q.view(batch, num_kv_heads, group, length, key_dim)  # (B, Hk, G, T, K)
    decay = log_decay.exp()  # (B, Hk, T)
    outputs = []
    for t in range(length):
        current = update_delta_state(current, k[:, :, t], v_in[:, :, t], decay[:, :, t], beta[:, :, t])
        outputs.append(queries[:, :, :, t] @ current.kv)  # (B, Hk, G, Dv)
    out = stack_tokens(outputs).reshape(batch, num_heads, length, v.shape[-1])
    return out.to(v.dtype), current


def chunked_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    initial_state: DeltaState | None = None,
    return_state: bool = False,
    key_mask: Tensor | None = None,
    normalize_keys: bool = False,
    kernel: GatedDeltaKernel | None = None,
):
    """Chunkwise-parallel form (see the module docstring); shapes as in ``gated_delta_rule``.

    Returns out (B, H, T, Dv) in v's dtype, or (out, DeltaState) when return_state. kernel: fla's gated
    delta rule kernel to run it on (``dofla.ops.fla_backend``), None for PyTorch.
    """
    if int(chunk_size) <= 0:
        raise DoflaError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    group, q, k, v_in, log_decay, beta = _prepare(q, k, v, log_decay, beta, key_mask, normalize_keys)
    batch, num_heads, length, key_dim = q.shape
    num_kv_heads, value_dim = k.shape[1], v.shape[-1]
    memory = _initial_kv(initial_state, k, value_dim)  # (B, Hk, K, Dv)
    previous_tokens = 0 if initial_state is None else initial_state.num_tokens
    if kernel is not None:
        initial_memory = None if initial_state is None else memory
        out, memory = kernel_gated_delta_rule(q, k, v_in, log_decay, beta, initial_memory, kernel=kernel)
        out = out.to(v.dtype)
        return (out, DeltaState(memory, previous_tokens + length)) if return_state else out
    size = min(int(chunk_size), length)
    num_chunks = -(-length // size)
    pad = num_chunks * size - length  # padded tokens: k = v = q = 0, a = 1, beta = 0, i.e. no update
    if pad:
        q, k, v_in = (F.pad(tensor, (0, 0, 0, pad)) for tensor in (q, k, v_in))
        log_decay, beta = F.pad(log_decay, (0, pad)), F.pad(beta, (0, pad))
    rows = group * size  # a chunk's queries of one key/value head, g * C + r, are the rows of one product
    # (B, Hk, N, G * C, K): each chunk's queries of a key/value head contiguous, so every product below is
    # one batched call on views, with no key, value or memory repeated over the group
    queries = (
        q.view(batch, num_kv_heads, group, num_chunks, size, key_dim)
        .transpose(2, 3)
        .reshape(batch, num_kv_heads, num_chunks, rows, key_dim)
    )
    keys = k.view(batch, num_kv_heads, num_chunks, size, key_dim)  # (B, Hk, N, C, K)
    values = v_in.view(batch, num_kv_heads, num_chunks, size, value_dim)  # (B, Hk, N, C, Dv)
    beta = beta.view(batch, num_kv_heads, num_chunks, size)  # (B, Hk, N, C)
    log_gamma = log_decay.view(batch, num_kv_heads, num_chunks, size).cumsum(-1)  # g_t from the chunk start

    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # [t, i]: i <= t
    # gamma_t / gamma_i for i <= t, exactly 0 above the diagonal (masked before exp: no overflow there).
    pair_decay = torch.where(
        causal, log_gamma[..., :, None] - log_gamma[..., None, :], float("-inf")
    ).exp()  # (B, Hk, N, C, C)
    strictly_lower = (beta[..., :, None] * (keys @ keys.transpose(-1, -2)) * pair_decay).tril(-1)
    identity = torch.eye(size, dtype=q.dtype, device=q.device)
    right = torch.cat(
        [keys * (beta * log_gamma.exp())[..., None], values * beta[..., None]], dim=-1
    )  # (B, Hk, N, C, K + Dv)
    # (I + A)^-1 by one solve against the identity (C right-hand sides instead of K + Dv), then one product:
    # the same forward substitution, a quarter of its work
    inverse = torch.linalg.solve_triangular(
        strictly_lower + identity, identity.expand_as(strictly_lower), upper=False, unitriangular=True
    )
    solved = inverse @ right
    w, u_from_values = solved.split([key_dim, value_dim], dim=-1)  # (B, Hk, N, C, K), (B, Hk, N, C, Dv)

    def split_group(tensor: Tensor) -> Tensor:  # (B, Hk, N, G * C, ...) -> (B, Hk, N, G, C, ...), a view
        return tensor.unflatten(3, (group, size))

    scores = (split_group(queries @ keys.transpose(-1, -2)) * pair_decay.unsqueeze(3)).flatten(3, 4)
    decayed_queries = (split_group(queries) * log_gamma.exp()[:, :, :, None, :, None]).flatten(3, 4)
    keys_to_end = keys * (log_gamma[..., -1:] - log_gamma).exp()[..., None]  # (B, Hk, N, C, K)
    chunk_decay = log_gamma[..., -1].exp()[..., None, None]  # (B, Hk, N, 1, 1)

    # per-chunk views by unbind, not by indexing: one backward node per tensor instead of one per chunk,
    # each of which would write a zero tensor of the full size (quadratic in the number of chunks); the
    # batch and heads merged into one dimension, so each product of the loop is one bmm / baddbmm (a 4-D
    # matmul is several operators, and at long prefills the loop's operators cost more than their work)
    def per_chunk(tensor: Tensor) -> tuple[Tensor, ...]:  # (B, Hk, N, ...) -> N x (B * Hk, ...)
        return tensor.flatten(0, 1).unbind(1)

    chunks = zip(
        per_chunk(u_from_values),
        per_chunk(w),
        per_chunk(decayed_queries),
        per_chunk(scores),
        per_chunk(chunk_decay),
        per_chunk(keys_to_end.transpose(-1, -2)),
        strict=True,
    )
    state = memory.reshape(batch * num_kv_heads, key_dim, value_dim)
    outputs = []
    for chunk_u, chunk_w, chunk_queries, chunk_scores, decay, chunk_keys_to_end in chunks:
        u = torch.baddbmm(chunk_u, chunk_w, state, alpha=-1)  # U' - W S_0 (B * Hk, C, Dv)
        outputs.append(torch.baddbmm(torch.bmm(chunk_scores, u), chunk_queries, state))  # (B * Hk, G * C, Dv)
        state = torch.baddbmm(decay * state, chunk_keys_to_end, u)
    memory = state.view(batch, num_kv_heads, key_dim, value_dim)
    out = split_group(torch.stack(outputs, dim=1).unflatten(0, (batch, num_kv_heads))).transpose(2, 3)
    out = out.reshape(batch, num_heads, num_chunks * size, value_dim)[:, :, :length].to(v.dtype)
    return (out, DeltaState(memory, previous_tokens + length)) if return_state else out
