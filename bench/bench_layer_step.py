"""One layer's decode step in isolation: microseconds per step and aten operators per step, per cell.

The step is what ``generate()`` runs in every converted layer for each new token: the student module's
forward on one token's q, k, v with a cache layer holding the state (from a real chunked prefill of
``--fill`` tokens), as the conversion hook hands it over. Shape (defaults): SmolLM2-135M's attention,
B=1, H=9 query heads, Hkv=3 key/value heads, head size 64, F=64 features, float32, one thread.
The machine may be busy: each timing is the median over ``--rounds`` rounds of ``--steps`` steps, on the
wall clock and on the process's CPU clock (which time spent waiting for a busy core does not count).

``--prefill N`` times one uncached prefill of N tokens instead (the chunked form, no autograd, as
``generate()``'s prefill and evaluation run it): microseconds and aten operators per prefill.

``--allocation A,B`` times each cell with A and with B features and at their mean (A + B) / 2, and gives the
mean of the A and B times against the mean dimension's: what a layer-wise allocation alternating A and B costs
against the uniform (``fix``) one at the same mean dimension (a step's cost is additive over layers).

``--against SRC`` compares with another checkout's ``src`` folder (e.g. an exported older commit): the two
run in alternating subprocesses, ``--runs`` times each, and the table gives the medians of both (wall and CPU
clock), then each run's wall-clock figures and the load average before and after.

    python bench/bench_layer_step.py
    python bench/bench_layer_step.py --cells "gla+window,gated_delta+window" --against /tmp/before/src
    python bench/bench_layer_step.py --cells "gated_delta conv8" --prefill 16384 --threads 2 --rounds 3
    python bench/bench_layer_step.py --cells "gated_delta+window" --window 128 --allocation 32,96
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

SOURCE = Path(__file__).resolve().parents[1] / "src"
# name -> LayerPlan fields (kind hybrid: window 64 and the long-context recipes' 4 sinks)
CELLS = {
    "gla+window": dict(kind="hybrid", cell="gla", feature_map="hedgehog", sinks=4),
    # bench_speed.py's gla+window row: the same cell on plan_for's default map
    "gla+window/prf": dict(kind="hybrid", cell="gla", feature_map="learnable_prf", sinks=4),
    "gated_delta+window": dict(kind="hybrid", cell="gated_delta", feature_map="projection", sinks=4),
    "linear+window": dict(kind="hybrid", cell="linear", feature_map="hedgehog", sinks=0),
    "gla": dict(kind="linear", cell="gla", feature_map="hedgehog"),
    # the dof-paper recipe's cell: plain linear attention over a learnable positive random-feature map
    "linear/prf": dict(kind="linear", cell="linear", feature_map="learnable_prf"),
    "window": dict(kind="hybrid", cell="window", feature_map="hedgehog", sinks=0),
    # the gated-delta-linear recipe's cell: no window, projection keys, an 8-token short convolution
    "gated_delta conv8": dict(
        kind="linear", cell="gated_delta", feature_map="projection", options={"short_conv": 8}
    ),
    # the gated-delta-linear recipe's cell: that convolution and the gate on the memory's read-out
    "gated_delta conv8 gate": dict(
        kind="linear",
        cell="gated_delta",
        feature_map="projection",
        options={"short_conv": 8, "output_gate": True},
    ),
}
DEFAULT_CELLS = ("gla+window", "gated_delta+window", "linear+window", "gla")


def build_layer(name: str, args):
    from dofla.cells import build_student
    from dofla.config import LayerPlan

    plan = LayerPlan(feature_dim=args.feature_dim, window=args.window, **CELLS[name])
    student = build_student(
        plan,
        layer_index=0,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        scaling=args.head_dim**-0.5,
    ).eval()
    with torch.no_grad():  # trained-looking parameters, not the initial ones
        generator = torch.Generator().manual_seed(0)
        for parameter in student.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return student


def timed(run, rounds: int, reset=lambda: None) -> tuple[float, float, int]:
    """``run`` once to warm up, then ``rounds`` times (each after ``reset``): the median seconds of a round on
    the wall clock and on the process's CPU clock, and the aten operators of one more profiled round, without
    autograd."""
    with torch.no_grad():
        run()  # warm-up
        times, cpu_times = [], []
        for _ in range(rounds):
            reset()
            start, cpu_start = time.perf_counter(), time.process_time()
            run()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        reset()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            run()
    calls = sum(event.count for event in profiler.key_averages() if event.key.startswith("aten::"))
    return statistics.median(times), statistics.median(cpu_times), calls


def measure(name: str, args) -> dict:
    """Median microseconds per step (per prefill with ``--prefill``) and aten operators per step (prefill)
    of one cell's layer."""
    from dofla.cache import RecurrentCacheLayer

    student = build_layer(name, args)
    generator = torch.Generator().manual_seed(1)

    def draw(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, args.head_dim, generator=generator)

    if args.prefill:
        inputs = (
            draw(args.heads, args.prefill),
            draw(args.kv_heads, args.prefill),
            draw(args.kv_heads, args.prefill),
        )
        seconds, cpu_seconds, calls = timed(lambda: student(*inputs), args.rounds)
        return dict(cell=name, us=seconds * 1e6, cpu_us=cpu_seconds * 1e6, ops=calls)

    layer = RecurrentCacheLayer()
    steps = [(draw(args.heads, 1), draw(args.kv_heads, 1), draw(args.kv_heads, 1)) for _ in range(args.steps)]

    def run_steps() -> None:
        for query, key, value in steps:
            student.pending_cache_layer = layer
            student(query, key, value)

    with torch.no_grad():
        student.pending_cache_layer = layer
        student(draw(args.heads, args.fill), draw(args.kv_heads, args.fill), draw(args.kv_heads, args.fill))
    prefilled = layer.state

    def reset() -> None:
        layer.state = prefilled

    seconds, cpu_seconds, calls = timed(run_steps, args.rounds, reset)
    per_step = 1e6 / args.steps
    return dict(cell=name, us=seconds * per_step, cpu_us=cpu_seconds * per_step, ops=calls / args.steps)


def run_here(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    return [measure(name, args) for name in args.cells]


def allocation_rows(args) -> list[dict]:
    """Per cell, the times at each dimension of ``args.allocation`` and at their mean, measured interleaved
    (``--rounds`` rounds, each at every dimension in turn), and the ratio of the allocation's mean time to the
    mean dimension's."""
    torch.set_num_threads(args.threads)
    low, high = args.allocation
    middle = (low + high) // 2
    rows = []
    for name in args.cells:
        times = {low: [], middle: [], high: []}
        for _ in range(args.rounds):
            for dimension in times:
                one_round = argparse.Namespace(**{**vars(args), "feature_dim": dimension, "rounds": 1})
                times[dimension].append(measure(name, one_round)["us"])
        medians = {dimension: statistics.median(values) for dimension, values in times.items()}
        mixed = (medians[low] + medians[high]) / 2
        rows.append(dict(cell=name, dims=(low, middle, high), us=medians, ratio=mixed / medians[middle]))
    return rows


def allocation_table(args, argv: list[str]) -> str:
    low, high = args.allocation
    middle = (low + high) // 2
    unit = "prefill" if args.prefill else "step"
    lines = [
        f"command: {' '.join(['bench_layer_step.py', *argv])}",
        f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), float32",
        "",
        f"per-layer {_what(args)}, B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, window "
        f"{args.window}; median of {args.rounds} interleaved rounds",
        "",
        f"| cell | F={low} µs | F={high} µs | mean of the two | F={middle} µs | {low}/{high} against {middle} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in allocation_rows(args):
        us = row["us"]
        lines.append(
            f"| {row['cell']} | {us[low]:.1f} | {us[high]:.1f} | {(us[low] + us[high]) / 2:.1f} | "
            f"{us[middle]:.1f} | {row['ratio']:.3f}x |"
        )
    return "\n".join(lines) + f"\n\n(µs per {unit})"


def run_in(source: str, args, argv: list[str]) -> list[dict]:
    """This script in a subprocess with ``source`` first on the path; its rows."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, __file__, *argv, "--json"]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def compare(args, argv: list[str]) -> str:
    """Alternate runs of ``--against`` and this checkout; a markdown table of the medians."""
    argv = [item for index, item in enumerate(argv) if not _is_against(argv, index)]
    load_before = os.getloadavg()
    results = {"before": {}, "after": {}}
    for _ in range(args.runs):
        for side, source in (("before", args.against), ("after", str(SOURCE))):
            for row in run_in(source, args, argv):
                results[side].setdefault(row["cell"], []).append(row)
    lines = [
        f"machine: {platform.machine()}, torch {torch.__version__}, float32",
        f"per-layer {_what(args)}, B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
        f"F={args.feature_dim}, window {args.window}, {args.threads} thread(s), "
        f"median of {args.runs} alternating runs",
        "",
        "| cell | before µs | after µs | speed-up | before CPU µs | after CPU µs | CPU speed-up | before ops "
        "| after ops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.cells:
        before, after = (statistics.median(row["us"] for row in results[side][name]) for side in results)
        cpu_before, cpu_after = (
            statistics.median(row.get("cpu_us", row["us"]) for row in results[side][name]) for side in results
        )
        ops = [results[side][name][0]["ops"] for side in ("before", "after")]
        lines.append(
            f"| {name} | {before:.0f} | {after:.0f} | {before / after:.3f}x | {cpu_before:.0f} | {cpu_after:.0f} "
            f"| {cpu_before / cpu_after:.3f}x | {ops[0]:.0f} | {ops[1]:.0f} |"
        )
    lines += ["", "wall-clock µs of each run, in order:"]
    for name in args.cells:
        for side in results:
            runs = ", ".join(f"{row['us']:.0f}" for row in results[side][name])
            lines.append(f"- {name}, {side}: {runs}")
    load_after = os.getloadavg()
    lines.append(
        "\nload average (1, 5, 15 min) before: "
        + ", ".join(f"{value:.2f}" for value in load_before)
        + "; after: "
        + ", ".join(f"{value:.2f}" for value in load_after)
    )
    return "\n".join(lines)


def _what(args) -> str:
    """What a row times, for the tables' headers."""
    return f"prefill of {args.prefill} tokens" if args.prefill else f"decode step after {args.fill} tokens"


def _is_against(argv: list[str], index: int) -> bool:
    item = argv[index]
    return item.startswith("--against") or (index > 0 and argv[index - 1] == "--against")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"cells: {', '.join(CELLS)}")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--fill", type=int, default=256, help="prefill tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=200, help="steps per round")
    parser.add_argument("--prefill", type=int, default=0, help="time a prefill of this many tokens instead")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", default=None, help="another checkout's src folder to compare with")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per side with --against")
    parser.add_argument(
        "--allocation",
        default=None,
        help="A,B: each cell at A and B features and at their mean; the allocation's cost against uniform",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    args.cells = [name.strip() for name in args.cells.split(",") if name.strip()]
    unknown = [name for name in args.cells if name not in CELLS]
    if unknown:
        parser.error(f"unknown cell {unknown[0]!r}; known: {', '.join(CELLS)}")
    if args.allocation is not None:
        try:
            args.allocation = tuple(int(item) for item in args.allocation.split(","))
        except ValueError:
            args.allocation = ()
        if len(args.allocation) != 2 or min(args.allocation) < 1 or sum(args.allocation) % 2:
            parser.error("--allocation takes two positive dimensions with an even sum, e.g. 32,96")
        if args.against:
            parser.error("--allocation and --against do not go together; run them apart")
        print(allocation_table(args, argv))
        return 0
    if args.against:
        print(compare(args, argv))
        return 0
    rows = run_here(args)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"command: {' '.join(['bench_layer_step.py', *argv])}")
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), float32\n")
    print(
        f"per-layer {_what(args)}, B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
        f"F={args.feature_dim}, window {args.window}, median of {args.rounds} rounds\n"
    )
    unit = "prefill" if args.prefill else "step"
    print(f"| cell | µs per {unit} | CPU µs per {unit} | aten ops per {unit} |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['cell']} | {row['us']:.1f} | {row['cpu_us']:.1f} | {row['ops']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
