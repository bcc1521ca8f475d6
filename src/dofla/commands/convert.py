"""``dofla convert``: convert a teacher with a plan (a recipe's, the plan options', or a saved one) and save
the converted folder.

The recipe and the plan and student options are ``dofla linearize``'s (the same flags, generated from the
``recipe`` setting and the ``plan`` and ``student`` sections of :mod:`dofla.settings`, the same defaults),
so ``dofla convert MODEL --recipe R`` makes the plan ``dofla linearize MODEL --recipe R`` trains.
"""

from __future__ import annotations

import argparse
import functools
import sys

from dofla.commands._common import (
    add_model_arguments,
    add_overwrite_argument,
    add_threads_argument,
    check_device_and_dtype,
)

PLAN_OPTIONS = ("recipe", "plan", "student")  # the settings convert takes (dofla.run_config)
ALIASES = {"plan.budget": ["--feature-dim"]}  # convert's earlier name of --budget


def register(subparsers) -> None:
    from dofla.commands._config_flags import add_config_arguments
    from dofla.settings import DistillSettings

    parser = subparsers.add_parser(
        "convert",
        help="swap a teacher's softmax attention for linear attention as a plan says, and save it",
        description="Convert MODEL in place from --plan PLAN.json (from `dofla dof`) or from the plan that "
        "--recipe and the plan options make (the flags and defaults of `dofla linearize`), and write a folder "
        "that `dofla generate` and `dofla evaluate` read. The converted model is not distilled yet: its "
        "students start from their initialisation. An allocation or --keep-softmax choice that measures the "
        "teacher measures it on --data (default: the web text shipped with dofla), on --dof-batches batches of "
        f"{DistillSettings.batch_size} rows of the recipe's training length (--seq-len of `dofla linearize`).",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--plan", default=None, help="plan JSON (from `dofla dof`), instead of --recipe and the plan options"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output folder: new or empty (or an earlier converted model with --overwrite)",
    )
    add_overwrite_argument(parser, "converted model")
    parser.add_argument(
        "--data",
        default=None,
        help="calibration text (txt, jsonl or a datasets folder) for a plan that measures the teacher "
        "(default: the web text shipped with dofla)",
    )
    parser.add_argument(
        "--student-only",
        action="store_true",
        help="save only the dofla parameters (the teacher is loaded again)",
    )
    add_threads_argument(parser)
    add_config_arguments(parser, only=PLAN_OPTIONS, aliases=ALIASES, config_file=False)
    parser.set_defaults(func=run)


def plan_config(args: argparse.Namespace):
    """The run config that the recipe and the plan options given make (defaults, then the recipe, then the
    flags, as ``dofla linearize`` resolves them), its plan settings checked."""
    from dofla.commands._config_flags import settings_from_args
    from dofla.run_config import LinearizeConfig

    settings = settings_from_args(args, only=PLAN_OPTIONS)
    config = LinearizeConfig.from_dict({**settings, "out_dir": args.out}, source="the command line")
    config.validate_plan()
    return config, settings


def run(args: argparse.Namespace) -> int:
    from dofla.cells import check_plan_cells
    from dofla.config import ConversionPlan
    from dofla.data import check_data_path
    from dofla.errors import DoflaError

    # Everything that can be checked without the model is checked before loading it.
    config, given = plan_config(args)
    plan = None
    if args.plan:
        if given:
            options = ", ".join(sorted(given))
            raise DoflaError(
                f"--plan is a whole plan and the options given ({options}) would make another; pass one of the two."
            )
        plan = ConversionPlan.load(args.plan)
        check_plan_cells(plan)
    check_data_path(args.data)
    check_device_and_dtype(args)
    from dofla import outputs
    from dofla.saving import check_model_folder

    out = check_model_folder(args.out, overwrite=args.overwrite, inputs=[args.model, args.plan, args.data])
    with outputs.output_lock(out):
        return _convert_and_save(args, plan, config)


def plan_from_settings(config, model, tokenizer, data: str | None = None):
    """The plan of ``config``'s ``plan`` and ``student`` sections for ``model``, as ``dofla linearize`` makes
    it before training (:func:`dofla.planning.measure_and_plan`, the windows' sinks as
    :func:`dofla.run_positions.resolve_sinks_at_edge` says), measured where it needs to be on calibration
    rows of ``data`` (default: the text shipped with dofla), ``plan.dof_batches`` batches of
    ``distill.batch_size`` rows of ``data.seq_len`` tokens."""
    from dofla import planning
    from dofla.models import get_adapter
    from dofla.planning.calibration import calibration_rows, calibration_texts
    from dofla.run_positions import resolve_sinks_at_edge

    batches, source = [], None
    if planning.measures_text(config.plan):
        # the layers first: a layer that does not exist is refused before the text is read
        get_adapter(model).layers_to_convert(config.plan.layers)
        size = config.distill.batch_size
        rows = config.plan.dof_batches * size
        print(
            f"measuring the teacher for the plan (allocation {config.plan.allocation}, --keep-softmax "
            f"{config.plan.keep_softmax}) on {rows} rows of {config.data.seq_len} tokens",
            file=sys.stderr,
            flush=True,
        )
        texts, source = calibration_texts(data)
        what = f"--dof-batches {config.plan.dof_batches} of {size} rows"
        sequences = calibration_rows(model, tokenizer, texts, source, config.data.seq_len, rows, what=what)
        device = next(model.parameters()).device
        batches = [batch.to(device) for batch in sequences.split(size)]
    plan = planning.measure_and_plan(model, batches, plan=config.plan, student=config.student)
    plan.sinks_at_edge = resolve_sinks_at_edge(config, model, plan)
    plan.position_period = config.plan.position_period or None
    if source is not None:
        plan.metadata["calibration"] = source
    if config.recipe is not None:
        plan.metadata["recipe"] = config.recipe
    return plan


def _convert_and_save(args: argparse.Namespace, plan, config) -> int:
    from dofla.convert import convert
    from dofla.models import load_teacher
    from dofla.saving import save_converted

    note = functools.partial(print, file=sys.stderr, flush=True)
    note(f"loading the teacher {args.model}")
    teacher = load_teacher(args.model, dtype=args.dtype, device=args.device)
    model = teacher.model
    if plan is None:
        plan = plan_from_settings(config, model, teacher.tokenizer, args.data)
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
