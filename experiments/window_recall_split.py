"""A finished gated-delta-recall run's student with its bounded state split differently, no training.

The state of a recall-cache student holds, per layer and key-value head, ``window + sinks`` recent keys and
``recall_cache`` keys its memory recalls worst (plus the memory itself). This script loads the run's saved
student, gives every converted layer each ``WINDOW:RECALL`` split of ``--splits`` in turn (the same trained
weights; the window and the recall cache are read at call time), and measures perplexity on the run's own
held-out rows at each ``--lengths`` (made again from its config exactly as the run made them) and the pass
key at those lengths (the default depths, as the run). Every split must hold as many tokens as the run's own
(``window + recall_cache`` equal): the same state bytes, so the run's equal-bytes baselines still apply.

    .venv/bin/python experiments/window_recall_split.py --run RUN --splits 128:288,256:160,384:32 \\
        --lengths 2048,4096 --threads 2 --out OUT

Writes ``window_recall_split.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla.cells.recall_cache import switch_on_recall_cache
from dofla.commands._common import integer_list
from dofla.io import write_text_atomic
from dofla.loading import load_converted
from dofla.models import load_teacher
from dofla.models.surgery import students
from dofla.pipeline import perplexity
from dofla.run_config import CONFIG_FILE, load_config
from dofla.run_data import prepare_data


def parse_splits(text: str) -> list[tuple[int, int]]:
    """``"128:288,384:32"`` -> [(128, 288), (384, 32)]; one sentence for anything else."""
    splits = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        window, _, recall = item.partition(":")
        if not (window.isdigit() and recall.isdigit()) or int(window) < 1 or int(recall) < 1:
            raise SystemExit(f"--splits takes WINDOW:RECALL items of whole numbers >= 1, got {item!r}.")
        splits.append((int(window), int(recall)))
    if not splits:
        raise SystemExit("--splits is empty; give WINDOW:RECALL items, e.g. 128:288,384:32.")
    return splits


def set_split(model, window: int, recall: int) -> None:
    """Every converted layer of ``model`` (and its plan) with a window of ``window`` tokens and a recall cache
    of ``recall`` tokens per head."""
    switch_on_recall_cache(model, recall)
    for index, student in students(model).items():
        student.window = window
        model.dofla_plan.layers[index].window = window


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="a finished run's folder (config.toml, model/)")
    parser.add_argument("--splits", required=True, help="comma-separated WINDOW:RECALL items")
    parser.add_argument("--lengths", required=True, help="held-out lengths of the run to measure")
    parser.add_argument("--passkey-trials", type=int, default=None, help="default: the run's")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    splits = parse_splits(args.splits)
    lengths = integer_list(args.lengths, "--lengths", minimum=2)
    if args.threads:
        torch.set_num_threads(args.threads)
    run, out = Path(args.run), Path(args.out)
    config = load_config(run / CONFIG_FILE)
    model, tokenizer, _ = load_converted(run / "model")
    layers = students(model)
    own = {(layer.window, layer.recall_budget) for layer in layers.values()}
    if len(own) != 1 or not next(iter(own))[1]:
        raise SystemExit(f"{run} is not a run whose every layer holds one window and a recall cache: {own}.")
    own_window, own_recall = next(iter(own))
    for window, recall in splits:
        if window + recall != own_window + own_recall:
            raise SystemExit(
                f"the split {window}:{recall} holds {window + recall} tokens per head and the run's "
                f"{own_window}:{own_recall} holds {own_window + own_recall}; give splits that sum to it."
            )
    command = "experiments/window_recall_split.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.time()
    torch.manual_seed(config.seed)  # as the run: its rows draw from this
    loaded = load_teacher(config.teacher.model, dtype=config.teacher.dtype, device=config.teacher.device)
    data = prepare_data(config, loaded.model, loaded.tokenizer, None, out / "data_cache")
    del loaded
    missing = [n for n in lengths if n not in data.heldout_by_length]
    if missing:
        raise SystemExit(
            f"the run has no held-out rows of {missing} tokens; it has {sorted(data.heldout_by_length)}."
        )
    trials = config.evaluate.passkey_trials if args.passkey_trials is None else args.passkey_trials
    from dofla.evaluation.passkey import passkey_retrieval

    rows = []
    for window, recall in splits:
        set_split(model, window, recall)
        row = {"window": window, "recall_cache": recall, "perplexity": {}, "passkey": {}}
        for length in lengths:
            sequences = data.heldout_by_length[length]
            row["perplexity"][length] = perplexity(model, sequences, config.distill.batch_size)
        if trials:
            results = passkey_retrieval(model, tokenizer, context_lengths=lengths, trials=trials)
            for length in lengths:
                at = [r for r in results if r.context_tokens == length]
                row["passkey"][length] = [round(r.accuracy * r.trials) for r in at], trials * len(at)
        rows.append(row)
        print(json.dumps(row), flush=True)
    seconds = time.time() - started
    lines = [
        "# The run's student with its window and recall cache split differently, no training",
        "",
        f"Command: `{command}` ({seconds:.0f} s, {torch.get_num_threads()} threads). Run: `{run}`, trained "
        f"with window {own_window} + {layers[min(layers)].sinks} sinks and a recall cache of {own_recall}; "
        "every split holds the same tokens per head (the same state bytes). Held-out rows as the run made them.",
        "",
        "| window | recall cache | "
        + " | ".join(f"ppl {n}" for n in lengths)
        + (" | " + " | ".join(f"pass key {n}" for n in lengths) if trials else "")
        + " |",
        "|---|---|" + "---|" * (len(lengths) * (2 if trials else 1)),
    ]
    for row in rows:
        cells = [f"{row['perplexity'][n]:.3f}" for n in lengths]
        if trials:
            cells += [f"{sum(row['passkey'][n][0])}/{row['passkey'][n][1]}" for n in lengths]
        lines.append(f"| {row['window']} | {row['recall_cache']} | " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(command=command, seconds=seconds, run=str(run), rows=rows)
    write_text_atomic(out / "window_recall_split.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "window_recall_split.json", json.dumps(payload, indent=2, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
