"""Arguments and checks shared by several sub-commands."""

from __future__ import annotations

import argparse

from dofla.config import check_feature_budget  # noqa: F401  (the commands check --budget with it)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2-135m",
        help="teacher: a Hugging Face model folder, a .gguf file, a hub id, or 'smollm2-135m' (embedded default)",
    )
    add_device_arguments(parser)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype and --device (both default to None: chosen from the machine)."""
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32 (CPU default) | bfloat16 (CUDA default) | float16 | float64 (exact comparisons, slow)",
    )
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: the CPU threads torch runs on, set before the command's work (:func:`apply_threads`;
    every long-running command takes it)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch, 1 to this machine's CPU count (default: torch's choice; 1 is faster when "
        "other jobs keep the cores busy)",
    )


def check_threads(threads: int | None) -> None:
    """``--threads``: None (torch's choice) or 1 to the CPU count, else one sentence."""
    import os

    from dofla.errors import DoflaError

    if threads is None:
        return
    cores = os.cpu_count() or 1
    if threads < 1:
        raise DoflaError(f"--threads must be at least 1, got {threads}.")
    if threads > cores:
        raise DoflaError(
            f"--threads {threads} is more than this machine's {cores} CPU threads; give at most that many."
        )


def apply_threads(args: argparse.Namespace) -> None:
    """Check ``args.threads`` (where the command takes ``--threads``) and set torch's thread count to it;
    :func:`dofla.cli.main` calls it before every command's work."""
    threads = getattr(args, "threads", None)
    check_threads(threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def add_overwrite_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace dofla's own earlier {what} in --out (files dofla did not write are never touched)",
    )


def check_device_and_dtype(args: argparse.Namespace) -> None:
    """--device and --dtype, checked before anything is loaded."""
    from dofla.models.loading import resolve_device, resolve_dtype

    resolve_dtype(args.dtype, resolve_device(args.device))


def check_at_least(option: str, value: int | float, minimum: int | float) -> None:
    from dofla.errors import DoflaError

    if not value >= minimum:  # also refuses NaN
        raise DoflaError(f"{option} must be at least {minimum}, got {value}.")


def integer_list(text: str, option: str, *, minimum: int) -> list[int]:
    """An option like 512,1024: distinct integers of at least ``minimum``, else one sentence saying so."""
    from dofla.errors import DoflaError

    items = [item.strip() for item in str(text).split(",") if item.strip()]
    try:
        values = [int(item) for item in items]
    except ValueError:
        values = []
    if not values or any(value < minimum for value in values):
        raise DoflaError(f"{option} must be comma-separated integers of at least {minimum}, got {text!r}.")
    if len(set(values)) != len(values):
        raise DoflaError(f"{option} lists a value twice: {text!r}.")
    return values


def add_position_arguments(parser: argparse.ArgumentParser) -> None:
    """``--position-period`` and ``--sinks-at-edge``: how a saved student reads positions (its plan's by
    default)."""
    parser.add_argument(
        "--position-period",
        type=int,
        default=None,
        help="the converted layers' memories read rotary positions modulo this many tokens (e.g. the length "
        "they were trained at; 0: the true positions); default: what the folder's plan says",
    )
    parser.add_argument(
        "--sinks-at-edge",
        choices=("on", "off"),
        default=None,
        help="on: the hybrid layers' windows see their sinks from the window's edge; off: at their true "
        "positions; default: what the folder's plan says",
    )


def check_position_arguments(args: argparse.Namespace) -> None:
    from dofla.errors import DoflaError

    if args.position_period is not None and args.position_period < 0:
        raise DoflaError(
            f"--position-period must be a number of tokens (0: the true positions), got {args.position_period}."
        )


def apply_position_arguments(model, args: argparse.Namespace) -> list[str]:
    """``--position-period`` and ``--sinks-at-edge`` on a loaded converted model (nothing when not given).
    Returns a line for each setting changed."""
    from dofla.convert import set_position_period, set_sinks_at_edge

    changed = []
    if args.position_period is not None:
        set_position_period(model, args.position_period or None)
        changed.append(f"position period: {args.position_period or 'none (true positions)'}")
    if args.sinks_at_edge is not None:
        set_sinks_at_edge(model, args.sinks_at_edge == "on")
        where = "the window's edge" if args.sinks_at_edge == "on" else "their true positions"
        changed.append(f"sinks seen from {where}")
    return changed
