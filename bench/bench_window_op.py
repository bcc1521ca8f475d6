"""The window op's chunked form: the fused path against the general blocked path, one layer, same run.

A piece of ``--length`` tokens continuing a state of ``--fill`` tokens (as a prompt fed in pieces), with
``--sinks`` sink keys, SmolLM2-135M's attention shape by default (B=1, 9 query heads, 3 key/value heads,
head size 64, window 64), float32, one thread. "fused" is what ``chunked_window_attention`` runs without
padding (one fused softmax kernel per chunk); "general" is the same call with an all-true key mask, which
takes the blocked path that padded inputs need (and that every call with sinks or a state took before the
fused path covered them). Both give the same output (tested in ``tests/test_ops_window.py``). Prints
milliseconds per call, medians of ``--repeats`` alternating calls.

    .venv/bin/python bench/bench_window_op.py
    .venv/bin/python bench/bench_window_op.py --length 16384 --sinks 0 --fill 0
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from dofla.ops import WindowInputs, WindowOptions, chunked_window_attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=2048, help="tokens of the timed piece")
    parser.add_argument("--fill", type=int, default=2048, help="tokens seen before it (0: no state)")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    total = args.fill + args.length

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, total, args.head_dim, generator=generator)

    query, key, value = draw(args.heads), draw(args.kv_heads), draw(args.kv_heads)
    options = WindowOptions(scaling=args.head_dim**-0.5, window=args.window, sinks=args.sinks)
    settings = dict(chunk_size=args.chunk_size)
    piece = slice(args.fill, total)
    all_present = torch.ones(1, args.length, dtype=torch.bool)
    times: dict[str, list[float]] = {"fused": [], "general": []}
    with torch.no_grad():
        state = None
        if args.fill:
            head = slice(0, args.fill)
            _, state = chunked_window_attention(
                WindowInputs(query[:, :, head], key[:, :, head], value[:, :, head]),
                options,
                return_state=True,
                **settings,
            )
        calls = {
            "fused": lambda: chunked_window_attention(
                WindowInputs(query[:, :, piece], key[:, :, piece], value[:, :, piece]),
                options,
                initial_state=state,
                **settings,
            ),
            "general": lambda: chunked_window_attention(
                WindowInputs(query[:, :, piece], key[:, :, piece], value[:, :, piece], all_present),
                options,
                initial_state=state,
                **settings,
            ),
        }
        outputs = {name: call() for name, call in calls.items()}  # warm-up
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    difference = (outputs["fused"] - outputs["general"]).abs().max().item()
    fused, general = (statistics.median(times[name]) * 1000 for name in ("fused", "general"))
    print(f"command: {' '.join(['bench_window_op.py', *(sys.argv[1:] if argv is None else argv)])}")
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), float32")
    print(
        f"one layer's window attention, piece of {args.length} tokens after {args.fill}, window {args.window}, "
        f"{args.sinks} sinks, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, chunk {args.chunk_size}, "
        f"median of {args.repeats} alternating calls; largest output difference {difference:.1e}"
    )
    print("")
    print("| path | ms per call | speed-up |")
    print("|---|---:|---:|")
    print(f"| general (blocked) | {general:.1f} | 1.00x |")
    print(f"| fused | {fused:.1f} | {general / fused:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
