"""Linear attention: naive reference, chunked form, recurrent form and one-token step. The forms take the
call's tensors as one ``LinearInputs``."""

from dofla.ops.inputs import LinearInputs
from dofla.ops.linear.chunked import chunked_linear_attention
from dofla.ops.linear.naive import linear_attention
from dofla.ops.linear.recurrent import recurrent_linear_attention
from dofla.ops.linear.step import linear_decode_step, update_linear_state

__all__ = [
    "LinearInputs",
    "chunked_linear_attention",
    "linear_attention",
    "linear_decode_step",
    "recurrent_linear_attention",
    "update_linear_state",
]
