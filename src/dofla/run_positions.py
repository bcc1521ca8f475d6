"""The run's position policy: the converted model's rotary position period and whether its windows see their
sinks from the window's edge (:mod:`dofla.rotary`)."""

from __future__ import annotations

from dofla.config import ConversionPlan
from dofla.convert import set_position_period
from dofla.errors import DoflaError
from dofla.models import get_adapter
from dofla.rotary import fixed_rotary_frequencies
from dofla.run_config import LinearizeConfig
from dofla.run_data import trained_length


def resolve_sinks_at_edge(config: LinearizeConfig, model, plan: ConversionPlan) -> bool:
    """Whether the run's hybrid windows see their sinks from the window's edge: ``plan.sinks_at_edge`` where
    given, else on for a hybrid plan with sinks where the teacher has one rotary embedding with fixed
    frequencies (measured on the constant-memory recipe trained at 1,024 tokens: 1.26x the teacher at 8,192
    against 1.41x, the only setting that beat the no-training window cache there; equal or better at every
    shorter length) and the edge-sink baselines can run (:func:`edge_sinks_obstacle`; refused when asked
    for where they cannot)."""
    obstacle = edge_sinks_obstacle(model, plan)
    chosen = config.plan.sinks_at_edge
    if chosen and obstacle:
        raise DoflaError(
            f"--sinks-at-edge is measured on unmasked, uncapped attention, and {obstacle}; leave --sinks-at-edge "
            "off for this teacher."
        )
    if chosen is not None:
        return bool(chosen)
    hybrid = config.plan.kind == "hybrid" and config.plan.sinks > 0
    return hybrid and obstacle is None and fixed_rotary_frequencies(model) is not None


def edge_sinks_obstacle(model, plan: ConversionPlan) -> str | None:
    """What keeps the edge-sink window baselines from running beside ``plan``'s students (None: nothing):
    soft-capped attention (Gemma 2), or converted layers that keep the teacher's own sliding-window mask."""
    adapter = get_adapter(model)
    if any(adapter.attention_softcap(module) for module in adapter.attention_modules(model)):
        return "this teacher soft-caps its attention scores"
    windowed = sorted(set(plan.metadata.get("teacher_windowed_layers") or []) & set(plan.converted_layers))
    if windowed:
        return f"the plan converts layers {windowed}, which keep the teacher's own sliding window"
    return None


def apply_position_period(config: LinearizeConfig, model) -> None:
    """The trained model's position period (:mod:`dofla.rotary`): ``plan.position_period`` where given (0:
    none), else the longest length the students trained at, where the teacher has one rotary embedding
    with fixed frequencies (measured at 8 times the training length: it removed the pure-linear student's
    collapse and gained 5% for the constant-memory hybrid, 1% beside kept softmax layers); none where the
    recall cache is on (``student.recall_cache`` after training or the cell options ``recall_cache`` and
    ``heavy_hitters`` during it: it reads the true positions), and where no converted layer reads rotary
    positions (windows alone, cells with their own projections such as ``gated_delta_net``)."""
    from dofla.cells.recall_cache import RECALL_OPTIONS
    from dofla.models.surgery import students

    period = config.plan.position_period
    in_cell = any(config.student.cell_options.get(name) for name in RECALL_OPTIONS)
    if period is None and (config.student.recall_cache or in_cell):
        return
    if period is None and not any(student.uses_features for student in students(model).values()):
        return
    if period is None:
        if fixed_rotary_frequencies(model) is None:  # none, several or length-dependent: true positions
            return
        period = trained_length(config)
    set_position_period(model, period or None)
