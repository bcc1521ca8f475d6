"""Prefill: run a prompt into a cache (in pieces if asked) and keep only the last position's logits."""

from __future__ import annotations

import inspect

import torch


def keep_last_logits(model) -> dict:
    """``logits_to_keep=1`` where the model takes it: (B, T, vocab) logits would dominate prefill memory."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk_size: int | None = None) -> torch.Tensor:
    """Run ``input_ids`` (B, T) into ``cache`` and return the last position's logits (B, vocab).

    ``chunk_size``: feed the prompt in pieces of that many tokens, each continuing the cache (as
    ``generate(..., prefill_chunk_size=N)`` does); a converted model's activations then stay those of one
    piece whatever the prompt length, and its result equals one forward up to rounding.
    """
    step = input_ids.shape[1] if not chunk_size else int(chunk_size)
    keep_last = keep_last_logits(model)
    logits = None
    for start in range(0, input_ids.shape[1], step):
        piece = input_ids[:, start : start + step]
        logits = model(input_ids=piece, past_key_values=cache, use_cache=True, **keep_last).logits
    return logits[:, -1]
