"""Route every attention call of a transformers model through dofla.

transformers' models compute q, k (after rotary) and v themselves and then call the function
registered under ``config._attn_implementation``. dofla registers ``dofla_sdpa`` and ``dofla_eager``:
they run the teacher's own softmax attention (SDPA or the model file's eager function) unless the
attention module carries a replacement under :data:`STUDENT_ATTRIBUTE`, and they let observers see
each call (capture for DoF, teacher-forced distillation). One mechanism serves every family
that uses the attention interface (Llama, Qwen2/3, Mistral, Gemma2/3, GPT-2, GPT-NeoX).
A module may also carry a function under :data:`SOFTMAX_OVERRIDE_ATTRIBUTE` that runs instead of its
softmax (the sliding-window baseline of :mod:`dofla.evaluation.window_baseline`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from dofla.errors import DoflaError

STUDENT_ATTRIBUTE = "dofla_student"
# A callable with teacher_attention's signature, run in place of the teacher's softmax (evaluation baselines).
SOFTMAX_OVERRIDE_ATTRIBUTE = "dofla_softmax_override"
_PREFIX = "dofla_"


@dataclass
class AttentionCall:
    """What one attention module saw and produced in one forward.

    query: (B, H, T, D) after rotary; key, value: (B, Hkv, S, D) (S = T without a cache);
    output: (B, T, H, Dv), the teacher's softmax attention output before the output projection.
    """

    module: torch.nn.Module
    layer_index: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    output: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)


Observer = Callable[[AttentionCall], None]


class _DispatchState:
    def __init__(self) -> None:
        self.observers: list[Observer] = []
        self.teacher_forced = 0


_STATE = _DispatchState()


def _eager_function(module: torch.nn.Module) -> Callable:
    """The eager attention of the module's own modeling file (it knows soft-capping etc.)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise DoflaError(f"{type(module).__name__} has no eager attention function; use --attention sdpa.")
    return function


def teacher_attention(module, query, key, value, attention_mask, *, teacher_kind: str, **kwargs):
    """The teacher's own softmax attention. Returns (output (B, T, H, D), weights or None)."""
    if teacher_kind == "eager":
        return _eager_function(module)(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _make_dispatcher(teacher_kind: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        student = getattr(module, STUDENT_ATTRIBUTE, None)
        if student is not None and not _STATE.teacher_forced:
            positions = {}
            # its memory wraps them (dofla.rotary), or its window sees its sinks from the edge
            reads = ("position_period", "edge_sink_frequencies")
            if any(getattr(student, name, None) is not None for name in reads):
                positions["position_ids"] = kwargs.get("position_ids")
            output, weights = student(query, key, value, attention_mask, scaling=scaling, **positions), None
        else:
            softmax = getattr(module, SOFTMAX_OVERRIDE_ATTRIBUTE, None) or teacher_attention
            output, weights = softmax(
                module,
                query,
                key,
                value,
                attention_mask,
                teacher_kind=teacher_kind,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
        if _STATE.observers:
            call = AttentionCall(
                module=module,
                layer_index=int(getattr(module, "layer_idx", -1)),
                query=query,
                key=key,
                value=value,
                attention_mask=attention_mask,
                scaling=float(scaling),
                output=output,
                extra=dict(kwargs),
            )
            for observer in list(_STATE.observers):
                observer(call)
        return output, weights

    attention.__name__ = f"dofla_{teacher_kind}_attention"
    return attention


for _kind, _mask in (("sdpa", sdpa_mask), ("eager", eager_mask)):
    AttentionInterface.register(_PREFIX + _kind, _make_dispatcher(_kind))
    AttentionMaskInterface.register(_PREFIX + _kind, _mask)


def install(model: torch.nn.Module) -> str:
    """Route ``model``'s attention through dofla (idempotent). Returns the dispatcher's name.

    The teacher keeps its eager attention where it was eager (e.g. Gemma-2 soft-capping);
    everything else runs SDPA.
    """
    config = model.config
    current = config._attn_implementation or "sdpa"
    if current.startswith(_PREFIX):
        return current
    kind = "eager" if current == "eager" else "sdpa"
    name = _PREFIX + kind
    model.set_attn_implementation(name)
    return name


def is_installed(model: torch.nn.Module) -> bool:
    return str(model.config._attn_implementation or "").startswith(_PREFIX)


@contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Call ``observer`` with an :class:`AttentionCall` for every dispatched attention call."""
    _STATE.observers.append(observer)
    try:
        yield
    finally:
        _STATE.observers.remove(observer)


def is_teacher_forced() -> bool:
    """True inside :func:`teacher_forced`: converted layers run the teacher's softmax."""
    return _STATE.teacher_forced > 0


@contextmanager
def teacher_forced() -> Iterator[None]:
    """Within this block converted layers still run the teacher's softmax attention.

    Observers then see the teacher's inputs and outputs for every layer, which is what
    layer-wise distillation trains on (the students run inside the observer).
    """
    _STATE.teacher_forced += 1
    try:
        yield
    finally:
        _STATE.teacher_forced -= 1
