"""The ``dofla`` command line: parses arguments and calls the library.

Each sub-command lives in ``dofla/commands/<name>.py`` with ``register(subparsers)`` that adds its
parser and sets ``func``; this file only finds them, runs one and turns errors into one sentence.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from dofla.errors import DoflaError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dofla",
        description="Turn a softmax-attention language model into a linear-attention one by distillation.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    import dofla.commands as commands_package

    for info in sorted(pkgutil.iter_modules(commands_package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"dofla.commands.{info.name}")
        module.register(subparsers)
    return parser


def _quiet_libraries() -> None:
    """Keep library progress bars and warnings for --debug; dofla prints its own progress, and its own
    warnings (e.g. a skipped non-finite training step) as one line without the source line."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    if getattr(warnings.formatwarning, "_dofla", False):
        return
    plain = warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None) -> str:
        if category is UserWarning and f"{os.sep}dofla{os.sep}" in str(filename):
            return f"dofla: warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    formatted._dofla = True
    warnings.formatwarning = formatted


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if not args.debug:
        _quiet_libraries()
    try:
        from dofla.commands._common import apply_threads

        apply_threads(args)  # --threads, checked and set before the command's work
        result = args.func(args)
    except DoflaError as error:
        if args.debug:
            raise
        print(f"dofla: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dofla: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
