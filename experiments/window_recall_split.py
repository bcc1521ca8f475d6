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

An ``induction:K:LONG:RECALL`` item gives the K layers whose heads copy most (:func:`induction_scores`: the
teacher's attention, on random tokens repeated once, from each token of the copy to the token that followed
its first occurrence) windows of LONG tokens, and every other layer an even share of what is left of the
run's total (:func:`induction_windows`), all with a recall cache of RECALL: the same tokens in all once every
window is full (at LONG + sinks tokens and beyond), fewer before.

A ``WINDOW:RECALL:HEAVY`` item keeps, beside the RECALL tokens the memory recalls worst, the HEAVY tokens
that drew the most attention while in the window (the cell option ``heavy_hitters``,
:mod:`dofla.ops.recall_cache.attention`); RECALL may then be 0.

``--recall`` also measures, at each length, the loss on text repeated beyond the run's own window
(:mod:`dofla.evaluation.recall`, the same rows and spans as the run's report), with the teacher's and that
window's (+ sinks) losses once, and each split's share of the teacher's gain (``kept``).

    .venv/bin/python experiments/window_recall_split.py --run RUN --splits 128:288,384:32,need:384:32 \\
        --lengths 2048,4096 --threads 2 --out OUT
    .venv/bin/python experiments/window_recall_split.py --run RUN --splits 384:32,induction:2:3584:32 \\
        --lengths 2048,4096 --recall --threads 2 --out OUT

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
from typing import NamedTuple

import torch

from dofla.cells.recall_cache import switch_on_recall_cache
from dofla.commands._common import integer_list
from dofla.evaluation.cache_baselines import held_state_bytes
from dofla.evaluation.logits import final_hidden_states
from dofla.evaluation.passkey import passkey_retrieval
from dofla.evaluation.recall import repeated_rows, summed_scores
from dofla.evaluation.window_baseline import window_restricted
from dofla.io import write_text_atomic
from dofla.loading import load_converted
from dofla.models import load_teacher
from dofla.models.surgery import students
from dofla.pipeline import perplexity
from dofla.run_config import CONFIG_FILE, load_config
from dofla.run_data import prepare_data


class Split(NamedTuple):
    """One item of ``--splits``: ``kind`` "uniform", "need" or "induction"; ``window`` (the mean window for
    need, the long one for induction), ``recall`` slots per head, ``long_layers`` (induction's K),
    ``heavy`` heavy-hitter slots per head."""

    kind: str
    window: int
    recall: int
    long_layers: int = 0
    heavy: int = 0

    def label(self) -> str:
        if self.kind == "need":
            return f"{self.window} on average, by need"
        if self.kind == "induction":
            return f"{self.window} in the {self.long_layers} layers that copy most, the rest even"
        return str(self.window)


def split_of(row: dict) -> Split:
    """The split a result row (of :func:`main`) measured."""
    return Split(row["kind"], row["window"], row["recall_cache"], row["long_layers"], row["heavy_hitters"])


def parse_splits(text: str) -> list[Split]:
    """``"128:288,need:384:32,induction:2:3584:32"`` -> Splits; one sentence for anything else."""
    splits = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split(":")
        kind = fields[0] if fields[0] in ("need", "induction") else "uniform"
        numbers = fields[1:] if kind != "uniform" else fields
        wanted = {"induction": (3,), "need": (2,), "uniform": (2, 3)}[kind]
        heavy = len(numbers) == 3 and kind == "uniform"
        whole = all(
            n.isdigit() and (int(n) >= 1 or (heavy and index == 1)) for index, n in enumerate(numbers)
        )
        if len(numbers) not in wanted or not whole or (heavy and int(numbers[2]) < 1):
            raise SystemExit(
                "--splits takes WINDOW:RECALL, WINDOW:RECALL:HEAVY, need:WINDOW:RECALL or "
                f"induction:LAYERS:LONG:RECALL items of whole numbers >= 1 (RECALL 0 with HEAVY), got {item!r}."
            )
        values = [int(n) for n in numbers]
        if kind == "induction":
            splits.append(Split(kind, values[1], values[2], values[0]))
        else:
            splits.append(Split(kind, values[0], values[1], 0, values[2] if heavy else 0))
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


@torch.no_grad()
def induction_scores(
    model, kv_heads: int, *, period: int = 256, trials: int = 2, seed: int = 0
) -> torch.Tensor:
    """(layers,): per layer, the largest over its key-value heads of the attention weight (the mean over the
    head's query heads and over the copy's tokens) from each token of a copy to the token that followed its
    first occurrence, on ``trials`` rows of ``period`` random tokens written twice (model: eager attention).
    A head near 1 copies (an induction head); a window shorter than the distance to the copy removes it."""
    vocabulary = int(model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(seed)
    totals = None
    for _ in range(trials):
        tokens = torch.randint(0, vocabulary, (period,), generator=generator)
        attentions = model(torch.cat([tokens, tokens])[None], output_attentions=True).attentions
        queries = torch.arange(period, 2 * period - 1)  # the copy's tokens but its last
        keys = queries - period + 1  # the token after each one's first occurrence
        by_layer = torch.stack([weights[0, :, queries, keys].float().mean(-1) for weights in attentions])
        totals = by_layer if totals is None else totals + by_layer  # (layers, heads)
    per_kv_head = (totals / trials).view(totals.shape[0], kv_heads, -1).mean(-1)
    return per_kv_head.amax(-1)


def induction_windows(scores: torch.Tensor, long_layers: int, long_window: int, total: int) -> list[int]:
    """Windows per layer summing to ``total``: ``long_window`` in the ``long_layers`` layers of highest
    ``scores``, the rest shared evenly by the others (where it does not divide, the first ones get one more)."""
    layers = len(scores)
    if not 1 <= long_layers < layers:
        raise SystemExit(
            f"an induction split gives 1 to {layers - 1} layers the long window; got {long_layers}."
        )
    left = total - long_layers * long_window
    if left < layers - long_layers:
        raise SystemExit(
            f"{long_layers} windows of {long_window} leave {left} tokens per head for the other "
            f"{layers - long_layers} layers; give a shorter long window or fewer long layers."
        )
    chosen = set(scores.argsort(descending=True)[:long_layers].tolist())
    share, extra = divmod(left, layers - long_layers)
    windows, given = [], 0
    for layer in range(layers):
        if layer in chosen:
            windows.append(long_window)
        else:
            windows.append(share + (given < extra))
            given += 1
    return windows


@torch.no_grad()
def recall_losses(model, rows: torch.Tensor, scored, batch_size: int) -> tuple[float, float]:
    """(mean loss, top-1 accuracy) on the repeated tokens ``scored`` of ``rows`` (:func:`repeated_rows`)."""
    loss, correct, count = summed_scores(
        lambda batch: (model, final_hidden_states(model, batch)), rows, scored, batch_size
    )
    return loss / count, correct / count


def set_split(model, windows: int | list[int], recall: int, heavy: int = 0) -> None:
    """Every converted layer of ``model`` (and its plan) with a window of ``windows`` tokens (one per layer in
    order, or one for all), a recall cache of ``recall`` tokens per head its memory recalls worst and
    ``heavy`` that drew the most attention."""
    switch_on_recall_cache(model, recall, heavy)
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
    parser.add_argument("--recall", action="store_true", help="also measure recall of repeated text")
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
    sinks = layers[min(layers)].sinks
    for split in splits:
        held = split.window + split.recall + split.heavy
        if split.kind != "induction" and held != own_window + own_recall:
            raise SystemExit(
                f"the split {split.window}:{split.recall} holds {held} tokens per head "
                f"and the run's {own_window}:{own_recall} holds {own_window + own_recall}; give splits that "
                "sum to it."
            )
        if split.kind == "induction" and split.recall >= own_window + own_recall:
            raise SystemExit(
                f"the recall cache of {split.recall} leaves no window in the run's {own_window + own_recall} "
                "tokens per head; give a smaller one."
            )
    trials = config.evaluate.passkey_trials if args.passkey_trials is None else args.passkey_trials
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
    kinds = {split.kind for split in splits}
    by_distance = copying = None
    if "need" in kinds:  # the teacher's attention by distance on the run's first rows
        rows = data.heldout_by_length[lengths[0]][: args.need_rows]
        by_distance = attention_by_distance(loaded.model, rows, sinks)
    if "induction" in kinds:
        copying = induction_scores(loaded.model, loaded.model.config.num_key_value_heads, seed=config.seed)
    teacher = loaded.model
    teacher.set_attn_implementation("sdpa")  # eager only to read the attention weights above
    # every split's windows, before any is measured (a split refused here costs no measuring)
    windows_of = []
    for split in splits:
        if split.kind == "need":
            windows_of.append(windows_by_need(by_distance, split.window, args.min_window))
        elif split.kind == "induction":
            total = len(layers) * (own_window + own_recall - split.recall)
            windows_of.append(induction_windows(copying, split.long_layers, split.window, total))
        else:
            windows_of.append(split.window)
    repeated, references = {}, {}
    if args.recall:  # the run's own spans and references: the teacher and its window of the run's size
        for length in lengths:
            repeated[length] = repeated_rows(data.heldout_by_length[length], own_window)
            teacher_loss = recall_losses(teacher, *repeated[length], config.distill.batch_size)
            with window_restricted(teacher, own_window, sinks):
                window_loss = recall_losses(teacher, *repeated[length], config.distill.batch_size)
            references[length] = {"teacher": teacher_loss, "window": window_loss}
    del loaded, teacher
    rows = []
    for split, windows in zip(splits, windows_of, strict=True):
        set_split(model, windows, split.recall, split.heavy)
        row = {
            "kind": split.kind,
            "window": split.window,
            "recall_cache": split.recall,
            "heavy_hitters": split.heavy,
        }
        row.update(long_layers=split.long_layers, perplexity={}, passkey={}, recall={})
        if not isinstance(windows, int):
            row["windows"] = windows
        row["state_bytes"] = held_state_bytes(model, data.heldout_by_length[max(lengths)][:1])
        for length in lengths:
            sequences = data.heldout_by_length[length]
            row["perplexity"][length] = perplexity(model, sequences, config.distill.batch_size)
            if args.recall:
                loss, accuracy = recall_losses(model, *repeated[length], config.distill.batch_size)
                (teacher_loss, _), (window_loss, _) = references[length].values()
                kept = (window_loss - loss) / (window_loss - teacher_loss)
                row["recall"][length] = {"loss": loss, "accuracy": accuracy, "kept": kept}
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
        f"with window {own_window} + {sinks} sinks and a recall cache of {own_recall}; every split holds the "
        "same tokens per head once its windows are full. Held-out rows as the run made them. Recall cache: the "
        "tokens the memory recalls worst; heavy hitters: those that drew the most attention while in the window. "
        f"State: the storage the model's cache holds after a prefill of {max(lengths)} tokens.",
        "",
        "| window | recall cache | heavy hitters | state MiB | "
        + " | ".join(f"ppl {n}" for n in lengths)
        + (" | " + " | ".join(f"recall kept {n}" for n in lengths) if args.recall else "")
        + (" | " + " | ".join(f"pass key {n}" for n in passkey_lengths) if trials else "")
        + " |",
        "|---|---|---|---|"
        + "---|" * (len(lengths) * (2 if args.recall else 1) + (len(passkey_lengths) if trials else 0)),
    ]
    for row in rows:
        cells = [f"{row['perplexity'][n]:.3f}" for n in lengths]
        if args.recall:
            cells += [f"{row['recall'][n]['kept']:.2f}" for n in lengths]
        if trials:
            cells += [f"{sum(row['passkey'][n][0])}/{row['passkey'][n][1]}" for n in passkey_lengths]
        lines.append(
            f"| {split_of(row).label()} | {row['recall_cache']} | {row['heavy_hitters']} | "
            f"{row['state_bytes'] / 2**20:.2f} | " + " | ".join(cells) + " |"
        )
    if args.recall:
        lines += [
            "",
            f"Recall: loss (nats per token) on text repeated at least {own_window} tokens after its first "
            "occurrence (the run report's spans); kept = (window - split) / (window - teacher):",
            "",
            "| model | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
            "| teacher | " + " | ".join(f"{references[n]['teacher'][0]:.3f}" for n in lengths) + " |",
            f"| window {own_window} + {sinks} sinks | "
            + " | ".join(f"{references[n]['window'][0]:.3f}" for n in lengths)
            + " |",
        ]
        for row in rows:
            lines.append(
                f"| {split_of(row).label()}, recall cache {row['recall_cache']}, heavy hitters {row['heavy_hitters']} | "
                + " | ".join(f"{row['recall'][n]['loss']:.3f}" for n in lengths)
                + " |"
            )
    for row in rows:
        if "windows" in row:
            lines += [
                "",
                f"Windows of the split `{row['kind']}` {row['window']}, layer 0 first: {row['windows']}.",
            ]
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(command=command, seconds=seconds, run=str(run), rows=rows)
    if by_distance is not None:
        payload["attention_by_distance"] = by_distance.tolist()
    if copying is not None:
        payload["induction_scores"] = copying.tolist()
    if references:
        payload["recall_references"] = references
    write_text_atomic(out / "window_recall_split.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "window_recall_split.json", json.dumps(payload, indent=2, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
