"""Causal attention ops in three forms with identical semantics: linear attention, the sliding-window
hybrid (with optional attention sinks), sliding-window softmax attention, and the gated delta rule.

``naive`` (reference, tests only), ``chunked`` (training and prefill), ``recurrent`` (decoding), and
``decode``: the window and hybrid recurrent forms' one-token steps on ring buffers (generation).
States from the chunked form continue in the recurrent form and back.
"""

from dofla.ops.chunked import chunked_hybrid_attention, chunked_linear_attention, chunked_window_attention
from dofla.ops.delta import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
    update_delta_state,
)
from dofla.ops.naive import hybrid_attention, linear_attention, window_attention
from dofla.ops.recurrent import (
    empty_hybrid_state,
    recurrent_hybrid_attention,
    recurrent_linear_attention,
    recurrent_window_attention,
    update_linear_state,
)
from dofla.ops.state import DeltaState, HybridState, LinearState, WindowState, exp_relative

__all__ = [
    "DeltaState",
    "HybridState",
    "LinearState",
    "WindowState",
    "chunked_gated_delta_rule",
    "chunked_hybrid_attention",
    "chunked_linear_attention",
    "chunked_window_attention",
    "empty_hybrid_state",
    "exp_relative",
    "gated_delta_rule",
    "hybrid_attention",
    "linear_attention",
    "recurrent_gated_delta_rule",
    "recurrent_hybrid_attention",
    "recurrent_linear_attention",
    "recurrent_window_attention",
    "update_delta_state",
    "update_linear_state",
    "window_attention",
]
