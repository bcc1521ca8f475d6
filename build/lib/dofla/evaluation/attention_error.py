"""Per-layer attention approximation error of a converted model against its own teacher.

One teacher-forced forward per batch: every converted layer sees the teacher's q, k, v for that
layer, so each layer's error is its own (errors of earlier layers do not compound here; perplexity
measures the compounded effect).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dofla import dispatch
from dofla.errors import DoflaError


@torch.no_grad()
def attention_errors(model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> dict[int, dict[str, float]]:
    """Relative error of each converted layer's attention output, before the output projection.

    Returns ``{layer: {"relative_error": ||y_student - y_teacher|| / ||y_teacher||,
    "cosine": mean cosine similarity per (token, head)}}``, accumulated over all batches.
    """
    squared_error: dict[int, float] = {}
    squared_norm: dict[int, float] = {}
    cosine_sum: dict[int, float] = {}
    cosine_count: dict[int, int] = {}

    def observer(call: dispatch.AttentionCall) -> None:
        student = getattr(call.module, dispatch.STUDENT_ATTRIBUTE, None)
        if student is None:
            return
        predicted = student(
            call.query, call.key, call.value, None, scaling=call.scaling
        ).float()  # (B, T, H, D)
        target = call.output.float()
        layer = call.layer_index
        squared_error[layer] = squared_error.get(layer, 0.0) + float((predicted - target).square().sum())
        squared_norm[layer] = squared_norm.get(layer, 0.0) + float(target.square().sum())
        cosine = torch.nn.functional.cosine_similarity(predicted, target, dim=-1)  # (B, T, H)
        cosine_sum[layer] = cosine_sum.get(layer, 0.0) + float(cosine.sum())
        cosine_count[layer] = cosine_count.get(layer, 0) + cosine.numel()

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with dispatch.teacher_forced(), dispatch.observe(observer):
            for batch in batches:  # the base model only: the output head plays no part in the errors
                model.base_model(input_ids=batch.to(device), use_cache=False)
    finally:
        model.train(was_training)
    if not squared_norm:
        raise DoflaError("the model has no converted layers to measure; convert it first.")
    return {
        layer: {
            "relative_error": (squared_error[layer] / max(squared_norm[layer], 1e-30)) ** 0.5,
            "cosine": cosine_sum[layer] / cosine_count[layer],
        }
        for layer in sorted(squared_norm)
    }
