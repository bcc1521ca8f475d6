"""What a student cell's forms and its one-token step read, each as one bundle: ``AttendInputs`` (a call's
inputs to ``LinearAttention.attend``) and ``StepInputs`` (one decoded token's, to ``decode_step``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from dofla.rotary import Turns


@dataclass
class AttendInputs:
    """One call of a cell as its forms read it: the teacher's ``query`` (B, H, T, D) and ``key`` (B, Hkv, T, D);
    the feature map's ``q_features`` (B, H, T, F), ``k_features`` (B, Hs, T, F) and ``k_log_scale`` (B, Hs, T)
    or None (all None for a cell without features); ``values`` (B, Hs, T, Dv); ``key_mask`` (B, T), True for
    real tokens, or None; ``scaling`` the window softmax's logit scale; ``state`` the cell's state before the
    call (None at the start); ``sink_query`` (B, H, T, D) the queries that score the window's sinks (None: the
    queries)."""

    query: Tensor
    key: Tensor
    q_features: Tensor | None
    k_features: Tensor | None
    values: Tensor
    k_log_scale: Tensor | None
    key_mask: Tensor | None
    scaling: float
    state: object = None
    sink_query: Tensor | None = None


@dataclass
class StepInputs:
    """One new token with a state and no padding (a decoding step): ``query`` (B, H, 1, D), ``key`` and
    ``value`` (B, Hkv, 1, D); ``state`` the cell's state; ``scaling`` the window softmax's logit scale;
    ``memory_qk`` the query and key the memory's features read where they differ from the window's (a
    position period, ``dofla.rotary``), else None; ``edge`` the turn of the query that scores the sinks
    (``edge_sink_turns``; None: the sinks at their true positions); ``slot`` a frozen window's next slot
    (``dofla.ops.window.step.write_key``; None: the ring's own count)."""

    query: Tensor
    key: Tensor
    value: Tensor
    state: object
    scaling: float
    memory_qk: tuple[Tensor, Tensor] | None = None
    edge: Turns | None = None
    slot: Tensor | None = None

    @property
    def feature_qk(self) -> tuple[Tensor, Tensor]:
        """The query and key the feature map reads."""
        return self.memory_qk or (self.query, self.key)
