"""``dofla convert``: convert a teacher with a plan (or a uniform one) and save the converted folder."""

from __future__ import annotations

import argparse

from dofla.commands._common import add_model_arguments, add_overwrite_argument, check_device_and_dtype
from dofla.config import DEFAULT_WINDOW, LayerPlan


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="swap a teacher's softmax attention for linear attention as a plan says, and save it",
        description="Convert MODEL in place from --plan PLAN.json (or a uniform plan from --kind/--feature-map/"
        "--feature-dim/--layers) and write a folder that `dofla generate` and `dofla evaluate` read. "
        "The converted model is not distilled yet: its features start from their initialisation.",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--plan", default=None, help="plan JSON (from `dofla dof`); overrides the uniform options"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output folder: new or empty (or an earlier converted model with --overwrite)",
    )
    add_overwrite_argument(parser, "converted model")
    parser.add_argument(
        "--kind", default=LayerPlan.kind, choices=("linear", "hybrid"), help="uniform plan: layer kind"
    )
    parser.add_argument("--feature-map", default=LayerPlan.feature_map, help="uniform plan: feature map name")
    parser.add_argument(
        "--feature-dim", type=int, default=LayerPlan.feature_dim, help="uniform plan: features per head"
    )
    parser.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, help="uniform plan: sliding window of hybrid layers"
    )
    parser.add_argument(
        "--layers", default=None, help="uniform plan: comma-separated layer indices to convert (default: all)"
    )
    parser.add_argument(
        "--convert-windowed",
        action="store_true",
        help="uniform plan without --layers: convert the teacher's own sliding-window layers too (by default "
        "they keep their bounded cache)",
    )
    parser.add_argument(
        "--per-query-head",
        action="store_true",
        help="uniform plan: one feature map and state per query head instead of per key/value head",
    )
    parser.add_argument(
        "--student-only",
        action="store_true",
        help="save only the dofla parameters (the teacher is loaded again)",
    )
    parser.set_defaults(func=run)


def parse_layers(text: str | None) -> list[int] | None:
    """'0,2,5' -> [0, 2, 5]; None or '' -> None (all layers)."""
    from dofla.errors import DoflaError

    if not text:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise DoflaError(
            f"--layers must be comma-separated layer numbers like 0,2,5, got {text!r}."
        ) from None


def run(args: argparse.Namespace) -> int:
    from dofla.cells import check_plan_cells
    from dofla.config import MAX_FEATURE_DIM, ConversionPlan
    from dofla.errors import DoflaError
    from dofla.feature_maps import FEATURE_MAPS

    # Everything that can be checked without the model is checked before loading it.
    plan = ConversionPlan.load(args.plan) if args.plan else None
    if plan is not None:
        check_plan_cells(plan)
    layers = parse_layers(args.layers)
    if plan is None:
        if args.feature_dim <= 0:
            raise DoflaError(f"--feature-dim must be positive, got {args.feature_dim}.")
        if args.feature_dim > MAX_FEATURE_DIM:
            raise DoflaError(
                f"--feature-dim {args.feature_dim} is above the most dofla builds, {MAX_FEATURE_DIM} features "
                "per head; use a smaller one."
            )
        if args.feature_map not in FEATURE_MAPS:
            raise DoflaError(
                f"unknown feature map {args.feature_map!r}; known maps: {', '.join(sorted(FEATURE_MAPS))}."
            )
        if args.kind == "hybrid" and args.window <= 0:
            raise DoflaError(f"--window must be positive, got {args.window}.")
    check_device_and_dtype(args)
    from dofla import outputs
    from dofla.saving import check_model_folder

    out = check_model_folder(args.out, overwrite=args.overwrite, inputs=[args.model, args.plan])
    with outputs.output_lock(out):
        return _convert_and_save(args, plan, layers)


def _convert_and_save(args: argparse.Namespace, plan, layers) -> int:
    from dofla.convert import convert, plan_for
    from dofla.models import load_teacher
    from dofla.saving import save_converted

    teacher = load_teacher(args.model, dtype=args.dtype, device=args.device)
    model = teacher.model
    if plan is None:
        plan = plan_for(
            model,
            kind=args.kind,
            feature_map=args.feature_map,
            feature_dim=args.feature_dim,
            layers=layers,
            window=args.window,
            share_kv_heads=not args.per_query_head,
            convert_windowed=args.convert_windowed,
        )
    convert(model, plan)
    out = save_converted(
        model,
        args.out,
        tokenizer=teacher.tokenizer,
        extra_metadata={"teacher": str(getattr(teacher, "spec", None) or args.model)},
        student_only=args.student_only,
        overwrite=args.overwrite,
    )
    kinds = [layer.kind for layer in plan.layers]
    print(
        f"converted {len(plan.converted_layers)} of {plan.num_layers} layers "
        f"({kinds.count('linear')} linear, {kinds.count('hybrid')} hybrid); saved to {out}"
    )
    return 0
