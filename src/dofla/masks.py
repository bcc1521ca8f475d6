"""Which keys of a call are real tokens, from the attention mask transformers hands an attention module."""

from __future__ import annotations

import torch
from torch import Tensor


def key_mask_from_attention_mask(attention_mask: Tensor | None, length: int) -> Tensor | None:
    """Which of this call's T keys are real tokens: (B, T) bool, or None when all are.

    attention_mask: transformers' 4-D mask (B, 1, T, S) with this call's keys in the last T columns,
    boolean (True = visible) or additive float (0 = visible). A token always sees itself unless it is
    padding, so the diagonal of the last (T, T) block marks the padded keys (left or right padding).
    Masks of other shapes (or None) mean no padding.
    """
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[-2] != length:
        return None
    if attention_mask.shape[-1] < length:
        return None
    block = attention_mask[:, 0, :, -length:]  # (B, T, T)
    diagonal = torch.diagonal(block, dim1=-2, dim2=-1)  # (B, T)
    if diagonal.dtype != torch.bool:
        diagonal = diagonal > torch.finfo(diagonal.dtype).min / 2
    if bool(diagonal.all()):
        return None
    return diagonal
