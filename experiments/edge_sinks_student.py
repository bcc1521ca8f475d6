"""A trained hybrid student whose windows see their sinks from the window's edge, with no retraining.

The hybrid cells' windows see their sink tokens at their true rotary positions by default, which SmolLM2
stops using beyond about 4,096 tokens of distance (``experiments/sink_positions.py``). This script measures a
saved student switched to sinks at the window's edge (``dofla.convert.set_sinks_at_edge``, the plan option
``sinks_at_edge``: query t scores the sinks as if it stood at position min(t, window + sinks)) beside the
same student with true positions, with and without a position period, on whole uncached rows.

    python experiments/edge_sinks_student.py --run runs/cpu_150k/gated_delta_w128 \\
        --out docs/results/long_context/sink_positions/student [--lengths 4096,8192] [--period 1024]

The rows are those of ``sink_positions.py`` and ``beyond_training_length.sh`` (the start of one long document).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from sink_positions import length_table, perplexities  # experiments/, beside this script

from dofla.convert import set_position_period, set_sinks_at_edge
from dofla.loading import load_converted
from dofla.models import load_teacher
from dofla.models.surgery import students


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="a run folder holding a saved hybrid student in model/")
    parser.add_argument("--data", default="../shared/data/wiki_demo/tinyshakespeare.txt")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--period", type=int, default=1024, help="also measured with this position period")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    student, tokenizer, plan = load_converted(str(Path(args.run) / "model"))
    windows = {(layer.window, layer.sinks) for layer in students(student).values() if layer.kind == "hybrid"}
    if len(windows) != 1 or len(students(student)) != plan.num_layers:
        raise SystemExit("this script takes a student whose every layer is hybrid with one window and sinks.")
    ((window, sinks),) = windows
    teacher = load_teacher("smollm2-135m").model.eval()
    student.eval()
    ids = tokenizer(Path(args.data).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, lines = (
        [],
        [f"# A saved student with its {sinks} sinks seen from its {window}-token window's edge", ""],
    )
    for length in [int(x) for x in args.lengths.split(",")]:
        rows = ids[: args.sequences * length].view(args.sequences, length)
        named = {"teacher": perplexities(teacher, rows)}
        for period in (None, args.period):
            set_position_period(student, period)
            suffix = "" if period is None else f", period {period}"
            set_sinks_at_edge(student, False)
            named[f"student, sinks at true positions{suffix}"] = perplexities(student, rows)
            set_sinks_at_edge(student, True)
            named[f"student, sinks at the window's edge{suffix}"] = perplexities(student, rows)
        results.append({"length": length, "sequences": args.sequences, "perplexity": named})
        lines += length_table(named, length, args.sequences)
        print("\n".join(lines[-len(named) - 5 :]), flush=True)
    (out / "edge_sinks_student.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "edge_sinks_student.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
