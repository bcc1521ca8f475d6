"""Planning: the measurements on the teacher that choose a conversion plan, and the plan they give.

    plan = planning.measure_and_plan(model, batches, plan=PlanSettings(allocation="dof", budget=64))

:func:`measure_and_plan` runs what the allocation and the softmax-layer choice need -- the DoF estimate
(:func:`dofla.dof.estimate`), each layer's measured error curve (:mod:`~dofla.planning.error_curves`, short
teacher-forced fits of students), each layer's window cost (:mod:`~dofla.planning.window_costs`) or the
greedy recall order (:mod:`~dofla.planning.recall_order`) -- and hands the results to
:func:`dofla.dof.make_plan`, which allocates and builds the plan. Planning sits above :mod:`dofla.dof`
(the pure allocation maths), :mod:`dofla.convert`, :mod:`dofla.distill` and :mod:`dofla.evaluation`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dofla.config import ConversionPlan
from dofla.dof.allocate import ALLOCATIONS
from dofla.dof.estimation import estimate
from dofla.dof.plan import make_plan
from dofla.models import get_adapter
from dofla.planning.error_curves import (
    CurveSettings,
    cached_error_curves,
    curve_cache,
    measure_error_curves,
    settings_for,
)
from dofla.planning.recall_order import cached_recall_order, recall_layer_order
from dofla.planning.window_costs import window_costs
from dofla.settings import PlanSettings, StudentSettings

__all__ = [
    "CurveSettings",
    "cached_error_curves",
    "cached_recall_order",
    "curve_cache",
    "measure_and_plan",
    "measure_error_curves",
    "measures_text",
    "recall_layer_order",
    "settings_for",
    "window_costs",
]


def measures_text(plan: PlanSettings) -> bool:
    """Whether :func:`measure_and_plan` runs the teacher on its calibration batches for ``plan`` (the
    allocation's measure or error curves, or the choice of the kept softmax layers); False: the batches are
    not read (e.g. ``allocation="fix"`` without ``keep_softmax``)."""
    rule, choice, kept = ALLOCATIONS[plan.allocation], plan.softmax_choice, plan.keep_softmax
    return rule.needs_measure or rule.needs_curves or bool(kept and choice != "uniform")


def measure_and_plan(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    plan: PlanSettings | None = None,
    student: StudentSettings | None = None,
    curve_options: dict[str, Any] | None = None,
    curves_folder: str | Path | None = None,
) -> ConversionPlan:
    """:func:`~dofla.dof.plan.make_plan` for the settings sections ``plan`` and ``student`` (defaults: the
    sections'), measuring ``plan.measure`` (``plan.dof_points`` points per head) on calibration batches
    (B, T) first when the allocation needs a measure (a measure-free allocation such as ``fix`` runs no
    teacher forward).

    For ``softmax_choice="recall"`` the greedy recall order
    (:func:`~dofla.planning.recall_order.recall_layer_order`) is measured on the batches first, up to
    ``keep_softmax`` layers. For ``softmax_choice="window"`` each layer's window cost (the KL of cutting it
    alone to the plan's window and sinks, :func:`~dofla.planning.window_costs.window_costs`) is measured on
    the batches first, so measure at the length the model must serve. Error curves
    (:mod:`dofla.planning.error_curves`) are measured on the same batches when the allocation or the
    softmax-layer choice needs them, with the planned student and ``curve_options`` (dims, steps, lr, loss,
    criterion, heldout_rows), and kept in ``curves_folder`` (default: the innermost
    :func:`~dofla.planning.error_curves.curve_cache`) for the next run with the same key; so is the recall
    order (:func:`~dofla.planning.recall_order.cached_recall_order`).
    """
    plan = plan if plan is not None else PlanSettings()
    student = student if student is not None else StudentSettings()
    rule, choice, kept = ALLOCATIONS[plan.allocation], plan.softmax_choice, plan.keep_softmax
    # the layers to convert, resolved once: the measurements below take them too
    layers = get_adapter(model).layers_to_convert(plan.layers, convert_windowed=plan.convert_windowed)
    plan = dataclasses.replace(plan, layers=layers, convert_windowed=False)
    curves = window_cost = recall_order = measured = None
    if rule.needs_curves or (kept and choice == "measured"):
        settings = settings_for(plan, student, **dict(curve_options or {}))
        # every layer's curve, whichever are converted: one measurement serves any choice of layers
        curves = cached_error_curves(model, batches, settings, folder=curves_folder)
    if kept and choice == "window":
        window_cost = window_costs(model, batches, window=plan.window, sinks=plan.sinks, layers=layers)
    if kept and choice == "recall":
        order = cached_recall_order(
            model, batches, kept, window=plan.window, sinks=plan.sinks, layers=layers, folder=curves_folder
        )
        recall_order = [layer for layer, _ in order]
    if rule.needs_measure or (kept and choice == "dof" and curves is None):
        measured = estimate(model, batches, num_points=plan.dof_points, measure=plan.measure)
    return make_plan(
        model,
        measured,
        plan=plan,
        student=student,
        curves=curves,
        window_cost=window_cost,
        recall_order=recall_order,
    )
