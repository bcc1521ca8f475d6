"""Sliding-window softmax attention with sinks: naive reference, chunked form, recurrent form and the
one-token step on a ring buffer."""

from dofla.ops.window.chunked import chunked_window_attention
from dofla.ops.window.naive import window_attention
from dofla.ops.window.recurrent import recurrent_window_attention
from dofla.ops.window.step import RingWindow, ring_window, ring_window_step

__all__ = [
    "RingWindow",
    "chunked_window_attention",
    "recurrent_window_attention",
    "ring_window",
    "ring_window_step",
    "window_attention",
]
