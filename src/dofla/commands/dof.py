"""``dofla dof MODEL``: measure degrees of freedom, allocate feature dimensions, write a plan and a report."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

from dofla.commands._common import (
    add_model_arguments,
    add_overwrite_argument,
    add_threads_argument,
    check_at_least,
    check_device_and_dtype,
    check_feature_budget,
)
from dofla.settings import PlanSettings, StudentSettings

DOF_KIND = "dof report"  # the kind in the marker of the output folder (dofla.outputs)
DOF_FILES = (  # what `dofla dof` writes, and all that --overwrite removes (never a file of the user's)
    "plan.json",
    "dof.json",
    "dof.md",
    "dims_per_layer.png",
    "measure_vs_lambda.png",
    "eigenvalue_decay.png",
    "error_curves.json",
    "error_curves-*.json",
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "dof",
        help="measure each layer's degrees of freedom and allocate feature dimensions under a budget",
        description="Writes OUT/plan.json (for `dofla convert`), OUT/dof.json, OUT/dof.md and PNG plots.",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--budget", type=int, default=PlanSettings.budget, help="mean features per converted layer (C)"
    )
    parser.add_argument(
        "--lambda",
        dest="lambdas",
        action="append",
        default=None,
        help="λ, e.g. 2^-4 (repeatable; first is used)",
    )
    parser.add_argument(
        "--measure", default=PlanSettings.measure, help="a measure of dofla.dof.MEASURES (e.g. dof_trace)"
    )
    parser.add_argument(
        "--allocation",
        default=PlanSettings.allocation,
        help="an allocation of dofla.dof.ALLOCATIONS (e.g. headwise)",
    )
    parser.add_argument("--num-points", type=int, default=1024, help="J, points sampled per head")
    parser.add_argument("--sequences", type=int, default=16, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--min-dim", type=int, default=1, help="minimum features per layer")
    parser.add_argument(
        "--keep-softmax", type=int, default=0, help="leave N layers as softmax (chosen by --softmax-choice)"
    )
    parser.add_argument(
        "--softmax-choice",
        default=None,
        help="dof (highest measure), uniform or measured (highest measured error)",
    )
    parser.add_argument("--feature-map", default=StudentSettings.feature_map)
    parser.add_argument("--kind", default=PlanSettings.kind, choices=("linear", "hybrid"))
    parser.add_argument(
        "--data",
        default=None,
        help="calibration text (default: the web text shipped with dofla, dofla/demo_text/c4_train.jsonl)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output folder (new or empty)")
    add_overwrite_argument(parser, "plan and report")
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dofla import dof, outputs
    from dofla.data import check_data_path
    from dofla.errors import DoflaError

    lambdas = [dof.parse_lambda(text) for text in (args.lambdas or ["2^-4"])]
    for text, value in zip(args.lambdas or ["2^-4"], lambdas, strict=True):
        if not math.isfinite(value):
            raise DoflaError(f"--lambda must be a finite positive number like 2^-4, got {text}.")
    dof.MEASURES[args.measure]  # unknown names are refused (with the known ones) before the teacher loads
    dof.ALLOCATIONS[args.allocation].check_budget(args.budget, None)
    if args.softmax_choice is not None:
        dof.SOFTMAX_CHOICES[args.softmax_choice]
    check_feature_budget(args.budget)
    check_at_least("--sequences", args.sequences, 1)
    check_at_least("--seq-len", args.seq_len, 2)
    check_at_least("--num-points", args.num_points, 2)
    check_at_least("--min-dim", args.min_dim, 1)
    check_at_least("--keep-softmax", args.keep_softmax, 0)
    if args.min_dim > args.budget:
        raise DoflaError(
            f"--min-dim {args.min_dim} is above the mean budget --budget {args.budget}: no allocation can give "
            "every layer that many features; lower --min-dim or raise --budget."
        )
    check_data_path(args.data)
    check_device_and_dtype(args)
    out = outputs.check_output_folder(args.out, DOF_KIND, inputs=[args.model, args.data])
    if out.is_dir() and outputs.user_entries(out) and not args.overwrite:
        raise DoflaError(f"{args.out} already holds a DoF report; pass --overwrite to replace it.")
    with outputs.output_lock(out):
        return _measure_and_write(args, lambdas)


def _measure_and_write(args: argparse.Namespace, lambdas: list[float]) -> int:
    from dofla import dof, outputs
    from dofla.errors import DoflaError
    from dofla.io import write_json_atomic, write_text_atomic
    from dofla.models import load_teacher
    from dofla.planning.calibration import calibration_rows, calibration_texts
    from dofla.settings import PlanSettings, StudentSettings

    note = functools.partial(print, file=sys.stderr, flush=True)
    # read only as far as --sequences rows need (check_data_path read its first text before any work)
    texts, source = calibration_texts(args.data)
    note(f"loading the teacher {args.model}")
    teacher = load_teacher(args.model, dtype=args.dtype, device=args.device)
    measure = dof.MEASURES[args.measure]
    dof.ALLOCATIONS[args.allocation].check_budget(args.budget, teacher.adapter.head_dim)
    if args.keep_softmax >= teacher.adapter.num_layers:  # now, not after the capture
        raise DoflaError(
            f"--keep-softmax {args.keep_softmax} leaves nothing to convert in a {teacher.adapter.num_layers}-layer "
            f"model; keep at most {teacher.adapter.num_layers - 1}."
        )
    note(f"reading {args.sequences} calibration sequences of {args.seq_len} tokens")
    sequences = calibration_rows(
        teacher.model,
        teacher.tokenizer,
        texts,
        source,
        args.seq_len,
        args.sequences,
        what="--sequences",
    )
    batches = list(sequences.split(4))
    note(f"capturing q/k on {args.sequences} x {args.seq_len} tokens, then estimating the measure per head")
    estimate = dof.estimate(
        teacher.model,
        batches,
        num_points=args.num_points,
        lambdas=lambdas,
        measure=measure.name,
        seed=args.seed,
        progress=True,
        kernel_spectra=True,  # for eigenvalue_decay.png
    )
    # the teacher's own sliding-window layers keep their bounded cache: the plan converts the others
    layers = teacher.adapter.layers_to_convert()
    options = dict(budget=args.budget, minimum=args.min_dim, keep_softmax=args.keep_softmax, layers=layers)
    planned = PlanSettings(
        budget=args.budget,
        allocation=args.allocation,
        kind=args.kind,
        layers=layers,
        keep_softmax=args.keep_softmax,
    )
    student = StudentSettings(feature_map=args.feature_map)
    curves = None
    if dof.ALLOCATIONS[args.allocation].needs_curves or args.softmax_choice == "measured":
        from dofla.planning.error_curves import cached_error_curves, settings_for

        note("measuring each layer's error curve (short teacher-forced fits at a few feature dimensions)")
        settings = settings_for(planned, student)
        curves = cached_error_curves(teacher.model, batches, settings, folder=args.out, progress=True)
    window_cost = None
    if args.keep_softmax and args.softmax_choice == "window":
        from dofla.planning.window_costs import window_costs

        note(
            f"measuring what cutting each layer alone to the plan's {planned.window}-token window costs (KL per token)"
        )
        window_cost = window_costs(teacher.model, batches, window=planned.window, layers=layers)
    # without --softmax-choice: by the measured error where the curves were measured, else by the measure
    choice = args.softmax_choice or ("measured" if curves is not None else "dof")
    plan = dof.make_plan(
        teacher.model,
        estimate,
        plan=dataclasses.replace(planned, softmax_choice=choice),
        student=student,
        minimum=args.min_dim,
        curves=curves,
        window_cost=window_cost,
    )
    plan.metadata.update(teacher=args.model, calibration=source, seed=args.seed)
    allocations = dof.allocate_all(estimate, teacher.adapter, curves=curves, **options)
    out = Path(args.out)
    if args.overwrite:
        outputs.remove_known_files(out, DOF_FILES)
    outputs.claim_output_folder(out, DOF_KIND)
    write_json_atomic(out / "plan.json", plan.to_dict())
    write_json_atomic(out / "dof.json", estimate.to_dict())
    table = dof.markdown_table(estimate, allocations)
    notes = "".join(f"\n> {warning}\n" for warning in estimate.warnings)
    header = (
        f"# Degrees of freedom: {args.model}\n\nmeasure `{args.measure}`, λ = {', '.join(map(str, lambdas))}, "
        f"J = {args.num_points}, {args.sequences} × {args.seq_len} tokens of {source}, seed {args.seed}, "
        f"budget C = {args.budget}; estimation took {estimate.seconds:.1f} s.\n{notes}\n"
    )
    write_text_atomic(out / "dof.md", header + table)
    plots = dof.plot_report(estimate, allocations, out)
    for warning in estimate.warnings:
        print(f"note: {warning}")
    print(table)
    print(f"plan: {out / 'plan.json'}   report: {out / 'dof.md'}   plots: {', '.join(p.name for p in plots)}")
    return 0
