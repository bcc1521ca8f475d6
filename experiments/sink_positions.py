"""Where should a window's sink tokens sit? The teacher's softmax cut to a window plus sinks, two ways.

A window-plus-sinks cache (the no-training baseline, and the softmax half of every hybrid student) lets each
query see the last W keys and the first S tokens. The keys carry rotary positions, so a sink is seen at its
true distance, up to the whole context. This measures the other choice (what a cache that numbers its own
slots does): each query sees the sinks as if it stood at position min(t, W + S), i.e. the sinks just before
its window at a fixed distance. Nothing is trained; only the teacher runs.

    python experiments/sink_positions.py --out docs/results/long_context/sink_positions \\
        [--data ../shared/data/wiki_demo/tinyshakespeare.txt] [--lengths 1024,2048,4096,8192] [--sequences 4]

Rows are cut from the start of one long document at each length (as ``beyond_training_length.sh`` does), and
perplexity is given overall and by position of the predicted token. The two baselines are
``dofla.evaluation.window_baseline.window_restricted`` with and without ``sinks_at_edge`` (``dofla evaluate
--edge-sinks`` shows both beside a student).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from dofla.evaluation.window_baseline import window_restricted
from dofla.models import load_teacher

BUCKETS = [(1, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]


def perplexities(model, rows: torch.Tensor) -> list[float]:
    """Overall, then per bucket of predicted-token positions that the rows reach."""
    length = rows.shape[1]
    losses = torch.zeros(length - 1)
    with torch.no_grad():
        for row in rows:
            logits = model(row[None]).logits[0, :-1].float()
            losses += F.cross_entropy(logits, row[1:], reduction="none")
    losses /= rows.shape[0]
    buckets = [(a, min(b, length)) for a, b in BUCKETS if a < length]
    return [math.exp(losses.mean())] + [math.exp(losses[a - 1 : b - 1].mean()) for a, b in buckets]


def length_table(named: dict[str, list[float]], length: int, sequences: int) -> list[str]:
    """Markdown lines: one row per model (overall, ratio to ``teacher``, buckets) under a length heading."""
    buckets = [f"{a}-{min(b, length) - 1}" for a, b in BUCKETS if a < length]
    lines = [f"**{length} tokens** ({sequences} sequences)", ""]
    lines += ["| model | ppl | x teacher | " + " | ".join(buckets) + " |"]
    lines += ["|---|---:|---:|" + "---:|" * len(buckets)]
    for name, values in named.items():
        cells = " | ".join(f"{v:.2f}" for v in values[1:])
        lines.append(f"| {name} | {values[0]:.2f} | {values[0] / named['teacher'][0]:.2f} | {cells} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="../shared/data/wiki_demo/tinyshakespeare.txt")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--windows", default="64,128", help="window sizes, each with --sinks sinks")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    teacher = load_teacher("smollm2-135m")
    model, tokenizer = teacher.model.eval(), teacher.tokenizer
    ids = tokenizer(Path(args.data).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, lines = [], []
    for length in [int(x) for x in args.lengths.split(",")]:
        rows = ids[: args.sequences * length].view(args.sequences, length)
        named = {"teacher": perplexities(model, rows)}
        for window in [int(x) for x in args.windows.split(",")]:
            for label, at_edge in (("true positions", False), ("at the window's edge", True)):
                with window_restricted(model, window, args.sinks, sinks_at_edge=at_edge):
                    named[f"window {window} + {args.sinks} sinks, {label}"] = perplexities(model, rows)
        results.append({"length": length, "sequences": args.sequences, "perplexity": named})
        lines += length_table(named, length, args.sequences)
        print("\n".join(lines[-len(named) - 5 :]), flush=True)
    (out / "sink_positions.json").write_text(json.dumps(results, indent=2) + "\n")
    header = f"# Sink positions: the teacher cut to a window plus {args.sinks} sinks, two ways\n\n"
    (out / "sink_positions.md").write_text(header + "\n".join(lines))


if __name__ == "__main__":
    main()
