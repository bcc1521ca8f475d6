"""``dofla evaluate``: a converted model against its teacher, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="compare a converted model with its teacher (perplexity, zero-shot, attention error, pass key)",
        description="Evaluate a converted model folder (from `dofla convert` or `dofla linearize`) and its teacher "
        "on the same data, and print both side by side.",
    )
    parser.add_argument("converted", help="folder written by `dofla convert` or `dofla linearize`")
    parser.add_argument(
        "--teacher", default=None, help="teacher to compare with (default: the one named in the folder)"
    )
    parser.add_argument(
        "--data", default=None, help="text for perplexity and attention error (txt, jsonl, json)"
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=16, help="number of held-out sequences")
    parser.add_argument(
        "--tasks", default="", help="comma-separated zero-shot tasks, e.g. piqa,arc_easy,winogrande"
    )
    parser.add_argument(
        "--tasks-dir", default=None, help="folder holding the task files (one sub-folder per task)"
    )
    parser.add_argument("--limit", type=int, default=None, help="at most this many items per task")
    parser.add_argument(
        "--passkey", default="", help="comma-separated context lengths for pass-key retrieval"
    )
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--json", dest="json_out", default=None, help="also write the results to this JSON file"
    )
    parser.add_argument(
        "--any-teacher",
        action="store_true",
        help="compare with --teacher even if it is not the model the folder was converted from",
    )
    parser.set_defaults(func=run)


def check_arguments(args: argparse.Namespace) -> None:
    """Every option that can be checked before a model is loaded."""
    from dofla.commands._common import check_at_least, check_device_and_dtype
    from dofla.errors import DoflaError
    from dofla.outputs import check_output_file

    check_at_least("--seq-len", args.seq_len, 2)
    check_at_least("--sequences", args.sequences, 1)
    if args.limit is not None:
        check_at_least("--limit", args.limit, 1)
    try:
        lengths = [int(length) for length in args.passkey.split(",") if length.strip()]
    except ValueError:
        lengths = [0]
    if any(length < 1 for length in lengths):
        raise DoflaError(
            f"--passkey must be comma-separated positive token counts like 1024,4096, got {args.passkey!r}."
        )
    if not (args.data or args.tasks.strip(",") or lengths):
        raise DoflaError("nothing to evaluate: give --data, --tasks with --tasks-dir, or --passkey.")
    if args.tasks.strip(",") and not args.tasks_dir:
        raise DoflaError("zero-shot tasks need --tasks-dir, the folder holding the task files.")
    check_device_and_dtype(args)
    if args.json_out:
        check_output_file(args.json_out, "--json")


def check_loaded(args: argparse.Namespace, student, tokenizer, teacher) -> None:
    """What needs the loaded models: the teacher is the student's own, the tokenizer, the context length."""
    from dofla.convert import check_teacher
    from dofla.errors import DoflaError
    from dofla.pipeline import context_length

    if not args.any_teacher:
        check_teacher(args.converted, teacher, student)
    if tokenizer is None:
        raise DoflaError(
            f"{args.converted} has no tokenizer files, which evaluation needs; save it with its tokenizer."
        )
    limit = context_length(teacher)
    if args.data and limit is not None and args.seq_len > limit:
        raise DoflaError(
            f"--seq-len {args.seq_len} is beyond the model's context of {limit} tokens; use at most {limit}."
        )


def run(args: argparse.Namespace) -> int:
    from dofla.convert import load_converted
    from dofla.data import load_texts, pack_token_sequences
    from dofla.errors import DoflaError
    from dofla.evaluation.attention_error import attention_errors
    from dofla.evaluation.passkey import passkey_retrieval
    from dofla.evaluation.perplexity import perplexity
    from dofla.evaluation.zero_shot import evaluate_zero_shot
    from dofla.io import to_json, write_text_atomic
    from dofla.models import load_teacher

    check_arguments(args)
    student, tokenizer, plan = load_converted(args.converted, dtype=args.dtype, device=args.device)
    teacher_spec = args.teacher or plan.metadata.get("teacher")
    if not teacher_spec:
        raise DoflaError("the converted folder does not name its teacher; pass --teacher MODEL.")
    teacher = load_teacher(teacher_spec, dtype=args.dtype, device=args.device).model
    check_loaded(args, student, tokenizer, teacher)
    results: dict[str, dict] = {}
    if args.data:
        sequences = pack_token_sequences(tokenizer, load_texts(args.data), args.seq_len)[: args.sequences]
        results["perplexity"] = {
            "teacher": perplexity(teacher, sequences)["perplexity"],
            "student": perplexity(student, sequences)["perplexity"],
        }
        results["attention_error"] = {
            str(layer): values for layer, values in attention_errors(student, sequences.split(4)).items()
        }
    tasks = [task for task in args.tasks.split(",") if task]
    if tasks:
        if not args.tasks_dir:
            raise DoflaError("zero-shot tasks need --tasks-dir, the folder holding the task files.")
        for name, model in (("teacher", teacher), ("student", student)):
            for task, scores in evaluate_zero_shot(
                model, tokenizer, tasks, args.tasks_dir, limit=args.limit
            ).items():
                results.setdefault("zero_shot", {}).setdefault(task, {})[name] = scores
    lengths = [int(length) for length in args.passkey.split(",") if length]
    if lengths:
        for name, model in (("teacher", teacher), ("student", student)):
            rows = passkey_retrieval(model, tokenizer, context_lengths=lengths)
            results.setdefault("passkey", {})[name] = [vars(row) for row in rows]
    if not results:
        raise DoflaError("nothing to evaluate: give --data, --tasks with --tasks-dir, or --passkey.")
    _print_results(results)
    if args.json_out:
        write_text_atomic(Path(args.json_out), to_json(results, indent=2) + "\n")
    return 0


def _print_results(results: dict[str, dict]) -> None:
    if "perplexity" in results:
        ppl = results["perplexity"]
        print(f"perplexity   teacher {ppl['teacher']:.3f}   student {ppl['student']:.3f}")
    if "attention_error" in results:
        print("layer  relative attention error  cosine")
        for layer, values in results["attention_error"].items():
            print(f"{layer:>5}  {values['relative_error']:>24.4f}  {values['cosine']:.4f}")
    for task, by_model in results.get("zero_shot", {}).items():
        teacher, student = by_model["teacher"], by_model["student"]
        print(
            f"{task:<14} acc teacher {teacher['acc']:.4f} student {student['acc']:.4f}   "
            f"acc_norm teacher {teacher['acc_norm']:.4f} student {student['acc_norm']:.4f}   n={teacher['items']}"
        )
    for name, rows in results.get("passkey", {}).items():
        summary = ", ".join(f"{r['context_tokens']}@{r['depth']:.1f}: {r['accuracy']:.2f}" for r in rows)
        print(f"pass key {name}: {summary}")
