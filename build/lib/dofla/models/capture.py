"""Capture each layer's queries (after rotary), keys, values and attention outputs from a teacher run.

Built on the attention dispatcher (``dofla.dispatch``), so it works the same for every supported
family. Streamed: one input batch at a time is run and yielded, so memory stays bounded by what the
caller keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from dofla import dispatch
from dofla.errors import DoflaError

FIELDS = ("query", "key", "value", "output")


def capture_attention(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    layers: Sequence[int] | None = None,
    fields: Sequence[str] = FIELDS,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """For each batch of token ids (B, T), yield ``{layer: {field: tensor}}``.

    query (B, H, T, D) after rotary; key, value (B, Hkv, T, D); output (B, T, H, D), the teacher's
    attention output before the output projection. Tensors are detached copies on ``device`` in
    ``dtype``. The model's attention implementation is restored afterwards.
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise DoflaError(f"unknown capture field(s) {', '.join(unknown)}; choose from {', '.join(FIELDS)}.")
    wanted = None if layers is None else set(int(layer) for layer in layers)
    model_device = next(model.parameters()).device
    previous = model.config._attn_implementation
    dispatch.install(model)
    captured: dict[int, dict[str, torch.Tensor]] = {}

    def observer(call: dispatch.AttentionCall) -> None:
        if wanted is not None and call.layer_index not in wanted:
            return
        captured[call.layer_index] = {
            name: getattr(call, name).detach().to(device=device, dtype=dtype) for name in fields
        }

    try:
        for batch in batches:
            captured = {}
            # Contexts per batch, not around the yield: the caller's code between batches keeps its grad mode.
            with torch.no_grad(), dispatch.teacher_forced(), dispatch.observe(observer):
                model(input_ids=batch.to(model_device), use_cache=False)
            yield captured
    finally:
        if previous and not previous.startswith("dofla_"):
            model.set_attn_implementation(previous)
