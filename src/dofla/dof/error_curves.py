"""Measured distillation error of each layer as a function of its feature dimension, and allocation by it.

The DoF measure saturates on real teachers (DoF ≈ J in every layer), so its allocation equals ``fix``. The
``measured`` allocation asks the question directly: how much worse is this layer at d features than at 2d?
The scores come from short teacher-forced fits (:mod:`dofla.planning.error_curves` measures them); this
module holds them and allocates by them.

:class:`ErrorCurves` keeps the scores (saved as JSON, atomically, keyed by everything that changes them so a
resumed run or a frontier grid reuses them); :meth:`ErrorCurves.error` reads a layer's score off the
least-squares line e(d) = a - b ln d through its fitted points (b >= 0; flat above the largest dimension);
:func:`greedy_dims` gives each layer its minimum and then one feature at a time to the layer whose score
drops most (ties to the smallest layer), within a maximum, to an exact total: about d ∝ b, the layer's
measured gain per doubling of its features.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dofla.errors import DoflaError
from dofla.io import write_json_atomic

CRITERIA = ("kl", "kl_scaled", "relative")
CURVES_FILE = "error_curves.json"
CURVES_VERSION = 1


@dataclass
class ErrorCurves:
    """Per layer, the held-out error of a short fit at each of ``dims`` (see the module docstring).

    errors[i][j]: the criterion's score of layer ``layers[i]`` at ``dims[j]``; layer_loss[i][j]: that fit's
    held-out layer loss (the distillation loss itself); head_errors[i][j][m]: the layer's score split over its
    feature-map heads m in proportion to their share of the squared output error (heads are fitted
    independently, so the split is exact for ``relative``); key: what the scores depend on (settings, data,
    teacher).
    """

    dims: list[int]
    layers: list[int]
    errors: list[list[float]]
    layer_loss: list[list[float]]
    criterion: str
    settings: dict[str, Any] = field(default_factory=dict)
    key: str = ""
    seconds: float = 0.0
    head_errors: list[list[list[float]]] | None = None
    version: int = CURVES_VERSION

    def row(self, layer: int) -> list[float]:
        if layer not in self.layers:
            raise DoflaError(
                f"layer {layer} has no measured error curve (measured layers: {self.layers}); measure the "
                "curves for the layers being converted."
            )
        return self.errors[self.layers.index(layer)]

    def error(self, layer: int, dim: int) -> float:
        """The layer's score at ``dim`` features: the least-squares line in log d through its fitted points
        (never rising with d), flat above the largest fitted dimension."""
        return _interpolate(self.dims, self.row(layer), dim)

    @property
    def map_heads(self) -> int:
        if self.head_errors is None:
            raise DoflaError(
                "these error curves have no per-head errors; measure them again with this dofla."
            )
        return len(self.head_errors[0][0])

    def head_error(self, layer: int, head: int, dim: int) -> float:
        """One feature-map head's score at ``dim`` features, interpolated as :meth:`error`."""
        heads = self.map_heads
        self.row(layer)  # refuses a layer without a curve
        if not 0 <= head < heads:
            raise DoflaError(f"head {head} does not exist: the curves have feature-map heads 0..{heads - 1}.")
        rows = self.head_errors[self.layers.index(layer)]
        return _interpolate(self.dims, [row[head] for row in rows], dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ErrorCurves:
        try:
            curves = cls(**data)
        except TypeError as error:
            raise DoflaError(
                f"this is not a dofla error-curve file ({error}); measure the curves again."
            ) from None
        if curves.version != CURVES_VERSION:
            raise DoflaError(
                f"error-curve version {curves.version} is not supported (this dofla reads {CURVES_VERSION})."
            )
        return curves

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ErrorCurves:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise DoflaError(
                f"cannot read the error curves {path} ({error}); delete it to measure again."
            ) from None
        return cls.from_dict(data)


def _interpolate(dims: Sequence[int], row: Sequence[float], dim: int) -> float:
    """The least-squares line e(d) = a - b ln d through the fitted points (b >= 0: more features never
    hurt), flat above the largest fitted dimension. Short fits are noisy; a line through all of them moves
    less with that noise than a curve through each, and the greedy rule then gives a layer features in
    proportion to its slope b (the marginal gain of one feature at d is about b / d)."""
    logs = [math.log(d) for d in dims]
    values = [float(value) for value in row]
    if len(values) == 1:
        return values[0]
    mean_log, mean_value = sum(logs) / len(logs), sum(values) / len(values)
    spread = sum((x - mean_log) ** 2 for x in logs)
    slope = max(
        0.0, -sum((x - mean_log) * (y - mean_value) for x, y in zip(logs, values, strict=True)) / spread
    )
    where = math.log(min(max(int(dim), 1), dims[-1]))
    return mean_value - slope * (where - mean_log)


# ------------------------------------------------------------------------------------------ allocation


def greedy_dims(
    curves: ErrorCurves, layers: Sequence[int], total: int, minimum: int, maximum: int | None
) -> list[int]:
    """Dimensions for ``layers`` summing exactly to ``total``, each in [minimum, maximum]: start at the minimum,
    then repeatedly give one feature to the layer whose interpolated error drops most (ties: the layer with
    fewer features, then the earlier layer)."""
    functions = [lambda dim, layer=layer: curves.error(layer, dim) for layer in layers]
    return greedy_fill(functions, total, minimum, maximum, "layers")


def greedy_head_dims(
    curves: ErrorCurves, layers: Sequence[int], total: int, minimum: int, maximum: int | None
) -> list[list[int]]:
    """Per converted layer, one dimension per feature-map head, all summing exactly to ``total``: the same
    greedy rule as :func:`greedy_dims` over every (layer, head)."""
    heads = curves.map_heads
    functions = [
        lambda dim, layer=layer, head=head: curves.head_error(layer, head, dim)
        for layer in layers
        for head in range(heads)
    ]
    flat = greedy_fill(functions, total, minimum, maximum, "heads")
    return [flat[position * heads : (position + 1) * heads] for position in range(len(layers))]


def greedy_fill(functions, total: int, minimum: int, maximum: int | None, what: str = "layers") -> list[int]:
    """Integers d_i in [minimum, maximum] summing to ``total`` that greedily lower sum_i functions[i](d_i): each
    starts at the minimum, then one unit at a time goes to the largest drop (ties: the smaller d_i, then i)."""
    count = len(functions)
    upper = total if maximum is None else int(maximum)
    if minimum * count > total:
        raise DoflaError(
            f"a minimum of {minimum} features for {count} {what} needs {minimum * count}, more than the budget "
            f"{total}; raise the budget to at least {minimum} per {what[:-1]}."
        )
    if upper * count < total:
        raise DoflaError(
            f"the budget of {total} features cannot be placed in {count} {what} of at most {upper} each; lower "
            f"the budget to at most {upper} per {what[:-1]} or raise the maximum."
        )
    dims = [int(minimum)] * count
    now = [function(minimum) for function in functions]

    def entry(i: int) -> tuple[float, int, int]:
        gain = now[i] - functions[i](dims[i] + 1)
        return (-gain, dims[i], i)

    heap = [entry(i) for i in range(count) if dims[i] < upper]
    heapq.heapify(heap)
    for _ in range(total - minimum * count):
        _, _, i = heapq.heappop(heap)
        dims[i] += 1
        now[i] = functions[i](dims[i])
        if dims[i] < upper:
            heapq.heappush(heap, entry(i))
    return dims


def choose_by_error(curves: ErrorCurves, layers: Sequence[int], count: int, budget: int) -> list[int]:
    """The ``count`` layers whose score at ``budget`` features is highest: keeping them as softmax removes the
    most measured error (for ``kl``: the end-to-end KL that converting that layer alone costs)."""
    ranked = sorted(layers, key=lambda layer: (-curves.error(layer, budget), layer))
    return sorted(ranked[:count])
