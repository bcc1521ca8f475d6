"""``dofla linearize``: the main job, from a softmax teacher to a saved, evaluated linear-attention model.

Its flags are generated from the run config's fields (:mod:`dofla.run_config`,
:mod:`dofla.commands._config_flags`); ``--config FILE`` reads a TOML file of the same settings.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def register(subparsers) -> None:
    from dofla.commands._config_flags import add_config_arguments

    parser = subparsers.add_parser(
        "linearize",
        help="DoF -> plan -> convert -> distill (-> LoRA) -> evaluate -> save, with a report",
        description=(
            "Convert a causal LM's softmax attention to linear (or linear + sliding window) attention, "
            "distil it layer by layer from the teacher, evaluate held-out perplexity and write DIR/report.md. "
            "Settings resolve as: defaults, then --recipe, then --config FILE, then the flags given here."
        ),
    )
    add_config_arguments(parser)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The resolved :class:`dofla.run_config.LinearizeConfig` of a parsed command line (not yet validated)."""
    from dofla.commands._config_flags import settings_from_args
    from dofla.run_config import LinearizeConfig

    settings = settings_from_args(args)
    settings["command"] = "dofla " + " ".join(shlex.quote(argument) for argument in sys.argv[1:])
    return LinearizeConfig.from_dict(settings, source=args.config or "the command line")


def run(args: argparse.Namespace) -> int:
    from dofla.pipeline import linearize

    result = linearize(config_from_args(args))
    print(f"held-out perplexity: teacher {result.teacher_ppl:.3f}, student {result.student_ppl:.3f}")
    if result.lora_teacher_ppl is not None:
        print(f"teacher after the same LoRA stage: {result.lora_teacher_ppl:.3f}")
    print(f"model:  {result.out_dir}")
    print(f"report: {result.report_path}")
    return 0
