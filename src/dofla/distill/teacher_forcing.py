"""Teacher-forced layer-wise attention transfer: one teacher forward trains every converted layer at once.

During the teacher's forward (no gradients, converted layers still running the teacher's softmax under
:func:`dofla.dispatch.teacher_forced`), an observer receives each layer's q, k, v and softmax output, runs
that layer's student on detached copies with gradients on, and back-propagates the layer's loss at once.
So each student's gradient comes from its own layer only, the graph of one layer is freed before the
next layer runs, and the teacher's weights (frozen, shared by reference) are never touched.

Layer-sharded runs start that forward from the teacher's hidden states stored on disk
(:mod:`dofla.distill.hidden_store`): :func:`teacher_forced_step_from_states` swaps the decoder layers
below the start for pass-throughs, so they are never executed; :func:`hidden_states_entering` captures
the states the store keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from dofla import dispatch
from dofla.distill.graphed import LayerLossGraphs
from dofla.distill.losses import layer_loss
from dofla.errors import DoflaError
from dofla.models.surgery import autocast_for, starting_at_layer
from dofla.models.surgery import students as converted_students


class _AllLayersSeen(Exception):
    """Raised by the observer after the last converted layer: the rest of the teacher's forward is unused."""


def freeze_teacher(model: nn.Module, layers: list[int] | None = None) -> dict[int, nn.Module]:
    """Make only the students' parameters (of ``layers``, default all converted) trainable.
    Returns those students by layer index."""
    students = converted_students(model)
    if not students:
        raise DoflaError("the model has no converted layers; convert it with dofla.convert.convert first.")
    if layers is not None:
        unknown = sorted(set(layers) - set(students))
        if unknown or not layers:
            raise DoflaError(
                f"layers {unknown or layers} are not converted layers; choose among {sorted(students)}."
            )
        students = {index: students[index] for index in sorted(set(layers))}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for student in students.values():
        for parameter in student.parameters():
            parameter.requires_grad_(True)
    return students


def teacher_forced_step(
    model: nn.Module,
    input_ids: torch.Tensor,
    students: dict[int, nn.Module],
    loss_kind: str,
    *,
    backward: bool,
    query_chunk: int = 128,
    loss_weight: float = 1.0,
    graphs: LayerLossGraphs | None = None,
) -> dict[int, float]:
    """One teacher forward over input_ids (B, T); each converted layer's loss (and, with ``backward``,
    its gradient, scaled by ``loss_weight``, accumulated into its student). Returns {layer: loss value}.

    ``graphs``: with ``backward``, each layer's loss and backward replayed from CUDA graphs
    (:mod:`dofla.distill.graphed`); the losses are read back to the host once, after the last layer.
    """
    losses: dict[int, torch.Tensor] = {}
    last_layer = max(students)
    device = input_ids.device
    graphed = graphs is not None and backward

    def observer(call: dispatch.AttentionCall) -> None:
        student = students.get(call.layer_index)
        if student is None or call.layer_index in losses:
            return
        with torch.enable_grad(), autocast_for(device, cache=not graphed):
            if graphed:
                loss = graphs.loss(student, call)
            else:
                loss = layer_loss(loss_kind, student, call, query_chunk=query_chunk)
            if backward:
                (loss * loss_weight).backward()
        losses[call.layer_index] = loss.detach().clone()  # a graph's output is overwritten at its next replay
        if call.layer_index == last_layer:
            raise _AllLayersSeen

    with torch.no_grad(), dispatch.teacher_forced(), dispatch.observe(observer), autocast_for(device):
        try:
            model(input_ids=input_ids, use_cache=False)
        except _AllLayersSeen:
            pass
    missing = sorted(set(students) - set(losses))
    if missing:
        raise DoflaError(
            f"layers {missing} were never called during the teacher's forward; the model's attention does "
            "not go through dofla's dispatcher (call dofla.dispatch.install(model))."
        )
    values = torch.stack([losses[index].float() for index in sorted(losses)]).tolist()  # one read-back
    return dict(zip(sorted(losses), values, strict=True))


def teacher_forced_step_from_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    start_layer: int,
    start_states: torch.Tensor,
    students: dict[int, nn.Module],
    loss_kind: str,
    **options,
) -> dict[int, float]:
    """:func:`dofla.distill.teacher_forcing.teacher_forced_step` starting from the teacher's stored hidden
    states (B, T, hidden) entering ``start_layer``; layers below it are not run. ``options``: that
    function's keyword arguments (backward, query_chunk, loss_weight). Returns {layer: loss}."""
    below = sorted(index for index in students if index < start_layer)
    if below:
        raise DoflaError(
            f"layers {below} come before the stored start layer {start_layer}; train them from a store with a "
            f"boundary at or below {below[0]}."
        )
    with starting_at_layer(model, start_layer, start_states):
        return teacher_forced_step(model, input_ids, students, loss_kind, **options)
