"""Long-context retrieval: find a pass key hidden at a given depth in filler text.

The standard synthetic test for whether a model can still read far back: a five-digit key is
stated once inside repeated filler, and the model must repeat it when asked at the end. Scoring is
exact match of the first five digits of the greedy answer (the first number the model writes).
Deterministic for a seed: every model of a comparison gets the same prompts. Each trial is one
prefill (only the last position's logits) and at most :data:`MAX_NEW_TOKENS` greedy steps through
the cache, stopping once five digits are out or a started number has ended.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from dofla.config import DEFAULT_WINDOW
from dofla.errors import DoflaError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"
DEFAULT_CONTEXT_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
MAX_NEW_TOKENS = 8
KEY_DIGITS = 5


@dataclass(frozen=True)
class PasskeyResult:
    context_tokens: int
    depth: float
    accuracy: float
    trials: int
    prompt_tokens: int = (
        0  # mean prompt length actually used (the context minus the answer's room, if capped)
    )


def build_prompt(tokenizer, passkey: str, context_tokens: int, depth: float) -> torch.Tensor:
    """Token ids (1, ~context_tokens) with the key stated at ``depth`` (0 = start, 1 = end) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise DoflaError(f"depth must be between 0 and 1, got {depth}.")
    intro = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it. "
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    filler_ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    fixed = len(tokenizer(intro + needle + QUESTION, add_special_tokens=False)["input_ids"])
    repeats = max(1, (context_tokens - fixed) // max(1, len(filler_ids)))
    before = round(repeats * depth)
    text = intro + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return torch.tensor([ids])


def greedy_tokens(model, prompt: torch.Tensor, max_new_tokens: int, stop=None) -> list[int]:
    """Greedy continuation of ``prompt`` (1, T): one prefill, then one token at a time through a cache.

    stop: called with the tokens so far after each one; True ends decoding early.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # only the last position's logits: (1, T, V) float logits would dominate a long prefill
    keep_last = (
        {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    )
    logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, **keep_last).logits[:, -1]
    generated: list[int] = []
    for step in range(max_new_tokens):
        next_token = logits.argmax(-1, keepdim=True)  # (1, 1)
        generated.append(int(next_token))
        if step + 1 == max_new_tokens or (stop is not None and stop(generated)):
            break
        logits = model(input_ids=next_token, past_key_values=cache, use_cache=True).logits[:, -1]
    return generated


def _digits(tokenizer, tokens: list[int]) -> str:
    return "".join(ch for ch in tokenizer.decode(tokens, skip_special_tokens=True) if ch.isdigit())


def _answer_is_out(tokenizer, tokens: list[int]) -> bool:
    """Five digits are out, or a number has started and the last token ended it (no digit in it)."""
    digits = _digits(tokenizer, tokens)
    return len(digits) >= KEY_DIGITS or (bool(digits) and not _digits(tokenizer, tokens[-1:]))


def _greedy_digits(model, tokenizer, prompt: torch.Tensor) -> str:
    """The first five digits of the model's greedy answer after ``prompt`` (decoding stops once it is out)."""
    tokens = greedy_tokens(
        model, prompt, MAX_NEW_TOKENS, stop=lambda tokens: _answer_is_out(tokenizer, tokens)
    )
    return _digits(tokenizer, tokens)[:KEY_DIGITS]


def _trials(
    tokenizer, context_lengths, depths, trials, seed, limit
) -> list[tuple[int, float, str, torch.Tensor]]:
    """(context, depth, key, prompt ids) for every trial; a prompt leaves room for the answer within ``limit``."""
    rng = random.Random(seed)
    planned = []
    for context in context_lengths:
        target = context if limit is None else min(context, limit - MAX_NEW_TOKENS - 1)
        for depth in depths:
            for _ in range(trials):
                passkey = str(rng.randint(10000, 99999))
                planned.append((context, depth, passkey, build_prompt(tokenizer, passkey, target, depth)))
    return planned


@torch.no_grad()
def _run_trials(model, tokenizer, planned, trials: int) -> list[PasskeyResult]:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    results = []
    try:
        for start in range(0, len(planned), trials):
            group = planned[start : start + trials]
            hits = sum(
                int(_greedy_digits(model, tokenizer, prompt.to(device)) == passkey)
                for _, _, passkey, prompt in group
            )
            context, depth = group[0][0], group[0][1]
            prompt_tokens = round(sum(prompt.shape[1] for *_, prompt in group) / len(group))
            results.append(PasskeyResult(context, depth, hits / len(group), len(group), prompt_tokens))
    finally:
        model.train(was_training)
    return results


def _check_settings(context_lengths, depths, trials) -> None:
    if not context_lengths or any(int(length) < 1 for length in context_lengths):
        raise DoflaError(f"pass-key context lengths must be positive integers, got {list(context_lengths)}.")
    if not depths or any(not 0.0 <= float(depth) <= 1.0 for depth in depths):
        raise DoflaError(f"pass-key depths must lie between 0 and 1, got {list(depths)}.")
    if trials < 1:
        raise DoflaError(f"pass-key trials must be at least 1, got {trials}.")


def passkey_retrieval(
    model,
    tokenizer,
    *,
    context_lengths: Sequence[int] = (256, 1024),
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 3,
    seed: int = 0,
) -> list[PasskeyResult]:
    """Exact-match accuracy of the generated key per (context length, depth), for one model."""
    _check_settings(context_lengths, depths, trials)
    planned = _trials(tokenizer, context_lengths, depths, trials, seed, None)
    return _run_trials(model, tokenizer, planned, trials)


def passkey_comparison(
    teacher,
    student,
    tokenizer,
    *,
    context_lengths: Sequence[int] | None = None,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 3,
    window: int = DEFAULT_WINDOW,
    sinks: int = 4,
    seed: int = 0,
    cache_budget: int | None = None,
) -> dict:
    """Pass-key accuracy of the teacher, its window baseline and the student on the same prompts.

    context_lengths: default :data:`DEFAULT_CONTEXT_LENGTHS` up to the teacher's maximum positions; a
    length given beyond that maximum is a DoflaError naming both numbers. A prompt leaves room for the
    answer within the teacher's maximum (``prompt_tokens`` says what was used). The window baseline is
    the teacher's softmax restricted to the last ``window`` tokens plus ``sinks`` first ones, untrained.
    In the layers the student converted only, when its plan keeps some as softmax (``window_layers``).
    student: None measures the teacher and its baseline only. The bounded-cache baselines
    (:mod:`dofla.evaluation.cache_baselines`, ``sinks`` sinks) keep at each length as many of the teacher's
    keys as fit in the bytes the student's cache holds after that length's first prompt, or
    ``cache_budget`` keys per layer where given; they evict during the prompt and the answer alike.

    Returns ``{"context_lengths", "depths", "trials", "window", "sinks", "rows": {name: {"label",
    "results": [{"context_tokens", "depth", "accuracy", "trials", "prompt_tokens"}]}}, "state_bytes":
    {name: {length: bytes}}, "cache_baselines": {length: [{"name", "tokens", "sinks", "label"}]},
    "notes"}``.
    """
    from dofla.evaluation.cache_baselines import (
        CACHE_BASELINES,
        baseline_bytes,
        check_cache_budget,
        equal_bytes_baselines,
    )
    from dofla.evaluation.long_context import check_context, context_limit
    from dofla.evaluation.window_baseline import baseline_layers, baseline_notes, window_restricted

    limit = context_limit(teacher)
    restricted = baseline_layers(student)
    notes = baseline_notes(student, int(window))
    if context_lengths is None:
        context_lengths = [length for length in DEFAULT_CONTEXT_LENGTHS if limit is None or length <= limit]
        if len(context_lengths) < len(DEFAULT_CONTEXT_LENGTHS):
            notes.append(f"lengths beyond the teacher's {limit} positions were left out.")
    context_lengths = [int(length) for length in context_lengths]
    _check_settings(context_lengths, depths, trials)
    for length in context_lengths:
        check_context(teacher, length, "a pass-key context")
    if cache_budget is not None:
        check_cache_budget(cache_budget, context_lengths, sinks)
    planned = _trials(tokenizer, context_lengths, depths, trials, seed, limit)
    label = f"window {window}" + (f" + {sinks} sinks" if sinks else "")
    baseline = "window" if sinks == 0 else f"window+sinks{sinks}"
    rows = {"teacher": {"label": "teacher", "results": _run_trials(teacher, tokenizer, planned, trials)}}
    with window_restricted(teacher, window, sinks, layers=restricted):
        rows[baseline] = {"label": label, "results": _run_trials(teacher, tokenizer, planned, trials)}
    state_bytes: dict[str, dict[str, int]] = {name: {} for name in [*rows, *CACHE_BASELINES, "student"]}
    chosen: dict[str, list[dict]] = {}
    noted: set[str] = set()
    for length in context_lengths:
        group = [trial for trial in planned if trial[0] == length]
        prompt = group[0][3]
        measured, bounded = equal_bytes_baselines(
            teacher, student, prompt, prompt.shape[1], sinks, restricted, cache_budget, noted
        )
        for name, count in measured.items():
            state_bytes[name][str(length)] = count
        state_bytes[baseline][str(length)] = baseline_bytes(
            teacher, window + sinks, prompt.shape[1], restricted
        )
        chosen[str(length)] = [item.summary() for item in bounded]
        for item in bounded:
            with item.applied(teacher, restricted):
                row = rows.setdefault(item.name, {"label": item.kind_label, "results": []})
                row["results"] += _run_trials(teacher, tokenizer, group, trials)
            state_bytes[item.name][str(length)] = baseline_bytes(
                teacher, item.tokens, prompt.shape[1], restricted
            )
    if student is not None:
        rows["student"] = {"label": "student", "results": _run_trials(student, tokenizer, planned, trials)}
    for row in rows.values():
        row["results"] = [asdict(result) for result in row["results"]]
    notes += sorted(noted)
    return {
        "context_lengths": context_lengths,
        "depths": [float(depth) for depth in depths],
        "trials": int(trials),
        "window": int(window),
        "sinks": int(sinks),
        "window_layers": restricted,
        "rows": rows,
        "state_bytes": {name: by_length for name, by_length in state_bytes.items() if name in rows},
        "cache_baselines": chosen,
        "notes": notes,
    }


def passkey_markdown(result: dict, *, heading: str = "## Pass-key retrieval") -> str:
    """A compact table: a row per model, a column per context length, accuracy per depth in each cell."""
    from dofla.evaluation.long_context_report import aligned_table

    depths = "/".join(f"{depth:g}" for depth in result["depths"])
    header = ["model", *(f"{length} tokens" for length in result["context_lengths"]), "mean"]
    body = []
    state = result.get("state_bytes") or {}
    for name, row in result["rows"].items():
        cells = []
        for length in result["context_lengths"]:
            accuracies = [r["accuracy"] for r in row["results"] if r["context_tokens"] == length]
            cell = "/".join(f"{accuracy:.2f}" for accuracy in accuracies) or "-"
            held = state.get(name, {}).get(str(length))
            cells.append(cell if held is None else f"{cell} ({held / 2**20:.2f} MiB)")
        mean = sum(r["accuracy"] for r in row["results"]) / max(1, len(row["results"]))
        body.append([row["label"], *cells, f"{mean:.2f}"])
    lines = [
        heading,
        "",
        f"Exact-match accuracy of a five-digit key hidden at depths {depths} of the context "
        f"({result['trials']} trials each, greedy decoding); in brackets, the bytes each model's cache holds "
        "at that length."
        + "".join(
            f" At {length} tokens: " + ", ".join(item["label"] for item in items) + "."
            for length, items in (result.get("cache_baselines") or {}).items()
            if items
        ),
        "",
        aligned_table(header, body),
    ]
    lines += [f"\nNote: {note}" for note in result.get("notes", [])]
    return "\n".join(lines) + "\n"
