"""Timing and memory helpers of the benchmarks: one setting at a time (a prefill, decode steps, a cache of a
given length, the process's peak memory). Timing never goes into a pass/fail test."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from dofla.cache import RecurrentCacheLayer, held_bytes, self_attention_cache
from dofla.evaluation.speed import random_prompt, synchronize
from dofla.prefill import keep_last_logits, prefill


class PeakMemory:
    """Peak resident memory of this process while the block runs, above what it held at the start (bytes).

    Linux only (``/proc/self``): the kernel's high-water mark is reset on entry (``clear_refs`` 5) and read
    on exit; elsewhere ``extra_bytes`` stays None. Freed tensors return to the system only when the allocator
    gives them back, so :func:`release_freed_memory` runs first.
    """

    def __init__(self) -> None:
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None

    @property
    def extra_bytes(self) -> int | None:
        if self.start_bytes is None or self.peak_bytes is None:
            return None
        return max(0, self.peak_bytes - self.start_bytes)

    def __enter__(self) -> PeakMemory:
        release_freed_memory()
        try:
            with open("/proc/self/clear_refs", "w") as stream:
                stream.write("5")
            self.start_bytes = _status_bytes("VmRSS")
        except OSError:
            self.start_bytes = None
        return self

    def __exit__(self, *exc) -> None:
        self.peak_bytes = _status_bytes("VmHWM") if self.start_bytes is not None else None


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as stream:
            for line in stream:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_freed_memory(collect: bool = False) -> None:
    """Return freed heap memory to the system (glibc ``malloc_trim``), so resident memory measures are honest;
    ``collect`` runs Python's cycle collector first (about 0.5 s with torch and transformers loaded)."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _layer_shape(model) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of a transformers decoder."""
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv_heads, head_dim


def kv_cache_bytes(model, batch_size: int, context: int) -> int:
    """Bytes of a softmax KV cache of ``context`` tokens for ``batch_size`` rows in the model's dtype."""
    layers, kv_heads, head_dim = _layer_shape(model)
    element = next(model.parameters()).element_size()
    return 2 * layers * batch_size * kv_heads * context * head_dim * element


def synthetic_kv_cache(model, batch_size: int, context: int, seed: int = 0) -> DynamicCache:
    """A DynamicCache holding ``context`` random keys and values per layer, (B, Hkv, context, D) each.

    Decoding cost does not depend on the cached values, so this stands in for a real prefill of a long
    prompt (which would take minutes on a CPU at 16k tokens).
    """
    layers, kv_heads, head_dim = _layer_shape(model)
    parameter = next(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    for layer in range(layers):
        keys, values = (
            torch.randn(batch_size, kv_heads, context, head_dim, generator=generator).to(
                device=parameter.device, dtype=parameter.dtype
            )
            for _ in range(2)
        )
        cache.update(keys, values, layer)
    return cache


def student_cache_at(model, batch_size: int, context: int, fill_tokens: int, seed: int = 0) -> DynamicCache:
    """A converted model's cache after a real prefill of ``fill_tokens`` tokens, counted as ``context``.

    A student's state has the same size and the decode step the same work whatever the length (a window
    needs ``fill_tokens`` >= its window to be full); only the token counter, which sets the position of the
    next token, is moved on to ``context``. Layers the plan keeps as full softmax get random keys and values
    in front of their real ones up to ``context`` (their decoding cost grows with it, as the teacher's).
    """
    generator = torch.Generator().manual_seed(seed)  # the prompt, then the softmax layers' filler
    prompt = random_prompt(model, batch_size, fill_tokens, generator)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True, **keep_last_logits(model))
    for layer in self_attention_cache(cache).layers:
        if isinstance(layer, RecurrentCacheLayer):
            layer.num_tokens = max(layer.num_tokens, int(context))
        elif getattr(layer, "keys", None) is not None and layer.keys.shape[-2] < context:
            extra = (
                batch_size,
                layer.keys.shape[1],
                int(context) - layer.keys.shape[-2],
                layer.keys.shape[-1],
            )
            filler = [torch.randn(extra, generator=generator).to(layer.keys) for _ in range(2)]
            layer.keys = torch.cat([filler[0], layer.keys], dim=-2)
            layer.values = torch.cat([filler[1], layer.values], dim=-2)
    return cache


@torch.no_grad()
def time_prefill(
    model, batch_size: int, context: int, seed: int = 0, chunk_size: int | None = None
) -> dict[str, float]:
    """One prefill of ``context`` random tokens (in pieces of ``chunk_size``, see :func:`prefill`): seconds,
    tokens/s and the cache bytes it leaves."""
    device = next(model.parameters()).device
    prompt = random_prompt(model, batch_size, context, torch.Generator().manual_seed(seed))
    cache = DynamicCache(config=model.config)
    synchronize(device)
    start = time.perf_counter()
    prefill(model, prompt, cache, chunk_size)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tokens_per_second": batch_size * context / seconds,
        "cache_bytes": held_bytes(cache),
    }


@torch.no_grad()
def time_decode(
    model,
    cache,
    batch_size: int,
    *,
    steps: int | None = None,
    target_seconds: float = 4.0,
    max_steps: int = 64,
    warm_up_steps: int = 1,
    forward=None,
) -> dict[str, float]:
    """Greedy decode steps from ``cache``: ``warm_up_steps`` untimed steps, then ``steps`` timed steps (or as
    many as fit in about ``target_seconds`` at the last warm-up step's pace, at least 2). ``forward``: what
    runs a step (keyword arguments ``input_ids``, ``past_key_values``, ``use_cache``; the model by default).
    Returns tokens/s, seconds per step, steps and cache bytes."""
    device = next(model.parameters()).device
    token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    forward = model if forward is None else forward

    def step(token):
        logits = forward(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        return logits.argmax(-1, keepdim=True)

    for _ in range(max(1, warm_up_steps)):
        start = time.perf_counter()
        token = step(token)
        synchronize(device)
    warm_up = time.perf_counter() - start
    if steps is None:
        steps = int(min(max_steps, max(2, target_seconds // max(warm_up, 1e-6))))
    start = time.perf_counter()
    for _ in range(steps):
        token = step(token)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "tokens_per_second": batch_size * steps / seconds,
        "seconds_per_step": seconds / steps,
        "steps": steps,
        "cache_bytes": held_bytes(cache),
    }
