"""One compiled decoding step (``dofla.ops.compiled``) alone: microseconds per call, eager and compiled, with
its inputs in the caches and after a sweep of other memory (as in a model, where the layer's MLP weights pass
through the caches between two attention steps).

The shapes are SmolLM2-135M's attention with the ``gated-delta`` recipe's cell: B=1, H=9 query heads, Hs=3
state heads, head size 64, F=64 features, a window of 128 + 4 sinks, its memory turned by a position period
and its sinks seen from the window's edge; 30 layers' worth of separate inputs, as a model's layers have.

    python bench/bench_compiled_kernel.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from dofla.ops.compiled import compiled
from dofla.ops.delta.step import gated_delta_window_step


def layer_inputs(generator: torch.Generator, batch: int) -> list:
    """One layer's arguments of ``gated_delta_window_step``."""

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    heads, state_heads, dim, slots, half = 9, 3, 64, 132, 32
    return [
        draw(batch, heads, 1, dim),
        draw(batch, state_heads, 1, dim),
        draw(batch, state_heads, 1, dim),
        draw(batch, state_heads, dim, dim, scale=0.1),  # memory
        draw(state_heads, dim, dim),  # map weight
        draw(state_heads, dim),
        draw(state_heads),
        draw(state_heads, dim),
        draw(state_heads),
        draw(heads),  # mix logit
        draw(batch, state_heads, slots, dim),
        draw(batch, state_heads, slots, dim),
        torch.tensor([5]),
        *(draw(batch, 1, 1, half) for _ in range(4)),  # the period's and the edge's cosines and sines
        None,
        None,
        None,
        None,
        None,
        dim**-0.5,
        4,
    ]


def timed(step, layers: list, sweep: torch.Tensor | None, rounds: int) -> float:
    """Median over ``rounds`` of the mean microseconds of one call, each call after a sweep of ``sweep``
    (when given) and not counting it."""
    means = []
    for _ in range(rounds):
        spent = 0.0
        for arguments in layers:
            if sweep is not None:
                sweep.add_(1.0)
            start = time.perf_counter()
            step(*arguments)
            spent += time.perf_counter() - start
        means.append(spent / len(layers))
    return statistics.median(means) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sweep-mib", type=int, default=40, help="memory swept between calls (MiB)")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    layers = [layer_inputs(generator, args.batch) for _ in range(30)]
    sweep = torch.zeros(args.sweep_mib * 2**20 // 4)
    kernel = compiled(gated_delta_window_step)
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, float32"
    )
    print(f"gated_delta_window_step, batch {args.batch}, 30 layers' inputs, median of {args.rounds} rounds\n")
    print("| step | inputs in the caches (µs) | after a sweep of other memory (µs) |\n|---|---:|---:|")
    with torch.no_grad():
        kernel(*layers[0])  # compiles
        for name, step in (("eager (the plain function)", gated_delta_window_step), ("compiled", kernel)):
            hot = timed(step, layers, None, args.rounds)
            cold = timed(step, layers, sweep, args.rounds)
            print(f"| {name} | {hot:.1f} | {cold:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
