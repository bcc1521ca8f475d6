"""The no-training baseline a converted model must beat: the teacher's softmax over a sliding window.

Under :func:`window_restricted` every softmax attention layer of a model (the teacher's own attention,
run by :mod:`dofla.dispatch`) sees only the last ``window`` keys up to and including the query, plus
the first ``sinks`` tokens of the sequence ("attention sinks"). Nothing is trained: this is what a
window-plus-sinks cache (StreamingLLM) keeps of the teacher, and what a linear or hybrid student costs
nothing to match. Converted layers keep running their students; only softmax layers are restricted.

The restriction is a boolean key mask intersected with the mask transformers builds (causal, padding,
the model's own sliding windows), so padded batches and ``generate()`` with a cache work unchanged.
Attention stays quadratic (masked SDPA or the model's eager function): this is for evaluation only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dofla import dispatch
from dofla.errors import DoflaError


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


def _window_mask_transform(window: int, sinks: int):
    # Every layer of one forward gets the same mask: build it once. The entry holds the mask object itself,
    # so its identity cannot be reused by another tensor while it is remembered.
    last: dict = {}

    def transform(query, key, attention_mask, teacher_kind):
        signature = (query.shape[2], key.shape[2], teacher_kind, query.dtype, query.device)
        if last.get("signature") == signature and last.get("mask") is attention_mask:
            return last["restricted"]
        visible = visible_keys(attention_mask, query.shape[2], key.shape[2]).to(query.device)
        restricted = restrict_to_window(visible, window, sinks)  # (B or 1, 1, T, S)
        if teacher_kind == "eager":  # the model files' eager attention adds the mask to the scores
            hidden = torch.finfo(query.dtype).min
            restricted = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                ~restricted, hidden
            )
        last.update(signature=signature, mask=attention_mask, restricted=restricted)
        return restricted

    return transform


@contextmanager
def window_restricted(model: torch.nn.Module, window: int, sinks: int = 0) -> Iterator[torch.nn.Module]:
    """Within this block the model's softmax attention sees only the last ``window`` keys plus ``sinks`` first ones.

    The window counts the query itself: ``window=1`` lets a token see only itself (and the sinks). The
    dispatcher is installed on the model if it was not (it computes exactly the model's own attention).
    """
    if int(window) < 1:
        raise DoflaError(f"the attention window must be at least 1 token, got {window}.")
    if int(sinks) < 0:
        raise DoflaError(f"the number of sink tokens cannot be negative, got {sinks}.")
    from dofla.models import get_adapter

    dispatch.install(model)
    modules = list(get_adapter(model).attention_modules(model))
    taken = [module for module in modules if getattr(module, dispatch.MASK_TRANSFORM_ATTRIBUTE, None)]
    if taken:
        raise DoflaError("this model is already inside window_restricted; leave that block first.")
    transform = _window_mask_transform(int(window), int(sinks))
    for module in modules:
        setattr(module, dispatch.MASK_TRANSFORM_ATTRIBUTE, transform)
    try:
        yield model
    finally:
        for module in modules:
            delattr(module, dispatch.MASK_TRANSFORM_ATTRIBUTE)
