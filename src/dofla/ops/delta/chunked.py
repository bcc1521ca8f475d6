"""The gated delta rule's chunked form (training and prefill); semantics in ``dofla.ops.delta``.

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
from dofla.ops._checks import initial_delta_kv, prepare_delta_inputs
from dofla.ops.fla_backend import GatedDeltaKernel, kernel_gated_delta_rule
from dofla.ops.inputs import DeltaInputs
from dofla.ops.state import DeltaState


def chunked_gated_delta_rule(
    inputs: DeltaInputs,
    *,
    chunk_size: int = 64,
    initial_state: DeltaState | None = None,
    return_state: bool = False,
    normalize_keys: bool = False,
    kernel: GatedDeltaKernel | None = None,
):
    """Chunkwise-parallel form (see the module docstring); inputs as in ``gated_delta_rule``.

    Returns out (B, H, T, Dv) in v's dtype, or (out, DeltaState) when return_state. kernel: fla's gated
    delta rule kernel to run it on (``dofla.ops.fla_backend``), None for PyTorch.
    """
    if int(chunk_size) <= 0:
        raise DoflaError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    group, q, k, v_in, log_decay, beta = prepare_delta_inputs(inputs, normalize_keys)
    v = inputs.v
    batch, num_heads, length, key_dim = q.shape
    num_kv_heads, value_dim = k.shape[1], v.shape[-1]
    memory = initial_delta_kv(initial_state, k, value_dim)  # (B, Hk, K, Dv)
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
