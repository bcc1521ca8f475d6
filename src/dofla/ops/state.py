"""Recurrent states of linear and hybrid attention, and the one stable-exponent helper all forms share.

Key ``j`` enters with weight ``exp(s_j)`` (its log scale; 0 when the feature map gives none). A state stores
its sums relative to an offset, the largest log scale it has seen, so every stored weight is at most 1:
huge log scales never overflow, and rescaling when the offset grows is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


def exp_relative(log_value: Tensor, log_offset: Tensor) -> Tensor:
    """``exp(log_value - log_offset)`` for ``log_value <= log_offset``; exactly 0 where ``log_value`` is -inf.

    An offset of -inf (nothing seen yet) is treated as 0 so that ``-inf - -inf`` never makes a NaN,
    in the forward or the backward pass.
    """
    finite_offset = torch.where(torch.isfinite(log_offset), log_offset, torch.zeros_like(log_offset))
    return torch.exp(log_value - finite_offset)


@dataclass
class LinearState:
    """Causal linear-attention state per key/value head (float32).

    kv: (B, Hk, F, Dv) = sum_j exp(s_j - log_offset) phi(k_j) v_j^T over the keys seen so far.
    normalizer: (B, Hk, F) = sum_j exp(s_j - log_offset) phi(k_j).
    log_offset: (B, Hk) = max_j s_j over the keys seen (-inf before any key).
    num_tokens: how many keys the state summarises.
    """

    kv: Tensor
    normalizer: Tensor
    log_offset: Tensor
    num_tokens: int = 0

    @classmethod
    def empty(
        cls, batch: int, num_kv_heads: int, feature_dim: int, value_dim: int, device=None, dtype=torch.float32
    ) -> LinearState:
        return cls(
            kv=torch.zeros(batch, num_kv_heads, feature_dim, value_dim, device=device, dtype=dtype),
            normalizer=torch.zeros(batch, num_kv_heads, feature_dim, device=device, dtype=dtype),
            log_offset=torch.full((batch, num_kv_heads), float("-inf"), device=device, dtype=dtype),
        )

    def _map(self, function) -> LinearState:
        return LinearState(
            function(self.kv), function(self.normalizer), function(self.log_offset), self.num_tokens
        )

    def to(self, device) -> LinearState:
        return self._map(lambda tensor: tensor.to(device))

    def detach(self) -> LinearState:
        return self._map(Tensor.detach)

    def index_select(self, batch_indices: Tensor) -> LinearState:
        """Keep (or reorder, or duplicate) batch rows, e.g. the surviving beams."""
        return self._map(lambda tensor: tensor.index_select(0, batch_indices.to(tensor.device)))

    def repeat_interleave(self, repeats: int) -> LinearState:
        """Repeat each batch row ``repeats`` times (B -> B * repeats), e.g. to start beam search."""
        return self._map(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def nbytes(self) -> int:
        return sum(
            tensor.numel() * tensor.element_size() for tensor in (self.kv, self.normalizer, self.log_offset)
        )


@dataclass
class HybridState:
    """Sliding-window hybrid state: the linear state of the keys that left the window plus the last keys.

    linear: LinearState over keys j <= (tokens seen) - 1 - window.
    keys: (B, Hk, L, D) the last L = min(tokens seen, window) keys (after rotary), input dtype.
    values: (B, Hk, L, Dv); key_features: (B, Hk, L, F); key_log_scales: (B, Hk, L) float32 (zeros when
    the feature map gives none).
    window: the window size the state was built with.
    """

    linear: LinearState
    keys: Tensor
    values: Tensor
    key_features: Tensor
    key_log_scales: Tensor
    window: int

    def _map(self, function) -> HybridState:
        buffers = {
            item.name: function(getattr(self, item.name))
            for item in fields(self)
            if item.name not in ("linear", "window")
        }
        return HybridState(linear=self.linear._map(function), window=self.window, **buffers)

    def to(self, device) -> HybridState:
        return self._map(lambda tensor: tensor.to(device))

    def detach(self) -> HybridState:
        return self._map(Tensor.detach)

    def index_select(self, batch_indices: Tensor) -> HybridState:
        return self._map(lambda tensor: tensor.index_select(0, batch_indices.to(tensor.device)))

    def repeat_interleave(self, repeats: int) -> HybridState:
        return self._map(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    @property
    def num_tokens(self) -> int:
        return self.linear.num_tokens + self.keys.shape[2]

    def nbytes(self) -> int:
        buffers = (self.keys, self.values, self.key_features, self.key_log_scales)
        return self.linear.nbytes() + sum(tensor.numel() * tensor.element_size() for tensor in buffers)
