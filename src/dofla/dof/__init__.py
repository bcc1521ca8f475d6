"""Degrees of freedom of each layer's (and head's) attention kernel, and feature dimensions allocated by them.

    estimate = dof.estimate(model, batches, measure="dof")          # capture q/k once, measure every head
    plan = dof.make_plan(model, estimate, plan=PlanSettings(budget=64, allocation="dof"))  # allocate, build it

Measuring on the teacher to choose a plan (and both in one call) is :mod:`dofla.planning`.

The package, by concern:

- :mod:`~dofla.dof.kernel`: the numerics (the stable DoF(λ), kernel spectra, attention-matrix ranks, λ notation);
- :mod:`~dofla.dof.measures`: the registered measures (``dof``, ``dof_trace``, ``attention_rank``);
- :mod:`~dofla.dof.estimation`: capturing points from a teacher and measuring them (:class:`DofEstimate`);
- :mod:`~dofla.dof.allocate`: the registered allocations (``fix``, ``dof``, ``dof_clip``, ``headwise``,
  ``measured``) and the softmax-layer choices (``dof``, ``uniform``, ``measured``);
- :mod:`~dofla.dof.plan`: :func:`make_plan`, the one plan builder, and :func:`allocate_all`;
- :mod:`~dofla.dof.error_curves`: each layer's measured distillation error as a function of its feature
  dimension (measured by :mod:`dofla.planning.error_curves`) and the ``measured`` allocation by it;
- :mod:`~dofla.dof.report`: the markdown table and plots of ``dofla dof``.

See docs/dof.md for the maths and docs/architecture.md for adding a measure or an allocation.
"""

from dofla.dof.allocate import (
    ALLOCATIONS,
    SOFTMAX_CHOICES,
    Allocation,
    AllocationRequest,
    AllocationRule,
    allocate_feature_dims,
    largest_remainder,
    register_allocation,
    register_softmax_choice,
)
from dofla.dof.error_curves import ErrorCurves, greedy_dims
from dofla.dof.estimation import (
    SATURATION_LEVEL,
    CapturedPoints,
    DofEstimate,
    HeadResult,
    capture_points,
    estimate,
    measure_points,
)
from dofla.dof.kernel import (
    SPECTRUM_POINTS,
    SPECTRUM_VALUES,
    attention_rank,
    degrees_of_freedom,
    energy_rank,
    kernel_spectrum,
    lambda_key,
    merge_duplicates,
    parse_lambda,
    plain_eigen_noise_floor,
)
from dofla.dof.measures import MEASURES, HeadSample, Measure, register_measure
from dofla.dof.plan import allocate_all, make_plan, map_head_measure
from dofla.dof.report import (
    layer_spectra,
    markdown_table,
    plot_eigenvalue_decay,
    plot_error_curves,
    plot_report,
)

__all__ = [
    "ALLOCATIONS",
    "MEASURES",
    "SATURATION_LEVEL",
    "SOFTMAX_CHOICES",
    "SPECTRUM_POINTS",
    "SPECTRUM_VALUES",
    "Allocation",
    "AllocationRequest",
    "AllocationRule",
    "CapturedPoints",
    "DofEstimate",
    "ErrorCurves",
    "HeadResult",
    "HeadSample",
    "Measure",
    "allocate_all",
    "allocate_feature_dims",
    "attention_rank",
    "capture_points",
    "degrees_of_freedom",
    "energy_rank",
    "estimate",
    "greedy_dims",
    "kernel_spectrum",
    "lambda_key",
    "largest_remainder",
    "layer_spectra",
    "make_plan",
    "map_head_measure",
    "markdown_table",
    "measure_points",
    "merge_duplicates",
    "parse_lambda",
    "plain_eigen_noise_floor",
    "plot_eigenvalue_decay",
    "plot_error_curves",
    "plot_report",
    "register_allocation",
    "register_measure",
    "register_softmax_choice",
]
