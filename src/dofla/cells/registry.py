"""The one registry of student cells: what replaces a layer's softmax attention, looked up by name.

A cell is a :class:`dofla.attention.LinearAttention` subclass: it receives the teacher's q, k, v and
returns the attention output, and keeps a recurrent state in the cache when decoding. Register a new one
with ``@register_cell("name")``; a plan names it in ``LayerPlan.cell``.
"""

from __future__ import annotations

from dofla.registry import Registry

CELLS: Registry[type] = Registry("cell")


def register_cell(name: str):
    """Class decorator: make a student cell buildable by ``name``."""
    return CELLS.decorator(name, attribute="cell_name")


def cell_class(name: str) -> type:
    """The registered cell class ``name``; an unknown name gets the list of known ones."""
    return CELLS[name]
