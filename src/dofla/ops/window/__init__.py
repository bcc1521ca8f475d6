"""Sliding-window softmax attention with sinks: naive reference, chunked form, recurrent form and the
one-token step on a ring buffer. The forms take the call's tensors as one ``WindowInputs`` and the
window's options as one ``WindowOptions``."""

from dofla.ops.inputs import WindowInputs, WindowOptions
from dofla.ops.window.chunked import chunked_window_attention
from dofla.ops.window.naive import window_attention
from dofla.ops.window.recurrent import recurrent_window_attention
from dofla.ops.window.step import RingWindow, ring_window, ring_window_step

__all__ = [
    "RingWindow",
    "WindowInputs",
    "WindowOptions",
    "chunked_window_attention",
    "recurrent_window_attention",
    "ring_window",
    "ring_window_step",
    "window_attention",
]
