"""The gated delta net for training and prefill: the convolution in one call, the delta rule chunkwise
(``dofla.ops.delta.chunked_gated_delta_rule``, on fla's kernel where it runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.ops.delta import DeltaInputs, chunked_gated_delta_rule
from dofla.ops.fla_backend import gated_delta_kernel
from dofla.ops.gated_delta_net.common import (
    GatedDeltaNetShape,
    GatedDeltaNetState,
    check_inputs,
    compute_dtype,
    delta_rule_inputs,
    empty_state,
    masked_inputs,
)
from dofla.ops.inputs import GatedDeltaNetInputs


def chunked_gated_delta_net(
    inputs: GatedDeltaNetInputs,
    shape: GatedDeltaNetShape,
    *,
    state: GatedDeltaNetState | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, GatedDeltaNetState]:
    """Inputs as in ``gated_delta_net``; state from an earlier call of any form or None. Returns the read-out
    (B, T, Hv, Dv) in mixed's dtype and the state (float32, float64 for float64 inputs)."""
    check_inputs(inputs, shape)
    mixed, log_decay, beta = masked_inputs(inputs)
    conv_weight, key_mask = inputs.conv_weight, inputs.key_mask
    width, length = conv_weight.shape[1], mixed.shape[1]
    if state is None:
        state = empty_state(mixed, width, shape)
    dtype = compute_dtype(mixed)
    inputs = torch.cat([state.conv.to(dtype), mixed.to(dtype)], dim=1)  # (B, W - 1 + T, C)
    convolved = F.conv1d(
        inputs.transpose(1, 2), conv_weight.to(dtype)[:, None], groups=shape.channels
    ).transpose(1, 2)  # (B, T, C): output t from inputs t .. t + W - 1 of the padded sequence
    query, key, value = delta_rule_inputs(convolved, shape)
    out, memory = chunked_gated_delta_rule(
        DeltaInputs(query, key, value, log_decay.transpose(1, 2), beta.transpose(1, 2).to(dtype), key_mask),
        chunk_size=chunk_size,
        initial_state=state.memory,
        return_state=True,
        kernel=gated_delta_kernel(value, shape.head_k_dim),  # None unless CUDA with fla
    )
    tail = inputs[:, length:].clone()  # a copy: a view would keep the whole input alive in the state
    return out.transpose(1, 2).to(mixed.dtype), GatedDeltaNetState(tail, memory)
