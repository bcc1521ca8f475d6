"""Prefill and decode throughput and cache memory, for a teacher and a converted model alike.

Timing lives only in benchmarks (``bench/``), never in pass/fail tests; the cache size is exact
(bytes of the tensors the cache holds) and is what tests may check.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache


def cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: keys/values of softmax layers and states of linear layers."""
    from dofla.cache import RecurrentCacheLayer, self_attention_cache

    total = 0
    for layer in self_attention_cache(cache).layers:
        if isinstance(layer, RecurrentCacheLayer):
            total += layer.nbytes()
        else:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
    return total


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_generation(
    model,
    *,
    context_lengths: Sequence[int] = (1024, 4096),
    batch_size: int = 1,
    new_tokens: int = 16,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Per context length: prefill time and tokens/s, decode tokens/s, cache bytes before/after decoding.

    The prompt is random token ids (speed and memory do not depend on the text); decoding feeds
    the greedy next token back one step at a time through the model's cache.
    """
    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    model.eval()
    # Only the last position's logits are needed: (B, T, vocab) logits would dominate prefill memory.
    keep_last = (
        {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    )
    for context in context_lengths:
        prompt = torch.randint(0, vocab, (batch_size, context), generator=generator).to(device)
        cache = DynamicCache(config=model.config)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _synchronize(device)
        start = time.perf_counter()
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, **keep_last).logits[:, -1]
        _synchronize(device)
        prefill_seconds = time.perf_counter() - start
        bytes_after_prefill = cache_bytes(cache)
        start = time.perf_counter()
        for _ in range(new_tokens):
            next_token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=next_token, past_key_values=cache, use_cache=True).logits[:, -1]
        _synchronize(device)
        decode_seconds = time.perf_counter() - start
        row = {
            "context": context,
            "batch_size": batch_size,
            "prefill_seconds": prefill_seconds,
            "prefill_tokens_per_second": batch_size * context / prefill_seconds,
            "decode_tokens_per_second": batch_size * new_tokens / decode_seconds,
            "cache_bytes_after_prefill": bytes_after_prefill,
            "cache_bytes_after_decode": cache_bytes(cache),
        }
        if device.type == "cuda":
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        rows.append(row)
    return rows
