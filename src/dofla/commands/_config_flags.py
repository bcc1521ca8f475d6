"""Command-line flags generated from the fields of the run config (:mod:`dofla.run_config`), and read back.

Each field becomes one flag: its name from the field (``--seq-len``) or from ``option(flag=...)``, its help
text and default from the field, and for a field looked up in a registry the registered names. Every flag
defaults to "not given", so :func:`settings_from_args` returns only what the user typed: that wins over a
``--config`` file, which wins over the recipe, which wins over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Collection, Mapping
from typing import Any

from dofla.commands._common import integer_list
from dofla.errors import DoflaError
from dofla.run_config import REGISTRIES, LinearizeConfig, read_settings, settings_of
from dofla.setting_values import Setting, merge, token_count, unwrap


def _help(setting: Setting) -> str:
    text = setting.field.metadata.get("help", "")
    default = setting.default
    if isinstance(default, bool):
        text += f" (default {'on' if default else 'off'})"
    elif default is not dataclasses.MISSING and default not in (None, {}):
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        text += f" (default {shown})"
    choices = setting.field.metadata.get("choices")
    if choices is not None:
        text += f"; one of: {', '.join(sorted(REGISTRIES[choices]()))}"
    return text.replace("%", "%%")


def _chosen(setting: Setting, only: Collection[str] | None) -> bool:
    """Whether ``setting`` has a flag and is among ``only`` (dotted keys or section names; None: all)."""
    if not setting.field.metadata.get("cli", True):
        return False
    return only is None or setting.key in only or setting.key.partition(".")[0] in only


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type = LinearizeConfig,
    *,
    only: Collection[str] | None = None,
    aliases: Mapping[str, list[str]] | None = None,
    config_file: bool = True,
) -> None:
    """One flag per setting of ``cls`` (one not given is absent from the parsed namespace), and ``--config``.

    ``only``: just the settings with these dotted keys or in these sections (``dofla convert`` takes the
    ``recipe`` and the ``plan`` and ``student`` sections); ``aliases``: more flags for a setting, by its key;
    ``config_file``: whether ``--config FILE`` is added."""
    if config_file:
        parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="a TOML run configuration, e.g. a run's config.toml (flags given here win over it)",
        )
    for setting in settings_of(cls):
        if not _chosen(setting, only):
            continue
        options: dict[str, Any] = dict(default=argparse.SUPPRESS, help=_help(setting))
        if unwrap(setting.hint)[0] is bool:
            options["action"] = argparse.BooleanOptionalAction
        if setting.flag.startswith("--"):
            if "action" not in options:
                options["metavar"] = setting.field.name.upper()
            flags = [setting.flag, *(aliases or {}).get(setting.key, [])]
            parser.add_argument(*flags, dest=setting.key, **options)
        else:  # a positional (the teacher): its dest is its first name
            parser.add_argument(setting.key, nargs="?", metavar=setting.flag, **options)


def text_value(setting: Setting, text: Any) -> Any:
    """The value of ``setting`` written as ``text`` on the command line; one sentence if it cannot be read."""
    kind, _ = unwrap(setting.hint)
    flag = setting.flag
    if not isinstance(text, str):  # flags argparse already read (true/false)
        return text
    if setting.field.metadata.get("tokens"):
        return token_count(flag, text)
    origin = typing.get_origin(kind)
    if origin is list:
        item = typing.get_args(kind)[0]
        if typing.get_origin(item) is tuple:
            return pair_list(flag, text, typing.get_args(item))
        if item is int:
            return integer_list(text, flag, minimum=setting.field.metadata.get("minimum") or 0)
        names = [name.strip() for name in text.split(",")]
        if not all(names):
            raise DoflaError(f"{flag} must be comma-separated names, got {text!r}.")
        return names
    if origin is dict:
        return key_values(flag, text)
    try:
        return kind(text)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, "a value")
        raise DoflaError(f"{flag} must be {what}, got {text!r}.") from None


def pair_list(flag: str, text: str, kinds: tuple[type, ...]) -> list[tuple]:
    """'256:0.5,512:0.5' with kinds (int, float) -> [(256, 0.5), (512, 0.5)]; '' -> []."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        try:
            if len(parts) != len(kinds):
                raise ValueError(item)
            pairs.append(tuple(kind(part.strip()) for kind, part in zip(kinds, parts, strict=True)))
        except ValueError:
            shape = ":".join(kind.__name__.upper() for kind in kinds)
            raise DoflaError(
                f"{flag} must be comma-separated {shape} pairs like 256:0.5,512:0.5, got {text!r}."
            ) from None
    return pairs


def key_values(flag: str, text: str) -> dict[str, Any]:
    """'window_factor=0.95,beta=true' -> {"window_factor": 0.95, "beta": True} (values read as JSON when
    they are numbers or true/false, else kept as text)."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise DoflaError(f"{flag} must be KEY=VALUE pairs separated by commas, got {text!r}.")
        try:
            values[key.strip()] = json.loads(value.strip())
        except ValueError:
            values[key.strip()] = value.strip()
    return values


def settings_from_args(
    args: argparse.Namespace, cls: type = LinearizeConfig, *, only: Collection[str] | None = None
) -> dict[str, Any]:
    """The settings of a parsed command line, nested by section: the ``--config`` file's, then the flags
    given (which win key by key). Flags not given are not there, so a recipe may still set them. ``only``:
    as :func:`add_config_arguments` was given it."""
    given: dict[str, Any] = {}
    for setting in settings_of(cls):
        if _chosen(setting, only) and setting.key in vars(args):
            section, _, name = setting.key.rpartition(".")
            value = text_value(setting, getattr(args, setting.key))
            (given.setdefault(section, {}) if section else given)[name] = value
    from_file = read_settings(args.config) if getattr(args, "config", None) else {}
    return merge(from_file, given)
