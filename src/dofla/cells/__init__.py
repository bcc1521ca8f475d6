"""Student cells: what replaces a layer's softmax attention, built by name from one registry.

``linear`` (:class:`dofla.attention.LinearAttention`: plain normalised linear attention; with a window, the
LoLCATs hybrid with one shared normalisation), ``gla`` (:mod:`dofla.cells.gated`: the same with a learned,
data-dependent decay), ``gated_delta`` (:mod:`dofla.cells.delta`: a gated delta rule memory, mixed with the
window per head), ``gated_delta_net`` (:mod:`dofla.cells.gated_delta_net`: exactly Qwen3.5's gated delta
net layer, with projections of its own, alone only; exportable to a standard checkpoint) and ``window``
(:mod:`dofla.cells.window`: the sliding window and sink tokens alone, no parameters). Each but ``window`` and ``gated_delta_net`` is
usable alone (plan kind "linear") or with the sliding window ("hybrid").
"""

from dofla.attention import LinearAttention
from dofla.cells.delta import DeltaHybridState, GatedDeltaAttention
from dofla.cells.gated import GatedLinearAttention, GatedState
from dofla.cells.gated_delta_net import GatedDeltaNet
from dofla.cells.registry import CELLS, cell_class, register_cell
from dofla.cells.window import WindowAttention

register_cell("linear")(LinearAttention)


def build_student(plan, **shape) -> LinearAttention:
    """The student of one layer: the plan's cell class built with the layer's shape (see LinearAttention)."""
    return cell_class(plan.cell)(plan, **shape)


def check_plan_cells(plan) -> None:
    """Refuse a ConversionPlan naming a cell that is not registered (before any model is loaded)."""
    for layer in plan.layers:
        if layer.kind != "softmax":
            cell_class(layer.cell)


__all__ = [
    "DeltaHybridState",
    "GatedDeltaAttention",
    "GatedDeltaNet",
    "WindowAttention",
    "CELLS",
    "GatedLinearAttention",
    "GatedState",
    "LinearAttention",
    "build_student",
    "cell_class",
    "check_plan_cells",
    "register_cell",
]
