"""Run the CPU benchmarks and write their printed tables into bench/results/ (``make bench``).

Each benchmark prints its own command, machine and a markdown table of ratios against the softmax
teacher measured in the same run; this script only runs them and keeps what they printed.
BENCHMARKS.md quotes these files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "ops": ["bench_ops.py"],
    "decode_memory": ["bench_decode_memory.py"],
    "distill": ["bench_distill.py"],
    # every cell, the recipes' students and the teacher on an in-place cache vs the teacher at 1k-16k, batch
    # 1 and 8 (about 40 min; supersedes bench_generation.py on the CPU, which stays for GPU runs:
    # `bench/run_all.py generation` still runs it)
    "speed": ["bench_speed.py"],
}
OPTIONAL = {
    "generation": ["bench_generation.py", "--contexts", "1024,4096"],
    # one layer's decode step per cell at one thread (µs and aten operators per step)
    "layer_step": ["bench_layer_step.py"],
}


def main() -> int:
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    selected = sys.argv[1:] or list(BENCHMARKS)
    failures = 0
    for name in selected:
        script, *options = {**BENCHMARKS, **OPTIONAL}[name]
        command = [sys.executable, str(HERE / script), *options]
        load = "load average before the run (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"== {name}: {' '.join(command)}", flush=True)
        completed = subprocess.run(command, capture_output=True, text=True)
        print(completed.stdout)
        if completed.returncode != 0:
            failures += 1
            print(completed.stderr[-4000:], file=sys.stderr)
            continue
        (results / f"{name}.md").write_text(load + "\n" + completed.stdout)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
