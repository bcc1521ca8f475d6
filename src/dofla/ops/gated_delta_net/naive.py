"""The reference: the convolution written as its sum per token and the delta rule's literal token loop
(``dofla.ops.delta.gated_delta_rule``). Tests only."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops.delta import DeltaInputs, gated_delta_rule
from dofla.ops.gated_delta_net.common import (
    GatedDeltaNetShape,
    check_inputs,
    compute_dtype,
    delta_rule_inputs,
    masked_inputs,
)
from dofla.ops.inputs import GatedDeltaNetInputs


def gated_delta_net(inputs: GatedDeltaNetInputs, shape: GatedDeltaNetShape) -> Tensor:
    """inputs: the call's tensors (shapes in ``GatedDeltaNetInputs``). Returns the read-out (B, T, Hv, Dv) in
    mixed's dtype."""
    check_inputs(inputs, shape)
    mixed, log_decay, beta = masked_inputs(inputs)
    conv_weight, key_mask = inputs.conv_weight, inputs.key_mask
    dtype = compute_dtype(mixed)
    width, length = conv_weight.shape[1], mixed.shape[1]
    inputs, weight = mixed.to(dtype), conv_weight.to(dtype)
    # token t sees inputs t - W + 1 .. t, tap i weighting input t - W + 1 + i (zeros before the first)
    convolved = []
    for t in range(length):
        total = torch.zeros_like(inputs[:, 0])
        for tap in range(width):
            source = t - width + 1 + tap
            if source >= 0:
                total = total + weight[:, tap] * inputs[:, source]
        convolved.append(total)
    query, key, value = delta_rule_inputs(torch.stack(convolved, dim=1), shape)
    out = gated_delta_rule(
        DeltaInputs(query, key, value, log_decay.transpose(1, 2), beta.transpose(1, 2).to(dtype), key_mask)
    )
    return out.transpose(1, 2).to(mixed.dtype)  # (B, T, Hv, Dv)
