"""``dofla linearize``: the main job, from a softmax teacher to a saved, evaluated linear-attention model.

Its flags are generated from the run config's fields (:mod:`dofla.run_config`,
:mod:`dofla.commands._config_flags`); ``--config FILE`` reads a TOML file of the same settings.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def register(subparsers) -> None:
    from dofla.commands._common import add_threads_argument
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
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="distil on N local processes, sharded as --sharding says (launches torchrun; same as "
        "`torchrun --nproc-per-node N -m dofla linearize ...`)",
    )
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The resolved :class:`dofla.run_config.LinearizeConfig` of a parsed command line (not yet validated)."""
    from dofla.commands._config_flags import settings_from_args
    from dofla.run_config import LinearizeConfig

    settings = settings_from_args(args)
    settings["command"] = "dofla " + " ".join(shlex.quote(argument) for argument in sys.argv[1:])
    return LinearizeConfig.from_dict(settings, source=args.config or "the command line")


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` / ``option=VALUE``."""
    kept, skip = [], False
    for argument in argv:
        if skip:
            skip = False
        elif argument == option:
            skip = True
        elif not argument.startswith(option + "="):
            kept.append(argument)
    return kept


def launch(args: argparse.Namespace, config) -> int:
    """Run this same command on ``--nproc`` local processes under ``torchrun`` (sharded distillation)."""
    import subprocess

    from dofla.distill.distributed import torchrun_command
    from dofla.distill.sharding import check_processes

    check_processes(config, args.nproc, f"--nproc {args.nproc}")
    return subprocess.call(torchrun_command(args.nproc, without_option(sys.argv[1:], "--nproc")))


def run(args: argparse.Namespace) -> int:
    from dofla.commands._common import check_at_least
    from dofla.distill.distributed import environment_world_size
    from dofla.pipeline import linearize

    check_at_least("--nproc", args.nproc, 1)
    config = config_from_args(args)
    if args.nproc > 1 and environment_world_size() == 1:
        config.validate()  # refused here, not once per process
        return launch(args, config)
    result = linearize(config)
    if result is None:  # a helper rank under torchrun: rank 0 prints the result
        return 0
    print(f"held-out perplexity: teacher {result.teacher_ppl:.3f}, student {result.student_ppl:.3f}")
    if result.lora_teacher_ppl is not None:
        print(f"teacher after the same LoRA stage: {result.lora_teacher_ppl:.3f}")
    print(f"model:  {result.out_dir}")
    print(f"report: {result.report_path}")
    return 0
