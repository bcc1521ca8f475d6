"""One setting of the tree (:class:`Setting`: its dotted key, flag and type), reading a value of it (typed
values, token counts like 2M), and nested dicts of settings (:func:`flatten`, :func:`merge`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dofla.errors import DoflaError
from dofla.settings import SECTIONS


@dataclass(frozen=True)
class Setting:
    """One field of the tree: ``key`` is its dotted name ("lora.rank"), ``flag`` its command-line flag."""

    key: str
    field: dataclasses.Field
    hint: Any  # the field's type, e.g. int or list[int] | None

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag") or "--" + self.field.name.replace("_", "-")

    @property
    def where(self) -> str:
        """How errors name it: the flag, and its place in a config file (only that for a setting without a
        flag)."""
        section, _, name = self.key.rpartition(".")
        place = f"{name} in [{section}]" if section else name
        return f"{self.flag} ({place})" if self.field.metadata.get("cli", True) else place

    @property
    def named(self) -> str:
        """Its shortest name in errors: the flag, or its place in a config file for a setting without a flag."""
        return self.flag if self.field.metadata.get("cli", True) else self.where

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default


def flatten(settings: Mapping[str, Any]) -> dict[str, Any]:
    """{"distill": {"tokens": 5}, "seed": 1} -> {"distill.tokens": 5, "seed": 1}."""
    flat = {}
    for key, value in settings.items():
        if key in SECTIONS:
            flat.update({f"{key}.{name}": item for name, item in value.items()})
        else:
            flat[key] = value
    return flat


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Nested settings, later layers winning key by key (sections merged, not replaced)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in SECTIONS and isinstance(value, Mapping):
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    return merged


def unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed): ``list[int] | None`` -> (list[int], True)."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in typing.get_args(hint):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None)), True
    return hint, False


def _is(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) is tuple:  # a fixed-size pair like (length, share), a list in TOML
        parts = typing.get_args(kind)
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(parts)
            and all(_is(item, part) for item, part in zip(value, parts, strict=True))
        )
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _as(value: Any, kind: Any) -> Any:
    """``value`` (which :func:`_is` of ``kind``) as ``kind``: an int given for a float becomes a float."""
    if typing.get_origin(kind) is tuple:
        return tuple(_as(item, part) for item, part in zip(value, typing.get_args(kind), strict=True))
    return kind(value)


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        return "[" + ", ".join(part.__name__ for part in typing.get_args(kind)) + "] pairs"
    return kind.__name__


def _describe(hint: Any) -> str:
    kind, optional = unwrap(hint)
    origin = typing.get_origin(kind)
    if origin is list:
        text = f"a list of {_type_name(typing.get_args(kind)[0])}"
    elif origin is dict:
        text = "a table"
    else:
        text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    return text + (" (or left out)" if optional else "")


def typed(setting: Setting, value: Any) -> Any:
    """``value`` for ``setting`` if its type fits (an int given for a float becomes a float), else an error."""
    kind, optional = unwrap(setting.hint)
    if value is None and optional:
        return None
    if setting.field.metadata.get("tokens") and isinstance(value, str):
        return token_count(setting.flag, value)
    origin = typing.get_origin(kind)
    if origin is list:
        item = typing.get_args(kind)[0]
        if isinstance(value, (list, tuple)) and all(_is(entry, item) for entry in value):
            return [_as(entry, item) for entry in value]
    elif origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif _is(value, kind):
        return kind(value)
    raise DoflaError(f"{setting.where} must be {_describe(setting.hint)}, got {value!r}.")


def token_count(option: str, text: str | int) -> int:
    """A token budget like 2M, 500k or 100000; refused (one sentence) unless a positive finite count."""
    from dofla.data import parse_tokens

    try:
        tokens = parse_tokens(text)
    except (OverflowError, DoflaError):  # 'inf' overflows int(); 'nan' and words are not numbers
        tokens = None
    if tokens is None or tokens <= 0:
        raise DoflaError(
            f"{option} must be a positive number of tokens like 2M, 500k or 100000, got {text!r}."
        )
    return tokens
