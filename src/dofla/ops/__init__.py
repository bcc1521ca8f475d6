"""Causal linear attention and the sliding-window hybrid in three forms with identical semantics.

``naive`` (quadratic reference, tests only), ``chunked`` (training and prefill), ``recurrent`` (decoding).
States from the chunked form continue in the recurrent form and back.
"""

from dofla.ops.chunked import chunked_hybrid_attention, chunked_linear_attention
from dofla.ops.naive import hybrid_attention, linear_attention
from dofla.ops.recurrent import (
    empty_hybrid_state,
    recurrent_hybrid_attention,
    recurrent_linear_attention,
    update_linear_state,
)
from dofla.ops.state import HybridState, LinearState, exp_relative

__all__ = [
    "HybridState",
    "LinearState",
    "chunked_hybrid_attention",
    "chunked_linear_attention",
    "empty_hybrid_state",
    "exp_relative",
    "hybrid_attention",
    "linear_attention",
    "recurrent_hybrid_attention",
    "recurrent_linear_attention",
    "update_linear_state",
]
