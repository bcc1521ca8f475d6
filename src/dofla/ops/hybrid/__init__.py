"""Hybrid attention (linear sums of the keys that left the window, plus the window's softmax): naive
reference, chunked form, recurrent form and the one-token steps on the ring layout. The forms take the
call's tensors as one ``HybridInputs`` and the options as one ``HybridOptions``."""

from dofla.ops.hybrid.chunked import chunked_hybrid_attention
from dofla.ops.hybrid.naive import hybrid_attention
from dofla.ops.hybrid.recurrent import empty_hybrid_state, recurrent_hybrid_attention
from dofla.ops.hybrid.step import RingHybridState, hybrid_decode_step, ring_hybrid_state
from dofla.ops.inputs import HybridInputs, HybridOptions

__all__ = [
    "HybridInputs",
    "HybridOptions",
    "RingHybridState",
    "chunked_hybrid_attention",
    "empty_hybrid_state",
    "hybrid_attention",
    "hybrid_decode_step",
    "recurrent_hybrid_attention",
    "ring_hybrid_state",
]
