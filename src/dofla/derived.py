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
        self._entry: tuple | None = None  # (key, value)

    def get(self, parameters: Sequence[Tensor], build: Callable[[], Any], *extra_key) -> Any:
        """``build()``'s value, rebuilt when a parameter changed, when ``extra_key`` (a dtype, say) differs
        from the kept one's, or when autograd tracks a parameter (then the value is not kept)."""
        tracked = torch.is_grad_enabled() and any(parameter.requires_grad for parameter in parameters)
        key = (*extra_key, *((parameter.data_ptr(), parameter._version) for parameter in parameters))
        if not tracked and self._entry is not None and self._entry[0] == key:
            return self._entry[1]
        value = build()
        self._entry = None if tracked else (key, value)
        return value
