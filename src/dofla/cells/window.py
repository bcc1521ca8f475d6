"""The ``window`` cell: the sliding-window softmax (plus sinks) alone, with no parameters: the teacher's
attention cut to its window, as a student that decodes with a bounded cache. Also the window part that the
``gated_delta`` cell mixes with its memory."""

from __future__ import annotations

import torch

from dofla.attention import LinearAttention
from dofla.cell_inputs import AttendInputs, StepInputs
from dofla.cells.registry import register_cell
from dofla.errors import DoflaError
from dofla.ops import (
    WindowInputs,
    WindowOptions,
    WindowState,
    chunked_window_attention,
    recurrent_window_attention,
    window_attention,
)
from dofla.ops.window.step import RingWindow, ring_window, ring_window_step


def window_part(cell: LinearAttention, form: str, inputs: AttendInputs, state, return_lse: bool = False):
    """The sliding-window softmax (+ sinks, scored by ``inputs.sink_query`` where given) of a call in
    ``form``, continuing the window ``state``: out (B, H, T, Dv) and its WindowState (or None); with
    ``return_lse`` (out, lse (B, H, T), state), lse the log-sum-exp of each query's scores."""
    keys = cell.state_heads_view(inputs.key)  # (B, Hs, T, D)
    window = WindowInputs(inputs.query, keys, inputs.values, inputs.key_mask, inputs.sink_query)
    options = WindowOptions(inputs.scaling, cell.window, cell.sinks, cell.softcap)
    if form == "naive":
        result = window_attention(window, options, return_lse=return_lse)
        return (*result, None) if return_lse else (result, None)
    if form == "recurrent":
        return recurrent_window_attention(window, options, state=state, return_lse=return_lse)
    return chunked_window_attention(
        window,
        options,
        chunk_size=cell.chunk_size_for("window+sinks" if cell.sinks else "window", inputs.query.shape[2]),
        initial_state=state,
        return_state=True,
        return_lse=return_lse,
    )


def takes_window_step(cell: LinearAttention, window, dtype: torch.dtype) -> bool:
    """Whether a layer's window state takes the ring step: no soft-capping, the layer's window and sinks,
    its buffers in ``dtype`` (the step's)."""
    return (
        cell.softcap is None
        and isinstance(window, (WindowState, RingWindow))
        and window.window == cell.window
        and window.sinks == cell.sinks
        and window.keys.dtype == window.values.dtype == dtype
    )


@register_cell("window")
class WindowAttention(LinearAttention):
    """The sliding-window softmax (plus ``sinks`` first tokens) alone: no feature map, no parameters."""

    uses_features = False

    def __init__(self, plan, **shape) -> None:
        if plan.kind != "hybrid":
            raise DoflaError("the window cell needs a window: use kind hybrid with it.")
        super().__init__(plan, **shape)

    def attend(self, form: str, inputs: AttendInputs):
        return window_part(self, form, inputs, inputs.state)

    def decode_step(self, step: StepInputs):
        """One token (see ``LinearAttention.decode_step``): the window's ring step (``dofla.ops.window.step``),
        sinks included, without soft-capping."""
        query, state = step.query, step.state
        exact = query.dtype in (torch.float32, torch.float64)  # the general form computes in these
        if not exact or step.value.dtype != query.dtype or not takes_window_step(self, state, query.dtype):
            return None
        batch, num_heads, _, head_dim = query.shape
        heads = self.state_heads
        ring = state if isinstance(state, RingWindow) else ring_window(state, state.num_tokens)
        output, new_state = ring_window_step(
            ring,
            self.step_queries(query),  # (B, Hs, G, D)
            self.state_heads_view(step.key).view(batch, heads, head_dim),
            self.state_heads_view(step.value).view(batch, heads, -1),
            scaling=step.scaling,
            slot=step.slot,
            **self.step_sinks(query, step.edge),
        )
        return output.view(batch, 1, num_heads, -1), new_state  # (B, 1, H, Dv)
