"""Held-out quality at length: teacher, no-training window baselines and student side by side, by position.

A converted model is only worth having if it beats the teacher restricted to a sliding window (plus a
few sink tokens) with no training at all (:mod:`dofla.evaluation.window_baseline`), at the training
length and beyond. :func:`long_context_quality` measures, for each context length asked:

- next-token perplexity overall and by token-position bucket (:func:`position_buckets`: the tokens
  predicted from fewer than ``window`` tokens, then doubling ranges up to the length) for the teacher,
  each window baseline and the student;
- the mean KL divergence from the teacher's next-token distribution (nats per token) and the share of
  tokens whose most likely next token agrees with the teacher's (top-1), for every row but the teacher;
- a finer loss-by-position curve for :func:`plot_loss_by_position`.

The teacher and the student are separate model objects (a student may carry merged LoRA weights, so
its non-attention weights need not be the teacher's). Each batch gets one forward per row; logits are
scored a chunk of rows at a time and reduced at once (:mod:`dofla.evaluation.logits`), so memory does
not grow with the number of sequences. The returned dict is JSON-able: non-finite numbers are None,
and ``notes`` says why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from dofla.errors import DoflaError
from dofla.evaluation.cache_baselines import (
    CACHE_BASELINES,
    CacheBaseline,
    baseline_bytes,
    check_cache_budget,
    equal_bytes_baselines,
)
from dofla.evaluation.logits import (
    final_hidden_states,
    kl_from_teacher,
    output_logits,
    row_chunks,
    vocabulary_size,
)
from dofla.evaluation.perplexity import exp_or_inf
from dofla.evaluation.window_baseline import (
    REFERENCE_WINDOW,
    baseline_layers,
    baseline_notes,
    check_edge_sinks,
    window_restricted,
)

DEFAULT_SINKS = (0, 4)
CURVE_POINTS = 32  # log-spaced position bins of the loss-by-position curve
NON_FINITE_NOTE = (
    "null marks a number that is not finite: a mean loss that is NaN or infinite (the model produced "
    "non-finite logits), or a perplexity whose exp overflows."
)


# ------------------------------------------------------------------------------------------- positions


def position_buckets(length: int, window: int) -> list[tuple[int, int]]:
    """Buckets [start, end) of predicted-token positions 1..length-1: [1, w), [w, 2w), [2w, 4w), ... .

    Position t is the token predicted from the t tokens before it. Example: window 64 at 1024 gives
    1-63, 64-127, 128-255, 256-511, 512-1023. A window of at least ``length`` gives one bucket.
    """
    if length < 2:
        raise DoflaError(f"a sequence needs at least 2 tokens to predict one, got length {length}.")
    if window < 1:
        raise DoflaError(f"the window must be at least 1 token, got {window}.")
    edges = [1]
    edge = window
    while edge < length:
        if edge > edges[-1]:
            edges.append(edge)
        edge *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:], strict=True))


def bucket_label(start: int, end: int) -> str:
    """'1-63' for the bucket [1, 64)."""
    return f"{start}-{end - 1}" if end - 1 > start else str(start)


def curve_bins(length: int, points: int = CURVE_POINTS) -> list[tuple[int, int]]:
    """About ``points`` log-spaced bins [start, end) covering positions 1..length-1 (for plotting)."""
    edges = sorted({1, length, *(round(length ** (index / points)) for index in range(points + 1))})
    return list(zip(edges[:-1], edges[1:], strict=True))


# ---------------------------------------------------------------------------------------------- inputs


def context_limit(model: torch.nn.Module) -> int | None:
    """The model's maximum positions (``max_position_embeddings`` or GPT-2's ``n_positions``), if it says."""
    from dofla.models import get_adapter

    return get_adapter(model).context_length


def check_context(model: torch.nn.Module, length: int, what: str = "a context") -> None:
    """Refuse a context longer than the teacher's maximum positions, naming both numbers."""
    limit = context_limit(model)
    if limit is not None and length > limit:
        raise DoflaError(
            f"{what} of {length} tokens is longer than the teacher's maximum of {limit} positions; "
            f"ask for lengths up to {limit}."
        )


def pack_by_length(
    tokenizer, texts: Sequence[str], lengths: Sequence[int], sequences: int, start_token: int | None = None
) -> dict[int, torch.Tensor]:
    """Held-out text packed at each length: ``{length: (N, length) token ids}``, at most ``sequences`` each.

    Each length packs the same text from its start (``dofla.data.pack_token_sequences``), so a longer
    length reads the same tokens in fewer, longer sequences; the text is tokenised only as far as
    ``sequences`` rows need. ``start_token``: what every row starts with
    (the beginning-of-sequence token where the teacher's family needs one, :func:`dofla.data.row_start_token`).
    """
    from dofla.data import pack_token_sequences, start_rows

    if sequences < 1:
        raise DoflaError(f"the number of sequences must be at least 1, got {sequences}.")
    return {
        int(length): start_rows(
            pack_token_sequences(tokenizer, texts, int(length), max_rows=sequences), start_token
        )
        for length in lengths
    }


# --------------------------------------------------------------------------------------------- scoring


class _PositionSums:
    """Per predicted position (length - 1 of them): summed NLL, KL from the teacher, top-1 agreement."""

    def __init__(self, length: int) -> None:
        self.nll = torch.zeros(length - 1, dtype=torch.float64)
        self.kl = torch.zeros(length - 1, dtype=torch.float64)
        self.agree = torch.zeros(length - 1, dtype=torch.float64)
        self.count = 0  # sequences (every position is predicted once per sequence)

    def mean(self, values: torch.Tensor, start: int, end: int) -> float:
        return float(values[start - 1 : end - 1].sum()) / (self.count * (end - start))


def _score_batch(
    batch: torch.Tensor,
    rows: Mapping[str, tuple[torch.nn.Module, torch.Tensor]],
    sums: Mapping[str, _PositionSums],
) -> None:
    """Add one batch's per-position NLL (every row) and KL / top-1 against the teacher (other rows) to ``sums``.

    rows: name -> (the model whose output head reads the hidden states, final hidden states (B, T, E));
    the first entry is the teacher's. Each chunk of positions makes the teacher's log-probabilities and
    probabilities once; every other row's are reduced against them and dropped.
    """
    size, length = batch.shape
    names = list(rows)
    flat = {name: hidden[:, :-1].reshape(-1, hidden.shape[-1]) for name, (_, hidden) in rows.items()}
    targets = batch[:, 1:].reshape(-1)  # (B*(T-1),)
    count = targets.shape[0]
    nll = {name: torch.empty(count, dtype=torch.float64) for name in names}
    kl = {name: torch.empty(count, dtype=torch.float64) for name in names[1:]}
    agree = {name: torch.empty(count, dtype=torch.float64) for name in names[1:]}
    teacher_name = names[0]
    for chunk in row_chunks(count, vocabulary_size(rows[teacher_name][0])):
        target = targets[chunk, None]
        teacher_model, _ = rows[teacher_name]
        teacher_log_probs = torch.log_softmax(
            output_logits(teacher_model, flat[teacher_name][chunk]), dim=-1
        )  # (R, V)
        nll[teacher_name][chunk] = _target_nll(teacher_log_probs, target)
        teacher_probs, teacher_top = teacher_log_probs.exp(), teacher_log_probs.argmax(-1)
        for name in names[1:]:
            model, _ = rows[name]
            log_probs = torch.log_softmax(output_logits(model, flat[name][chunk]), dim=-1)  # (R, V) float32
            nll[name][chunk] = _target_nll(log_probs, target)
            agree[name][chunk] = (log_probs.argmax(-1) == teacher_top.to(log_probs.device)).double().cpu()
            kl[name][chunk] = kl_from_teacher(teacher_log_probs, teacher_probs, log_probs).double().cpu()
    for name in names:
        sums[name].nll += nll[name].view(size, length - 1).sum(0)
        sums[name].count += size
        if name in kl:
            sums[name].kl += kl[name].view(size, length - 1).sum(0)
            sums[name].agree += agree[name].view(size, length - 1).sum(0)


def _target_nll(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """-log p(target) per row, (R,) float64 on the CPU, from log-probabilities (R, V) and targets (R, 1)."""
    return -log_probs.gather(-1, target.to(log_probs.device)).squeeze(-1).double().cpu()


def _number(value: float, notes: set[str]) -> float | None:
    if math.isfinite(value):
        return value
    notes.add(NON_FINITE_NOTE)
    return None


def _measures(sums: _PositionSums, start: int, end: int, compared: bool, notes: set[str]) -> dict:
    nll = sums.mean(sums.nll, start, end)
    measures = {"nll": _number(nll, notes), "perplexity": _number(exp_or_inf(nll), notes)}
    if compared:
        measures["kl"] = _number(sums.mean(sums.kl, start, end), notes)
        measures["top1"] = _number(sums.mean(sums.agree, start, end), notes)
    return measures


def _row_names(window: int, sinks: Sequence[int], with_student: bool, at_edge: bool) -> dict[str, dict]:
    rows: dict[str, dict] = {"teacher": {"label": "teacher"}}
    for count in sinks:
        name = "window" if count == 0 else f"window+sinks{count}"
        label = f"window {window}" + (f" + {count} sinks" if count else "")
        rows[name] = {"label": label, "window": window, "sinks": count}
    for count in sinks if at_edge else ():
        if count:
            label = f"window {window} + {count} sinks at the edge"
            rows[f"window+sinks{count}@edge"] = {
                "label": label,
                "window": window,
                "sinks": count,
                "at_edge": True,
            }
    if with_student:
        rows["student"] = {"label": "student"}
    return rows


def _check_sequences(sequences: torch.Tensor, length: int, vocabulary: int) -> None:
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.shape[1] != length:
        shape = tuple(sequences.shape) if isinstance(sequences, torch.Tensor) else type(sequences).__name__
        raise DoflaError(f"the sequences for length {length} must be a tensor (N, {length}), got {shape}.")
    if sequences.shape[0] < 1:
        raise DoflaError(f"no sequences of {length} tokens to evaluate; give more held-out text.")
    if int(sequences.min()) < 0 or int(sequences.max()) >= vocabulary:
        raise DoflaError(
            f"the sequences for length {length} hold token ids outside the model's vocabulary 0..{vocabulary - 1}."
        )


@torch.no_grad()
def long_context_quality(
    teacher: torch.nn.Module,
    student: torch.nn.Module | None,
    sequences_by_length: Mapping[int, torch.Tensor],
    *,
    window: int = REFERENCE_WINDOW,
    sinks: Sequence[int] = DEFAULT_SINKS,
    buckets: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    batch_size: int = 4,
    progress: Callable[[str], None] | None = None,
    sinks_at_edge: bool = False,
    cache_sinks: int = 4,
    cache_budget: int | None = None,
) -> dict:
    """Perplexity by position bucket for teacher, window baselines and student, and KL / top-1, per length.

    teacher: the plain teacher (the window baselines run on it); student: the converted model (None to
    measure the teacher and its baselines only). sequences_by_length: ``{length: (N, length) token ids}``
    of held-out text (:func:`pack_by_length`). window, sinks: one baseline per entry of ``sinks`` (0 = the
    window alone); ``sinks_at_edge`` adds, for each nonzero count, the baseline whose sinks are seen from the
    window's edge (``window+sinks4@edge``; :func:`dofla.evaluation.window_baseline.edge_sink_window_attention`,
    rotary teachers only). A student that keeps some layers as full softmax (its plan) is compared with
    baselines restricting only the layers it converted (``window_layers`` in the result, a note says so).
    buckets: ``{length: [(start, end), ...]}`` to override :func:`position_buckets`. Every length is checked
    against the teacher's maximum positions before any model runs.

    The bounded-cache baselines (:mod:`dofla.evaluation.cache_baselines`: ``streaming``, ``heavy-hitter``,
    with ``cache_sinks`` sinks) keep, at each length, as many of the teacher's keys as fit in the bytes the
    student's cache holds there, or ``cache_budget`` keys per layer where given (without a student and a
    budget they are left out). ``state_bytes`` gives every row's bytes at each length: measured (the storage
    the cache holds after a prefill) for the teacher and the student, computed from the keys kept for the
    baselines.

    Returns ``{"window", "sinks", "teacher_context", "rows": {name: label and settings},
    "by_length": {"1024": {"length", "sequences", "predicted_tokens", "buckets": [{"start", "end",
    "label"}], "models": {name: {"nll", "perplexity", ("kl", "top1",) "buckets": [...]}},
    "loss_by_position": {"start", "end", "nll": {name: [...]}}, "seconds": {name: forward seconds,
    "output_heads": scoring seconds}, "state_bytes": {name: bytes}, "cache_baselines": {name: {"name",
    "tokens", "sinks", "label"}}}}, "notes": [...]}``; row names are ``teacher``, ``window``,
    ``window+sinks4``, ..., ``streaming``, ``heavy-hitter`` and ``student``.
    """
    if batch_size < 1:
        raise DoflaError(f"the batch size must be at least 1, got {batch_size}.")
    sinks = [int(count) for count in sinks]
    if any(count < 0 for count in sinks) or len(set(sinks)) != len(sinks):
        raise DoflaError(f"sink counts must be distinct non-negative integers, got {sinks}.")
    if int(window) < 1:
        raise DoflaError(f"the window must be at least 1 token, got {window}.")
    if not sequences_by_length:
        raise DoflaError("no lengths to evaluate; give held-out sequences for at least one length.")
    from dofla.models.surgery import is_converted

    if is_converted(teacher) or teacher is student:
        raise DoflaError("the teacher given is a converted model; pass the plain teacher, loaded on its own.")
    vocabulary = vocabulary_size(teacher)
    if student is not None and vocabulary_size(student) != vocabulary:
        raise DoflaError(
            f"the student's vocabulary ({vocabulary_size(student)}) differs from the teacher's ({vocabulary})."
        )
    for length, sequences in sequences_by_length.items():
        check_context(teacher, int(length))
        _check_sequences(sequences, int(length), vocabulary)
    if sinks_at_edge:
        check_edge_sinks(teacher)
    if cache_budget is not None:
        check_cache_budget(cache_budget, [int(length) for length in sequences_by_length], cache_sinks)
    rows = _row_names(int(window), sinks, student is not None, sinks_at_edge)
    notes: set[str] = set(baseline_notes(student, int(window)))
    restricted = baseline_layers(student)
    measured_bytes, cache_rows = _cache_baselines(
        teacher, student, sequences_by_length, restricted, cache_sinks, cache_budget, notes
    )
    if any(cache_rows.values()):
        kept_student = rows.pop("student", None)
        for name in CACHE_BASELINES:
            rows[name] = {"label": CacheBaseline(name, 0, 0).kind_label}
        if kept_student is not None:
            rows["student"] = kept_student
    result: dict = {
        "window": int(window),
        "sinks": sinks,
        "teacher_context": context_limit(teacher),
        "window_layers": restricted,
        "rows": rows,
        "by_length": {},
    }
    models = [teacher] + ([student] if student is not None else [])
    modes = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        for length, sequences in sequences_by_length.items():
            length = int(length)
            chosen = buckets.get(length) if buckets else None
            baselines = {baseline.name: baseline for baseline in cache_rows[length]}
            here = {
                name: row for name, row in rows.items() if name not in CACHE_BASELINES or name in baselines
            }
            measured = _one_length(
                teacher,
                student,
                sequences,
                here,
                chosen or position_buckets(length, int(window)),
                int(window),
                restricted,
                batch_size,
                notes,
                progress,
                baselines,
            )
            measured["cache_baselines"] = {name: baseline.summary() for name, baseline in baselines.items()}
            measured["state_bytes"] = _state_bytes(
                teacher, here, baselines, measured_bytes[length], length, restricted
            )
            result["by_length"][str(length)] = measured
    finally:
        for model, mode in zip(models, modes, strict=True):
            model.train(mode)
    result["notes"] = sorted(notes)
    return result


def _cache_baselines(
    teacher, student, sequences_by_length, restricted, sinks: int, budget: int | None, notes: set[str]
) -> tuple[dict[int, dict[str, int]], dict[int, list[CacheBaseline]]]:
    """Per length: the bytes the teacher's and the student's caches hold after a prefill of the first row,
    and the bounded-cache baselines of the student's bytes (or of ``budget`` keys per layer)."""
    measured, baselines = {}, {}
    for length, sequences in sequences_by_length.items():
        length = int(length)
        measured[length], baselines[length] = equal_bytes_baselines(
            teacher, student, sequences[:1], length, sinks, restricted, budget, notes
        )
    if budget is None and student is not None:
        notes.add(
            "StreamingLLM and heavy hitters (H2O) keep, at each length, as many of the teacher's keys and "
            "values per layer as fit in the bytes the student's cache holds there (state MiB)."
        )
    if any(baselines.values()):
        notes.add(
            "state MiB: the storage the cache holds after a prefill of the length, measured for the teacher "
            "and the student; computed from the keys kept for the window, StreamingLLM and heavy-hitter "
            "baselines, which run as masks over the teacher's ordinary cache."
        )
    return measured, baselines


def _state_bytes(teacher, rows, baselines, measured, length: int, restricted) -> dict[str, int]:
    """Every row's cache bytes at ``length``: measured for the teacher and the student, computed otherwise."""
    state = {}
    for name, row in rows.items():
        if name in measured:
            state[name] = measured[name]
        elif name in baselines:
            state[name] = baseline_bytes(teacher, baselines[name].tokens, length, restricted)
        else:
            state[name] = baseline_bytes(teacher, row["window"] + row.get("sinks", 0), length, restricted)
    return state


def row_hidden_states(
    name: str, teacher, student, batch, window: int, sinks: int, layers, at_edge: bool = False
) -> tuple:
    """(the model whose output head a row reads, its final hidden states (B, T, E)) for a comparison row:
    ``teacher``, ``student``, or any other name the teacher cut to ``window`` keys plus ``sinks`` first
    ones in ``layers`` (None: all), seen from the window's edge where ``at_edge``."""
    if name == "teacher":
        return teacher, final_hidden_states(teacher, batch)
    if name == "student":
        return student, final_hidden_states(student, batch)
    with window_restricted(teacher, window, sinks, layers=layers, sinks_at_edge=at_edge):
        return teacher, final_hidden_states(teacher, batch)


def _one_length(
    teacher, student, sequences, rows, buckets, window, restricted, batch_size, notes, progress, baselines
) -> dict:
    length = sequences.shape[1]
    sums = {name: _PositionSums(length) for name in rows}
    seconds = dict.fromkeys([*rows, "output_heads"], 0.0)
    batches = sequences.split(batch_size)
    started = time.perf_counter()
    for index, batch in enumerate(batches, start=1):
        hidden: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {}
        for name, row in rows.items():
            clock = time.perf_counter()
            if name in baselines:
                with baselines[name].applied(teacher, restricted):
                    hidden[name] = teacher, final_hidden_states(teacher, batch)
            else:
                hidden[name] = row_hidden_states(
                    name,
                    teacher,
                    student,
                    batch,
                    window,
                    row.get("sinks", 0),
                    restricted,
                    row.get("at_edge", False),
                )
            seconds[name] += time.perf_counter() - clock
        clock = time.perf_counter()
        _score_batch(batch, hidden, sums)
        seconds["output_heads"] += time.perf_counter() - clock
        if progress is not None:
            progress(f"length {length}: batch {index}/{len(batches)} ({time.perf_counter() - started:.0f} s)")
    bucket_rows = [
        {"start": start, "end": end - 1, "label": bucket_label(start, end)} for start, end in buckets
    ]
    models = {}
    for name in rows:
        compared = name != "teacher"
        entry = _measures(sums[name], 1, length, compared, notes)
        entry["buckets"] = [_measures(sums[name], start, end, compared, notes) for start, end in buckets]
        models[name] = entry
    bins = curve_bins(length)
    curve = {
        "start": [start for start, _ in bins],
        "end": [end - 1 for _, end in bins],
        "nll": {
            name: [_number(sums[name].mean(sums[name].nll, start, end), notes) for start, end in bins]
            for name in rows
        },
    }
    return {
        "length": length,
        "sequences": int(sequences.shape[0]),
        "predicted_tokens": int(sequences.shape[0]) * (length - 1),
        "buckets": bucket_rows,
        "models": models,
        "loss_by_position": curve,
        "seconds": {name: round(value, 3) for name, value in seconds.items()},
    }


# --------------------------------------------------------------------------------------------- reports
