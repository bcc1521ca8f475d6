"""Chunk sizes of the chunked forms, per op and prefill length."""

from __future__ import annotations

from dofla.errors import DoflaError

# Chunk size per chunked op and prefill length, chosen by a measured sweep (bench/sweep_chunk_size.py,
# SmolLM2-135M's attention shape, float32, one CPU thread; its table is bench/results/chunk_sizes.md):
# rows (longest length, chunk size), the last row's size beyond. A plan's ``chunk_size`` option overrides.
# "window+sinks": the window op with sink slots, which copies each chunk's keys and values beside the sinks
# (without sinks a chunk's keys are a view), so fewer, larger chunks pay (bench/results/chunk_sizes_sinks.md).
CHUNK_SIZES: dict[str, tuple[tuple[int, int], ...]] = {
    "linear": ((16384, 32),),
    "delta": ((16384, 32),),
    "window": ((16384, 16),),
    "window+sinks": ((1024, 32), (16384, 64)),
}


def choose_chunk_size(op: str, length: int) -> int:
    """The chunk size of ``CHUNK_SIZES`` for ``op`` ("linear", "delta", "window" or "window+sinks") at
    ``length`` tokens."""
    rows = CHUNK_SIZES[op]
    for longest, size in rows:
        if length <= longest:
            return size
    return rows[-1][1]


def check_chunk_size(chunk_size: int) -> int:
    if int(chunk_size) <= 0:
        raise DoflaError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    return int(chunk_size)
