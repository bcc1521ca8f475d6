"""The no-training baseline a converted model must beat: the teacher's softmax over a sliding window.

Under :func:`window_restricted` every softmax attention layer of a model (the teacher's own attention,
run by :mod:`dofla.dispatch`) sees only the last ``window`` keys up to and including the query, plus
the first ``sinks`` tokens of the sequence ("attention sinks"). Nothing is trained: this is what a
window-plus-sinks cache (StreamingLLM) keeps of the teacher, and what a linear or hybrid student costs
nothing to match. Converted layers keep running their students; only softmax layers are restricted.

The restriction is a boolean key mask intersected with the mask transformers builds (causal, padding,
the model's own sliding windows), so padded batches and ``generate()`` with a cache work unchanged;
the teacher's own attention function (masked SDPA, or the model's eager one) then runs, quadratic in
the length. A plain uncached SDPA call longer than two blocks (:data:`BAND_BLOCK`, held-out perplexity)
takes :func:`banded_window_attention` instead, which computes the scores near the diagonal only and is
checked against the masked form.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from dofla import dispatch
from dofla.config import DEFAULT_WINDOW
from dofla.errors import DoflaError
from dofla.rotary import check_edge_sinks

REFERENCE_WINDOW = DEFAULT_WINDOW  # the baselines' window for a student without one (pure linear)


def visible_keys(attention_mask: torch.Tensor | None, query_length: int, key_length: int) -> torch.Tensor:
    """Which keys each query may see under ``attention_mask``: bool (B or 1, 1, T, S), True = visible.

    attention_mask: what transformers gives the attention function: None (plain causal, or a single
    decoding query that sees every cached key), a bool mask (True = visible) or an additive float mask
    (0 = visible, a very negative number = hidden), shaped (B or 1, 1, T, S).
    """
    if attention_mask is None:
        if query_length == 1:
            return torch.ones(1, 1, 1, key_length, dtype=torch.bool)
        # transformers drops the mask only for an uncached causal call, aligned at the first key
        query_index = torch.arange(query_length)[:, None]
        key_index = torch.arange(key_length)[None, :]
        return (key_index <= query_index).view(1, 1, query_length, key_length)
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def restrict_to_window(visible: torch.Tensor, window: int, sinks: int = 0) -> torch.Tensor:
    """Narrow a visibility mask (..., T, S) to the last ``window`` keys of each query plus ``sinks`` first ones.

    A query's own position is its last visible key (for every real token, the token itself), so the
    window ends there whatever the cache layout; the sinks are the first ``sinks`` keys the query may see
    (after left padding, the first real tokens). A row that sees nothing stays as it was.
    """
    key_length = visible.shape[-1]
    key_index = torch.arange(key_length, device=visible.device)  # (S,)
    last = torch.where(visible, key_index, -1).amax(-1, keepdim=True)  # (..., T, 1) the query's position
    in_window = key_index > last - window  # (..., T, S); keys after `last` are invisible already
    if sinks > 0:
        in_window = in_window | (visible.cumsum(-1) <= sinks)
    return visible & in_window


BAND_BLOCK = 64  # fewest queries per block of the banded form (a block is at least the window long)


def banded_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int,
    sinks: int,
    scaling: float,
    block: int = BAND_BLOCK,
) -> torch.Tensor:
    """Causal softmax over the last ``window`` keys plus the first ``sinks``, for an uncached, unpadded call.

    query (B, H, T, D), key and value (B, Hkv, T, D) (key/value heads shared by H / Hkv query heads).
    Returns (B, T, H, Dv). Equal to the teacher's SDPA under the :func:`restrict_to_window` mask, but
    only near the diagonal: the queries are cut into blocks of c = max(block, window) positions, and
    block i attends to the keys of blocks i - 1 and i (all its windows can reach) and to the sinks, in
    one SDPA call for every block, with the query heads of a key/value head stacked as rows (no copy of
    the keys per query head). The cost grows with T * (2c + sinks) instead of T^2.
    """
    batch, heads, length, _ = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    size = max(int(block), int(window))  # c: a window never reaches past the previous block
    count = -(-length // size)  # blocks
    pad = count * size - length
    sinks = min(int(sinks), length)

    def band(tensor: torch.Tensor) -> torch.Tensor:  # (B, Hkv, T, D) -> (B, Hkv * blocks, sinks + 2c, D)
        # a block of zeros in front, so that block 0 has a previous block (hidden by the mask)
        blocks = F.pad(tensor, (0, 0, size, pad)).unflatten(2, (count + 1, size))  # (B, Hkv, n + 1, c, D)
        parts = [blocks[:, :, :-1], blocks[:, :, 1:]]
        if sinks:
            parts.insert(0, tensor[:, :, None, :sinks].expand(-1, -1, count, -1, -1))
        return torch.cat(parts, dim=3).flatten(1, 2)

    rows = F.pad(query, (0, 0, 0, pad)).reshape(batch, kv_heads, groups, count, size, query.shape[-1])
    rows = rows.transpose(2, 3).reshape(batch, kv_heads * count, groups * size, query.shape[-1])
    mask = _band_mask(count, size, groups, kv_heads, int(window), sinks, query.dtype, query.device)
    output = F.scaled_dot_product_attention(rows, band(key), band(value), attn_mask=mask, scale=scaling)
    output = output.view(batch, kv_heads, count, groups, size, -1).permute(0, 2, 4, 1, 3, 5)
    return output.reshape(batch, count * size, heads, -1)[:, :length].contiguous()  # (B, T, H, Dv)


@functools.lru_cache(maxsize=4)
def _band_mask(
    count: int,
    size: int,
    groups: int,
    kv_heads: int,
    window: int,
    sinks: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Which of the keys (sinks, previous block, own block) each stacked query row of each block sees.

    Returns the additive mask (0 seen, -inf hidden; what SDPA makes of a bool mask on every call),
    (1, Hkv * blocks, groups * c, sinks + 2c): four dimensions, as SDPA's CPU flash kernel needs.
    Query t sees a band key p when t - window < p <= t and p >= 0 (p < 0: the zeros before the first
    block), and sink j when it lies before its window (j <= t - window; a sink inside the window is
    seen in the band, once). Cached: every layer of a forward, and each window row, asks for the same.
    """
    query = (torch.arange(count)[:, None] * size + torch.arange(size)[None, :])[:, :, None]  # (n, c, 1)
    key = torch.arange(-size, size)[None, None, :] + (torch.arange(count) * size)[:, None, None]  # (n, 1, 2c)
    in_band = (key <= query) & (key > query - window) & (key >= 0)  # (n, c, 2c)
    in_sinks = torch.arange(sinks)[None, None, :] <= query - window  # (n, c, sinks)
    mask = torch.cat([in_sinks, in_band], dim=-1)  # (n, c, K)
    mask = mask[:, None].expand(-1, groups, -1, -1).reshape(count, groups * size, -1)  # (n, G*c, K)
    mask = mask.repeat(kv_heads, 1, 1)[None]  # (1, Hkv * n, G*c, K)
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf")).to(device)


def edge_sink_queries(
    query: torch.Tensor, window: int, sinks: int, frequencies: torch.Tensor
) -> torch.Tensor:
    """The queries (..., T, D) of a call starting at position 0 turned back to position min(t, window + sinks)
    in the rotary planes (``frequencies``: the model's inverse frequencies): what scores the sinks when they
    are seen from the window's edge (:func:`edge_sink_window_attention`)."""
    from dofla.rotary import edge_turns

    length = query.shape[-2]
    position = torch.arange(length, device=query.device)
    turns = edge_turns(position, length, int(window) + int(sinks), frequencies.to(query.device), query.dtype)
    return query if turns is None else turns(query)


def edge_sink_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int,
    sinks: int,
    scaling: float,
    frequencies: torch.Tensor,
    block: int = 128,
) -> torch.Tensor:
    """Causal softmax over the last ``window`` keys plus the first ``sinks``, with the sinks seen from the
    window's edge: query t scores the sinks as if it stood at position min(t, window + sinks) (its rotary
    angle turned back by the difference, ``frequencies`` the model's inverse frequencies), so they sit just
    before its window at a fixed distance instead of t tokens away; the window's keys keep their true
    distances. A sink is seen only once it is older than the window (inside it, as a window key), as in
    :func:`restrict_to_window`. For an uncached, unpadded call: query (B, H, T, D), key and value
    (B, Hkv, T, D) -> (B, T, H, Dv); blocks of ``block`` queries, each scoring its band of keys and the sinks.
    """
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    sinks = min(int(sinks), length)
    position = torch.arange(length, device=query.device)
    sink_query = edge_sink_queries(query, window, sinks, frequencies)
    outputs = []
    for start in range(0, length, int(block)):
        stop = min(start + int(block), length)
        first = max(0, start - int(window) + 1)
        queries, keys = position[start:stop, None], position[None, first:stop]
        band = (keys <= queries) & (keys > queries - int(window))  # (q, k)
        scores = (query[:, :, start:stop] @ key[:, :, first:stop].transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~band, float("-inf"))
        values = value[:, :, first:stop]
        if sinks:
            seen = position[None, :sinks] <= queries - int(window)  # (q, S): older than the window
            sink_scores = (sink_query[:, :, start:stop] @ key[:, :, :sinks].transpose(-1, -2)) * scaling
            scores = torch.cat([sink_scores.masked_fill(~seen, float("-inf")), scores], dim=-1)
            values = torch.cat([value[:, :, :sinks], values], dim=2)
        outputs.append(torch.softmax(scores, dim=-1) @ values)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


class _WindowedSoftmax:
    """Runs in place of a layer's softmax (dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE) with the window restriction."""

    def __init__(self, window: int, sinks: int, edge_frequencies: torch.Tensor | None = None) -> None:
        self.window, self.sinks = window, sinks
        self.edge_frequencies = edge_frequencies  # sinks seen from the window's edge (rotary frequencies)
        # Every layer of one forward gets the same mask: build it once. The entry holds the mask object
        # itself, so its identity cannot be reused by another tensor while it is remembered.
        self.last: dict = {}

    def __call__(
        self, module, query, key, value, attention_mask, *, teacher_kind, scaling, dropout=0.0, **kwargs
    ):
        length = query.shape[2]
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
        plain = attention_mask is None and key.shape[2] == length and causal and not dropout
        # what else SDPA would take into account; the banded form does not
        altered = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "cache"))
        if self.edge_frequencies is not None:
            if not plain or altered:
                raise DoflaError(
                    "sinks at the window's edge are measured on whole uncached rows without padding or "
                    "soft-capping (perplexity); use the true-position window baseline for this."
                )
            return edge_sink_window_attention(
                query, key, value, self.window, self.sinks, scaling, self.edge_frequencies
            ), None
        if teacher_kind == "sdpa" and plain and not altered and length > 2 * max(BAND_BLOCK, self.window):
            output = banded_window_attention(
                query, key, value, self.window, self.sinks, scaling, block=BAND_BLOCK
            )
            return output, None
        mask = self.restricted_mask(query, key, attention_mask, teacher_kind)
        return dispatch.teacher_attention(
            module,
            query,
            key,
            value,
            mask,
            teacher_kind=teacher_kind,
            scaling=scaling,
            dropout=dropout,
            **kwargs,
        )

    def restricted_mask(self, query, key, attention_mask, teacher_kind) -> torch.Tensor:
        """The mask transformers gave, narrowed to the window and sinks (bool, or additive for eager)."""
        signature = (query.shape[2], key.shape[2], teacher_kind, query.dtype, query.device)
        if self.last.get("signature") == signature and self.last.get("mask") is attention_mask:
            return self.last["restricted"]
        visible = visible_keys(attention_mask, query.shape[2], key.shape[2]).to(query.device)
        restricted = restrict_to_window(visible, self.window, self.sinks)  # (B or 1, 1, T, S)
        if teacher_kind == "eager":  # the model files' eager attention adds the mask to the scores
            hidden = torch.finfo(query.dtype).min
            restricted = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                ~restricted, hidden
            )
        self.last.update(signature=signature, mask=attention_mask, restricted=restricted)
        return restricted


@contextmanager
def window_restricted(
    model: torch.nn.Module,
    window: int,
    sinks: int = 0,
    layers: Sequence[int] | None = None,
    *,
    sinks_at_edge: bool = False,
) -> Iterator[torch.nn.Module]:
    """Within this block the model's softmax attention sees only the last ``window`` keys plus ``sinks`` first ones.

    The window counts the query itself: ``window=1`` lets a token see only itself (and the sinks). layers:
    the attention layers restricted (indices; default all), the others keep their full softmax, e.g. the
    layers a student converted when it keeps some as softmax. The dispatcher is installed on the model if
    it was not (it computes exactly the model's own attention). ``sinks_at_edge``: the sinks are seen from
    the window's edge instead of their true positions (:func:`edge_sink_window_attention`; rotary models,
    whole uncached rows only).
    """
    if int(window) < 1:
        raise DoflaError(f"the attention window must be at least 1 token, got {window}.")
    if int(sinks) < 0:
        raise DoflaError(f"the number of sink tokens cannot be negative, got {sinks}.")
    from dofla.models import get_adapter

    dispatch.install(model)
    modules = list(get_adapter(model).attention_modules(model))
    if layers is not None:
        chosen = sorted({int(layer) for layer in layers})
        wrong = [layer for layer in chosen if not 0 <= layer < len(modules)]
        if wrong:
            raise DoflaError(
                f"layers {wrong} are not attention layers of this model (it has {len(modules)}, 0 to "
                f"{len(modules) - 1}); pass indices in that range."
            )
        modules = [modules[layer] for layer in chosen]
    taken = [module for module in modules if getattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE, None)]
    if taken:
        raise DoflaError("this model is already inside window_restricted; leave that block first.")
    softmax = _WindowedSoftmax(int(window), int(sinks), check_edge_sinks(model) if sinks_at_edge else None)
    for module in modules:
        setattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE, softmax)
    try:
        yield model
    finally:
        for module in modules:
            delattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE)


def baseline_layers(student: torch.nn.Module | None) -> list[int] | None:
    """The layers a fair window baseline restricts for ``student``: the layers it converted when it keeps
    some as full softmax (a plan with softmax layers), else None (every layer)."""
    plan = getattr(student, "dofla_plan", None)
    if plan is None:
        return None
    converted = sorted(int(layer) for layer in plan.converted_layers)
    return None if len(converted) == len(plan.layers) else converted


def baseline_window(plan) -> int:
    """The baselines' window for a student with ``plan`` (None: no student): the largest window of its
    hybrid layers, else (no window: a pure linear student) :data:`REFERENCE_WINDOW`."""
    windows = [int(layer.window) for layer in plan.layers if layer.kind == "hybrid"] if plan else []
    return max(windows) if windows else REFERENCE_WINDOW


def baseline_notes(student: torch.nn.Module | None, window: int) -> list[str]:
    """The sentences a report adds about its window baselines: when they restrict only some layers, and
    when the student keeps no window of its own (the baseline's is then a reference, not the student's)."""
    plan = getattr(student, "dofla_plan", None)
    if plan is None:
        return []
    notes = []
    layers = baseline_layers(student)
    if layers is not None:
        kept = sorted(set(range(len(plan.layers))) - set(layers))
        windowed = [layer for layer in kept if layer in set(plan.kept_windowed_layers)]
        full = [layer for layer in kept if layer not in set(windowed)]
        parts = ([f"layers {full} keep their full softmax"] if full else []) + (
            [f"layers {windowed} keep the teacher's own sliding window"] if windowed else []
        )
        notes.append(
            f"the window baselines restrict only the {len(layers)} layers the student converted; "
            f"{' and '.join(parts)}, as in the student."
        )
    if not any(layer.kind == "hybrid" for layer in plan.layers):
        notes.append(
            f"the student keeps no window: the window {window} baselines are a reference (what a cache of "
            f"the last {window} tokens keeps of the teacher), not a part of the student."
        )
    return notes
