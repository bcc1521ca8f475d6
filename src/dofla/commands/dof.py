"""``dofla dof MODEL``: measure degrees of freedom, allocate feature dimensions, write a plan and a report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dofla.commands._common import add_model_arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "dof",
        help="measure each layer's degrees of freedom and allocate feature dimensions under a budget",
        description="Writes OUT/plan.json (for `dofla convert`), OUT/dof.json, OUT/dof.md and PNG plots.",
    )
    add_model_arguments(parser)
    parser.add_argument("--budget", type=int, default=64, help="mean features per converted layer (C)")
    parser.add_argument(
        "--lambda",
        dest="lambdas",
        action="append",
        default=None,
        help="λ, e.g. 2^-4 (repeatable; first is used)",
    )
    parser.add_argument("--measure", default="dof", help="a measure of dofla.dof.MEASURES (e.g. dof_trace)")
    parser.add_argument(
        "--allocation", default="dof", help="an allocation of dofla.dof.ALLOCATIONS (e.g. headwise)"
    )
    parser.add_argument("--num-points", type=int, default=1024, help="J, points sampled per head")
    parser.add_argument("--sequences", type=int, default=16, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--min-dim", type=int, default=1, help="minimum features per layer")
    parser.add_argument(
        "--keep-softmax", type=int, default=0, help="leave the N highest-measure layers as softmax"
    )
    parser.add_argument("--feature-map", default="learnable_prf")
    parser.add_argument("--kind", default="linear", choices=("linear", "hybrid"))
    parser.add_argument(
        "--data", default=None, help="calibration text (default: text sampled from the teacher)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output folder")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dofla import dof
    from dofla.data import load_texts, pack_token_sequences, sample_teacher_texts
    from dofla.errors import DoflaError
    from dofla.io import write_text_atomic
    from dofla.models import load_teacher
    from dofla.models.loading import cache_root

    lambdas = [dof.parse_lambda(text) for text in (args.lambdas or ["2^-4"])]
    measure = dof.MEASURES[args.measure]  # unknown names are refused before the teacher loads
    allocation = dof.ALLOCATIONS[args.allocation]
    allocation.check_budget(args.budget, None)
    teacher = load_teacher(args.model, dtype=args.dtype, device=args.device)
    allocation.check_budget(args.budget, teacher.adapter.head_dim)
    if teacher.tokenizer is None:
        raise DoflaError("the teacher has no tokenizer, which calibration needs.")
    if args.data:
        texts, source = load_texts(args.data), f"file {args.data}"
    else:
        texts = sample_teacher_texts(
            teacher.model,
            teacher.tokenizer,
            args.sequences,
            args.seq_len + 16,
            seed=args.seed,
            cache_dir=cache_root() / "samples",
        )
        source = "text sampled from the teacher (cached)"
    sequences = pack_token_sequences(teacher.tokenizer, texts, args.seq_len)
    if sequences.shape[0] < args.sequences:
        raise DoflaError(
            f"the calibration data gives {sequences.shape[0]} sequences of {args.seq_len} tokens, "
            f"{args.sequences} are needed; give more text, fewer --sequences or a shorter --seq-len."
        )
    batches = list(sequences[: args.sequences].split(4))
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
    options = dict(budget=args.budget, minimum=args.min_dim, keep_softmax=args.keep_softmax)
    plan = dof.make_plan(
        teacher.model,
        estimate,
        variant=args.allocation,
        kind=args.kind,
        feature_map=args.feature_map,
        **options,
    )
    plan.metadata.update(teacher=args.model, calibration=source, seed=args.seed)
    allocations = dof.allocate_all(estimate, teacher.adapter, **options)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    write_text_atomic(out / "dof.json", json.dumps(estimate.to_dict(), indent=2) + "\n")
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
