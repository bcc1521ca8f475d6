"""Student cells: what replaces a layer's softmax attention, built by name from one registry.

``linear`` (:class:`dofla.attention.LinearAttention`: plain normalised linear attention; with a window, the
LoLCATs hybrid with one shared normalisation), ``gla`` (:mod:`dofla.cells.gated`: the same with a learned,
data-dependent decay), ``gated_delta`` (:mod:`dofla.cells.delta`: a gated delta rule memory, mixed with the
window per head) and ``window`` (the sliding window and sink tokens alone, no parameters). Each but
``window`` is usable alone (plan kind "linear") or with the sliding window ("hybrid").
"""

from dofla.attention import LinearAttention
from dofla.cells.delta import DeltaHybridState, GatedDeltaAttention, WindowAttention
from dofla.cells.gated import GatedLinearAttention, GatedState
from dofla.cells.registry import CELLS, cell_class, register_cell

register_cell("linear")(LinearAttention)


def build_student(plan, **shape) -> LinearAttention:
    """The student of one layer: the plan's cell class built with the layer's shape (see LinearAttention)."""
    return cell_class(plan.cell)(plan, **shape)


__all__ = [
    "DeltaHybridState",
    "GatedDeltaAttention",
    "WindowAttention",
    "CELLS",
    "GatedLinearAttention",
    "GatedState",
    "LinearAttention",
    "build_student",
    "cell_class",
    "register_cell",
]
