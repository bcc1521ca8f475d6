"""Where a teacher's first load goes (de-quantising a GGUF and writing the cached copy): the CPU seconds of
the imports and of :func:`dofla.models.load_teacher`, and cProfile's functions by cumulative time. Point
``DOFLA_CACHE`` at an empty folder for a cold load.

    DOFLA_CACHE=$(mktemp -d) python bench/profile_cold_load.py            # the embedded SmolLM2-135M
    DOFLA_CACHE=$(mktemp -d) python bench/profile_cold_load.py model.gguf --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--top", type=int, default=45, help="functions shown")
    args = parser.parse_args(argv)
    cpu, wall = time.process_time(), time.time()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from dofla.models import load_teacher

    print(f"imports: cpu {time.process_time() - cpu:.1f} s, wall {time.time() - wall:.1f} s", flush=True)
    profile = cProfile.Profile()
    cpu, wall = time.process_time(), time.time()
    profile.enable()
    teacher = load_teacher(args.model)
    profile.disable()
    print(f"load_teacher: cpu {time.process_time() - cpu:.1f} s, wall {time.time() - wall:.1f} s", flush=True)
    print(teacher.source)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
