"""Prefill speed of one attention layer: chunked linear attention vs the quadratic reference vs softmax SDPA.

Shape (defaults): B=1, H=9 query heads, Hk=3 key/value heads, head size 64, F=64 features, float32, CPU.
The quadratic reference needs (B, H, T, T) float32 matrices (2.4 GB at T=8192), so it is timed at
--naive-length (and chunked again at that length for a like-for-like ratio). Prints a markdown table.

    .venv/bin/python bench/bench_ops.py                 # T=8192, naive at T=2048
    .venv/bin/python bench/bench_ops.py --length 2048 --chunk-sizes 32 64 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from dofla.feature_maps import build_feature_map
from dofla.ops import LinearInputs, chunked_linear_attention, linear_attention


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(repeats: int, function, *arguments) -> float:
    device = str(arguments[0].device)
    function(*arguments)  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        function(*arguments)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_layer_inputs(length, heads, kv_heads, head_dim, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, length, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    value = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    return query.to(device), key.to(device), value.to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--naive-length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    scaling = args.head_dim**-0.5
    feature_map = build_feature_map(
        "learnable_prf",
        num_heads=args.kv_heads,
        head_dim=args.head_dim,
        feature_dim=args.features,
        scaling=scaling,
    ).to(args.device)

    def linear_layer(query, key, value, chunk_size):
        """Feature map on q and k, then chunked linear attention: what a converted layer computes."""
        q_features, _ = feature_map(query, is_query=True)
        k_features, k_log_scale = feature_map(key, is_query=False)
        return chunked_linear_attention(
            LinearInputs(q_features, k_features, value, k_log_scale), chunk_size=chunk_size
        )

    def naive_layer(query, key, value):
        q_features, _ = feature_map(query, is_query=True)
        k_features, k_log_scale = feature_map(key, is_query=False)
        return linear_attention(LinearInputs(q_features, k_features, value, k_log_scale))

    def softmax_layer(query, key, value):
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )

    def measure(length):
        query, key, value = make_layer_inputs(length, args.heads, args.kv_heads, args.head_dim, args.device)
        chunk_times = {
            size: median_seconds(args.repeats, linear_layer, query, key, value, size)
            for size in args.chunk_sizes
        }
        softmax_time = median_seconds(args.repeats, softmax_layer, query, key, value)
        naive_time = None
        if length <= args.naive_length:
            naive_time = median_seconds(args.repeats, naive_layer, query, key, value)
        return length, chunk_times, min(chunk_times, key=chunk_times.get), softmax_time, naive_time

    with torch.inference_mode():
        rows = [measure(length) for length in sorted({args.naive_length, args.length})]

    print(f"command: {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")
    print(
        f"shape: B=1, H={args.heads}, Hk={args.kv_heads}, d={args.head_dim}, F={args.features}, float32, "
        f"device={args.device}{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, "
        f"CPU threads={torch.get_num_threads()}, torch {torch.__version__}; median of {args.repeats} runs; "
        "feature map (learnable_prf) time included in the linear rows"
    )
    print()
    sizes = " | ".join(f"chunk {size} (ms)" for size in args.chunk_sizes)
    print(f"| T | {sizes} | best chunk | SDPA softmax (ms) | naive (ms) | SDPA / chunked | naive / chunked |")
    print("|---" * (len(args.chunk_sizes) + 6) + "|")
    for length, chunk_times, best_size, softmax_time, naive_time in rows:
        best = chunk_times[best_size]
        cells = " | ".join(f"{1e3 * chunk_times[size]:.1f}" for size in args.chunk_sizes)
        naive_cells = (
            ("-", "-") if naive_time is None else (f"{1e3 * naive_time:.1f}", f"{naive_time / best:.1f}x")
        )
        print(
            f"| {length} | {cells} | {best_size} | {1e3 * softmax_time:.1f} | {naive_cells[0]} | "
            f"{softmax_time / best:.1f}x | {naive_cells[1]} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
