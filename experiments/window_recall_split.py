"""A finished gated-delta-recall run's student with its bounded state split differently, no training.

The state of a recall-cache student holds, per layer and key-value head, ``window + sinks`` recent keys and
``recall_cache`` keys its memory recalls worst (plus the memory itself). This script loads the run's saved
student, gives every converted layer each ``WINDOW:RECALL`` split of ``--splits`` in turn (the same trained
weights; the window and the recall cache are read at call time), and measures perplexity on the run's own
held-out rows at each ``--lengths`` (made again from its config exactly as the run made them) and the pass
key at those lengths or at ``--passkey-lengths`` (the default depths, as the run). Every split must hold as
many tokens as the run's own (``window + recall_cache`` equal): the same state bytes, so the run's
equal-bytes baselines still apply.

A ``need:WINDOW:RECALL`` item gives the layers windows of WINDOW tokens on average, split by measured need:
the teacher's attention by query-key distance on the run's first held-out rows (:func:`attention_by_distance`)
and, from a floor of ``--min-window`` tokens, each further token of window to the layer whose attention at
its next distance is largest (:func:`windows_by_need`): the same total, so the same state bytes.

    .venv/bin/python experiments/window_recall_split.py --run RUN --splits 128:288,256:160,384:32,need:384:32 \\
        --lengths 2048,4096 --threads 2 --out OUT

Writes ``window_recall_split.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import heapq
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


def parse_splits(text: str) -> list[tuple[int, int, bool]]:
    """``"128:288,need:384:32"`` -> [(128, 288, False), (384, 32, True)] (window, recall cache, split by
    need); one sentence for anything else."""
    splits = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        need = item.startswith("need:")
        window, _, recall = item.removeprefix("need:").partition(":")
        if not (window.isdigit() and recall.isdigit()) or int(window) < 1 or int(recall) < 1:
            raise SystemExit(
                f"--splits takes WINDOW:RECALL or need:WINDOW:RECALL items of whole numbers >= 1, got {item!r}."
            )
        splits.append((int(window), int(recall), need))
    if not splits:
        raise SystemExit("--splits is empty; give WINDOW:RECALL items, e.g. 128:288,384:32.")
    return splits


@torch.no_grad()
def attention_by_distance(model, rows: torch.Tensor, sinks: int) -> torch.Tensor:
    """(layers, T): per layer, the mean over heads and queries of ``rows`` (B, T) of the attention weight the
    model (eager attention) puts on the key ``d`` tokens back, for d = 0 .. T-1, the first ``sinks`` keys left
    out (every window keeps them)."""
    length = rows.shape[1]
    position = torch.arange(length)
    distance = (position[:, None] - position[None, :]).clamp(min=0).flatten()  # (T * T,): i - j, i >= j
    totals = None
    for row in rows:
        attentions = model(row[None], output_attentions=True).attentions  # per layer (1, H, T, T)
        by_layer = []
        for weights in attentions:
            summed = weights[0].float().sum(0)  # (T, T) over heads
            summed[:, :sinks] = 0
            by_layer.append(torch.bincount(distance, weights=summed.flatten(), minlength=length))
        stacked = torch.stack(by_layer) / (attentions[0].shape[1] * length)
        totals = stacked if totals is None else totals + stacked
    return totals / len(rows)


def windows_by_need(by_distance: torch.Tensor, mean_window: int, floor: int) -> list[int]:
    """Windows per layer summing to ``mean_window`` x layers: each layer starts at ``floor`` tokens and each
    further token goes to the layer whose attention at the distance it would add (``by_distance``, from
    :func:`attention_by_distance`) is largest, a layer's window growing at most to the measured length."""
    layers, length = by_distance.shape
    if not 1 <= floor <= mean_window:
        raise SystemExit(f"--min-window must be between 1 and the mean window {mean_window}; got {floor}.")
    if mean_window > length:
        raise SystemExit(
            f"the mean window {mean_window} is more than the measured rows' {length} tokens can place."
        )
    windows = [floor] * layers
    heap = [(-float(by_distance[layer, floor]), layer) for layer in range(layers) if floor < length]
    heapq.heapify(heap)
    for _ in range((mean_window - floor) * layers):  # no window outgrows the rows: mean_window <= length
        _, layer = heapq.heappop(heap)
        windows[layer] += 1
        if windows[layer] < length:
            heapq.heappush(heap, (-float(by_distance[layer, windows[layer]]), layer))
    return windows


def set_split(model, windows: int | list[int], recall: int) -> None:
    """Every converted layer of ``model`` (and its plan) with a window of ``windows`` tokens (one per layer in
    order, or one for all) and a recall cache of ``recall`` tokens per head."""
    switch_on_recall_cache(model, recall)
    for order, (index, student) in enumerate(sorted(students(model).items())):
        window = windows if isinstance(windows, int) else windows[order]
        student.window = window
        model.dofla_plan.layers[index].window = window


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="a finished run's folder (config.toml, model/)")
    parser.add_argument("--splits", required=True, help="comma-separated WINDOW:RECALL items")
    parser.add_argument("--lengths", required=True, help="held-out lengths of the run to measure")
    parser.add_argument("--passkey-lengths", default=None, help="pass-key lengths (default: --lengths)")
    parser.add_argument("--passkey-trials", type=int, default=None, help="default: the run's")
    parser.add_argument("--min-window", type=int, default=16, help="each layer's least window in need: items")
    parser.add_argument("--need-rows", type=int, default=2, help="held-out rows the need is measured on")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    splits = parse_splits(args.splits)
    lengths = integer_list(args.lengths, "--lengths", minimum=2)
    passkey_lengths = (
        integer_list(args.passkey_lengths, "--passkey-lengths", minimum=2)
        if args.passkey_lengths
        else lengths
    )
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
    for window, recall, _ in splits:
        if window + recall != own_window + own_recall:
            raise SystemExit(
                f"the split {window}:{recall} holds {window + recall} tokens per head and the run's "
                f"{own_window}:{own_recall} holds {own_window + own_recall}; give splits that sum to it."
            )
    command = "experiments/window_recall_split.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.time()
    torch.manual_seed(config.seed)  # as the run: its rows draw from this
    loaded = load_teacher(
        config.teacher.model,
        dtype=config.teacher.dtype,
        device=config.teacher.device,
        attn_implementation="eager",
    )
    data = prepare_data(config, loaded.model, loaded.tokenizer, None, out / "data_cache")
    missing = [n for n in lengths if n not in data.heldout_by_length]
    if missing:
        raise SystemExit(
            f"the run has no held-out rows of {missing} tokens; it has {sorted(data.heldout_by_length)}."
        )
    by_distance = None
    if any(need for *_, need in splits):  # the teacher's attention by distance on the run's first rows
        rows = data.heldout_by_length[lengths[0]][: args.need_rows]
        by_distance = attention_by_distance(loaded.model, rows, layers[min(layers)].sinks)
    del loaded
    # every split's windows, before any is measured (a need split refused here costs no measuring)
    windows_of = [windows_by_need(by_distance, w, args.min_window) if need else w for w, _, need in splits]
    trials = config.evaluate.passkey_trials if args.passkey_trials is None else args.passkey_trials
    from dofla.evaluation.passkey import passkey_retrieval

    rows = []
    for (window, recall, need), windows in zip(splits, windows_of, strict=True):
        set_split(model, windows, recall)
        row = {"window": window, "recall_cache": recall, "by_need": need, "perplexity": {}, "passkey": {}}
        if need:
            row["windows"] = windows
        for length in lengths:
            sequences = data.heldout_by_length[length]
            row["perplexity"][length] = perplexity(model, sequences, config.distill.batch_size)
        if trials:
            results = passkey_retrieval(model, tokenizer, context_lengths=passkey_lengths, trials=trials)
            for length in passkey_lengths:
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
        + (" | " + " | ".join(f"pass key {n}" for n in passkey_lengths) if trials else "")
        + " |",
        "|---|---|" + "---|" * (len(lengths) + (len(passkey_lengths) if trials else 0)),
    ]
    for row in rows:
        cells = [f"{row['perplexity'][n]:.3f}" for n in lengths]
        if trials:
            cells += [f"{sum(row['passkey'][n][0])}/{row['passkey'][n][1]}" for n in passkey_lengths]
        window = f"{row['window']} on average, by need" if row["by_need"] else str(row["window"])
        lines.append(f"| {window} | {row['recall_cache']} | " + " | ".join(cells) + " |")
    for row in rows:
        if row["by_need"]:
            lines += ["", f"Windows by need (mean {row['window']}), layer 0 first: {row['windows']}."]
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(command=command, seconds=seconds, run=str(run), rows=rows)
    if by_distance is not None:
        payload["attention_by_distance"] = by_distance.tolist()
    write_text_atomic(out / "window_recall_split.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "window_recall_split.json", json.dumps(payload, indent=2, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
