"""The gated delta rule's literal token loop, the reference (tests only); semantics in ``dofla.ops.delta``."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import (
    initial_delta_kv,
    prepare_delta_inputs,
)
from dofla.ops.inputs import DeltaInputs
from dofla.ops.state import DeltaState


def gated_delta_rule(
    inputs: DeltaInputs, *, initial_state: DeltaState | None = None, normalize_keys: bool = False
) -> Tensor:
    """The literal token loop, one state per query head with the K x K transition written out. Tests only.

    inputs: the call's tensors (shapes in ``DeltaInputs``). Returns (B, H, T, Dv) in v's dtype.
    """
    group, q, k, v_in, log_decay, beta = prepare_delta_inputs(inputs, normalize_keys)
    v = inputs.v
    length, key_dim = q.shape[2], q.shape[3]

    def per_query_head(tensor: Tensor) -> Tensor:
        return tensor.repeat_interleave(group, dim=1)  # (B, Hk, ...) -> (B, H, ...)

    keys, values = per_query_head(k), per_query_head(v_in)
    decay, beta = per_query_head(log_decay).exp(), per_query_head(beta)
    memory = per_query_head(initial_delta_kv(initial_state, k, v.shape[-1]))  # (B, H, K, Dv)
    identity = torch.eye(key_dim, dtype=q.dtype, device=q.device)
    outputs = []
    for t in range(length):
        a, b = decay[:, :, t, None, None], beta[:, :, t, None, None]  # (B, H, 1, 1)
        key = keys[:, :, t, :, None]  # (B, H, K, 1)
        transition = a * (identity - b * key @ key.transpose(-1, -2))  # (B, H, K, K)
        memory = transition @ memory + b * key @ values[:, :, t, None, :]  # (B, H, K, Dv)
        outputs.append(memory.transpose(-1, -2) @ q[:, :, t, :, None])  # (B, H, Dv, 1)
    return torch.cat(outputs, dim=-1).transpose(-1, -2).to(v.dtype)
