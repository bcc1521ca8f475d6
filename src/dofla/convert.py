"""Convert a transformers model in place from a ConversionPlan (saving: :mod:`dofla.saving`, loading:
:mod:`dofla.loading`).

Conversion attaches a :class:`dofla.attention.LinearAttention` as ``dofla_student`` to each selected
attention module and routes attention through :mod:`dofla.dispatch`; the teacher's projections, rotary
and norms are reused by reference, so the same code serves every family. A forward pre-hook on each
converted attention module swaps a :class:`dofla.cache.RecurrentCacheLayer` into the cache it is given
(``generate()`` works unchanged) and hands that layer to the student for the call. The model's class gains
:class:`dofla.saving.ConvertedModel`, so its ``save_pretrained`` writes a converted folder.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from dofla import dispatch
from dofla.attention import LinearAttention
from dofla.cache import attach_cache_layer, attach_kv_layer
from dofla.cells import build_student, cell_class
from dofla.config import ConversionPlan
from dofla.data import context_length
from dofla.dof import make_plan
from dofla.errors import DoflaError
from dofla.models.adapters import CACHE_ARGUMENTS
from dofla.models.surgery import Architecture, architecture, is_converted, students
from dofla.saving import converted_class
from dofla.settings import PlanSettings, StudentSettings

STUDENT_PREFIX = dispatch.STUDENT_ATTRIBUTE  # every dofla parameter name contains ".dofla_student."
_HOOKS_ATTRIBUTE = "_dofla_hook_handles"


def student_for(facts: Architecture, layer_plan, index: int) -> LinearAttention:
    """The student for layer ``index`` as ``layer_plan`` says, on the device of that layer's attention."""
    shape = dict(
        layer_index=index,
        num_heads=facts.num_heads,
        num_kv_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        scaling=facts.scalings[index],
        softcap=facts.softcaps[index],
    )
    module = facts.attention_modules[index]
    # a cell with projections of its own starts from the teacher's (dofla.cells.gated_delta_net)
    from_teacher = getattr(cell_class(layer_plan.cell), "from_teacher_attention", None)
    if from_teacher is not None:
        return from_teacher(layer_plan, module, **shape)
    student = build_student(layer_plan, **shape)
    parameter = next(module.parameters(), None)
    return student.to(parameter.device) if parameter is not None else student


def plan_for(
    model: nn.Module,
    kind: str | None = None,
    feature_map: str | None = None,
    feature_dim: int | None = None,
    layers: list[int] | None = None,
    window: int | None = None,
    share_kv_heads: bool = True,
    options: dict[str, Any] | None = None,
    cell: str | None = None,
    sinks: int | None = None,
    convert_windowed: bool = False,
) -> ConversionPlan:
    """A plan giving every layer in ``layers`` the same kind, cell, map and dimension ``feature_dim``: the
    ``fix`` allocation of :func:`dofla.dof.make_plan` (default layers: those whose cache grows, all with
    ``convert_windowed``). What is not given is the settings sections' default (:mod:`dofla.settings`)."""
    plan = PlanSettings(
        allocation="fix",
        layers=layers,
        per_query_head=not share_kv_heads,
        convert_windowed=convert_windowed,
        **_given(
            kind=kind, budget=None if feature_dim is None else int(feature_dim), window=window, sinks=sinks
        ),
    )
    student = StudentSettings(cell_options=dict(options or {}), **_given(cell=cell, feature_map=feature_map))
    return make_plan(model, plan=plan, student=student, metadata={"made_by": "plan_for"})


def _given(**values: Any) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


def _attention_cache_argument(module: nn.Module, args: tuple, kwargs: dict):
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    if args:  # passed by position (not done by the supported families, but cheap to allow)
        parameters = list(inspect.signature(module.forward).parameters)
        for name in CACHE_ARGUMENTS:
            if name in parameters and parameters.index(name) < len(args):
                return args[parameters.index(name)]
    return None


def _before_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Give the student this call's cache layer, swapping a RecurrentCacheLayer into the cache if needed."""
    student = getattr(module, STUDENT_PREFIX)
    student.pending_cache_layer = None
    if getattr(student, "reads_hidden_states", False):  # a cell with its own projections
        student.pending_hidden_states = args[0] if args else kwargs.get("hidden_states")
    if dispatch.is_teacher_forced():  # the teacher's softmax runs and needs its ordinary cache layer
        return
    cache = _attention_cache_argument(module, args, kwargs)
    if cache is not None:
        # the slot the module itself updates (its layer_idx), which is the plan's layer index
        slot = int(getattr(module, "layer_idx", student.layer_index))
        student.pending_cache_layer = attach_cache_layer(cache, slot)


def _before_kept_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A softmax layer the plan keeps: its cache layer grows in place instead of by concatenation."""
    cache = _attention_cache_argument(module, args, kwargs)
    if cache is not None:
        attach_kv_layer(cache, int(getattr(module, "layer_idx", module._dofla_kept_index)))


def _after_attention(module: nn.Module, args: tuple, output) -> None:
    student = getattr(module, STUDENT_PREFIX)
    student.pending_cache_layer = None
    if getattr(student, "reads_hidden_states", False):
        student.pending_hidden_states = None


def check_windows(plan: ConversionPlan, context: int | None) -> None:
    """Refuse a hybrid layer's window (plus sinks) longer than the teacher's context: every token would see
    all before it (plain softmax), and each decoding cache would hold that many keys (a window of 10^11 asks
    terabytes)."""
    if context is None:
        return
    for index in plan.converted_layers:
        layer = plan.layers[index]
        if layer.kind == "hybrid" and layer.window + layer.sinks > context:
            raise DoflaError(
                f"layer {index}: the window of {layer.window} tokens (+ {layer.sinks} sinks) is longer than the "
                f"teacher's context of {context} tokens; use a window of at most {context - layer.sinks}, or "
                "keep the layer as softmax."
            )


def convert(model: nn.Module, plan: ConversionPlan) -> nn.Module:
    """Convert ``model`` in place as ``plan`` says and return it.

    Everything is checked before the model changes: the plan's own consistency, that it was made for this
    architecture (type, layers, heads, head size), and that every student can be built.
    """
    if is_converted(model):
        raise DoflaError("this model is already converted; call dofla.convert.unconvert(model) first.")
    if not isinstance(plan, ConversionPlan):
        raise DoflaError(
            f"convert needs a ConversionPlan, got {type(plan).__name__}; load one with ConversionPlan.load."
        )
    plan.validate()
    facts = architecture(model)
    plan.check_matches(
        facts.model_type, facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim
    )
    if len(facts.attention_modules) != facts.num_layers:
        raise DoflaError(
            f"found {len(facts.attention_modules)} attention modules in a {facts.num_layers}-layer "
            f"{facts.model_type} model; this architecture is not supported."
        )
    check_windows(plan, context_length(model))
    built: dict[int, LinearAttention] = {}
    for index in plan.converted_layers:
        try:
            built[index] = student_for(facts, plan.layers[index], index)
        except (ValueError, TypeError) as error:  # a cell reads its options as numbers, names, pairs
            raise DoflaError(
                f"layer {index}: the {plan.layers[index].cell} cell cannot read its options "
                f"{plan.layers[index].options} ({error}); fix --cell-options (KEY=VALUE with a number where "
                "one is meant)."
            ) from None

    dispatch.install(model)
    for index, student in built.items():
        module = facts.attention_modules[index]
        setattr(module, STUDENT_PREFIX, student)
        handles = [
            module.register_forward_pre_hook(_before_attention, with_kwargs=True),
            module.register_forward_hook(_after_attention),
        ]
        setattr(module, _HOOKS_ATTRIBUTE, handles)
    for index, module in enumerate(facts.attention_modules):
        if index not in built:
            module._dofla_kept_index = index
            handle = module.register_forward_pre_hook(_before_kept_attention, with_kwargs=True)
            setattr(module, _HOOKS_ATTRIBUTE, [handle])
    model.dofla_plan = plan
    if isinstance(model, PreTrainedModel):  # save_pretrained now writes a converted folder
        model.__class__ = converted_class(type(model))
    if plan.position_period is not None:
        set_position_period(model, plan.position_period)
    if plan.sinks_at_edge:
        set_sinks_at_edge(model, True)
    return model


_PERIOD_HOOK_ATTRIBUTE = "_dofla_position_period_hook"


def set_position_period(model: nn.Module, period: int | None) -> None:
    """Let every converted layer's memory read rotary positions modulo ``period`` tokens (None: the true
    positions), and record it in the model's plan (saved with it): :mod:`dofla.rotary`."""
    from dofla.rotary import check_period, rotary_embedding, wrap_positions_hook

    check_period(period)
    plan = getattr(model, "dofla_plan", None)
    if plan is None:
        raise DoflaError("a position period applies to a converted model; convert it first.")
    found = None if period is None else rotary_embedding(model)
    if period is not None and found is None:
        raise DoflaError(
            "this model has no rotary position embeddings, so a position period has nothing to wrap; leave "
            "it unset."
        )
    previous = getattr(model, _PERIOD_HOOK_ATTRIBUTE, None)
    if previous is not None:
        previous.remove()
        delattr(model, _PERIOD_HOOK_ATTRIBUTE)
    layers = students(model)
    # no softmax anywhere (every layer converted, none with a window): the positions wrapped once, at the
    # rotary embedding; else each converted layer turns its memory's q and k back itself
    whole = len(layers) == plan.num_layers and all(student.kind == "linear" for student in layers.values())
    per_layer = found is not None and not whole
    for student in layers.values():
        wraps = per_layer and student.uses_features  # a window-only cell has no memory to wrap
        student.position_period = period if wraps else None
        student.rotary_frequencies = found[1] if wraps else None
    if found is not None and whole:
        handle = found[0].register_forward_pre_hook(wrap_positions_hook(period), with_kwargs=True)
        setattr(model, _PERIOD_HOOK_ATTRIBUTE, handle)
    plan.position_period = period


def set_sinks_at_edge(model: nn.Module, on: bool) -> None:
    """Let every converted layer's window see its sinks from the window's edge (``on``) or at their true
    positions, and record it in the model's plan (saved with it). From the edge, token t scores the sinks
    with its query turned back to position ``min(t, window + sinks)`` (``LinearAttention.edge_sink_query``):
    they stay just before its window, at the distances the teacher read them in training, instead of
    moving ever further away (the teacher stops reading sinks some thousands of tokens away). Needs the
    model's one rotary embedding with fixed frequencies; layers without a window or sinks are unchanged."""
    from dofla.rotary import check_edge_sinks

    plan = getattr(model, "dofla_plan", None)
    if plan is None:
        raise DoflaError("sinks at the window's edge apply to a converted model; convert it first.")
    frequencies = check_edge_sinks(model) if on else None
    for student in students(model).values():
        student.edge_sink_frequencies = frequencies
    plan.sinks_at_edge = bool(on)


def unconvert(model: nn.Module) -> nn.Module:
    """Remove the students and hooks: the model is its teacher again (the dispatcher stays installed)."""
    period_hook = getattr(model, _PERIOD_HOOK_ATTRIBUTE, None)
    if period_hook is not None:
        period_hook.remove()
        delattr(model, _PERIOD_HOOK_ATTRIBUTE)
    for module in model.modules():
        for handle in getattr(module, _HOOKS_ATTRIBUTE, []):
            handle.remove()
        for name in (_HOOKS_ATTRIBUTE, "_dofla_kept_index"):
            if hasattr(module, name):
                delattr(module, name)
        if isinstance(getattr(module, STUDENT_PREFIX, None), nn.Module):
            delattr(module, STUDENT_PREFIX)
    model.dofla_plan = None
    model.__class__ = getattr(type(model), "_dofla_base_class", type(model))
    return model
