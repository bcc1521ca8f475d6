"""lm-eval tasks on local files (dofla.evaluation.harness): `dofla evaluate` gives lm-eval's own numbers,
a converted folder opens through lm-eval's `hf` model, the task configs mirror lm-eval's built-in ones, bad
task names and missing files fail clearly, and the shared public files load completely."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lm_eval
import pytest
from test_save_load import trained_a_little

from dofla.cli import main
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.evaluation import harness
from dofla.models import build_tiny_model, build_tiny_tokenizer
from dofla.saving import save_converted

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BUILTIN_TASKS = Path(lm_eval.__file__).parent / "tasks"
WORDS = "the cat sat on a mat while bob ate red figs by his old dog".split()


def _phrase(seed: int, length: int = 5) -> str:
    return " ".join(WORDS[(seed * 7 + 3 * i) % len(WORDS)] for i in range(length))


def write_task_files(folder: Path, count: int = 6) -> Path:
    """A few made-up documents per task, in each task's public release layout."""
    (folder / "piqa").mkdir(parents=True)
    rows = [{"goal": _phrase(i), "sol1": _phrase(i + 1, 3), "sol2": _phrase(i + 2, 4)} for i in range(count)]
    (folder / "piqa" / "valid.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "piqa" / "valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(count)))
    (folder / "arc").mkdir()
    for arc_set in ("ARC-Easy", "ARC-Challenge"):
        rows = [
            {
                "id": f"q{i}",
                "question": _phrase(i, 6) + "?",
                "choices": {"text": [_phrase(i + j, 2) for j in range(4)], "label": ["1", "2", "3", "4"]},
                "answerKey": str(1 + i % 4),
            }
            for i in range(count)
        ]
        (folder / "arc" / f"{arc_set}-test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "winogrande").mkdir()
    rows = [
        {
            "qID": str(i),
            "sentence": f"{_phrase(i, 3)} _ {_phrase(i + 1, 3)}.",
            "option1": "bob",
            "option2": "cat",
        }
        | {"answer": str(1 + i % 2)}
        for i in range(count)
    ]
    (folder / "winogrande" / "dev.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for split, rows_per_subject in (("test", 1), ("dev", 5)):
        (folder / "mmlu" / split).mkdir(parents=True)
        for subject in harness.mmlu_subjects():
            with open(folder / "mmlu" / split / f"{subject}_{split}.csv", "w", newline="") as stream:
                for i in range(rows_per_subject):
                    csv.writer(stream).writerow([_phrase(i, 4) + "?", "a", "b", "c", "d", "ABCD"[i % 4]])
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(tasks folder, teacher folder, converted folder) of a tiny Llama."""
    root = tmp_path_factory.mktemp("harness")
    teacher = build_tiny_model("llama", seed=3)
    teacher.save_pretrained(root / "teacher")
    build_tiny_tokenizer().save_pretrained(root / "teacher")
    student = trained_a_little(convert(teacher, plan_for(teacher, kind="linear", feature_dim=8)))
    save_converted(student, root / "converted", tokenizer=build_tiny_tokenizer())
    return write_task_files(root / "tasks"), root / "teacher", root / "converted"


def lm_eval_on_folder(folder: Path, tasks: list[str], tasks_dir: Path, **options) -> dict:
    """lm-eval's own entry point loading the model folder itself (`--model hf --model_args pretrained=...`)."""
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32",
        tasks=[harness.resolve_task(task)[1].lm_eval_name for task in tasks],
        task_manager=harness.task_manager(tasks_dir),
        batch_size=2,
        device="cpu",
        **options,
    )


def test_dofla_evaluate_gives_lm_evals_own_numbers(folders, tmp_path):
    tasks_dir, teacher, converted = folders
    tasks = ["piqa", "arc_easy", "arc_challenge", "winogrande"]
    out = tmp_path / "results.json"
    argv = ["evaluate", str(converted), "--teacher", str(teacher), "--tasks", ",".join(tasks)]
    assert main([*argv, "--tasks-dir", str(tasks_dir), "--batch-size", "2", "--json", str(out)]) == 0
    section = json.loads(out.read_text())["lm_eval"]
    assert section["version"] == lm_eval.__version__
    assert "python -m dofla.lm_eval_cli --model hf" in section["commands"]["student"]
    for name, folder in (("teacher", teacher), ("student", converted)):
        direct = lm_eval_on_folder(folder, tasks, tasks_dir)
        for task in tasks:
            assert section["tasks"][task][name] == harness.scores_from_results(direct, task)
    assert section["tasks"]["piqa"]["teacher"]["items"] == 6


def test_per_document_log_likelihoods_equal_and_students_differ(folders):
    tasks_dir, teacher, converted = folders
    from dofla.loading import load_converted

    student, tokenizer, _ = load_converted(converted)
    _, ours = harness.evaluate_tasks(
        student, tokenizer, ["winogrande"], tasks_dir, batch_size=2, log_samples=True
    )
    theirs = lm_eval_on_folder(converted, ["winogrande"], tasks_dir, log_samples=True)
    plain = lm_eval_on_folder(teacher, ["winogrande"], tasks_dir, log_samples=True)

    def log_likelihoods(results):
        return [[float(r[0][0]) for r in doc["resps"]] for doc in results["samples"]["dofla_winogrande"]]

    assert log_likelihoods(ours) == log_likelihoods(theirs)
    assert log_likelihoods(ours) != log_likelihoods(plain)  # the students ran, not the teacher's softmax


def test_mmlu_is_five_shot_from_dev(folders):
    tasks_dir, _, _ = folders
    tasks = harness.task_manager(tasks_dir).load(["dofla_mmlu"])["tasks"]
    anatomy = tasks["dofla_mmlu_anatomy"]
    assert len(tasks) == 57 and anatomy.config.num_fewshot == 5
    context = anatomy.fewshot_context(anatomy.test_docs()[0], num_fewshot=5)
    assert context.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n")
    assert context.count("Answer:") == 6  # five solved dev questions, then the test question


def _builtin(path: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(BUILTIN_TASKS / path, resolve_func=False)


def _ours(path: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(harness.TASKS_PATH / path, resolve_func=False)


FIELDS = ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "metric_list", "fewshot_config")


@pytest.mark.parametrize(
    "builtin, ours",
    [
        ("piqa/piqa.yaml", "piqa.yaml"),
        ("arc/arc_easy.yaml", "arc_easy.yaml"),
        ("arc/arc_challenge.yaml", "arc_challenge.yaml"),
        ("hellaswag/hellaswag.yaml", "hellaswag.yaml"),
        ("winogrande/default.yaml", "winogrande.yaml"),
        ("mmlu/default/mmlu_anatomy.yaml", "mmlu/dofla_mmlu_anatomy.yaml"),
    ],
)
def test_task_configs_mirror_the_builtin_ones(builtin, ours):
    theirs, mine = _builtin(builtin), _ours(ours)
    for field in FIELDS:
        if isinstance(theirs.get(field), str) and "/" in theirs[field]:  # a !function: compared below
            continue
        assert mine.get(field) == theirs.get(field), field
    assert mine.get("num_fewshot") == (5 if "mmlu" in ours else None)  # MMLU: 5-shot as papers report it
    split = theirs.get("test_split") or theirs.get("validation_split")
    assert split in (mine.get("test_split"), mine.get("validation_split"))


def test_every_mmlu_subject_mirrors_its_builtin_description_and_category():
    subjects = harness.mmlu_subjects()
    assert len(subjects) == 57
    for subject in subjects:
        theirs, mine = _builtin(f"mmlu/default/mmlu_{subject}.yaml"), _ours(f"mmlu/dofla_mmlu_{subject}.yaml")
        assert mine["description"] == theirs["description"]
        assert mine["tag"] == "dofla_" + theirs["tag"]
        assert mine["dataset_kwargs"]["subject"] == theirs["dataset_name"]


def test_winogrande_and_hellaswag_preparation_match_the_builtin_functions():
    from lm_eval.tasks._yaml_loader import _import_func_in_yml

    wino = BUILTIN_TASKS / "winogrande"
    doc = {"sentence": "Ann beat Bo so _ won the cup.", "option1": "Ann", "option2": "Bo", "answer": "2"}
    assert harness.winogrande_gold(doc) == _import_func_in_yml("preprocess_winogrande.doc_to_text", wino)(doc)
    assert harness.winogrande_continuation(doc) == "won the cup."
    assert harness.winogrande_contexts(doc) == _import_func_in_yml(
        "preprocess_winogrande.doc_to_choice", wino
    )(doc)
    import datasets

    rows = [
        {
            "activity_label": "Cooking",
            "ctx_a": "A man [title] stirs.",
            "ctx_b": "then he [step]  adds",
            "endings": ["salt [header] now.", " pepper  "],
            "label": "1",
        }
    ]
    builtin = _import_func_in_yml("utils.process_docs", BUILTIN_TASKS / "hellaswag")
    ours, theirs = (
        harness.hellaswag_docs(datasets.Dataset.from_list(rows)),
        builtin(datasets.Dataset.from_list(rows)),
    )
    assert [ours[0][key] for key in ("query", "choices", "gold")] == [
        theirs[0][k] for k in ("query", "choices", "gold")
    ]


def test_unknown_task_and_missing_files_fail_clearly(tmp_path, capsys):
    with pytest.raises(DoflaError, match="unknown lm-eval task 'lambada'; known tasks: piqa, arc_easy"):
        harness.check_task_files(["lambada"], tmp_path)
    with pytest.raises(DoflaError, match=f"needs {tmp_path}/hellaswag/hellaswag_val.jsonl"):
        harness.check_task_files(["hellaswag"], tmp_path)
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    with pytest.raises(
        DoflaError, match=r"needs .*mmlu/test/abstract_algebra_test.csv \(and 113 more files\)"
    ):
        harness.check_task_files(["dofla_mmlu"], tmp_path)
    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "ARC-Easy-test.jsonl").write_text("{broken\n")
    with pytest.raises(DoflaError, match="line 1 is not valid JSON"):
        harness.arc_dataset(str(tmp_path), "ARC-Easy")
    # the command refuses before loading any model (tmp_path is no converted folder)
    assert main(["evaluate", str(tmp_path), "--tasks", "piqa,hellaswag", "--tasks-dir", str(tmp_path)]) == 1
    assert "task 'piqa' needs" in capsys.readouterr().err


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the shared evaluation data is not beside this checkout")
def test_public_task_files_load_completely():
    harness.check_task_files(list(harness.TASKS)[:4] + ["mmlu"], SHARED_DATA)
    assert len(harness.piqa_dataset(str(SHARED_DATA))["validation"]) == 1838
    assert len(harness.arc_dataset(str(SHARED_DATA), "ARC-Easy")["test"]) == 2376
    assert len(harness.arc_dataset(str(SHARED_DATA), "ARC-Challenge")["test"]) == 1172
    assert len(harness.winogrande_dataset(str(SHARED_DATA))["validation"]) == 1267
    sizes = [harness.mmlu_dataset(str(SHARED_DATA), subject) for subject in harness.mmlu_subjects()]
    assert sum(len(s["test"]) for s in sizes) == 14042 and sum(len(s["dev"]) for s in sizes) == 285


def test_lm_eval_cli_finds_the_folders_and_refuses_an_older_converted_folder(folders, tmp_path, capsys):
    from dofla import lm_eval_cli

    _, teacher, converted = folders
    argv = ["--model", "hf", "--model_args", f"pretrained={converted},dtype=float32", "--tasks", "dofla_piqa"]
    assert lm_eval_cli.pretrained_folders(argv) == [str(converted)]
    assert lm_eval_cli.pretrained_folders([f"--model_args=dtype=float32,pretrained={teacher}"]) == [
        str(teacher)
    ]
    older = tmp_path / "older"
    older.mkdir()
    for item in converted.iterdir():
        (older / item.name).write_bytes(item.read_bytes())
    (older / "config.json").write_text((teacher / "config.json").read_text())  # the layout before DoflaConfig
    assert lm_eval_cli.main(["--model_args", f"pretrained={older}", "--tasks", "dofla_piqa"]) == 1
    assert "would open it as the plain teacher; re-save it first" in capsys.readouterr().err
