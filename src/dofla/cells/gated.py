"""Gated linear attention (``gla``): linear attention that forgets, one data-dependent decay per head and token.

Key j's linear weight at query i is multiplied by ``prod_{t=j+1..i} alpha_t`` with
``alpha_t = sigmoid(v_t . w_h / sqrt(Dv) + b_h)`` in (0, 1), computed from the token's value (values carry
no rotary position, keys do). The attention stays normalised, so the query's own factor ``exp(A_i)`` (A the
cumulative log decay) cancels and the decay is exactly a key log scale ``-A_j``: the linear and hybrid ops of
:mod:`dofla.ops` run unchanged in all three forms, and their running-maximum offsets keep every exponent
<= 0 however long the sequence. The summed mass of old keys is thus bounded by about ``1 / (1 - alpha)``
instead of growing with the number of tokens, which is what lets a student trained at one length hold at
longer ones. In hybrid layers the decay acts on the keys that left the window, relative to the newest of
them (the hybrid's linear offset), so the window's own weights are untouched.

Initialisation starts close to "remember": ``w = 0`` and the biases give the heads memories
``1 / (1 - alpha)`` spread geometrically over ``decay_memory`` = (shortest, longest) tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dofla.attention import LinearAttention
from dofla.cells.registry import register_cell
from dofla.errors import DoflaError

DEFAULT_DECAY_MEMORY = (128.0, 2048.0)


@dataclass
class GatedState:
    """The inner op's state (LinearState or HybridState) and the cumulative log decay so far, (B, Hs).

    The inner state's key log scales include ``-A_j``; a continuation adds ``log_decay_total`` to its own
    running sums so that offsets agree exactly with a single pass over all tokens.
    """

    inner: Any
    log_decay_total: Tensor

    def _map(self, function) -> GatedState:
        return GatedState(self.inner._map(function), function(self.log_decay_total))

    def to(self, device) -> GatedState:
        return self._map(lambda tensor: tensor.to(device))

    def detach(self) -> GatedState:
        return self._map(Tensor.detach)

    def index_select(self, batch_indices: Tensor) -> GatedState:
        return self._map(lambda tensor: tensor.index_select(0, batch_indices.to(tensor.device)))

    def repeat_interleave(self, repeats: int) -> GatedState:
        return self._map(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def nbytes(self) -> int:
        total = self.log_decay_total
        return self.inner.nbytes() + total.numel() * total.element_size()


def initial_decay_logits(heads: int, shortest: float, longest: float) -> Tensor:
    """(heads,) logits of alpha with memories 1 / (1 - alpha) geometric from ``shortest`` to ``longest``."""
    if not 1.0 < float(shortest) <= float(longest):
        raise DoflaError(
            f"decay_memory must be (shortest, longest) tokens with 1 < shortest <= longest, got "
            f"({shortest}, {longest})."
        )
    memories = torch.logspace(math.log10(shortest), math.log10(longest), heads, dtype=torch.float64)
    alpha = 1.0 - 1.0 / memories
    return torch.log(alpha / (1.0 - alpha)).float()


@register_cell("gla")
class GatedLinearAttention(LinearAttention):
    """Linear or hybrid attention with a learned, data-dependent decay per state head (see module docstring).

    Option ``decay_memory`` (shortest, longest) in tokens: the heads' initial memories (default 128, 2048).
    """

    CELL_OPTIONS = ("decay_memory",)

    def __init__(self, plan, **shape) -> None:
        super().__init__(plan, **shape)
        shortest, longest = self.cell_options.get("decay_memory", DEFAULT_DECAY_MEMORY)
        heads, value_dim = self.state_heads, self.head_dim
        self.decay_weight = nn.Parameter(torch.zeros(heads, value_dim))  # (Hs, Dv)
        self.decay_bias = nn.Parameter(initial_decay_logits(heads, shortest, longest))  # (Hs,)

    def log_decay(self, values: Tensor, key_mask: Tensor | None) -> Tensor:
        """values (B, Hs, T, Dv) -> log alpha (B, Hs, T) <= 0, in float32 (float64 for float64 values).

        Padded tokens (``key_mask`` False) do not decay the state: their log alpha is 0.
        """
        dtype = torch.promote_types(values.dtype, torch.float32)
        logits = torch.einsum("bhtd,hd->bht", values.to(dtype), self.decay_weight.to(dtype))
        logits = logits * values.shape[-1] ** -0.5 + self.decay_bias.to(dtype)[None, :, None]
        log_alpha = F.logsigmoid(logits)
        if key_mask is not None:
            log_alpha = log_alpha * key_mask[:, None, :].to(dtype)
        return log_alpha

    def _attend(
        self, form, query, key, q_features, k_features, values, k_log_scale, key_mask, scaling, state
    ):
        total = torch.cumsum(self.log_decay(values, key_mask), dim=-1)  # (B, Hs, T): A_t
        if state is not None:
            total = total + state.log_decay_total[..., None].to(total.dtype)
        decayed = -total if k_log_scale is None else k_log_scale.to(total.dtype) - total
        output, inner = super()._attend(
            form,
            query,
            key,
            q_features,
            k_features,
            values,
            decayed,
            key_mask,
            scaling,
            None if state is None else state.inner,
        )
        new_state = None if inner is None else GatedState(inner, total[..., -1])
        return output, new_state

    def parameter_groups(self, base_lr: float) -> list[dict]:
        groups = super().parameter_groups(base_lr)
        groups.append({"params": [self.decay_weight, self.decay_bias], "lr": float(base_lr), "name": "decay"})
        return groups
