"""Feature dimensions under a budget, by registered allocation rules.

Allocation under a budget C (mean features per converted layer). Registered rules (``variant=``):

- ``fix``: C everywhere (no measure needed);
- ``dof``: ``M_s ∝ measure_s`` (layer measure = max over heads) with largest-remainder rounding so that the
  total is exactly C × (converted layers), and a per-layer minimum;
- ``dof_clip``: as ``dof`` but clamped to the head size; the clipped excess is redistributed over the
  unclipped layers in proportion;
- ``headwise``: per-head dimensions with mean C per head; a layer's tensor width is its largest head;
- ``measured``: each layer's held-out distillation error measured at a few dimensions by short teacher-forced
  fits (:mod:`dofla.dof.error_curves`), then one feature at a time to the layer whose error drops most;
- ``measured_headwise``: the same over every feature-map head (mean C per head).

The DoF rules (``dof``, ``dof_clip``, ``headwise``) allocate by a measure that saturates on real teachers
(DoF ≈ J in every layer): the plan then records ``saturated_fraction`` and their allocation is close to ``fix``.

``keep_softmax=N`` leaves N converted layers as softmax attention, chosen by ``softmax_choice``
(:data:`SOFTMAX_CHOICES`: ``dof``, the highest measure; ``uniform``, evenly spaced; ``measured``, the highest
measured error at the budget; ``window``, the highest cost of cutting the layer alone to the window;
``recall``, added greedily by the teacher's recall of spans repeated beyond the window).
:func:`dofla.dof.plan.make_plan` turns an estimate (allocated here), a ready :class:`Allocation` or nothing
(rules that need no measure, e.g. ``fix``) into a :class:`~dofla.config.ConversionPlan`.

Adding a rule is one function ``(request: AllocationRequest) -> (layer_dims, head_dims or None)`` decorated
with :func:`register_allocation`, and its test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dofla.dof.error_curves import ErrorCurves, choose_by_error, greedy_dims, greedy_head_dims
from dofla.errors import DoflaError
from dofla.registry import Registry


@dataclass
class Allocation:
    variant: str
    budget: int
    layer_dims: list[int]  # 0 for layers kept as softmax (or not converted)
    head_dims: list[list[int]] | None = None  # headwise only: per map head
    softmax_layers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AllocationRequest:
    """What a rule allocates for: the converted layers only, in layer order.

    layer_measure: one value per converted layer (max over its heads; zeros when no measure was taken);
    head_measure: per converted layer, one value per map head (None when no estimate was given);
    budget: mean features per converted layer; minimum: features a layer (or head) gets at least;
    head_size: the attention head size (None when unknown); layers: the converted layers' indices;
    maximum: features a layer gets at most (None: no bound); curves: the measured error curves (rules
    registered with ``needs_curves``).
    """

    layer_measure: list[float]
    head_measure: list[list[float]] | None
    budget: int
    minimum: int
    head_size: int | None
    layers: list[int] = field(default_factory=list)
    maximum: int | None = None
    curves: ErrorCurves | None = None


AllocationFunction = Callable[[AllocationRequest], tuple[list[int], list[list[int]] | None]]


@dataclass(frozen=True)
class AllocationRule:
    """A registered rule. needs_measure: it allocates by a DoF estimate (``fix`` does not);
    at_most_head_size: no layer gets more features than the head size, so the budget may not exceed it;
    needs_curves: it allocates by measured error curves (:mod:`dofla.dof.error_curves`)."""

    name: str
    function: AllocationFunction
    needs_measure: bool = True
    at_most_head_size: bool = False
    needs_curves: bool = False

    def check_budget(self, budget: int, head_size: int | None) -> None:
        """Refuse a budget this rule cannot place (before any expensive measuring)."""
        if budget <= 0:
            raise DoflaError(f"the budget must be a positive number of features per layer, got {budget}.")
        if self.at_most_head_size and head_size is not None and budget > head_size:
            raise DoflaError(
                f"with {self.name} every layer has at most {head_size} features (the head size), so the mean "
                f"budget cannot be {budget}; lower --budget or use --allocation dof."
            )


ALLOCATIONS: Registry[AllocationRule] = Registry("allocation")


def register_allocation(
    name: str, *, needs_measure: bool = True, at_most_head_size: bool = False, needs_curves: bool = False
):
    """Function decorator: make ``function(request)`` the allocation rule ``name``."""

    def register(function: AllocationFunction) -> AllocationFunction:
        ALLOCATIONS.add(name, AllocationRule(name, function, needs_measure, at_most_head_size, needs_curves))
        return function

    return register


SoftmaxChoice = Callable[..., list[int]]
SOFTMAX_CHOICES: Registry[SoftmaxChoice] = Registry("softmax-layer choice")


def register_softmax_choice(name: str):
    """Function decorator: ``function(layers, count, *, measure, curves, budget, window_cost, recall_order)
    -> chosen layers``, the ``count`` layers of ``layers`` that stay softmax (``measure``: one value per model
    layer; ``curves``: the measured error curves or None; ``window_cost``: per model layer, what cutting that
    layer alone to the window costs (:func:`dofla.planning.window_costs.window_costs`) or None;
    ``recall_order``: layers in the order a greedy search for recall beyond the window adds them
    (:func:`dofla.planning.recall_order.recall_layer_order`) or None)."""

    def register(function: SoftmaxChoice) -> SoftmaxChoice:
        SOFTMAX_CHOICES.add(name, function)
        return function

    return register


@register_softmax_choice("dof")
def by_measure(layers, count, *, measure, curves, budget, window_cost=None, recall_order=None) -> list[int]:
    """The layers with the highest DoF measure (ties: the earlier layer)."""
    return sorted(sorted(layers, key=lambda i: (-measure[i], i))[:count])


@register_softmax_choice("uniform")
def evenly_spaced(
    layers, count, *, measure, curves, budget, window_cost=None, recall_order=None
) -> list[int]:
    """Evenly spaced through the layers: position (i + 1/2) * n / count of the n layers, i = 0..count-1."""
    layers = sorted(layers)
    return sorted({layers[int((i + 0.5) * len(layers) / count)] for i in range(count)})


@register_softmax_choice("measured")
def by_measured_error(
    layers, count, *, measure, curves, budget, window_cost=None, recall_order=None
) -> list[int]:
    """The layers whose measured error at the budget is highest (restoring them removes the most error)."""
    if curves is None:
        raise DoflaError(
            "the measured softmax-layer choice needs measured error curves: use dofla.planning.measure_and_plan, or give "
            "curves=dofla.planning.measure_error_curves(...) to make_plan."
        )
    return choose_by_error(curves, layers, count, budget)


@register_softmax_choice("window")
def by_window_cost(
    layers, count, *, measure, curves, budget, window_cost=None, recall_order=None
) -> list[int]:
    """The layers whose restriction alone to the plan's window (and sinks) costs the model the most KL at
    the calibration length: the layers that most need the whole context (ties: the earlier layer)."""
    if window_cost is None:
        raise DoflaError(
            "the window softmax-layer choice needs each layer's window cost: use dofla.planning.measure_and_plan, or give "
            "window_cost=dofla.planning.window_costs.window_costs(...) to make_plan."
        )
    return sorted(sorted(layers, key=lambda i: (-window_cost[i], i))[:count])


@register_softmax_choice("recall")
def by_recall(layers, count, *, measure, curves, budget, window_cost=None, recall_order=None) -> list[int]:
    """The first ``count`` layers of the greedy recall order: kept as full softmax one at a time, each the
    layer that most lowers the window-restricted teacher's loss on spans repeated beyond the window, given
    those already kept (layers that together carry recall, which single-layer scores miss)."""
    if recall_order is None:
        raise DoflaError(
            "the recall softmax-layer choice needs the greedy recall order: use dofla.planning.measure_and_plan, or give "
            "recall_order=[layer for layer, _ in dofla.planning.recall_order.recall_layer_order(...)] to make_plan."
        )
    chosen = [int(layer) for layer in recall_order if int(layer) in set(layers)][:count]
    if len(chosen) < count:
        raise DoflaError(
            f"the recall order has {len(chosen)} of the converted layers, fewer than the {count} to keep as "
            "softmax; measure it for at least that many."
        )
    return sorted(chosen)


def largest_remainder(shares: Sequence[float], total: int, minimum: int, maximum: int | None) -> list[int]:
    """Integers proportional to ``shares`` summing exactly to ``total``, each within [minimum, maximum].

    Water-filling: x_i = clip(t·share_i, minimum, maximum) with t chosen so that Σx = total (what a
    bound cuts from one layer goes to the others in proportion); then largest-remainder rounding.
    If even t → ∞ leaves budget over (zero shares pinned at the minimum), the rest is spread evenly
    over the layers still below the maximum.
    """
    count = len(shares)
    upper = float(maximum) if maximum is not None else math.inf
    if minimum * count > total:
        raise DoflaError(
            f"a minimum of {minimum} features for {count} layers needs {minimum * count}, more than the budget {total}."
        )
    if upper * count < total:
        raise DoflaError(
            f"the budget of {total} features cannot be placed in {count} layers of at most {maximum} each; "
            f"lower the budget to at most {maximum} per layer."
        )
    shares = [max(float(value), 0.0) for value in shares]

    def filled(scale: float) -> list[float]:
        return [min(max(scale * share, minimum), upper) for share in shares]

    low, high = 0.0, 1.0
    while sum(filled(high)) < total and high < 1e300:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if sum(filled(middle)) < total else (low, middle)
    ideal = filled(high)
    short = total - sum(ideal)
    if short > 1e-9:  # only layers with zero share can still take features
        open_layers = [i for i in range(count) if ideal[i] < upper]
        for i in open_layers:
            ideal[i] = min(upper, ideal[i] + short / len(open_layers))
    scale_back = total / sum(ideal)
    ideal = [min(max(value * scale_back, minimum), upper) for value in ideal]
    result = [min(max(math.floor(value), minimum), int(min(upper, total))) for value in ideal]
    leftover = total - sum(result)
    order = sorted(range(count), key=lambda i: (ideal[i] - result[i], -i), reverse=True)
    step = 1 if leftover > 0 else -1
    while leftover != 0:
        moved = False
        for i in order if step > 0 else reversed(order):
            if leftover == 0:
                break
            candidate = result[i] + step
            if minimum <= candidate <= upper:
                result[i] = candidate
                leftover -= step
                moved = True
        if not moved:
            raise DoflaError(f"cannot place {total} features within the per-layer bounds.")
    return result


# ------------------------------------------------------------------------------------------ the rules


@register_allocation("fix", needs_measure=False)
def fix(request: AllocationRequest) -> tuple[list[int], None]:
    """The budget in every converted layer."""
    if request.budget < request.minimum:
        raise DoflaError(f"the budget {request.budget} is below the minimum {request.minimum}.")
    return [request.budget] * len(request.layer_measure), None


@register_allocation("dof")
def proportional(request: AllocationRequest) -> tuple[list[int], None]:
    """Dimensions proportional to the layer measure, summing exactly to budget × layers."""
    total = request.budget * len(request.layer_measure)
    return largest_remainder(request.layer_measure, total, request.minimum, None), None


@register_allocation("dof_clip", at_most_head_size=True)
def proportional_clipped(request: AllocationRequest) -> tuple[list[int], None]:
    """As ``dof``, each layer clamped to the head size, the excess shared by the others in proportion."""
    if request.head_size is None:
        raise DoflaError("dof_clip needs the head size.")
    total = request.budget * len(request.layer_measure)
    return largest_remainder(request.layer_measure, total, request.minimum, request.head_size), None


@register_allocation("measured", needs_measure=False, needs_curves=True)
def measured(request: AllocationRequest) -> tuple[list[int], None]:
    """Greedy by marginal measured error: every layer its minimum (at least the smallest fitted dimension when
    the budget allows), then one feature at a time to the layer whose fitted held-out error drops most, to
    exactly budget × layers (at most ``maximum`` each)."""
    if request.curves is None:
        raise DoflaError(
            "the measured allocation needs measured error curves: use dofla.planning.measure_and_plan, or give "
            "curves=dofla.planning.measure_error_curves(...) to make_plan."
        )
    total = request.budget * len(request.layers)
    minimum = _measured_minimum(request)
    return greedy_dims(request.curves, request.layers, total, minimum, request.maximum), None


# the smallest summed-error reduction over fix, predicted by the curves, worth a measured allocation; on the
# embedded teacher the curves predicted 2.6% and the allocation lost to fix (docs/results/allocation/)
WORTHWHILE_PREDICTED_GAIN = 0.10


def predicted_gain_over_fix(curves: ErrorCurves, layer_dims: Sequence[int], budget: int) -> float:
    """1 - (summed fitted error at ``layer_dims``) / (summed fitted error at ``budget`` everywhere), over the
    converted layers (dimension > 0): how much the curves themselves expect an allocation to beat fix."""
    converted = [(layer, int(dim)) for layer, dim in enumerate(layer_dims) if dim > 0]
    at_fix = sum(curves.error(layer, int(budget)) for layer, _ in converted)
    allocated = sum(curves.error(layer, dim) for layer, dim in converted)
    return float(1.0 - allocated / at_fix) if at_fix > 0 else 0.0


def _measured_minimum(request: AllocationRequest) -> int:
    """Below the smallest fitted dimension nothing was measured, so a layer gets at least that many features
    when the budget allows it (else the request's minimum)."""
    smallest = min(request.curves.dims)
    fits = request.budget >= smallest and (request.maximum is None or request.maximum >= smallest)
    return max(request.minimum, smallest) if fits else request.minimum


@register_allocation("measured_headwise", needs_measure=False, needs_curves=True)
def measured_headwise(request: AllocationRequest) -> tuple[list[int], list[list[int]]]:
    """``measured`` over every feature-map head: mean budget per head, each head at most ``maximum``; a layer
    is as wide as its widest head."""
    if request.curves is None:
        raise DoflaError(
            "the measured_headwise allocation needs measured error curves: use dofla.planning.measure_and_plan, or give "
            "curves=dofla.planning.measure_error_curves(...) to make_plan."
        )
    heads = request.curves.map_heads
    total = request.budget * len(request.layers) * heads
    head_dims = greedy_head_dims(
        request.curves, request.layers, total, _measured_minimum(request), request.maximum
    )
    return [max(row) for row in head_dims], head_dims


@register_allocation("headwise")
def headwise(request: AllocationRequest) -> tuple[list[int], list[list[int]]]:
    """Per-head dimensions proportional to the head measure (mean budget per head); a layer is as wide as
    its widest head."""
    if request.head_measure is None:
        raise DoflaError("headwise allocation needs the per-head measures.")
    flat = [value for row in request.head_measure for value in row]
    values = largest_remainder(flat, request.budget * len(flat), request.minimum, None)
    heads = len(request.head_measure[0])
    head_dims = [
        values[position * heads : (position + 1) * heads] for position in range(len(request.head_measure))
    ]
    return [max(row) for row in head_dims], head_dims


# ------------------------------------------------------------------------------------------ allocating


def allocate_feature_dims(
    layer_measure: Sequence[float],
    *,
    budget: int,
    variant: str = "dof",
    head_size: int | None = None,
    minimum: int = 1,
    keep_softmax: int = 0,
    head_measure: Sequence[Sequence[float]] | None = None,
    layers: Sequence[int] | None = None,
    maximum: int | None = None,
    softmax_choice: str | None = None,
    curves: ErrorCurves | None = None,
    window_cost: Sequence[float] | None = None,
    recall_order: Sequence[int] | None = None,
) -> Allocation:
    """Feature dimensions per layer (and per head for ``headwise``) with mean ``budget`` over converted layers.

    layer_measure: one value per model layer; head_measure: per layer, one per map head; layers: the layers
    to convert (default all; the others get 0, i.e. stay softmax); maximum: features per layer at most (rules
    that spread features unevenly honour it); keep_softmax: that many of the layers stay softmax, chosen by
    ``softmax_choice`` (:data:`SOFTMAX_CHOICES`; default ``measured`` when ``curves`` are given, else ``dof``);
    curves: measured error curves (:mod:`dofla.dof.error_curves`) for ``measured`` rules and choices;
    window_cost: per layer, the cost of cutting it alone to the window, for the ``window`` choice;
    recall_order: the greedy recall order of layers, for the ``recall`` choice.
    """
    rule = ALLOCATIONS[variant]
    choice = SOFTMAX_CHOICES[softmax_choice or ("measured" if curves is not None else "dof")]
    count = len(layer_measure)
    rule.check_budget(budget, head_size)
    if minimum < 1:
        raise DoflaError(f"the minimum per layer must be at least 1, got {minimum}.")
    if maximum is not None and maximum < budget:
        raise DoflaError(
            f"the budget of {budget} features per layer cannot be placed in layers of at most {maximum} each; "
            f"lower the budget to at most {maximum} or raise the maximum."
        )
    if budget < minimum:
        raise DoflaError(
            f"the budget of {budget} features per layer is below the minimum of {minimum} per layer; raise the "
            f"budget to at least {minimum} or lower the minimum."
        )
    selected = list(range(count)) if layers is None else sorted({int(index) for index in layers})
    outside = [index for index in selected if not 0 <= index < count]
    if outside:
        raise DoflaError(f"layer {outside[0]} does not exist: the model has layers 0..{count - 1}.")
    if not 0 <= keep_softmax < len(selected):
        raise DoflaError(
            f"keep_softmax must be between 0 and {len(selected) - 1} for {len(selected)} layers, got {keep_softmax}: "
            "at least one layer must be converted; lower the number of softmax layers."
        )
    if any(not math.isfinite(value) or value < 0 for value in layer_measure):
        raise DoflaError("the layer measures must be finite and non-negative.")
    softmax_layers = (
        choice(
            selected,
            keep_softmax,
            measure=list(layer_measure),
            curves=curves,
            budget=budget,
            window_cost=None if window_cost is None else list(window_cost),
            recall_order=None if recall_order is None else list(recall_order),
        )
        if keep_softmax
        else []
    )
    converted = [i for i in selected if i not in softmax_layers]
    if rule.needs_curves and curves is None:
        raise DoflaError(
            f"allocation {variant!r} allocates by measured error curves: use dofla.planning.measure_and_plan, or give "
            "curves=dofla.planning.measure_error_curves(...) to make_plan."
        )
    request = AllocationRequest(
        layer_measure=[float(layer_measure[i]) for i in converted],
        head_measure=None if head_measure is None else [list(head_measure[i]) for i in converted],
        budget=budget,
        minimum=minimum,
        head_size=head_size,
        layers=converted,
        maximum=maximum,
        curves=curves,
    )
    converted_dims, converted_head_dims = rule.function(request)
    dims = [0] * count
    for i, value in zip(converted, converted_dims, strict=True):
        dims[i] = value
    head_dims = None
    if converted_head_dims is not None:
        head_dims = [[0] * len(converted_head_dims[0]) for _ in range(count)]
        for i, row in zip(converted, converted_head_dims, strict=True):
            head_dims[i] = row
    return Allocation(
        variant=variant, budget=budget, layer_dims=dims, head_dims=head_dims, softmax_layers=softmax_layers
    )
