"""Chunk size per op and prefill length: times each chunked op at each chunk size, picks the fastest.

The three chunked forms the student cells run at prefill (``linear``: the linear and gla cells' linear
attention; ``delta``: the gated delta rule; ``window``: the sliding-window softmax) are timed on random
inputs of a teacher's attention shape (default SmolLM2-135M: 9 query heads, 3 key/value heads, head and
feature size 64), float32, batch 1, at each length and chunk size, alternating the sizes within each
repeat so that a busy machine slows them alike; the minimum over repeats counts. Writes
``results/chunk_sizes.json`` (every time and the choice) and prints a markdown table and the rows of
``dofla.ops.chunk_sizes.CHUNK_SIZES`` that the choice gives (the library's table is copied from a run).

    python bench/sweep_chunk_size.py                      # 1k, 4k, 16k tokens; chunks 16-128; 1 thread
    python bench/sweep_chunk_size.py --lengths 2048 --ops linear --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dofla.ops import (
    DeltaInputs,
    LinearInputs,
    WindowInputs,
    WindowOptions,
    chunked_gated_delta_rule,
    chunked_linear_attention,
    chunked_window_attention,
)

HERE = Path(__file__).resolve().parent
OPS = ("linear", "delta", "window")


def make_inputs(length: int, heads: int, kv_heads: int, dim: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        "q_features": draw(1, heads, length, dim).exp(),  # positive features, as a feature map gives
        "k_features": draw(1, kv_heads, length, dim).exp(),
        "log_scale": draw(1, kv_heads, length),
        "query": F.normalize(draw(1, heads, length, dim), dim=-1),
        "key": F.normalize(draw(1, kv_heads, length, dim), dim=-1),
        "value": draw(1, kv_heads, length, dim),
        "log_decay": -0.05 * torch.rand(1, kv_heads, length, generator=generator),
        "beta": torch.rand(1, kv_heads, length, generator=generator),
    }


def run_op(op: str, inputs: dict, chunk_size: int, window: int, sinks: int = 0) -> None:
    if op == "linear":
        chunked_linear_attention(
            LinearInputs(inputs["q_features"], inputs["k_features"], inputs["value"], inputs["log_scale"]),
            chunk_size=chunk_size,
            return_state=True,
        )
    elif op == "delta":
        chunked_gated_delta_rule(
            DeltaInputs(inputs["query"], inputs["key"], inputs["value"], inputs["log_decay"], inputs["beta"]),
            chunk_size=chunk_size,
            return_state=True,
        )
    else:
        chunked_window_attention(
            WindowInputs(inputs["query"], inputs["key"], inputs["value"]),
            WindowOptions(scaling=inputs["query"].shape[-1] ** -0.5, window=window, sinks=sinks),
            chunk_size=chunk_size,
            return_state=True,
        )


def sweep(args) -> dict:
    results = {}
    for length in args.lengths:
        inputs = make_inputs(length, args.heads, args.kv_heads, args.dim)
        for op in args.ops:
            times = {size: [] for size in args.chunks}
            with torch.no_grad():
                for size in args.chunks:  # warm-up
                    run_op(op, inputs, size, args.window, args.sinks)
                for _ in range(args.repeats):
                    for size in args.chunks:
                        start = time.perf_counter()
                        run_op(op, inputs, size, args.window, args.sinks)
                        times[size].append(time.perf_counter() - start)
            best = {size: min(values) for size, values in times.items()}
            choice = min(best, key=best.get)
            results[f"{op} {length}"] = {"op": op, "length": length, "seconds": best, "chosen": choice}
            line = ", ".join(f"{size}: {seconds * 1000:.1f} ms" for size, seconds in best.items())
            print(f"  {op} at {length}: {line} -> {choice}", file=sys.stderr, flush=True)
    return results


def table(results: dict, args) -> str:
    lines = ["| op | length | " + " | ".join(f"C={size} ms" for size in args.chunks) + " | chosen |"]
    lines.append("|---|---:|" + "---:|" * len(args.chunks) + "---:|")
    for row in results.values():
        cells = " | ".join(f"{row['seconds'][size] * 1000:.1f}" for size in args.chunks)
        lines.append(f"| {row['op']} | {row['length']} | {cells} | {row['chosen']} |")
    rules = []
    for op in args.ops:
        rows = sorted((row["length"], row["chosen"]) for row in results.values() if row["op"] == op)
        rules.append(f'    "{op}": {tuple(rows)},')
    return (
        "\n".join(lines)
        + "\n\nCHUNK_SIZES rows (length, chosen chunk size):\n```\n"
        + "\n".join(rules)
        + "\n```"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--chunks", default="16,32,64,128")
    parser.add_argument("--ops", default=",".join(OPS), help=f"any of {', '.join(OPS)}")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64, help="head size = feature size")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=0, help="sink tokens of the window op")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "chunk_sizes.json"))
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    args.chunks = [int(x) for x in str(args.chunks).split(",")]
    args.ops = [x.strip() for x in str(args.ops).split(",") if x.strip()]
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op {unknown[0]!r}; known: {', '.join(OPS)}")
    torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.time()
    results = sweep(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load_before": load, "rows": results}, indent=1))
    print(f"command: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, "
        f"float32, batch 1, {args.heads}/{args.kv_heads} heads of {args.dim}, window {args.window}, {args.sinks} sinks; load average "
        f"before: {load}; took {time.time() - started:.0f} s; minimum over {args.repeats} repeats\n"
    )
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
