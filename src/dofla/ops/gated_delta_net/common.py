"""What every form of the gated delta net shares: its shape, its state, and the step from convolved inputs
to the delta rule's q, k, v."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.errors import DoflaError
from dofla.ops.inputs import GatedDeltaNetInputs
from dofla.ops.state import BatchedState, DeltaState

L2_EPS = 1e-6  # as transformers' (and fla's) l2norm: x / sqrt(|x|^2 + eps)


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """Heads and head sizes: the projected inputs hold q (Hk * K), k (Hk * K), v (Hv * Dv) channels, in
    that order; Hv is a multiple of Hk (each q/k head serves Hv / Hk consecutive value heads)."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int

    @property
    def channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass
class GatedDeltaNetState(BatchedState):
    """The convolution's last W - 1 projected inputs ``conv`` (B, W - 1, C) (zeros before the first token)
    and the gated delta rule's memory (one K x Dv matrix per value head)."""

    conv: Tensor
    memory: DeltaState

    @property
    def num_tokens(self) -> int:
        return self.memory.num_tokens


def compute_dtype(tensor: Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the gated delta rule's dtype, as in transformers)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def check_inputs(inputs: GatedDeltaNetInputs, shape: GatedDeltaNetShape) -> None:
    """mixed (B, T, C), conv_weight (C, W), log_decay and beta (B, T, Hv)."""
    mixed, conv_weight, log_decay, beta = inputs.mixed, inputs.conv_weight, inputs.log_decay, inputs.beta
    if mixed.dim() != 3 or mixed.shape[-1] != shape.channels:
        raise DoflaError(
            f"the gated delta net expects projected inputs (batch, tokens, {shape.channels}), got "
            f"{tuple(mixed.shape)}."
        )
    if conv_weight.dim() != 2 or conv_weight.shape[0] != shape.channels:
        raise DoflaError(
            f"the convolution weight must be (channels, width) = ({shape.channels}, W), got "
            f"{tuple(conv_weight.shape)}."
        )
    gates = (*mixed.shape[:2], shape.num_v_heads)
    if tuple(log_decay.shape) != gates or tuple(beta.shape) != gates:
        raise DoflaError(
            f"log_decay and beta must be (batch, tokens, value heads) = {gates}, got "
            f"{tuple(log_decay.shape)} and {tuple(beta.shape)}."
        )
    if shape.num_v_heads % shape.num_k_heads:
        raise DoflaError(
            f"{shape.num_v_heads} value heads are not a multiple of {shape.num_k_heads} key heads."
        )


def l2_normalize(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def delta_rule_inputs(convolved: Tensor, shape: GatedDeltaNetShape) -> tuple[Tensor, Tensor, Tensor]:
    """The convolution's output (B, T, C) before its SiLU -> q, k (B, Hv, T, K) and v (B, Hv, T, Dv) in the
    compute dtype: SiLU, split, q and k L2-normalised (q also scaled by K ** -0.5) and repeated over the
    value heads they serve."""
    batch, length, _ = convolved.shape
    activated = F.silu(convolved.to(compute_dtype(convolved)))
    key_width = shape.num_k_heads * shape.head_k_dim
    query, key, value = activated.split([key_width, key_width, shape.num_v_heads * shape.head_v_dim], -1)
    group = shape.num_v_heads // shape.num_k_heads

    def heads(tensor: Tensor, count: int) -> Tensor:
        return tensor.view(batch, length, count, -1).transpose(1, 2)  # (B, heads, T, dim)

    query = l2_normalize(heads(query, shape.num_k_heads)) * shape.head_k_dim**-0.5
    key = l2_normalize(heads(key, shape.num_k_heads))
    if group > 1:
        query, key = query.repeat_interleave(group, dim=1), key.repeat_interleave(group, dim=1)
    return query, key, heads(value, shape.num_v_heads)


def masked_inputs(inputs: GatedDeltaNetInputs) -> tuple[Tensor, Tensor, Tensor]:
    """mixed, log_decay and beta with the absent tokens (``key_mask`` (B, T) False) as zeros: they enter the
    convolution as zeros and leave the memory as it was (no decay, no write)."""
    mixed, log_decay, beta, key_mask = inputs.mixed, inputs.log_decay, inputs.beta, inputs.key_mask
    if key_mask is None:
        return mixed, log_decay, beta
    present = key_mask[:, :, None]
    return mixed * present.to(mixed.dtype), log_decay * present, beta * present


def empty_state(mixed: Tensor, conv_width: int, shape: GatedDeltaNetShape) -> GatedDeltaNetState:
    """The state before the first token: zero inputs and an empty memory, in the compute dtype."""
    dtype = compute_dtype(mixed)
    batch = mixed.shape[0]
    conv = mixed.new_zeros(batch, conv_width - 1, shape.channels, dtype=dtype)
    memory = mixed.new_zeros(batch, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim, dtype=dtype)
    return GatedDeltaNetState(conv, DeltaState(memory, 0))
