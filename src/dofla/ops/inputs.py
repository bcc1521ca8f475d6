"""What each op's forms read, as bundles passed whole: the tensors of one call (``DeltaInputs``), so that the
naive, chunked and recurrent forms of an op share one signature and the checks that read it, as the cells'
``dofla.cell_inputs`` bundles do one level up."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class DeltaInputs:
    """One call of the gated delta rule (``dofla.ops.delta``): ``q`` (B, H, T, K), ``k`` (B, Hk, T, K), ``v``
    (B, Hk, T, Dv), ``log_decay`` (B, Hk, T) <= 0, ``beta`` (B, Hk, T) in (0, 1); ``key_mask`` (B, T), True
    for real tokens, or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    log_decay: Tensor
    beta: Tensor
    key_mask: Tensor | None = None
