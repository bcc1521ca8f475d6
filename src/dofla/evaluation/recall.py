"""Recall beyond the window: predicting a span of text the second time it appears, far back.

Each held-out row gets one repeated span (:func:`dofla.data.span_placements` with every row chosen): a
eighth of the row copied at least ``window`` tokens after its first occurrence. Every repeated token but
the span's first (which follows ordinary text) can be predicted exactly by looking back at the first
occurrence: the teacher does so through its softmax (its induction heads), the teacher restricted to the
window cannot, and a student can only through what its state carries. Unlike a pass key it needs no
prompt template and gives hundreds of scored tokens per row, so small differences show.

:func:`recall_beyond_window` reports, for the teacher, the window baseline (with sinks) and the student,
the loss, perplexity and top-1 accuracy (the next token exactly) on those tokens, and the share of the
teacher's gain over the window baseline the student keeps: (window - student) / (window - teacher) in
loss; 0 is no recall beyond the window, 1 the teacher's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dofla.data import copy_spans, span_placements
from dofla.errors import DoflaError
from dofla.evaluation.cache_baselines import (
    baseline_bytes,
    bytes_label,
    check_cache_budget,
    equal_bytes_baselines,
)
from dofla.evaluation.logits import final_hidden_states, output_logits, vocabulary_size
from dofla.evaluation.long_context import row_hidden_states
from dofla.evaluation.perplexity import exp_or_inf
from dofla.evaluation.window_baseline import baseline_layers

RECALL_SEED = 0


def repeated_rows(sequences: torch.Tensor, window: int, seed: int = RECALL_SEED):
    """Held-out rows (N, T) with one span each repeated beyond ``window``: (rows, scored), where scored
    is a list of (row, positions (S - 1,) whose next token is a repeated one, those tokens (S - 1,))."""
    placements = span_placements(*sequences.shape, 1.0, gap=window, seed=seed)
    rows = copy_spans(sequences, placements)
    scored = []
    for row, _, target, span in placements:
        positions = torch.arange(target, target + span - 1)
        scored.append((row, positions, rows[row, positions + 1]))
    return rows, sorted(scored, key=lambda item: item[0])


def row_scores(model, hidden: torch.Tensor, scored, offset: int) -> tuple[float, float, int]:
    """Summed loss and correct top-1 predictions over the scored positions of a batch's rows."""
    loss, correct, count = 0.0, 0.0, 0
    for row, positions, targets in scored:
        logits = output_logits(model, hidden[row - offset, positions.to(hidden.device)])  # (S - 1, V)
        log_probs = torch.log_softmax(logits, dim=-1)
        targets = targets.to(log_probs.device)
        loss += float(-log_probs.gather(-1, targets[:, None]).sum())
        correct += float((log_probs.argmax(-1) == targets).sum())
        count += len(targets)
    return loss, correct, count


def summed_scores(hidden_of, rows: torch.Tensor, scored, batch_size: int) -> tuple[float, float, int]:
    """:func:`row_scores` summed over ``rows`` (N, T) of :func:`repeated_rows`, ``batch_size`` rows at a time:
    ``hidden_of(batch)`` gives (the model whose output head reads, its final hidden states (B, T, E))."""
    loss, correct, count = 0.0, 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        in_batch = [item for item in scored if start <= item[0] < start + len(batch)]
        model, hidden = hidden_of(batch)
        scores = row_scores(model, hidden, in_batch, start)
        loss, correct, count = loss + scores[0], correct + scores[1], count + scores[2]
    return loss, correct, count


@torch.no_grad()
def recall_beyond_window(
    teacher: torch.nn.Module,
    student: torch.nn.Module | None,
    sequences: torch.Tensor,
    *,
    window: int,
    sinks: int = 4,
    batch_size: int = 4,
    seed: int = RECALL_SEED,
    cache_budget: int | None = None,
) -> dict:
    """Loss, perplexity and top-1 accuracy on tokens repeated beyond the window (module docstring).

    sequences (N, T): held-out token ids. Rows: ``teacher``, ``window`` (the teacher's softmax restricted to
    ``window`` keys plus ``sinks`` first ones, in the layers the student converted) and ``student`` (if
    given), and the bounded-cache baselines ``streaming`` and ``heavy-hitter``
    (:mod:`dofla.evaluation.cache_baselines`) of the bytes the student's cache holds at the rows' length, or
    of ``cache_budget`` keys per layer. Returns ``{"length", "sequences", "span", "window", "sinks", "tokens",
    "models": {name: {"label", "nll", "perplexity", "accuracy", "state_bytes"}}, "kept"}`` (kept: None
    without a student, or when the teacher does no better than the window).
    """
    if sequences.dim() != 2 or sequences.shape[0] < 1:
        raise DoflaError(f"recall needs held-out rows (N, T), got shape {tuple(sequences.shape)}.")
    if int(sequences.max()) >= vocabulary_size(teacher):
        raise DoflaError("the rows for recall hold token ids outside the teacher's vocabulary.")
    length = int(sequences.shape[1])
    if cache_budget is not None:
        check_cache_budget(cache_budget, [length], sinks)
    rows, scored = repeated_rows(sequences, window, seed)
    labels = {"teacher": "teacher", "window": f"window {window}" + (f" + {sinks} sinks" if sinks else "")}
    restricted = baseline_layers(student)
    notes = set()
    measured, baselines = equal_bytes_baselines(
        teacher, student, rows[:1], length, sinks, restricted, cache_budget, notes
    )
    state = {
        "teacher": measured["teacher"],
        "window": baseline_bytes(teacher, window + sinks, length, restricted),
    }
    if student is not None:
        state["student"] = measured["student"]
    bounded = {baseline.name: baseline for baseline in baselines}
    for name, baseline in bounded.items():
        labels[name] = baseline.label
        state[name] = baseline_bytes(teacher, baseline.tokens, length, restricted)
    if student is not None:
        labels["student"] = "student"

    def hidden_of(name: str):
        def bounded_teacher(batch):
            with bounded[name].applied(teacher, restricted):
                return teacher, final_hidden_states(teacher, batch)

        if name in bounded:
            return bounded_teacher
        return lambda batch: row_hidden_states(name, teacher, student, batch, window, sinks, restricted)

    totals = {name: summed_scores(hidden_of(name), rows, scored, batch_size) for name in labels}
    models = {}
    for name, (loss, correct, count) in totals.items():
        nll = loss / count
        finite = math.isfinite(nll)  # a broken model's NaN loss is reported as None (JSON has no NaN)
        models[name] = {
            "label": labels[name],
            "nll": nll if finite else None,
            "perplexity": exp_or_inf(nll) if finite else None,
            "accuracy": correct / count,
            "state_bytes": state[name],
        }
    kept = None
    gain = models["window"]["nll"] - models["teacher"]["nll"]
    if student is not None and gain > 0 and models["student"]["nll"] is not None:
        kept = (models["window"]["nll"] - models["student"]["nll"]) / gain
    return {
        "length": int(rows.shape[1]),
        "sequences": int(rows.shape[0]),
        "span": int(scored[0][1].numel() + 1),
        "window": int(window),
        "sinks": int(sinks),
        "tokens": totals["teacher"][2],
        "models": models,
        "kept": kept,
        "notes": sorted(notes),
    }


def recall_markdown(results: Sequence[dict], heading: str = "## Recall beyond the window") -> str:
    """A table per length: loss, perplexity and top-1 accuracy on the repeated tokens, and the share kept."""
    if not results:
        return ""
    first = results[0]
    lines = [
        heading,
        "",
        f"Each held-out row repeats one span of an eighth of its tokens at least {first['window']} tokens after its first occurrence; scored: the repeated tokens after the span's first (predictable "
        "only by looking back). kept: the share of the teacher's gain over the window baseline (in loss) "
        "the student keeps (0: no recall beyond the window, 1: the teacher's).",
        "",
    ]
    for result in results:
        lines += [
            f"**{result['length']} tokens** ({result['sequences']} rows, {result['tokens']} scored tokens)",
            "",
            "| model | loss | perplexity | top-1 accuracy | state MiB |",
            "|---|---|---|---|---|",
        ]
        for entry in result["models"].values():
            loss = "-" if entry["nll"] is None else f"{entry['nll']:.3f}"
            perplexity = "-" if entry["perplexity"] is None else f"{entry['perplexity']:.2f}"
            held = bytes_label(entry.get("state_bytes"))
            lines.append(f"| {entry['label']} | {loss} | {perplexity} | {entry['accuracy']:.3f} | {held} |")
        if result["kept"] is not None:
            lines += ["", f"kept: {result['kept']:.2f}"]
        lines.append("")
    return "\n".join(lines)
