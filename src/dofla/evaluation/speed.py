"""Prefill and decode throughput and cache memory, for a teacher and a converted model alike.

Timing lives only in benchmarks (``bench/``), never in pass/fail tests; the cache size is exact (the
tensor storage the cache keeps alive, :func:`dofla.cache.held_bytes`) and is what tests may check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from dofla.cache import held_bytes
from dofla.prefill import prefill


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompt(model, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(batch_size, length) random token ids of the model's vocabulary on its device (speed and memory do
    not depend on the text)."""
    vocab = int(model.config.get_text_config().vocab_size)
    prompt = torch.randint(0, vocab, (batch_size, length), generator=generator)
    return prompt.to(next(model.parameters()).device)


@torch.no_grad()
def measure_generation(
    model,
    *,
    context_lengths: Sequence[int] = (1024, 4096),
    batch_size: int = 1,
    new_tokens: int = 16,
    seed: int = 0,
    graph: bool = False,
) -> list[dict[str, float]]:
    """Per context length: prefill time and tokens/s, decode tokens/s, cache bytes before/after decoding.

    The prompt is random token ids (speed and memory do not depend on the text); decoding feeds
    the greedy next token back one step at a time through the model's cache. ``graph``: decode through a
    :class:`dofla.graph_decode.CapturedDecoder` (kept softmax layers with room for ``new_tokens``; a CUDA
    graph on CUDA), its capture timed apart (``capture_seconds``).
    """
    from dofla.graph_decode import CapturedDecoder

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    rows = []
    model.eval()
    for context in context_lengths:
        prompt = random_prompt(model, batch_size, context, generator)
        cache = DynamicCache(config=model.config)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        logits = prefill(model, prompt, cache)  # only the last position's logits, (B, vocab)
        synchronize(device)
        prefill_seconds = time.perf_counter() - start
        bytes_after_prefill = held_bytes(cache)
        start = time.perf_counter()
        decoder = CapturedDecoder(model, cache, batch_size, context, steps=new_tokens) if graph else None
        synchronize(device)
        capture_seconds = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new_tokens):
            next_token = logits.argmax(-1, keepdim=True)
            if decoder is not None:
                logits = decoder.step(next_token)
            else:
                logits = model(input_ids=next_token, past_key_values=cache, use_cache=True).logits[:, -1]
        synchronize(device)
        decode_seconds = time.perf_counter() - start
        if decoder is not None:
            decoder.finish()
        row = {
            "context": context,
            "batch_size": batch_size,
            "prefill_seconds": prefill_seconds,
            "prefill_tokens_per_second": batch_size * context / prefill_seconds,
            "decode_tokens_per_second": batch_size * new_tokens / decode_seconds,
            "cache_bytes_after_prefill": bytes_after_prefill,
            "cache_bytes_after_decode": held_bytes(cache),
        }
        if decoder is not None:
            row["capture_seconds"] = capture_seconds
        if device.type == "cuda":
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        rows.append(row)
    return rows
