"""What a decode step and a prefill spend their time on: torch.profiler's top operators, per cell and the teacher.

For each model (the teacher, then each student cell converted from it with an untrained plan) it profiles
``--steps`` decode steps at each batch size (from a real prefill of ``--fill`` tokens) and one prefill of
``--prefill`` tokens at batch 1, and prints the operators sorted by self CPU time, with the number of
operator calls per decode step and layer (what Python-level overhead scales with).

    python bench/profile_decode.py                                # embedded SmolLM2-135M, all cells
    python bench/profile_decode.py --cells linear --batches 8 --top 15
    python bench/profile_decode.py --cells "gated-delta recipe" --batches 1 --fill 1200 --counts-only \
        --position-period 1024 --sinks-at-edge    # operator calls per step and layer, as linearize converts
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from dofla.convert import unconvert

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from bench_speed import DEFAULT_STUDENTS, STUDENTS, TEACHER, build_model, prepared_model  # noqa: E402


def profile_model(model, name: str, args) -> str:
    layers = model.config.get_text_config().num_hidden_layers
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    lines = []
    with torch.no_grad():
        for batch in args.batches:
            prompt = torch.randint(0, vocab, (batch, args.fill), generator=generator)
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = torch.zeros(batch, 1, dtype=torch.long)
            for _ in range(2):  # warm-up
                model(input_ids=token, past_key_values=cache, use_cache=True)
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                for _ in range(args.steps):
                    model(input_ids=token, past_key_values=cache, use_cache=True)
            seconds = (time.perf_counter() - start) / args.steps
            events = profiler.key_averages()
            calls = sum(event.count for event in events if event.key.startswith("aten::"))
            total = sum(event.self_cpu_time_total for event in events) / args.steps / 1000
            lines += [
                f"## {name}: decode step, batch {batch}, after {args.fill} tokens",
                f"{seconds * 1000:.1f} ms per step under the profiler ({total:.1f} ms of operator self time), "
                f"{calls / args.steps / layers:.0f} aten calls per step and layer",
            ]
            if not args.counts_only:
                lines.append(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if args.counts_only or not args.prefill:
            return "\n".join(lines)
        prompt = torch.randint(0, vocab, (1, args.prefill), generator=generator)
        model(input_ids=prompt[:, :64], past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            model(input_ids=prompt, past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
        seconds = time.perf_counter() - start
        lines += [
            f"## {name}: prefill of {args.prefill} tokens, batch 1",
            f"{seconds:.2f} s under the profiler",
            profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke test)")
    parser.add_argument(
        "--cells", default=",".join(DEFAULT_STUDENTS), help=f"students: {', '.join(STUDENTS)}"
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument(
        "--fill", type=int, default=256, help="prompt tokens before the profiled decode steps"
    )
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the profiled prefill")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="operators shown per profile")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument(
        "--position-period", type=int, default=0, help="the students' position period (0: true positions)"
    )
    parser.add_argument(
        "--sinks-at-edge", action="store_true", help="the students' windows see their sinks from the edge"
    )
    parser.add_argument(
        "--counts-only", action="store_true", help="print the time and operator calls per step, no tables"
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [args.fill]  # build_model's position budget
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    print(f"command: {' '.join(['profile_decode.py', *sys.argv[1:]])}")
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, float32\n"
    )
    print(profile_model(model, TEACHER, args))
    for name in [name.strip() for name in args.cells.split(",") if name.strip()]:
        prepared_model(model, name, args, lambda line: None)
        try:
            print(profile_model(model, name, args))
        finally:
            unconvert(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
