"""Decoding steps on ring buffers: one token of the window and hybrid ops in the fewest small operators.

A decoding step's cost at batch 1 is its number of small operators, not its arithmetic. The general states
(``WindowState``, ``HybridState``) keep the window's keys in order and grow or shift them with a copy per
token; the decoding layout here keeps them in a fixed buffer of ``sinks + window`` slots instead: the sinks
first, then the window as a ring where token t lives in slot ``sinks + t % window``. The softmax over the
slots does not depend on their order, so a step writes the new key over the oldest one in place and reads
every slot at once, hidden slots (empty, absent keys, sinks still held in the window) masked by an additive
score bias of -inf.

A step converts a general state on its first call (``ring_window``, ``ring_hybrid_state``); the general forms
read a ring state back through ``BatchedState.general_layout`` (the cells call it before any other form).
Ring buffers are updated in place when autograd is off (generation), so a ring state is consumed by the step
it is given to: keep ``state.general_layout()`` (a copy) to reuse one. With autograd on, a step copies the
buffers first, so its gradients are those of the general recurrent form.

"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.errors import DoflaError
from dofla.ops.state import BatchedState, WindowState
from dofla.ops.window.chunked import takes_fused_lse

NEGATIVE_INFINITY = float("-inf")


def ring_slots(ordered: Tensor, tokens: int, window: int, fill: float) -> Tensor:
    """(B, Hk, L, ...) the last L = min(tokens, window) entries in order -> (B, Hk, window, ...) with token t's
    entry in slot t % window and ``fill`` in the empty slots."""
    length = ordered.shape[2]
    padding = ordered.new_full((*ordered.shape[:2], window - length, *ordered.shape[3:]), fill)
    return torch.cat([ordered, padding], dim=2).roll((tokens - length) % window, dims=2)


def ordered_slots(slots: Tensor, tokens: int, window: int) -> Tensor:
    """The inverse of ``ring_slots``: (B, Hk, window, ...) -> (B, Hk, L, ...) oldest first (a copy)."""
    length = min(tokens, window)
    return slots.roll(-((tokens - length) % window), dims=2)[:, :, :length].clone()


def visible_bias(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """visible (B, Hk, L) bool -> additive score bias (B, Hk, 1, L): 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, NEGATIVE_INFINITY
    )[:, :, None]


@dataclass
class RingWindow(BatchedState):
    """The sliding window and sinks in the decoding layout (see the module docstring).

    keys: (B, Hk, S + W, D), values: (B, Hk, S + W, Dv') with Dv' >= value_dim (the hybrid keeps a column
    of ones after the values, whose softmax-weighted sum is the softmax's denominator); sink slots first.
    bias: (B, Hk, 1, S + W) 0 for the keys the next query sees, -inf for hidden slots.
    sink_count: (B, Hk) int64 filled sink slots; sinks_full: whether every row's are (no sink bookkeeping).
    window: W; value_dim: Dv; num_tokens: tokens seen (present or not), so the next goes to slot
    S + num_tokens % W; hidden_until: a window slot may be hidden only while num_tokens is below it (a
    step's present key unhides its slot until then; afterwards every slot already holds one).
    """

    keys: Tensor
    values: Tensor
    bias: Tensor
    sink_count: Tensor
    window: int
    value_dim: int
    num_tokens: int
    sinks_full: bool
    hidden_until: int

    @property
    def sinks(self) -> int:
        return self.keys.shape[2] - self.window

    @property
    def next_slot(self) -> int:
        return self.sinks + self.num_tokens % self.window

    def general_layout(self) -> WindowState:
        """The ``WindowState`` this ring holds (copies)."""
        sinks, tokens, window = self.sinks, self.num_tokens, self.window
        present = ordered_slots(self.bias[:, :, 0, sinks:] == 0, tokens, window)  # (B, Hk, L)
        return WindowState(
            keys=ordered_slots(self.keys[:, :, sinks:], tokens, window),
            values=ordered_slots(self.values[:, :, sinks:, : self.value_dim], tokens, window),
            key_present=present,
            sink_keys=self.keys[:, :, :sinks].clone(),
            sink_values=self.values[:, :, :sinks, : self.value_dim].clone(),
            sink_count=self.sink_count.clone(),
            window=window,
            num_tokens=tokens,
        )


def ring_window(state: WindowState, tokens: int, *, ones_column: bool = False) -> RingWindow:
    """A general window state that has seen ``tokens`` tokens in the decoding layout (new buffers, in the
    state's key dtype); ``ones_column`` appends the column of ones to the values (the hybrid's)."""
    window, sinks = state.window, state.sinks
    dtype = state.keys.dtype
    filled = torch.arange(sinks, device=state.keys.device) < state.sink_count[..., None]  # (B, Hk, S)
    window_bias = ring_slots(
        visible_bias(state.key_present, dtype)[:, :, 0], tokens, window, NEGATIVE_INFINITY
    )
    values = torch.cat([state.sink_values, ring_slots(state.values, tokens, window, 0.0)], dim=2)
    if ones_column:  # in every slot, empty ones included: a key written there later keeps it
        values = F.pad(values, (0, 1), value=1.0)
    return RingWindow(
        keys=torch.cat([state.sink_keys, ring_slots(state.keys, tokens, window, 0.0)], dim=2),
        values=values,
        bias=torch.cat([visible_bias(filled, dtype)[:, :, 0], window_bias], dim=2)[:, :, None],
        sink_count=state.sink_count.clone(),
        window=window,
        value_dim=state.values.shape[-1],
        num_tokens=int(tokens),
        sinks_full=bool((state.sink_count >= sinks).all()),
        # empty slots, absent keys, sinks: all rewritten by then (none to rewrite where every slot shows)
        hidden_until=int(tokens) + (0 if bool((window_bias == 0).all()) else window),
    )


def owned_state(state: BatchedState, buffer: Tensor) -> BatchedState:
    """The state a step may update in place: itself without autograd (generation), else a copy (with
    autograd, or when its buffers, ``buffer`` one of them, were made in inference mode and this is not)."""
    return state.map_tensors(torch.clone) if torch.is_grad_enabled() or not in_place(buffer) else state


def write_key(ring: RingWindow, key: Tensor, value: Tensor, slot: Tensor | None = None) -> Tensor | None:
    """Put one present key, key (B, Hk, D) and value (B, Hk, Dv), in the ring's next slot, in place, and
    into the free sink slot while there is one. Returns is_sink (B, Hk) while sinks are still filling,
    else None. Does not advance ``num_tokens`` (the caller does, once everything is written).
    ``slot``: the next slot as a (1,) int64 tensor for a ring in its steady state whose token count is
    frozen (``steady_ring``; see ``advance_slot``), else None (the slot from the count)."""
    if slot is not None:
        ring.keys.index_copy_(2, slot, key[:, :, None])
        ring.values[..., : ring.value_dim].index_copy_(2, slot, value[:, :, None])
        return None
    slot = ring.next_slot
    ring.keys[:, :, slot] = key
    ring.values[:, :, slot, : ring.value_dim] = value
    if ring.sinks_full:
        if ring.num_tokens < ring.hidden_until:  # the slot may have held a hidden key
            ring.bias[:, :, 0, slot] = 0.0
        return None
    sinks, count = ring.sinks, ring.sink_count
    fills = torch.arange(sinks, device=count.device) == count[..., None]  # (B, Hk, S): the slot it fills
    sink_keys, sink_values = ring.keys[:, :, :sinks], ring.values[:, :, :sinks, : ring.value_dim]
    sink_keys.copy_(torch.where(fills[..., None], key[:, :, None], sink_keys))
    sink_values.copy_(torch.where(fills[..., None], value[:, :, None], sink_values))
    ring.bias[:, :, 0, :sinks].masked_fill_(fills, 0.0)
    is_sink = count < sinks  # (B, Hk): a sink is hidden in the window (the sink slot shows it)
    ring.bias[:, :, 0, slot] = torch.zeros_like(ring.bias[:, :, 0, slot]).masked_fill(
        is_sink, NEGATIVE_INFINITY
    )
    ring.sink_count = count + is_sink
    ring.hidden_until = ring.num_tokens + ring.window + 1  # token num_tokens + W rewrites this slot
    ring.sinks_full = bool((ring.sink_count >= sinks).all())
    return is_sink


def sink_seen_keys(ring: RingWindow, sink_key_turn=None) -> Tensor:
    """The ring's keys (B, Hk, S + W, D) as the queries score them: its sink slots passed through
    ``sink_key_turn`` (a function of the sink keys (B, Hk, S, D), e.g. ``Turns.keys_for_turned_query`` for
    sinks seen from the window's edge) where given (a copy), else the ring's own buffer."""
    sinks = ring.sinks
    if sink_key_turn is None or not sinks:
        return ring.keys
    return torch.cat([sink_key_turn(ring.keys[:, :, :sinks]), ring.keys[:, :, sinks:]], dim=2)


def window_scores(
    ring: RingWindow,
    queries: Tensor,
    scaling: float,
    sink_queries: Tensor | None = None,
    keys: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """queries (B, Hk, G, D) -> scaling * q.k + bias (B * Hk, G, S + W) over every slot, in one operator;
    with ``sink_queries`` (B, Hk, G, D) the sink slots' scores from those (one more, and a copy). ``keys``
    and ``bias``: the slots' keys and score bias (default the ring's, see ``sink_seen_keys``), which may go
    on past the ring's slots."""
    keys = (ring.keys if keys is None else keys).flatten(0, 1)  # (B * Hk, S + W, D)
    bias = (ring.bias if bias is None else bias).flatten(0, 1)  # (B * Hk, 1, S + W)
    scores = torch.baddbmm(bias, queries.flatten(0, 1), keys.transpose(1, 2), alpha=scaling)
    sinks = ring.sinks
    if sink_queries is None or not sinks:
        return scores
    sink_scores = torch.baddbmm(
        bias[..., :sinks], sink_queries.flatten(0, 1), keys[:, :sinks].transpose(1, 2), alpha=scaling
    )
    return torch.cat([sink_scores, scores[..., sinks:]], dim=-1)


def ring_window_step(
    ring: RingWindow,
    queries: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scaling: float,
    return_lse: bool = False,
    sink_queries: Tensor | None = None,
    sink_key_turn=None,
    slot: Tensor | None = None,
    extra: tuple[Tensor, Tensor, Tensor] | None = None,
):
    """One present token of ``recurrent_window_attention`` (sinks included, no soft-capping): queries
    (B, Hk, G, D), key (B, Hk, D), value (B, Hk, Dv), in the ring's dtype, sink_queries (B, Hk, G, D) the
    queries that score the sinks (None: queries) -> out (B, Hk, G, Dv) and the ring after the token (the
    same buffers, updated in place without autograd); with ``return_lse`` (out, lse, ring), lse (B, Hk, G)
    the log-sum-exp of the queries' softmax scores. ``sink_key_turn`` instead of ``sink_queries``: the sinks
    scored by the queries against their keys turned by it (``sink_seen_keys``), in the fused softmax.
    ``slot``: a frozen ring's next slot (see ``write_key``), moved on in place. ``extra``: more keys the
    same softmax reads beside the window's, (keys (B, Hk, N, D), values (B, Hk, N, Dv), visible (B, Hk, N)
    bool), e.g. a recall cache's (``dofla.cells.recall_cache``); not with ``sink_queries``."""
    ring = owned_state(ring, ring.keys)
    write_key(ring, key, value, slot)
    if slot is None:
        ring.num_tokens += 1
    else:
        advance_slot(slot, ring)
    own_sink_scores = sink_queries is not None and ring.sinks > 0
    keys, values, bias = sink_seen_keys(ring, sink_key_turn), ring.values, ring.bias
    if extra is not None:
        if own_sink_scores:
            raise DoflaError("a ring step reads extra keys only where its queries score the sinks too.")
        extra_keys, extra_values, visible = extra
        width = values.shape[-1] - extra_values.shape[-1]  # the hybrid's column of ones, if any
        keys = torch.cat([keys, extra_keys.to(keys.dtype)], dim=2)
        values = torch.cat([values, F.pad(extra_values.to(values.dtype), (0, width), value=1.0)], dim=2)
        bias = torch.cat([bias, visible_bias(visible, bias.dtype)], dim=-1)
    if not return_lse and not own_sink_scores:
        # one fused softmax over all slots; the new key is visible (in the window or as a sink)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scaling)
        return out, ring
    fused = not own_sink_scores and takes_fused_lse(queries, keys, values)
    if fused:  # generation: the fused kernel gives both
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, attn_mask=bias, scale=scaling
        )
        return out, lse, ring
    scores = window_scores(ring, queries, scaling, sink_queries, keys, bias)  # (B * Hk, G, S + W [+ N])
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # finite: the new key is visible
    out = torch.bmm(torch.exp(scores - lse), values.flatten(0, 1)).view(*queries.shape[:3], -1)
    return (out, lse.view(queries.shape[:3]), ring) if return_lse else (out, ring)


def in_place(tensor: Tensor) -> bool:
    """Whether a state's buffer may be updated in place here: not one made in inference mode while this is
    not (under ``torch.compile``, which cannot ask, the buffers a frozen decoding step holds, which
    ``dofla.graph_decode.CapturedDecoder`` makes so)."""
    if torch.compiler.is_compiling():
        return True
    return not (tensor.is_inference() and not torch.is_inference_mode_enabled())


def steady_ring(ring) -> bool:
    """Whether a window (a ``RingWindow``) is in its steady state, where a step may write its next slot
    from a frozen token count (``write_key``'s ``slot``): the window full, every sink kept, no slot hidden,
    its buffers updatable in place."""
    return (
        isinstance(ring, RingWindow)
        and ring.sinks_full
        and ring.num_tokens >= max(ring.hidden_until, ring.window)
        and in_place(ring.keys)
    )


def frozen_slot(ring: RingWindow) -> Tensor:
    """The ring's next slot as a (1,) int64 tensor, for steps whose token count is frozen (a captured or
    compiled decoding step: ``dofla.graph_decode``)."""
    return torch.tensor([ring.next_slot], device=ring.keys.device)


def advance_slot(slot: Tensor, ring: RingWindow) -> None:
    """Move a frozen ring's next slot (``frozen_slot``) on by one token, in place."""
    slot.copy_(torch.remainder(slot - ring.sinks + 1, ring.window) + ring.sinks)
