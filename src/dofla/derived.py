"""Tensors derived from parameters (folded weights, gates), kept between calls until a parameter changes.

A decoding step's cost is its number of small operators, so a step should not rebuild, token after token,
a tensor that depends only on the parameters. ``DerivedTensor`` keeps one such tensor (or tuple of tensors)
while every parameter it reads has the same storage and version counter (no optimiser step, no load, no
move to another device or dtype since) and autograd does not track them; otherwise it rebuilds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


class DerivedTensor:
    """What ``build()`` returns from ``parameters``, kept between calls (see the module docstring)."""

    def __init__(self) -> None:
        # (extra key, the parameters themselves, their storages and versions, value); holding the
        # parameters keeps a replaced one's storage from being reused by a new tensor that would match
        self._entry: tuple | None = None

    def get(self, parameters: Sequence[Tensor], build: Callable[[], Any], *extra_key) -> Any:
        """``build()``'s value, rebuilt when a parameter changed (another tensor, storage or version), when
        ``extra_key`` (a dtype, say) differs from the kept one's, or when autograd tracks a parameter (then
        the value is not kept), or when a parameter was made in inference mode (it keeps no version counter,
        so the value is not kept either), and under ``torch.compile`` (a compiled step builds it in every call;
        its version counters are not traced)."""
        if torch.compiler.is_compiling():
            return build()
        tracked = torch.is_grad_enabled() and any(parameter.requires_grad for parameter in parameters)
        if any(parameter.is_inference() for parameter in parameters):
            self._entry = None
            return build()
        state = tuple((parameter.data_ptr(), parameter._version) for parameter in parameters)
        entry = self._entry
        if (
            not tracked
            and entry is not None
            and entry[0] == extra_key
            and len(entry[1]) == len(parameters)
            and all(kept is parameter for kept, parameter in zip(entry[1], parameters, strict=True))
            and entry[2] == state
        ):
            return entry[3]
        value = build()
        self._entry = None if tracked else (extra_key, tuple(parameters), state, value)
        return value
