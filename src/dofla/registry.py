"""Named choices (losses, DoF measures, allocations, feature maps, ...) looked up in one kind of table.

A :class:`Registry` is a dict from name to the registered thing with two additions: registering a
second, different thing under a taken name is refused, and looking up a name that is not there raises
a :class:`~dofla.errors.DoflaError` that lists the registered names. Adding a choice is one decorated
function or class in the module that owns the registry; nothing else lists names.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from dofla.errors import DoflaError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Names of one ``kind`` (e.g. "loss") -> registered things; ``registry[name]`` refuses unknown names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def add(self, name: str, thing: T) -> T:
        """Register ``thing`` as ``name``; a name is registered once (the same thing again is a no-op)."""
        if name in self and self[name] != thing:
            raise ValueError(f"{self.kind} {name!r} is already registered ({self[name]!r})")
        self[name] = thing
        return thing

    def decorator(self, name: str, attribute: str | None = None):
        """A class/function decorator registering its target as ``name`` (and setting ``target.attribute``
        to the name, when given)."""

        def register(thing: T) -> T:
            self.add(name, thing)
            if attribute is not None:
                setattr(thing, attribute, name)
            return thing

        return register

    def __missing__(self, name: str):
        raise DoflaError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self))}.")
