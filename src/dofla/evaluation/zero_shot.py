"""Zero-shot multiple-choice evaluation by log-likelihood, on local copies of the standard task files.

Every task becomes a list of :class:`Item`: one (context, continuation) pair per answer choice and
the index of the right one. A choice's score is the summed log-probability of its continuation
tokens given its context; ``acc`` picks the highest score, ``acc_norm`` the highest score per byte
of continuation (as lm-eval does). Nothing is downloaded: the task files are read from a folder
the user gives (the layout of each task's public release, see :data:`TASK_FILES`).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dofla.errors import DoflaError


@dataclass(frozen=True)
class Item:
    """One question: ``choices[i]`` is (context, continuation); ``label`` the index of the right one."""

    choices: tuple[tuple[str, str], ...]
    label: int


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DoflaError(f"{path} line {line_number} is not valid JSON ({error.msg}).") from None
    return records


def _read_labels(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


def _question_answer(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def load_piqa(folder: Path) -> list[Item]:
    records = _read_jsonl(folder / "valid.jsonl")
    labels = _read_labels(folder / "valid-labels.lst")
    return [
        Item(
            choices=tuple((_question_answer(r["goal"]), " " + r[key]) for key in ("sol1", "sol2")),
            label=label,
        )
        for r, label in zip(records, labels, strict=True)
    ]


def _load_arc(folder: Path, file_name: str) -> list[Item]:
    items = []
    for record in _read_jsonl(folder / file_name):
        labels = record["choices"]["label"]
        context = _question_answer(record["question"])
        choices = tuple((context, " " + text) for text in record["choices"]["text"])
        items.append(Item(choices=choices, label=labels.index(record["answerKey"])))
    return items


def load_arc_easy(folder: Path) -> list[Item]:
    return _load_arc(folder, "ARC-Easy-test.jsonl")


def load_arc_challenge(folder: Path) -> list[Item]:
    return _load_arc(folder, "ARC-Challenge-test.jsonl")


def load_winogrande(folder: Path) -> list[Item]:
    """Partial scoring: the blank is filled with each option and the rest of the sentence is scored."""
    items = []
    for record in _read_jsonl(folder / "dev.jsonl"):
        before, after = record["sentence"].split("_", 1)
        continuation = " " + after.strip()
        choices = tuple((before + record[key], continuation) for key in ("option1", "option2"))
        items.append(Item(choices=choices, label=int(record["answer"]) - 1))
    return items


def load_wsc273(folder: Path) -> list[Item]:
    items = []
    for record in _read_jsonl(folder / "winograd_wsc.jsonl"):
        continuation = " " + record["continuation"].strip()
        items.append(
            Item(choices=tuple((c, continuation) for c in record["context_options"]), label=record["gold"])
        )
    return items


def load_logiqa(folder: Path) -> list[Item]:
    """Blocks of 8 lines: blank, answer letter, passage, question, four options "A.text"."""
    lines = (folder / "Test.txt").read_text(encoding="utf-8").splitlines()
    items = []
    for start in range(0, len(lines) - 7, 8):
        answer, passage, question, *options = (line.strip() for line in lines[start + 1 : start + 8])
        texts = [option[2:].strip() if option[1:2] == "." else option for option in options]
        listing = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", texts, strict=True))
        context = f"Passage: {passage}\nQuestion: {question}\nChoices:\n{listing}\nAnswer:"
        items.append(
            Item(choices=tuple((context, " " + text) for text in texts), label="abcd".index(answer.lower()))
        )
    return items


def load_mmlu(folder: Path) -> list[Item]:
    """All 57 subjects' test questions; the continuation is the answer letter."""
    files = sorted((folder / "test").glob("*_test.csv"))
    if not files:
        raise DoflaError(f"no MMLU test files (*_test.csv) under {folder / 'test'}.")
    items = []
    for path in files:
        subject = path.name.removesuffix("_test.csv").replace("_", " ")
        header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        with open(path, encoding="utf-8", newline="") as stream:
            for question, *options, answer in csv.reader(stream):
                listing = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", options, strict=True))
                context = f"{header}{question.strip()}\n{listing}\nAnswer:"
                items.append(
                    Item(
                        choices=tuple((context, f" {letter}") for letter in "ABCD"),
                        label="ABCD".index(answer),
                    )
                )
    return items


TASK_LOADERS: dict[str, tuple[str, Callable[[Path], list[Item]]]] = {
    "piqa": ("piqa", load_piqa),
    "arc_easy": ("arc", load_arc_easy),
    "arc_challenge": ("arc", load_arc_challenge),
    "winogrande": ("winogrande", load_winogrande),
    "wsc273": ("wsc273", load_wsc273),
    "logiqa": ("logiqa", load_logiqa),
    "mmlu": ("mmlu", load_mmlu),
}
"""task name -> (sub-folder of the data folder, loader)."""


def load_task(name: str, data_dir: str | Path, *, limit: int | None = None) -> list[Item]:
    if name not in TASK_LOADERS:
        raise DoflaError(f"unknown task {name!r}; known tasks: {', '.join(TASK_LOADERS)}.")
    sub_folder, loader = TASK_LOADERS[name]
    folder = Path(data_dir) / sub_folder
    if not folder.is_dir():
        raise DoflaError(f"task {name!r} needs its files in {folder}, which does not exist.")
    try:
        items = loader(folder)
    except FileNotFoundError as error:
        raise DoflaError(f"task {name!r}: missing file {error.filename}.") from None
    except (KeyError, ValueError) as error:
        raise DoflaError(
            f"task {name!r}: the files in {folder} are not in the expected format ({error})."
        ) from None
    return items[:limit] if limit is not None else items


@torch.no_grad()
def continuation_log_likelihoods(
    model: torch.nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], *, batch_size: int = 8
) -> list[float]:
    """Summed log-probability of each continuation given its context.

    Context and continuation are tokenised separately so the continuation's tokens are exactly
    those scored; sequences are right-padded in batches and truncated from the left to the
    model's context length.
    """
    device = next(model.parameters()).device
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    encoded = []
    for context, continuation in pairs:
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        continuation_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = (bos + context_ids + continuation_ids)[-limit:]
        encoded.append((ids, len(continuation_ids)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores: list[float] = []
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, _) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        logits = model(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
        ).logits.float()
        log_probs = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, W-1, V): position t predicts token t+1
        targets = input_ids[:, 1:].to(device)
        token_scores = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, W-1)
        for row, (ids, count) in enumerate(batch):
            scores.append(float(token_scores[row, len(ids) - 1 - count : len(ids) - 1].sum()))
    return scores


def evaluate_items(model, tokenizer, items: Sequence[Item], *, batch_size: int = 8) -> dict[str, float]:
    """Accuracy (``acc``), byte-length-normalised accuracy (``acc_norm``) and their standard errors."""
    pairs = [pair for item in items for pair in item.choices]
    scores = continuation_log_likelihoods(model, tokenizer, pairs, batch_size=batch_size)
    correct = correct_norm = 0
    position = 0
    for item in items:
        count = len(item.choices)
        item_scores = scores[position : position + count]
        lengths = [max(1, len(continuation.encode("utf-8"))) for _, continuation in item.choices]
        position += count
        correct += int(max(range(count), key=lambda i: item_scores[i]) == item.label)
        correct_norm += int(max(range(count), key=lambda i: item_scores[i] / lengths[i]) == item.label)
    total = len(items)
    if total == 0:
        raise DoflaError("no items to evaluate.")
    acc, acc_norm = correct / total, correct_norm / total
    return {
        "acc": acc,
        "acc_stderr": math.sqrt(acc * (1 - acc) / total),
        "acc_norm": acc_norm,
        "acc_norm_stderr": math.sqrt(acc_norm * (1 - acc_norm) / total),
        "items": total,
    }


def evaluate_zero_shot(
    model,
    tokenizer,
    tasks: Sequence[str],
    data_dir: str | Path,
    *,
    limit: int | None = None,
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """Each task's scores; all task files are checked before any model work starts."""
    loaded = {name: load_task(name, data_dir, limit=limit) for name in tasks}
    model.eval()
    return {
        name: evaluate_items(model, tokenizer, items, batch_size=batch_size) for name, items in loaded.items()
    }
