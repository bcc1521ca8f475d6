"""From a DoF estimate (or a ready allocation) to the conversion plan: :func:`make_plan`, the one plan builder
(``dofla.convert.plan_for`` is its uniform case; :func:`dofla.planning.measure_and_plan` measures first),
and :func:`allocate_all`, every registered allocation of one estimate (``dofla dof``'s report)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from dofla.config import ConversionPlan, LayerPlan
from dofla.dof.allocate import (
    ALLOCATIONS,
    WORTHWHILE_PREDICTED_GAIN,
    Allocation,
    allocate_feature_dims,
    predicted_gain_over_fix,
)
from dofla.dof.error_curves import ErrorCurves
from dofla.dof.estimation import DofEstimate
from dofla.dof.kernel import lambda_key
from dofla.errors import DoflaError
from dofla.models import get_adapter
from dofla.settings import PlanSettings, StudentSettings


def map_head_measure(
    head_measure: Sequence[Sequence[float]], num_kv_heads: int, share_kv_heads: bool
) -> list[list[float]]:
    """Per-query-head measures -> per map head: with shared maps, the max over the query heads of a group."""
    if not share_kv_heads:
        return [list(row) for row in head_measure]
    groups = len(head_measure[0]) // num_kv_heads
    return [[max(row[g * groups : (g + 1) * groups]) for g in range(num_kv_heads)] for row in head_measure]


def allocate_all(
    estimate_result: DofEstimate,
    adapter,
    *,
    budget: int,
    minimum: int = 1,
    keep_softmax: int = 0,
    lam: float | None = None,
    share_kv_heads: bool = True,
    curves: ErrorCurves | None = None,
    layers: Sequence[int] | None = None,
) -> dict[str, Allocation]:
    """Every registered allocation for one estimate over ``layers`` (default all), by name (rules bounded by
    the head size are left out when the budget exceeds it, rules that need measured error curves when no
    ``curves`` are given)."""
    layer_values = estimate_result.layer_measure(lam)
    head_values = map_head_measure(estimate_result.head_measure(lam), adapter.num_kv_heads, share_kv_heads)
    options = dict(
        head_size=adapter.head_dim,
        minimum=minimum,
        keep_softmax=keep_softmax,
        head_measure=head_values,
        softmax_choice="dof",
        curves=curves,
        layers=layers,
    )
    return {
        name: allocate_feature_dims(layer_values, budget=budget, variant=name, **options)
        for name, rule in ALLOCATIONS.items()
        if not (rule.at_most_head_size and budget > adapter.head_dim)
        and not (rule.needs_curves and curves is None)
    }


def make_plan(
    model: torch.nn.Module,
    estimate_or_allocation: DofEstimate | Allocation | None = None,
    *,
    plan: PlanSettings | None = None,
    student: StudentSettings | None = None,
    minimum: int = 1,
    maximum: int | None = None,
    lam: float | None = None,
    curves: ErrorCurves | None = None,
    window_cost: Sequence[float] | None = None,
    recall_order: Sequence[int] | None = None,
    metadata: dict | None = None,
) -> ConversionPlan:
    """The conversion plan for ``model``: from a DoF estimate (allocated here by ``plan.allocation``), a ready
    allocation, or nothing (an allocation that needs no measure, e.g. ``fix``).

    The choices are the settings' sections (:mod:`dofla.settings`; each default written there): ``plan``
    (budget, allocation, kind, window, sinks, keep_softmax, softmax_choice, per_query_head, and the layers
    to convert: default those whose cache grows, every layer with ``convert_windowed``; the teacher's own
    sliding-window layers stay as they are, see
    :meth:`~dofla.models.adapters.ArchitectureAdapter.layers_to_convert`) and ``student`` (cell, feature map,
    cell options). ``metadata`` is merged into what the plan records about its allocation. minimum, maximum,
    lam, curves (measured error curves, for the ``measured`` allocation and softmax choice), window_cost
    (for ``softmax_choice="window"``) and recall_order (for ``softmax_choice="recall"``): see
    :func:`allocate_feature_dims`; :func:`dofla.planning.measure_and_plan` measures them.
    """
    plan = plan if plan is not None else PlanSettings()
    student = student if student is not None else StudentSettings()
    budget, variant, keep_softmax, softmax_choice = (
        plan.budget,
        plan.allocation,
        plan.keep_softmax,
        plan.softmax_choice,
    )
    share_kv_heads = not plan.per_query_head
    adapter = get_adapter(model)
    layers = adapter.layers_to_convert(plan.layers, convert_windowed=plan.convert_windowed)
    if isinstance(estimate_or_allocation, Allocation):
        allocation = estimate_or_allocation
        recorded = {"allocation": allocation.variant, "budget": allocation.budget}
    else:
        estimate_result = estimate_or_allocation
        recorded = {"allocation": variant, "budget": budget}
        if curves is not None:
            recorded.update(
                error_criterion=curves.criterion, error_dims=list(curves.dims), error_curves_key=curves.key
            )
        if estimate_result is None:
            if ALLOCATIONS[variant].needs_measure:
                raise DoflaError(
                    f"allocation {variant!r} allocates by a measure: give a DoF estimate (dofla.dof.estimate) "
                    "or use allocation fix."
                )
            layer_values, head_values = [0.0] * adapter.num_layers, None
        else:
            layer_values = estimate_result.layer_measure(lam)
            head_values = map_head_measure(
                estimate_result.head_measure(lam), adapter.num_kv_heads, share_kv_heads
            )
            recorded.update(
                measure=estimate_result.measure,
                num_points=estimate_result.num_points,
                saturated_fraction=estimate_result.saturated_fraction(),
            )
            recorded["lambda"] = lambda_key(lam if lam is not None else estimate_result.lambdas[0])
        allocation = allocate_feature_dims(
            layer_values,
            budget=budget,
            variant=variant,
            head_size=adapter.head_dim,
            minimum=minimum,
            keep_softmax=keep_softmax,
            head_measure=head_values,
            layers=layers,
            maximum=maximum,
            softmax_choice=softmax_choice,
            curves=curves,
            window_cost=window_cost,
            recall_order=recall_order,
        )
        if keep_softmax:
            recorded.update(keep_softmax=keep_softmax, softmax_layers=list(allocation.softmax_layers))
            recorded["softmax_choice"] = softmax_choice or ("measured" if curves is not None else "dof")
            if recorded["softmax_choice"] == "window":
                recorded["window_cost"] = [round(float(value), 6) for value in window_cost]
            if recorded["softmax_choice"] == "recall":
                recorded["recall_order"] = [int(layer) for layer in recall_order]
        if variant == "measured" and curves is not None:
            gain = predicted_gain_over_fix(curves, allocation.layer_dims, budget)
            recorded["predicted_error_reduction_vs_fix"] = gain
            if gain < WORTHWHILE_PREDICTED_GAIN:
                warnings.warn(
                    f"the measured error curves predict only {100 * gain:.1f}% less summed error than fix at "
                    f"budget {budget}: the measured allocation is unlikely to beat fix on this teacher (on the "
                    "embedded teacher it did not); use --allocation fix unless a held-out run says otherwise.",
                    stacklevel=2,
                )
    if adapter.windowed_layers():  # which of the teacher's own windows the plan keeps (reports say why)
        recorded.update(
            teacher_window=adapter.sliding_window, teacher_windowed_layers=adapter.windowed_layers()
        )
    recorded.update(metadata or {})
    plan_layers = []
    for index in range(adapter.num_layers):
        if allocation.layer_dims[index] == 0:
            plan_layers.append(LayerPlan(kind="softmax"))
            continue
        plan_layers.append(
            LayerPlan(
                kind=plan.kind,
                feature_map=student.feature_map,
                feature_dim=int(allocation.layer_dims[index]),
                head_feature_dims=allocation.head_dims[index] if allocation.head_dims is not None else None,
                share_kv_heads=share_kv_heads,
                window=int(plan.window),
                options=dict(student.cell_options),
                cell=student.cell,
                sinks=int(plan.sinks),
            )
        )
    conversion = ConversionPlan(
        model_type=str(adapter.model_type),
        num_layers=adapter.num_layers,
        num_heads=adapter.num_heads,
        num_kv_heads=adapter.num_kv_heads,
        head_dim=adapter.head_dim,
        layers=plan_layers,
        metadata=recorded,
    )
    conversion.validate()
    return conversion
