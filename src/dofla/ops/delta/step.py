"""The gated delta rule's one-token step as a gated-delta cell runs it (generation, and the frozen decoding
steps of ``dofla.graph_decode``): the short convolution, the L2 normalisation, the two gates, the update, the
read and the output gate, from a small bundle of the layer's weights."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dofla.ops.delta.recurrent import update_delta_state
from dofla.ops.state import DeltaState


class DeltaStepWeights(NamedTuple):
    """A gated-delta layer's weights as its one-token step takes them, in the step's dtype.

    gates (Hs, Dv, 2): the decay and write gates' weights, scaled by Dv ** -0.5; gate_bias (Hs, 1, 2);
    conv (W, C): the short convolution over the features and values (C channels: each state head's G query
    features and its key's, flattened, then the values), or None; output_gate (Hs, G, Dv, Dv) (scaled by
    Dv ** -0.5) and output_gate_bias (Hs, G, 1, Dv), or None.
    """

    gates: Tensor
    gate_bias: Tensor
    conv: Tensor | None = None
    output_gate: Tensor | None = None
    output_gate_bias: Tensor | None = None


def output_gated(read: Tensor, values: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The memory's read-out (B, Hs, G, T, Dv) scaled by the output gate from the tokens' values (B, Hs, T, Dv):
    ``2 sigmoid(v W + b)`` per query head and channel; weight (Hs, G, Dv, Dv) already scaled, bias
    (Hs, G, 1, Dv)."""
    logits = torch.einsum("bstd,sgde->bsgte", values, weight)
    return read * (2 * torch.sigmoid(logits + bias))


def gated_delta_step(
    weights: DeltaStepWeights, features: Tensor, values: Tensor, memory: DeltaState, tail: Tensor | None
) -> tuple[Tensor, DeltaState, Tensor | None]:
    """One token: features (B, Hs, G + 1, K) (each state head's G queries, then its key, before the
    convolution and normalisation), values (B, Hs, Dv), the memory before it and the convolution's last
    W - 1 inputs ``tail`` (B, W - 1, C) (None without a convolution) -> the read-out (B, Hs, G, Dv), the
    memory after the token and the new tail. The gates read the token's own value; the memory stores the
    convolved one."""
    written = values
    if weights.conv is not None:  # this token's inputs after the last W - 1
        present = torch.cat([features.flatten(1), values.flatten(1)], dim=1)  # (B, C)
        recent = torch.cat([tail, present[:, None]], dim=1)  # (B, W, C)
        mixed = torch.linalg.vecdot(recent, weights.conv, dim=1)  # (B, C)
        grouped, written = mixed.split([features[0].numel(), values[0].numel()], dim=-1)
        # the new tail owns its W - 1 rows (a slice of ``recent`` would keep all W alive in the cache)
        features, written, tail = grouped.view_as(features), written.view_as(values), recent[:, 1:].clone()
    norms = torch.linalg.vector_norm(features, dim=-1, keepdim=True).clamp_min(1e-12)  # as F.normalize
    features = features / norms  # (B, Hs, G + 1, K)
    dtype = weights.gates.dtype
    gates = torch.sigmoid(torch.baddbmm(weights.gate_bias, values.to(dtype).transpose(0, 1), weights.gates))
    decay, beta = gates[..., 0].T, gates[..., 1].T  # (B, Hs) each
    memory = update_delta_state(memory, features[:, :, -1], written, decay, beta)
    queries = features[:, :, :-1]  # (B, Hs, G, K)
    read = torch.bmm(queries.flatten(0, 1), memory.kv.flatten(0, 1)).view(*queries.shape[:3], -1)
    if weights.output_gate is not None:  # (B, Hs, G, Dv), one token
        gated = output_gated(
            read[:, :, :, None], values[:, :, None], weights.output_gate, weights.output_gate_bias
        )
        read = gated.squeeze(3)
    return read, memory, tail
