"""The short convolution of a gated-delta layer's memory inputs over a call's tokens (option ``short_conv``):
a causal depthwise convolution, each channel mixed with the same channel of the W - 1 tokens before it."""

from __future__ import annotations

import torch
from torch import Tensor

CONV_BLOCK = 256  # tokens per block of the convolution without autograd: a block's inputs stay in cache


def causal_depthwise_conv(inputs: Tensor, weight: Tensor, length: int) -> Tensor:
    """``sum_i weight[i] * inputs[:, i : i + length]``: inputs (B, W - 1 + T, C), weight (W, C) -> (B, T, C).

    The same multiply-adds in the same order either way, so the two paths agree bit for bit. With autograd
    (training) or off the CPU one pass over all tokens per tap, accumulated in place; on the CPU without it
    (prefill, evaluation) block by block of ``CONV_BLOCK`` tokens, so the W passes over a block read it from
    the CPU's cache instead of memory (several times faster at long prefills). On a GPU the blocks would
    only multiply the kernel launches (W per block)."""
    width = weight.shape[0]
    tracked = torch.is_grad_enabled() and (inputs.requires_grad or weight.requires_grad)
    if tracked or inputs.device.type != "cpu":
        mixed = inputs[:, :length] * weight[0]
        for offset in range(1, width):
            mixed.addcmul_(inputs[:, offset : offset + length], weight[offset])
        return mixed
    mixed = inputs.new_empty(inputs.shape[0], length, inputs.shape[2])
    for start in range(0, length, CONV_BLOCK):
        stop = min(length, start + CONV_BLOCK)
        block = torch.mul(inputs[:, start:stop], weight[0], out=mixed[:, start:stop])
        for offset in range(1, width):
            block.addcmul_(inputs[:, start + offset : stop + offset], weight[offset])
    return mixed
