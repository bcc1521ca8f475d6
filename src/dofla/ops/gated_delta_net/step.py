"""One token of the gated delta net: the decoding step the recurrent form loops over."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.delta import update_delta_state
from dofla.ops.gated_delta_net.common import GatedDeltaNetShape, GatedDeltaNetState, delta_rule_inputs


def gated_delta_net_step(
    mixed: Tensor,
    conv_weight: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    state: GatedDeltaNetState,
    shape: GatedDeltaNetShape,
) -> tuple[Tensor, GatedDeltaNetState]:
    """mixed (B, C) one token's projected q, k, v; conv_weight (C, W); log_decay and beta (B, Hv); the state
    so far -> the read-out (B, Hv, Dv) in the state's dtype and the new state."""
    dtype = state.conv.dtype
    recent = torch.cat([state.conv, mixed.to(dtype)[:, None]], dim=1)  # (B, W, C): this token last
    convolved = torch.linalg.vecdot(recent, conv_weight.to(dtype).T, dim=1)  # (B, C)
    query, key, value = delta_rule_inputs(convolved[:, None], shape)  # (B, Hv, 1, K) etc.
    memory = update_delta_state(
        state.memory, key[:, :, 0], value[:, :, 0], log_decay.to(dtype).exp(), beta.to(dtype)
    )
    out = (query @ memory.kv).squeeze(2)  # (B, Hv, Dv)
    return out, GatedDeltaNetState(recent[:, 1:].clone(), memory)  # the tail owns its W - 1 rows
