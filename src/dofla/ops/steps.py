"""What the one-token steps share: ring slots as tensors, products that fuse when compiled, one token's
rotary turns, and whether a buffer may be written in place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.rotary import rotate_by


def slot_index(slot: int, size: int, device: torch.device) -> Tensor:
    """The ring slot ``slot`` of ``size`` as a 1-element int64 tensor, kept per (size, device) (a Python int
    would specialise the compiled step on it; a new tensor per step is one more allocation)."""
    key = (size, device)
    slots = _SLOTS.get(key)
    if slots is None:
        slots = _SLOTS[key] = torch.arange(size, device=device).split(1)
    return slots[slot]


_SLOTS: dict[tuple[int, torch.device], tuple[Tensor, ...]] = {}


def product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (broadcast batches) as a sum of products: compiled, it becomes loops fused with the
    operators around it, where a small matrix product would be a library call of its own (at decoding's sizes
    the call costs more than the arithmetic)."""
    return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)


def in_place(tensor: Tensor) -> bool:
    """Whether a state's buffer may be updated in place here (as ``dofla.ops.window.step`` updates its rings):
    not one made in inference mode while this is not (under ``torch.compile``, which cannot ask, the
    compiled whole step's buffers, which ``dofla.graph_decode.CapturedDecoder`` makes so)."""
    if torch.compiler.is_compiling():
        return True
    return not (tensor.is_inference() and not torch.is_inference_mode_enabled())


def one_token_turn(turns, dtype: torch.dtype):
    """The cosines and sines (B, 1, 1, r/2) of one token's turn (``dofla.rotary.Turns``) as the compiled
    steps take them: (None, None) for no turns, None where they are not in ``dtype``."""
    if turns is None:
        return None, None
    if turns.cos.dtype != dtype or turns.cos.shape[2] != 1:
        return None
    return turns.cos, turns.sin


def turned(x: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    """x (B, Hk, N, D) turned in the rotary planes by the angles of ``cos``, ``sin`` (B, 1, 1, r/2)
    (``dofla.rotary.rotate_by``: elementwise, fused into the kernel); x itself for None."""
    return x if cos is None else rotate_by(x, cos, sin)


def sinks_turned(ring_keys: Tensor, cos: Tensor | None, sin: Tensor | None, sinks: int) -> Tensor:
    """The ring's keys (B, Hk, S + W, D) with its ``sinks`` sink keys turned by the opposite of the angles of
    ``cos``, ``sin`` (so that a query scores them as its turn would, ``Turns.keys_for_turned_query``); the
    ring's keys for None."""
    if cos is None:
        return ring_keys
    return torch.cat([rotate_by(ring_keys[:, :, :sinks], cos, -sin), ring_keys[:, :, sinks:]], dim=2)
