"""The gated delta net token by token (decoding a few tokens), a loop of its one-token step."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.gated_delta_net.common import (
    GatedDeltaNetShape,
    GatedDeltaNetState,
    check_inputs,
    empty_state,
    masked_inputs,
)
from dofla.ops.gated_delta_net.step import gated_delta_net_step
from dofla.ops.inputs import GatedDeltaNetInputs


def recurrent_gated_delta_net(
    inputs: GatedDeltaNetInputs, shape: GatedDeltaNetShape, *, state: GatedDeltaNetState | None = None
) -> tuple[Tensor, GatedDeltaNetState]:
    """Inputs as in ``gated_delta_net``; state from an earlier call of any form or None. Returns the read-out
    (B, T, Hv, Dv) in mixed's dtype and the state (float32, float64 for float64 inputs)."""
    check_inputs(inputs, shape)
    mixed, log_decay, beta = masked_inputs(inputs)
    conv_weight = inputs.conv_weight
    current = empty_state(mixed, conv_weight.shape[1], shape) if state is None else state
    outputs = []
    for t in range(mixed.shape[1]):
        out, current = gated_delta_net_step(
            mixed[:, t], conv_weight, log_decay[:, t], beta[:, t], current, shape
        )
        outputs.append(out)
    return torch.stack(outputs, dim=1).to(mixed.dtype), current
