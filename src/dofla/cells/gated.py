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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dofla.attention import LinearAttention, state_dtype
from dofla.cell_inputs import AttendInputs, StepInputs
from dofla.cells.registry import register_cell
from dofla.errors import DoflaError
from dofla.ops.state import BatchedState

DEFAULT_DECAY_MEMORY = (128.0, 2048.0)


@dataclass
class GatedState(BatchedState):
    """The inner op's state (LinearState or HybridState) and the cumulative log decay so far, (B, Hs).

    The inner state's key log scales include ``-A_j``; a continuation adds ``log_decay_total`` to its own
    running sums so that offsets agree exactly with a single pass over all tokens.
    """

    inner: BatchedState
    log_decay_total: Tensor

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens


def initial_gate_logits(heads: int, shortest: float, longest: float) -> Tensor:
    """(heads,) logits of alpha with memories 1 / (1 - alpha) geometric from ``shortest`` to ``longest``."""
    if not 1.0 < float(shortest) <= float(longest):
        raise DoflaError(
            f"decay_memory must be (shortest, longest) tokens with 1 < shortest <= longest, got "
            f"({shortest}, {longest})."
        )
    memories = torch.logspace(math.log10(shortest), math.log10(longest), heads, dtype=torch.float64)
    alpha = 1.0 - 1.0 / memories
    return torch.log(alpha / (1.0 - alpha)).float()


class TokenGate(nn.Module):
    """A per-head, per-token gate in (0, 1) from the token's value: sigmoid(v_t . w_h / sqrt(Dv) + b_h).

    w starts at 0, so every token of a head starts with the same gate sigmoid(b_h).
    """

    def __init__(self, heads: int, value_dim: int, initial_logits: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads, value_dim))  # (Hs, Dv)
        self.bias = nn.Parameter(initial_logits.clone().float())  # (Hs,)

    def logits(self, values: Tensor) -> Tensor:
        """values (B, Hs, T, Dv) -> logits (B, Hs, T) in float32 (float64 for float64 values)."""
        dtype = torch.promote_types(values.dtype, torch.float32)
        logits = (values.to(dtype) @ self.weight.to(dtype)[:, :, None]).squeeze(-1)  # (B, Hs, T)
        return logits * values.shape[-1] ** -0.5 + self.bias.to(dtype)[None, :, None]

    def step_logits(self, values: Tensor) -> Tensor:
        """``logits`` of one token in fewer operators (decoding): values (B, Hs, Dv) -> (B, Hs)."""
        return torch.add(self.bias, torch.linalg.vecdot(values, self.weight), alpha=values.shape[-1] ** -0.5)

    def log_gate(self, values: Tensor, key_mask: Tensor | None) -> Tensor:
        """log gate (B, Hs, T) <= 0; padded tokens (``key_mask`` False) get 0 (a gate of 1: no decay)."""
        log_gate = F.logsigmoid(self.logits(values))
        if key_mask is not None:
            log_gate = log_gate * key_mask[:, None, :].to(log_gate.dtype)
        return log_gate


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
        self.decay = TokenGate(heads, value_dim, initial_gate_logits(heads, shortest, longest))

    def log_decay(self, values: Tensor, key_mask: Tensor | None) -> Tensor:
        """values (B, Hs, T, Dv) -> log alpha (B, Hs, T) <= 0; padded tokens do not decay the state."""
        return self.decay.log_gate(values, key_mask)

    def attend(self, form: str, inputs: AttendInputs):
        state, k_log_scale = inputs.state, inputs.k_log_scale
        total = torch.cumsum(self.log_decay(inputs.values, inputs.key_mask), dim=-1)  # (B, Hs, T): A_t
        if state is not None:
            total = total + state.log_decay_total[..., None].to(total.dtype)
        decayed = -total if k_log_scale is None else k_log_scale.to(total.dtype) - total
        inner_inputs = replace(inputs, k_log_scale=decayed, state=None if state is None else state.inner)
        output, inner = super().attend(form, inner_inputs)
        new_state = None if inner is None else GatedState(inner, total[..., -1].clone())
        return output, new_state

    def decode_step(self, step: StepInputs):
        """One token (see ``LinearAttention.decode_step``): the gate's log decay joins the running total
        A_t, and the key enters the inner (linear or hybrid) state with log scale ``s_t - A_t``."""
        state = step.state
        if not isinstance(state, GatedState) or not self._has_decode_step(state.inner):
            return None
        inputs = self.step_features(step, state_dtype(state.inner))
        if inputs is None:
            return None
        features, log_scale, values = inputs
        total = state.log_decay_total + F.logsigmoid(self.decay.step_logits(values))  # (B, Hs): A_t
        decayed = -total if log_scale is None else log_scale[..., -1] - total
        output, inner = self.state_step(step, state.inner, features, values, decayed)
        return output, GatedState(inner, total)

    def parameter_groups(self, base_lr: float) -> list[dict]:
        groups = super().parameter_groups(base_lr)
        groups.append({"params": list(self.decay.parameters()), "lr": float(base_lr), "name": "decay"})
        return groups
