"""What-if: a trained hybrid student whose window sees its sinks from the window's edge, with no retraining.

The hybrid cells' windows see their sink tokens at their true rotary positions, which SmolLM2 stops using
beyond about 4,096 tokens of distance (``experiments/sink_positions.py``). The cells have no edge-sink option
yet; this script measures what one would give a saved student by patching the chunked window's sink scores
(``dofla.ops.chunked.sink_sums``; the gated delta cell's window is sent through the general chunked path,
which uses it, instead of the fused one) so that query t scores the sinks as if it stood at position
min(t, window + sinks). Only whole uncached rows run here (the chunked form), so the patch is exact for them;
it is a measurement, not a feature (decoding is not patched).

    python experiments/edge_sinks_student.py --run runs/cpu_150k/gated_delta_w128 \\
        --out docs/results/long_context/sink_positions/student [--lengths 4096,8192] [--period 1024]

The rows are those of ``sink_positions.py`` and ``beyond_training_length.sh`` (the start of one long document).
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch
from sink_positions import length_table, perplexities  # experiments/, beside this script

import dofla.cells.delta as delta
import dofla.ops.chunked as chunked
from dofla.convert import load_converted, set_position_period, students
from dofla.evaluation.window_baseline import edge_sink_queries
from dofla.models import load_teacher
from dofla.rotary import rotary_frequencies


@contextmanager
def sinks_at_edge(window: int, frequencies: torch.Tensor):
    """The chunked window's sink scores taken from queries turned back to position min(t, window + sinks)."""
    original = chunked.sink_sums

    def patched(queries, sink, *, scaling, softcap=None):  # queries (B, Hk, G, T, D)
        turned = edge_sink_queries(queries, window, sink.keys.shape[2], frequencies)
        return original(turned, sink, scaling=scaling, softcap=softcap)

    window_attention = delta.chunked_window_attention

    def general_window(query, keys, values, *, key_mask=None, **options):
        # an all-present key mask takes the general path (whose sinks go through sink_sums), not the fused one
        if key_mask is None:
            key_mask = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
        return window_attention(query, keys, values, key_mask=key_mask, **options)

    chunked.sink_sums, delta.chunked_window_attention = patched, general_window
    try:
        yield
    finally:
        chunked.sink_sums, delta.chunked_window_attention = original, window_attention


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
        raise SystemExit(
            "this what-if takes a student whose every layer is hybrid with one window and sinks."
        )
    ((window, sinks),) = windows
    frequencies = rotary_frequencies(student)
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
            named[f"student, sinks at true positions{suffix}"] = perplexities(student, rows)
            with sinks_at_edge(window, frequencies):
                named[f"student, sinks at the window's edge{suffix}"] = perplexities(student, rows)
        results.append({"length": length, "sequences": args.sequences, "perplexity": named})
        lines += length_table(named, length, args.sequences)
        print("\n".join(lines[-len(named) - 5 :]), flush=True)
    (out / "edge_sinks_student.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "edge_sinks_student.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
