"""The gated delta rule's recurrent form (decoding); semantics in ``dofla.ops.delta``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    initial_delta_kv,
    prepare_delta_inputs,
    stack_tokens,
)
from dofla.ops.inputs import DeltaInputs
from dofla.ops.state import DeltaState


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
    inputs: DeltaInputs, *, state: DeltaState | None = None, normalize_keys: bool = False
) -> tuple[Tensor, DeltaState]:
    """Token by token (decoding); inputs as in ``gated_delta_rule``, state from an earlier call of either
    form or None. Returns out (B, H, T, Dv) in v's dtype and the state (float32, float64 for float64 inputs).
    """
    group, q, k, v_in, log_decay, beta = prepare_delta_inputs(inputs, normalize_keys)
    v = inputs.v
    batch, num_heads, length, key_dim = q.shape
    num_kv_heads = k.shape[1]
    current = DeltaState(initial_delta_kv(state, k, v.shape[-1]), 0 if state is None else state.num_tokens)
    queries = q.view(batch, num_kv_heads, group, length, key_dim)  # (B, Hk, G, T, K)
    decay = log_decay.exp()  # (B, Hk, T)
    outputs = []
    for t in range(length):
        current = update_delta_state(current, k[:, :, t], v_in[:, :, t], decay[:, :, t], beta[:, :, t])
        outputs.append(queries[:, :, :, t] @ current.kv)  # (B, Hk, G, Dv)
    out = stack_tokens(outputs).reshape(batch, num_heads, length, v.shape[-1])
    return out.to(v.dtype), current
