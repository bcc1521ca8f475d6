"""Zero- and few-shot accuracy through EleutherAI's lm-evaluation-harness, offline, on local task files.

dofla ships lm-eval task configs (``lm_eval_tasks/``, see :data:`TASKS_PATH`) that mirror lm-eval's built-in
``piqa``, ``arc_easy``, ``arc_challenge``, ``winogrande``, ``hellaswag`` and ``mmlu`` (prompts, choices,
metrics; MMLU 5-shot from its dev split) under the names ``dofla_<task>``. They read each task's public
release files from a folder given as lm-eval metadata (``tasks_dir``) through the loaders below, so nothing
is downloaded. :func:`evaluate_tasks` runs them with ``lm_eval.simple_evaluate`` on a loaded model through
lm-eval's own HF wrapper (``HFLM``); lm-eval's command line gives the same numbers with
``--include_path TASKS_PATH --metadata '{"tasks_dir": ...}'`` (:func:`lm_eval_command`).
"""

from __future__ import annotations

import csv
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dofla.errors import DoflaError
from dofla.registry import Registry

TASKS_PATH = Path(__file__).resolve().parent / "lm_eval_tasks"
"""The folder of dofla's lm-eval task configs: lm-eval's ``--include_path``."""


@dataclass(frozen=True)
class LocalTask:
    """A dofla lm-eval task: its lm-eval name and the files it reads, relative to the tasks folder."""

    lm_eval_name: str
    files: tuple[str, ...]


MMLU_FILES = ("mmlu/test/<subject>_test.csv", "mmlu/dev/<subject>_dev.csv")
TASKS: Registry[LocalTask] = Registry("lm-eval task")
for _name, _task in (
    ("piqa", LocalTask("dofla_piqa", ("piqa/valid.jsonl", "piqa/valid-labels.lst"))),
    ("arc_easy", LocalTask("dofla_arc_easy", ("arc/ARC-Easy-test.jsonl",))),
    ("arc_challenge", LocalTask("dofla_arc_challenge", ("arc/ARC-Challenge-test.jsonl",))),
    ("winogrande", LocalTask("dofla_winogrande", ("winogrande/dev.jsonl",))),
    ("hellaswag", LocalTask("dofla_hellaswag", ("hellaswag/hellaswag_val.jsonl",))),
    ("mmlu", LocalTask("dofla_mmlu", MMLU_FILES)),
):
    TASKS.add(_name, _task)
"""Task names accepted by ``dofla evaluate --tasks`` (the lm-eval name ``dofla_<task>`` is accepted too)."""


def _known() -> str:
    return ", ".join(TASKS)


def resolve_task(name: str) -> tuple[str, LocalTask]:
    """(dofla name, task) for ``piqa`` or ``dofla_piqa``; an unknown name lists the known ones."""
    key = name.removeprefix("dofla_")
    if key not in TASKS:
        raise DoflaError(f"unknown lm-eval task {name!r}; known tasks: {_known()}.")
    return key, TASKS[key]


MMLU_GROUPS = ("stem", "other", "social_sciences", "humanities")


def mmlu_subjects() -> list[str]:
    """The 57 MMLU subjects, from dofla's task configs (``dofla_mmlu_<subject>.yaml``)."""
    names = (
        path.stem.removeprefix("dofla_mmlu_") for path in (TASKS_PATH / "mmlu").glob("dofla_mmlu_*.yaml")
    )
    return sorted(name for name in names if name not in MMLU_GROUPS)


def task_files(name: str) -> list[str]:
    """The files a task reads, relative to the tasks folder (every MMLU subject's test and dev CSV)."""
    key, task = resolve_task(name)
    if key != "mmlu":
        return list(task.files)
    return [f"mmlu/{split}/{subject}_{split}.csv" for subject in mmlu_subjects() for split in ("test", "dev")]


def check_task_files(names: Sequence[str], tasks_dir: str | Path) -> None:
    """Refuse, before any model work, an unknown task or a task whose files are not in ``tasks_dir``
    (and a missing lm-eval)."""
    import importlib.util

    if not names:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise DoflaError(
            "lm-eval tasks need the lm-eval package; install it with `pip install 'dofla[eval]'`."
        )
    folder = Path(tasks_dir)
    for name in names:
        missing = [relative for relative in task_files(name) if not (folder / relative).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more files)" if len(missing) > 1 else ""
            raise DoflaError(
                f"task {resolve_task(name)[0]!r} needs {folder / missing[0]}{more}, in the task's public release "
                "layout under --tasks-dir; it is not there."
            )


# ---------------------------------------------------------------------------------- datasets (lm-eval loaders)


def _tasks_dir(tasks_dir: str | None) -> Path:
    if not tasks_dir:
        raise DoflaError(
            'dofla\'s lm-eval tasks read local files: pass their folder as --metadata \'{"tasks_dir": "FOLDER"}\'.'
        )
    return Path(tasks_dir)


def _file(path: Path) -> Path:
    if not path.is_file():
        raise DoflaError(f"missing task file {path} (the task's public release layout is expected).")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with open(_file(path), encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DoflaError(f"{path} line {line_number} is not valid JSON ({error.msg}).") from None
    return records


def _splits(**splits: list[dict]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def piqa_dataset(tasks_dir: str | None = None, **_: Any):
    """PIQA's validation split: valid.jsonl (goal, sol1, sol2) joined with valid-labels.lst (label)."""
    folder = _tasks_dir(tasks_dir) / "piqa"
    records = _read_jsonl(folder / "valid.jsonl")
    labels = [int(line) for line in _file(folder / "valid-labels.lst").read_text().split()]
    if len(labels) != len(records):
        raise DoflaError(
            f"{folder}: {len(records)} questions but {len(labels)} labels; the files do not match."
        )
    rows = [{**record, "label": label} for record, label in zip(records, labels, strict=True)]
    return _splits(validation=rows)


def arc_dataset(tasks_dir: str | None = None, arc_set: str = "ARC-Easy", **_: Any):
    """An ARC set's test split (``arc_set``: ARC-Easy or ARC-Challenge), from ``<arc_set>-test.jsonl``."""
    rows = _read_jsonl(_tasks_dir(tasks_dir) / "arc" / f"{arc_set}-test.jsonl")
    return _splits(
        test=[{key: row[key] for key in ("id", "question", "choices", "answerKey")} for row in rows]
    )


def winogrande_dataset(tasks_dir: str | None = None, **_: Any):
    """WinoGrande 1.1 dev (lm-eval's winogrande_xl validation split) from dev.jsonl."""
    rows = _read_jsonl(_tasks_dir(tasks_dir) / "winogrande" / "dev.jsonl")
    keys = ("sentence", "option1", "option2", "answer")
    return _splits(validation=[{key: str(row[key]) for key in keys} for row in rows])


def winogrande_gold(doc: dict) -> int:
    """The right option's index (lm-eval's doc_to_text for partial scoring: one context per option)."""
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_continuation(doc: dict) -> str:
    """What follows the blank, stripped: the continuation scored after each filled-in context."""
    return doc["sentence"][doc["sentence"].index("_") + 1 :].strip()


def winogrande_contexts(doc: dict) -> list[str]:
    """The sentence up to the blank, filled with each option."""
    before = doc["sentence"][: doc["sentence"].index("_")]
    return [before + doc["option1"], before + doc["option2"]]


def hellaswag_dataset(tasks_dir: str | None = None, **_: Any):
    """HellaSwag's validation split from the release's hellaswag_val.jsonl."""
    rows = _read_jsonl(_tasks_dir(tasks_dir) / "hellaswag" / "hellaswag_val.jsonl")
    keys = ("activity_label", "ctx_a", "ctx_b", "endings", "label")
    return _splits(validation=[{key: row[key] for key in keys} for row in rows])


def _clean_hellaswag(text: str) -> str:
    """WikiHow artefacts out: " [title]" becomes a full stop, other bracketed tags go, double spaces close."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_docs(dataset):
    """lm-eval's HellaSwag preparation: query "activity: ctx_a Ctx_b", cleaned endings, integer gold."""

    def prepare(doc: dict) -> dict:
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _clean_hellaswag(doc["activity_label"] + ": " + context),
            "choices": [_clean_hellaswag(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(prepare)


def mmlu_dataset(tasks_dir: str | None = None, subject: str = "", **_: Any):
    """One MMLU subject's test and dev splits from ``test/<subject>_test.csv`` and ``dev/<subject>_dev.csv``."""
    folder = _tasks_dir(tasks_dir) / "mmlu"

    def rows(split: str) -> list[dict]:
        path = _file(folder / split / f"{subject}_{split}.csv")
        with open(path, encoding="utf-8", newline="") as stream:
            table = [row for row in csv.reader(stream) if row]
        if any(len(row) != 6 or row[5] not in ("A", "B", "C", "D") for row in table):
            raise DoflaError(f"{path} is not MMLU's headerless question,A,B,C,D,answer CSV.")
        return [
            {"question": q, "subject": subject, "choices": [a, b, c, d], "answer": "ABCD".index(answer)}
            for q, a, b, c, d, answer in table
        ]

    return _splits(test=rows("test"), dev=rows("dev"))


# ------------------------------------------------------------------------------------------------ evaluation


def task_manager(tasks_dir: str | Path):
    """lm-eval's TaskManager over dofla's task configs only, reading files from ``tasks_dir``."""
    from lm_eval.tasks import TaskManager

    return TaskManager(
        include_path=str(TASKS_PATH),
        include_defaults=False,
        metadata={"tasks_dir": str(Path(tasks_dir).resolve())},
    )


def scores_from_results(results: dict, name: str) -> dict[str, float]:
    """One task's (or group's) lm-eval metrics as {acc, acc_stderr, acc_norm, acc_norm_stderr, items}."""
    _, task = resolve_task(name)
    measured = results["results"][task.lm_eval_name]
    scores = {
        metric: float(measured[f"{metric},none"])
        for metric in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
        if isinstance(measured.get(f"{metric},none"), int | float)
    }
    subtasks = results.get("group_subtasks", {})
    leaves, pending = [], [task.lm_eval_name]
    while pending:
        current = pending.pop()
        children = subtasks.get(current) or []
        pending.extend(children)
        if not children:
            leaves.append(current)
    scores["items"] = int(sum(results["n-samples"][leaf]["effective"] for leaf in leaves))
    return scores


def evaluate_tasks(
    model,
    tokenizer,
    names: Sequence[str],
    tasks_dir: str | Path,
    *,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict[str, float]], dict]:
    """Each task's lm-eval scores on ``model`` (a loaded transformers model) and lm-eval's full results.

    ``limit``: at most this many documents per task (per MMLU subject). ``num_fewshot``: None keeps each
    task's own (0, MMLU 5). ``log_samples``: keep lm-eval's per-document records (``results["samples"]``).
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    check_task_files(names, tasks_dir)
    lm_names = [resolve_task(name)[1].lm_eval_name for name in names]
    if progress is not None:
        progress(f"lm-eval {lm_eval.__version__}: {', '.join(lm_names)}")
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = lm_eval.simple_evaluate(
        model=wrapped,
        tasks=lm_names,
        task_manager=task_manager(tasks_dir),
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
    )
    scores = {resolve_task(name)[0]: scores_from_results(results, name) for name in names}
    return scores, results


def teacher_folder(spec: str) -> str:
    """The folder lm-eval's command line can open for a teacher spec: the folder itself, dofla's cached
    copy of an embedded teacher (``$DOFLA_CACHE/teachers/NAME``), else the spec (a hub id)."""
    from dofla.models.loading import cache_root

    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser().resolve())
    cached = cache_root() / "teachers" / spec
    return str(cached) if (cached / "config.json").is_file() else spec


def lm_eval_command(
    pretrained: str | Path,
    names: Sequence[str],
    tasks_dir: str | Path,
    *,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot: int | None = None,
    converted: bool = False,
    dtype: str = "float32",
    device: str = "cpu",
) -> str:
    """The lm-eval command line that evaluates the model folder ``pretrained`` as :func:`evaluate_tasks` does.

    A converted folder needs ``python -m dofla.lm_eval_cli`` (lm-eval's CLI after ``import dofla``).
    """
    program = "python -m dofla.lm_eval_cli" if converted else "lm_eval"
    parts = [
        *shlex.split(program),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={pretrained},dtype={dtype}",
        "--tasks",
        ",".join(resolve_task(name)[1].lm_eval_name for name in names),
        "--include_path",
        str(TASKS_PATH),
        "--metadata",
        json.dumps({"tasks_dir": str(Path(tasks_dir).resolve())}),
        "--batch_size",
        str(batch_size),
        "--device",
        device,
    ]
    if limit is not None:
        parts += ["--limit", str(limit)]
    if num_fewshot is not None:
        parts += ["--num_fewshot", str(num_fewshot)]
    return shlex.join(parts)
