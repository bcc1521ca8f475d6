"""``dofla evaluate``: a converted model against its teacher and the teacher's no-training window baseline."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dofla.commands._common import (
    add_position_arguments,
    add_threads_argument,
    apply_position_arguments,
    check_device_and_dtype,
    check_position_arguments,
    check_threads,
    integer_list,
)
from dofla.config import DEFAULT_WINDOW

DEFAULT_LENGTHS = "512,1024"
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="compare a converted model with its teacher and a sliding-window baseline "
        "(perplexity by position at several lengths, KL, lm-eval tasks, attention error, pass key)",
        description="Evaluate a converted model folder (from `dofla convert` or `dofla linearize`) beside its "
        "teacher and the teacher's softmax restricted to a sliding window (no training), on the same data, "
        "at each --lengths.",
    )
    parser.add_argument("converted", help="folder written by `dofla convert` or `dofla linearize`")
    parser.add_argument(
        "--teacher", default=None, help="teacher to compare with (default: the one named in the folder)"
    )
    parser.add_argument("--data", default=None, help="held-out text for perplexity (txt, jsonl, json)")
    parser.add_argument(
        "--lengths",
        default=None,
        help=f"comma-separated context lengths for perplexity, e.g. 512,1024,2048 (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="one context length (same as --lengths N)")
    parser.add_argument("--sequences", type=int, default=16, help="held-out sequences per length")
    parser.add_argument(
        "--skip-texts",
        type=int,
        default=0,
        help="leave out the first N texts of --data (e.g. the part a run trained on); the rest is packed",
    )
    parser.add_argument(
        "--batch-size", type=int, default=4, help="sequences per forward pass (perplexity and lm-eval tasks)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help=f"window of the sliding-window baseline (default: the plan's hybrid window, else {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--sinks", default="0,4", help="comma-separated sink-token counts, one window baseline each"
    )
    parser.add_argument(
        "--cache-budget",
        type=int,
        default=None,
        help="keys per layer of the StreamingLLM and heavy-hitter (H2O) baselines (default: as many as fit "
        "in the bytes the student's cache holds at each length)",
    )
    parser.add_argument(
        "--edge-sinks",
        action="store_true",
        help="also the window baselines whose sinks are seen from the window's edge instead of their true "
        "positions (rotary teachers; perplexity only): a stronger no-training cache far beyond the window",
    )
    parser.add_argument(
        "--error-sequences",
        type=int,
        default=4,
        help="sequences of the shortest length for the per-layer attention error (0: skip it)",
    )
    parser.add_argument(
        "--tasks",
        default="",
        help="comma-separated lm-eval tasks run through lm-evaluation-harness on local files: piqa, arc_easy, "
        "arc_challenge, winogrande, hellaswag, mmlu (5-shot)",
    )
    parser.add_argument(
        "--tasks-dir",
        default=None,
        help="folder holding the task files, one sub-folder per task in its public release layout "
        "(piqa/valid.jsonl, arc/ARC-Easy-test.jsonl, mmlu/test/*_test.csv...)",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="at most this many documents per task (per MMLU subject)"
    )
    parser.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="few-shot examples for every task (default: each task's own, 0; MMLU 5)",
    )
    parser.add_argument(
        "--passkey", default="", help="comma-separated context lengths for pass-key retrieval, e.g. 1024,2048"
    )
    parser.add_argument(
        "--passkey-depths",
        default="0.1,0.5,0.9",
        help="comma-separated depths of the key (0 = start, 1 = end)",
    )
    parser.add_argument("--passkey-trials", type=int, default=3, help="keys tried per length and depth")
    parser.add_argument(
        "--recall",
        action="store_true",
        help="also score recall beyond the window at each --lengths: the same held-out sequences with a span "
        "of their own text repeated past the window, loss and accuracy on the repeated tokens (needs --data)",
    )
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    add_threads_argument(parser)
    parser.add_argument(
        "--plot", default=None, help="write the loss-by-position plot here (.png, .pdf, .svg)"
    )
    parser.add_argument(
        "--json", dest="json_out", default=None, help="also write the results to this JSON file"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace dofla's own earlier --json results and --plot figure (other files are never replaced)",
    )
    parser.add_argument(
        "--any-teacher",
        action="store_true",
        help="compare with --teacher even if it is not the model the folder was converted from",
    )
    add_position_arguments(parser)
    parser.set_defaults(func=run)


def _depths(text: str) -> list[float]:
    from dofla.errors import DoflaError

    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= value <= 1.0 for value in values):
        raise DoflaError(f"--passkey-depths must be comma-separated numbers between 0 and 1, got {text!r}.")
    return values


def check_arguments(args: argparse.Namespace) -> None:
    """Every option is checked before a model is loaded; sets args.length_list, sink_list, passkey_list."""
    from dofla import outputs
    from dofla.data import check_data_path
    from dofla.errors import DoflaError
    from dofla.outputs import check_output_file

    if args.lengths is not None and args.seq_len is not None:
        raise DoflaError("give either --lengths or --seq-len, not both (--seq-len N is --lengths N).")
    lengths = args.lengths if args.lengths is not None else args.seq_len
    args.length_list = integer_list(DEFAULT_LENGTHS if lengths is None else lengths, "--lengths", minimum=2)
    if args.sequences < 1:
        raise DoflaError(f"--sequences must be at least 1, got {args.sequences}.")
    if args.batch_size < 1:
        raise DoflaError(f"--batch-size must be at least 1, got {args.batch_size}.")
    check_position_arguments(args)
    if args.window is not None and args.window < 1:
        raise DoflaError(f"--window must be at least 1 token, got {args.window}.")
    args.sink_list = integer_list(args.sinks, "--sinks", minimum=0)
    if args.cache_budget is not None:
        from dofla.evaluation.cache_baselines import check_cache_budget

        passkeys = integer_list(args.passkey, "--passkey", minimum=1) if args.passkey.strip() else []
        lengths = (args.length_list if args.data else []) + passkeys
        check_cache_budget(args.cache_budget, lengths, max(args.sink_list))
    if args.error_sequences < 0:
        raise DoflaError(f"--error-sequences must be 0 or more, got {args.error_sequences}.")
    args.passkey_list = integer_list(args.passkey, "--passkey", minimum=1) if args.passkey.strip() else []
    args.depth_list = _depths(args.passkey_depths)
    if args.passkey_trials < 1:
        raise DoflaError(f"--passkey-trials must be at least 1, got {args.passkey_trials}.")
    args.task_list = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if args.task_list and not args.tasks_dir:
        raise DoflaError("lm-eval tasks need --tasks-dir, the folder holding the task files.")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise DoflaError(f"--num-fewshot must be 0 or more, got {args.num_fewshot}.")
    check_threads(args.threads)
    if args.limit is not None and args.limit < 1:
        raise DoflaError(f"--limit must be at least 1, got {args.limit}.")
    if not (args.data or args.task_list or args.passkey_list):
        raise DoflaError("nothing to evaluate: give --data, --tasks with --tasks-dir, or --passkey.")
    if args.skip_texts < 0:
        raise DoflaError(f"--skip-texts must be 0 or more, got {args.skip_texts}.")
    if args.skip_texts and not args.data:
        raise DoflaError("--skip-texts leaves out texts of --data; give --data.")
    if args.recall and not args.data:
        raise DoflaError("--recall repeats spans of held-out text, which needs --data.")
    if args.plot is not None:
        if not args.data:
            raise DoflaError("--plot draws the held-out loss by position, which needs --data.")
        if Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
            raise DoflaError(f"--plot {args.plot} must end in {', '.join(PLOT_SUFFIXES)}.")
    inputs = [args.converted, args.teacher or _named_teacher(args.converted), args.data, args.tasks_dir]
    if args.plot is not None:
        check_output_file(
            args.plot, "--plot", inputs=inputs, overwrite=args.overwrite, ours=outputs.is_matplotlib_figure
        )
    if args.json_out is not None:
        check_output_file(
            args.json_out, "--json", inputs=inputs, overwrite=args.overwrite, ours=outputs.is_dofla_json
        )
        if args.plot is not None and Path(args.plot).resolve() == Path(args.json_out).resolve():
            raise DoflaError("--plot and --json name the same file; give each its own.")
    check_data_path(args.data)
    check_device_and_dtype(args)


def _named_teacher(converted: str) -> str | None:
    """The teacher a converted folder names (an input --json and --plot must not write into), if it can be
    read; a damaged folder is reported when it is loaded."""
    from dofla.errors import DoflaError
    from dofla.loading import read_record

    try:
        teacher = read_record(converted).get("teacher")
    except (DoflaError, OSError):
        return None
    return teacher if isinstance(teacher, str) else None


def busy_cpu_hint(threads: int, load_average: float, cores: int) -> str | None:
    """A line for stderr when torch would run ``threads`` > 1 CPU threads beside other busy jobs, else None.

    Measured on the 2-core CPU with one core kept busy by another job: 2 threads took 2.6 times as long
    as 1 (docs/results/long_context/evaluate_speed.md); each thread waits on the other at every op.
    """
    if threads <= 1 or load_average < 1.0:
        return None
    return (
        f"the CPU is already busy (load average {load_average:.1f} on {cores} cores) and torch will run "
        f"{threads} threads that wait on each other: --threads 1 is often much faster here."
    )


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    import torch

    from dofla.data import load_texts, span_placements
    from dofla.errors import DoflaError
    from dofla.evaluation import harness, long_context, long_context_report
    from dofla.evaluation.attention_error import attention_errors
    from dofla.evaluation.passkey import passkey_comparison
    from dofla.evaluation.recall import recall_beyond_window
    from dofla.evaluation.window_baseline import baseline_window
    from dofla.io import write_json_atomic
    from dofla.loading import check_teacher, load_converted
    from dofla.models import load_teacher
    from dofla.models.loading import resolve_device

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # set already where dofla.cli runs the command
    elif hasattr(os, "getloadavg") and resolve_device(args.device).type == "cpu":
        hint = busy_cpu_hint(torch.get_num_threads(), os.getloadavg()[0], os.cpu_count() or 1)
        if hint:
            _progress(hint)
    texts = load_texts(args.data) if args.data else None
    if texts is not None and args.skip_texts:
        if args.skip_texts >= len(texts):
            raise DoflaError(
                f"--skip-texts {args.skip_texts} leaves nothing of {args.data}, which holds {len(texts)} texts; "
                "skip fewer."
            )
        texts = texts[args.skip_texts :]
    harness.check_task_files(args.task_list, args.tasks_dir)  # now, not after the models have run
    student, tokenizer, plan = load_converted(args.converted, dtype=args.dtype, device=args.device)
    for line in apply_position_arguments(student, args):
        _progress(line)
    teacher_spec = args.teacher or plan.metadata.get("teacher")
    if not teacher_spec:
        raise DoflaError("the converted folder does not name its teacher; pass --teacher MODEL.")
    loaded = load_teacher(teacher_spec, dtype=args.dtype, device=args.device)
    teacher, tokenizer = loaded.model, tokenizer or loaded.tokenizer
    if not args.any_teacher:
        check_teacher(args.converted, teacher, student)
    if tokenizer is None:
        raise DoflaError(
            "neither the converted folder nor the teacher has a tokenizer to read the text with."
        )
    window = args.window or baseline_window(plan)
    for length in args.length_list if texts is not None else []:
        long_context.check_context(teacher, length)
    for length in args.passkey_list:
        long_context.check_context(teacher, length, "a pass-key context")
    if args.recall:  # the rows must be long enough to repeat a span beyond the window: refused now
        for length in args.length_list:
            span_placements(1, length, 1.0, gap=window)

    results: dict = {"made_by": "dofla", "window": window, "sinks": args.sink_list}
    if texts is not None:
        results["data"] = {"path": str(args.data), "skip_texts": args.skip_texts, "texts": len(texts)}
    if texts is not None:
        from dofla.data import row_start_token

        start = row_start_token(teacher, tokenizer)  # Gemma reads every row from its <bos>
        sequences = long_context.pack_by_length(tokenizer, texts, args.length_list, args.sequences, start)
        for length, packed in sequences.items():
            if len(packed) < args.sequences:
                _progress(
                    f"the data gives only {len(packed)} sequences of {length} tokens ({args.sequences} asked)."
                )
        quality = long_context.long_context_quality(
            teacher,
            student,
            sequences,
            window=window,
            sinks=args.sink_list,
            batch_size=args.batch_size,
            progress=_progress,
            sinks_at_edge=args.edge_sinks or plan.sinks_at_edge,  # a student's own cache beside it
            cache_sinks=max(args.sink_list),
            cache_budget=args.cache_budget,
        )
        results["long_context"] = quality
        if args.error_sequences:
            shortest = sequences[min(sequences)][: args.error_sequences]
            clock = time.perf_counter()
            errors = attention_errors(student, shortest.split(args.batch_size))
            results["attention_error"] = {
                "length": int(shortest.shape[1]),
                "sequences": int(shortest.shape[0]),
                "seconds": round(time.perf_counter() - clock, 3),
                "layers": {str(layer): values for layer, values in errors.items()},
            }
        if args.recall:
            results["recall"] = [
                recall_beyond_window(
                    teacher,
                    student,
                    packed,
                    window=window,
                    sinks=max(args.sink_list),
                    batch_size=args.batch_size,
                    cache_budget=args.cache_budget,
                )
                for packed in sequences.values()
            ]
    if args.task_list:
        results["lm_eval"] = _lm_eval_tasks(args, teacher_spec, teacher, student, tokenizer)
    if args.passkey_list:
        results["passkey"] = passkey_comparison(
            teacher,
            student,
            tokenizer,
            context_lengths=args.passkey_list,
            depths=args.depth_list,
            trials=args.passkey_trials,
            window=window,
            sinks=max(args.sink_list),
            cache_budget=args.cache_budget,
        )
    _print_results(results)
    if args.plot and "long_context" in results:
        long_context_report.plot_loss_by_position(results["long_context"], args.plot)
    if args.json_out:
        write_json_atomic(args.json_out, results)
    return 0


def _lm_eval_tasks(args, teacher_spec: str, teacher, student, tokenizer) -> dict:
    """The tasks through lm-eval on both models, with the lm-eval command lines that give the same numbers."""
    import lm_eval

    from dofla.evaluation import harness
    from dofla.loading import saved_before_auto_config

    options = {"limit": args.limit, "batch_size": args.batch_size, "num_fewshot": args.num_fewshot}
    parameter = next(teacher.parameters())
    loaded_as = {"dtype": str(parameter.dtype).removeprefix("torch."), "device": str(parameter.device)}
    section: dict = {
        "version": lm_eval.__version__,
        **options,
        "commands": {
            "teacher": harness.lm_eval_command(
                harness.teacher_folder(teacher_spec), args.task_list, args.tasks_dir, **options, **loaded_as
            ),
            "student": harness.lm_eval_command(
                Path(args.converted).resolve(),
                args.task_list,
                args.tasks_dir,
                converted=True,
                **options,
                **loaded_as,
            ),
        },
        "tasks": {},
    }
    if saved_before_auto_config(args.converted):
        section["commands"]["student"] = (
            "(re-save the folder first: it predates dofla's config.json, README 'Loading with transformers') "
            + section["commands"]["student"]
        )
    for name, model in (("teacher", teacher), ("student", student)):
        _progress(f"lm-eval tasks on the {name}")
        scores, _ = harness.evaluate_tasks(model, tokenizer, args.task_list, args.tasks_dir, **options)
        for task, values in scores.items():
            section["tasks"].setdefault(task, {})[name] = values
    return section


def _print_results(results: dict) -> None:
    from dofla.evaluation import long_context_report
    from dofla.evaluation.passkey import passkey_markdown
    from dofla.evaluation.recall import recall_markdown

    if "long_context" in results:
        quality = results["long_context"]
        print(long_context_report.long_context_markdown(quality))
        for length, measured in quality["by_length"].items():
            spent = ", ".join(f"{name} {seconds:.0f}" for name, seconds in measured["seconds"].items())
            print(f"seconds at {length} tokens ({measured['sequences']} sequences): {spent}")
        print()
    if "attention_error" in results:
        measured = results["attention_error"]
        print(
            f"attention error per layer (teacher-forced, {measured['sequences']} x {measured['length']} "
            f"tokens, {measured['seconds']:.0f} s)"
        )
        body = [
            [layer, f"{values['relative_error']:.4f}", f"{values['cosine']:.4f}"]
            for layer, values in measured["layers"].items()
        ]
        print(long_context_report.aligned_table(["layer", "relative error", "cosine"], body) + "\n")
    if "lm_eval" in results:
        print(lm_eval_markdown(results["lm_eval"]))
    if "recall" in results:
        print(recall_markdown(results["recall"]))
    if "passkey" in results:
        print(passkey_markdown(results["passkey"]))


def lm_eval_markdown(section: dict) -> str:
    """The lm-eval scores as a table (acc and acc_norm with standard errors, teacher and student)."""
    from dofla.evaluation.long_context_report import aligned_table

    def shown(values: dict, metric: str) -> str:
        if metric not in values:
            return "-"
        return f"{values[metric]:.4f} ± {values[f'{metric}_stderr']:.4f}"

    body = [
        [task, str(by_model["teacher"]["items"])]
        + [
            shown(by_model[model], metric)
            for metric in ("acc", "acc_norm")
            for model in ("teacher", "student")
        ]
        for task, by_model in section["tasks"].items()
    ]
    header = ["task", "n", "acc teacher", "acc student", "acc_norm teacher", "acc_norm student"]
    return f"lm-eval {section['version']} tasks\n" + aligned_table(header, body) + "\n"
