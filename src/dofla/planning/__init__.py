"""Planning: the measurements on the teacher that choose a conversion plan, and the plan they give.

    plan = planning.measure_and_plan(model, batches, variant="dof", measure="dof", budget=64)

:func:`measure_and_plan` runs what the allocation and the softmax-layer choice need -- the DoF estimate
(:func:`dofla.dof.estimate`), each layer's measured error curve (:mod:`~dofla.planning.error_curves`, short
teacher-forced fits of students), each layer's window cost (:mod:`~dofla.planning.window_costs`) or the
greedy recall order (:mod:`~dofla.planning.recall_order`) -- and hands the results to
:func:`dofla.dof.make_plan`, which allocates and builds the plan. Planning sits above :mod:`dofla.dof`
(the pure allocation maths), :mod:`dofla.convert`, :mod:`dofla.distill` and :mod:`dofla.evaluation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dofla.config import DEFAULT_WINDOW, ConversionPlan
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

__all__ = [
    "CurveSettings",
    "cached_error_curves",
    "cached_recall_order",
    "curve_cache",
    "measure_and_plan",
    "measure_error_curves",
    "recall_layer_order",
    "settings_for",
    "window_costs",
]


def measure_and_plan(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    variant: str = "dof",
    measure: str = "dof",
    num_points: int = 1024,
    curve_options: dict[str, Any] | None = None,
    curves_folder: str | Path | None = None,
    **plan_options,
) -> ConversionPlan:
    """:func:`make_plan` for allocation ``variant``, measuring ``measure`` on calibration batches (B, T) first
    when the allocation needs a measure (a measure-free allocation such as ``fix`` runs no teacher forward).
    ``plan_options``: :func:`make_plan`'s keyword arguments (budget, kind, feature_map, window, layers, ...).

    For ``softmax_choice="recall"`` the greedy recall order
    (:func:`~dofla.planning.recall_order.recall_layer_order`) is measured on the batches first, up to
    ``keep_softmax`` layers. For ``softmax_choice="window"`` each layer's window cost (the KL of cutting it alone to the plan's window
    and sinks, :func:`~dofla.planning.window_costs.window_costs`) is measured on the batches first, so
    measure at the length the model must serve. Error curves (:mod:`dofla.planning.error_curves`) are measured on
    the same batches when the allocation or the softmax-layer choice needs them, with the planned student
    and ``curve_options`` (dims, steps, lr, loss, criterion, heldout_rows), and kept in ``curves_folder``
    (default: the innermost :func:`~dofla.planning.error_curves.curve_cache`) for the next run with the same key;
    so is the recall order (:func:`~dofla.planning.recall_order.cached_recall_order`).
    """
    rule = ALLOCATIONS[variant]
    choice = plan_options.get("softmax_choice")
    # the layers to convert, resolved once: the measurements below take them too
    plan_options["layers"] = get_adapter(model).layers_to_convert(
        plan_options.get("layers"), convert_windowed=plan_options.pop("convert_windowed", False)
    )
    wants_curves = rule.needs_curves or (plan_options.get("keep_softmax", 0) and choice == "measured")
    if wants_curves and plan_options.get("curves") is None:
        settings = settings_for(plan_options, **dict(curve_options or {}))
        # every layer's curve, whichever are converted: one measurement serves any choice of layers
        plan_options["curves"] = cached_error_curves(model, batches, settings, folder=curves_folder)
    if plan_options.get("keep_softmax", 0) and choice == "window" and plan_options.get("window_cost") is None:
        plan_options["window_cost"] = window_costs(
            model,
            batches,
            window=plan_options.get("window", DEFAULT_WINDOW),
            sinks=plan_options.get("sinks", 0),
            layers=plan_options.get("layers"),
        )
    if (
        plan_options.get("keep_softmax", 0)
        and choice == "recall"
        and plan_options.get("recall_order") is None
    ):
        order = cached_recall_order(
            model,
            batches,
            plan_options["keep_softmax"],
            window=plan_options.get("window", DEFAULT_WINDOW),
            sinks=plan_options.get("sinks", 0),
            layers=plan_options.get("layers"),
            folder=curves_folder,
        )
        plan_options["recall_order"] = [layer for layer, _ in order]
    measured = None
    if rule.needs_measure or (
        plan_options.get("keep_softmax", 0)
        and (choice or "dof") == "dof"
        and plan_options.get("curves") is None
    ):
        measured = estimate(model, batches, num_points=num_points, measure=measure)
    return make_plan(model, measured, variant=variant, **plan_options)
