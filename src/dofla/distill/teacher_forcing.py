"""Teacher-forced layer-wise attention transfer: one teacher forward trains every converted layer at once.

During the teacher's forward (no gradients, converted layers still running the teacher's softmax under
:func:`dofla.dispatch.teacher_forced`), an observer receives each layer's q, k, v and softmax output, runs
that layer's student on detached copies with gradients on, and back-propagates the layer's loss at once.
So each student's gradient comes from its own layer only, the graph of one layer is freed before the
next layer runs, and the teacher's weights (frozen, shared by reference) are never touched.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from dofla import dispatch
from dofla.convert import students as converted_students
from dofla.distill.losses import layer_loss
from dofla.errors import DoflaError


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


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; CPUs (no bf16 units here) compute in float32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def teacher_forced_step(
    model: nn.Module,
    input_ids: torch.Tensor,
    students: dict[int, nn.Module],
    loss_kind: str,
    *,
    backward: bool,
    query_chunk: int = 128,
    loss_weight: float = 1.0,
) -> dict[int, float]:
    """One teacher forward over input_ids (B, T); each converted layer's loss (and, with ``backward``,
    its gradient, scaled by ``loss_weight``, accumulated into its student). Returns {layer: loss value}.
    """
    losses: dict[int, float] = {}
    last_layer = max(students)
    device = input_ids.device

    def observer(call: dispatch.AttentionCall) -> None:
        student = students.get(call.layer_index)
        if student is None or call.layer_index in losses:
            return
        with torch.enable_grad(), autocast_for(device):
            loss = layer_loss(loss_kind, student, call, query_chunk=query_chunk)
            if backward:
                (loss * loss_weight).backward()
        losses[call.layer_index] = float(loss.detach())
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
    return losses
