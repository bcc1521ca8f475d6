"""Recurrent states of every op (linear, hybrid, window, gated delta) and the one stable-exponent helper.

Key ``j`` enters with weight ``exp(s_j)`` (its log scale; 0 when the feature map gives none). A state stores
its sums relative to an offset, the largest log scale it has seen, so every stored weight is at most 1:
huge log scales never overflow, and rescaling when the offset grows is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self

import torch
from torch import Tensor


def exp_relative(log_value: Tensor, log_offset: Tensor) -> Tensor:
    """``exp(log_value - log_offset)`` for ``log_value <= log_offset``; exactly 0 where ``log_value`` is -inf.

    An offset of -inf (nothing seen yet) is treated as 0 so that ``-inf - -inf`` never makes a NaN,
    in the forward or the backward pass.
    """
    # Clamping -inf to the lowest finite number keeps -inf - offset = -inf (so exp gives 0) and passes no
    # gradient to a clamped offset: the same as replacing it by 0, in 3 operators instead of 5 (decode is
    # bound by the number of small operators).
    return torch.exp(log_value - log_offset.clamp_min(torch.finfo(log_offset.dtype).min))


def log_sum_exp(denominator: Tensor, maximum: Tensor) -> Tensor:
    """A softmax's log-sum-exp from its sum of ``exp(score - maximum)``: ``log(denominator) + maximum``, -inf
    where the sum is 0 (no key seen), with no NaN in the backward pass there."""
    seen = denominator > 0
    safe = torch.where(seen, denominator, torch.ones_like(denominator))
    return torch.where(seen, torch.log(safe) + maximum, torch.full_like(safe, float("-inf")))


class BatchedState:
    """Helpers shared by every state dataclass: each tensor field (or nested state) has the batch first."""

    def map_tensors(self, function) -> Self:
        """The same state with ``function`` applied to every tensor (ints such as ``window`` kept)."""
        updated = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Tensor):
                value = function(value)
            elif isinstance(value, BatchedState):
                value = value.map_tensors(function)
            updated[item.name] = value
        return type(self)(**updated)

    def tensors(self) -> list[Tensor]:
        """Every tensor of the state, nested states' included, in field order."""
        found = []
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Tensor):
                found.append(value)
            elif isinstance(value, BatchedState):
                found.extend(value.tensors())
        return found

    def to(self, device) -> Self:
        return self.map_tensors(lambda tensor: tensor.to(device))

    def detach(self) -> Self:
        return self.map_tensors(Tensor.detach)

    def index_select(self, batch_indices: Tensor) -> Self:
        """Keep (or reorder, or duplicate) batch rows, e.g. the surviving beams."""
        return self.map_tensors(lambda tensor: tensor.index_select(0, batch_indices.to(tensor.device)))

    def repeat_interleave(self, repeats: int) -> Self:
        """Repeat each batch row ``repeats`` times (B -> B * repeats), e.g. to start beam search."""
        return self.map_tensors(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors())

    def general_layout(self) -> Self:
        """This state as every form reads it: the ring buffers of decoding steps (``dofla.ops.window.step``), which
        override this, put back in order (copies); a state without nested states is returned as it is."""
        nested = {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if isinstance(getattr(self, item.name), BatchedState)
        }
        if not nested:
            return self
        updated = {item.name: getattr(self, item.name) for item in fields(self)}
        updated.update({name: state.general_layout() for name, state in nested.items()})
        return type(self)(**updated)


@dataclass
class LinearState(BatchedState):
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


@dataclass
class WindowState(BatchedState):
    """Sliding-window softmax state: the last ``window`` keys and the attention-sink keys.

    keys: (B, Hk, L, D) the last L = min(tokens seen, window) keys (after rotary), input dtype.
    values: (B, Hk, L, Dv), input dtype.
    key_present: (B, Hk, L) bool, False for absent (padding) keys and for sinks (which the sink buffers hold).
    sink_keys: (B, Hk, S, D), sink_values: (B, Hk, S, Dv): S = ``sinks`` slots, input dtype; slot s holds
    the s-th present key of the sequence once it has been seen (zeros before).
    sink_count: (B, Hk) int64, how many sink slots are filled (< S only while fewer present keys were seen).
    window: the window size; num_tokens: how many tokens (present or not) the state has seen.
    """

    keys: Tensor
    values: Tensor
    key_present: Tensor
    sink_keys: Tensor
    sink_values: Tensor
    sink_count: Tensor
    window: int
    num_tokens: int = 0

    @property
    def sinks(self) -> int:
        return self.sink_keys.shape[2]

    @classmethod
    def empty(
        cls,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        value_dim: int,
        window: int,
        sinks: int = 0,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
    ) -> WindowState:
        """A state that has seen nothing; key and value buffers in ``dtype``."""

        def zeros(length: int, *shape, kind=dtype) -> Tensor:
            return torch.zeros(batch, num_kv_heads, length, *shape, device=device, dtype=kind)

        return cls(
            keys=zeros(0, head_dim),
            values=zeros(0, value_dim),
            key_present=zeros(0, kind=torch.bool),
            sink_keys=zeros(int(sinks), head_dim),
            sink_values=zeros(int(sinks), value_dim),
            sink_count=torch.zeros(batch, num_kv_heads, device=device, dtype=torch.long),
            window=int(window),
        )

    @classmethod
    def empty_like(cls, key: Tensor, value: Tensor, window: int, sinks: int = 0) -> WindowState:
        """A state that has seen nothing, with buffers in the dtypes and device of key (B, Hk, T, D) and
        value (B, Hk, T, Dv)."""
        batch, num_kv_heads = key.shape[:2]
        return cls(
            keys=key[:, :, :0],
            values=value[:, :, :0],
            key_present=torch.ones(batch, num_kv_heads, 0, dtype=torch.bool, device=key.device),
            sink_keys=key.new_zeros(batch, num_kv_heads, int(sinks), key.shape[-1]),
            sink_values=value.new_zeros(batch, num_kv_heads, int(sinks), value.shape[-1]),
            sink_count=torch.zeros(batch, num_kv_heads, dtype=torch.long, device=key.device),
            window=int(window),
        )


@dataclass
class HybridState(BatchedState):
    """Sliding-window hybrid state: the linear state of the keys that left the window plus the last keys.

    linear: LinearState over keys j <= (tokens seen) - 1 - window that are not sinks.
    keys: (B, Hk, L, D) the last L = min(tokens seen, window) keys (after rotary), input dtype.
    values: (B, Hk, L, Dv); key_features: (B, Hk, L, F); key_log_scales: (B, Hk, L) float32 (zeros when
    the feature map gives none; -inf for absent keys and for sinks, so neither reaches the linear state).
    sink_keys, sink_values, sink_count: the attention-sink buffers, as in ``WindowState`` (S = 0 slots
    without sinks).
    window: the window size the state was built with.
    """

    linear: LinearState
    keys: Tensor
    values: Tensor
    key_features: Tensor
    key_log_scales: Tensor
    sink_keys: Tensor
    sink_values: Tensor
    sink_count: Tensor
    window: int

    @property
    def num_tokens(self) -> int:
        return self.linear.num_tokens + self.keys.shape[2]

    @property
    def sinks(self) -> int:
        return self.sink_keys.shape[2]

    def window_state(self) -> WindowState:
        """The softmax part of this state as a ``WindowState`` (shares the tensors)."""
        return WindowState(
            keys=self.keys,
            values=self.values,
            key_present=~torch.isneginf(self.key_log_scales),
            sink_keys=self.sink_keys,
            sink_values=self.sink_values,
            sink_count=self.sink_count,
            window=self.window,
            num_tokens=self.num_tokens,
        )


@dataclass
class DeltaState(BatchedState):
    """Gated delta rule state per key/value head.

    kv: (B, Hk, K, Dv) the fast-weight memory S (float32, float64 for float64 inputs); out_t = S_t^T q_t.
    num_tokens: how many tokens (present or not) the state has seen.
    """

    kv: Tensor
    num_tokens: int = 0

    @classmethod
    def empty(
        cls, batch: int, num_kv_heads: int, key_dim: int, value_dim: int, device=None, dtype=torch.float32
    ) -> DeltaState:
        return cls(torch.zeros(batch, num_kv_heads, key_dim, value_dim, device=device, dtype=dtype))
