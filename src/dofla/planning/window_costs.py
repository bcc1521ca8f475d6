"""What cutting each layer alone to the sliding window costs the teacher (the input of
``softmax_choice="window"``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dofla.evaluation.logits import final_hidden_states, kl_from_teacher, output_logits, row_chunks
from dofla.evaluation.window_baseline import window_restricted
from dofla.models import get_adapter
from dofla.models.surgery import hidden_states_entering, starting_at_layer


@torch.no_grad()
def window_costs(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    window: int,
    sinks: int = 0,
    layers: Sequence[int] | None = None,
) -> list[float]:
    """What cutting each layer alone to the window costs the model: per layer, the mean KL (nats per token)
    from the full model's next-token distribution when only that layer's softmax sees the last ``window``
    keys plus ``sinks`` first ones, on token batches (B, T). Layers not in ``layers`` (default all) get 0.

    The layers whose cost is highest are the ones a long-context hybrid should keep as full softmax
    (``softmax_choice="window"``): the cost is measured at the batches' length, so measure at the lengths
    the model must serve. Each layer's forward starts from the hidden states entering it (the layers below
    are unchanged), and the output head runs a few rows at a time (:mod:`dofla.evaluation.logits`).
    """
    count = len(list(get_adapter(model).attention_modules(model)))
    chosen = list(range(count)) if layers is None else sorted({int(layer) for layer in layers})
    if not chosen:
        return [0.0] * count
    device = next(model.parameters()).device
    totals = [0.0] * count
    tokens = 0
    for batch in batches:
        ids = batch.to(device)
        reference = final_hidden_states(model, ids).flatten(0, 1)  # (B * T, E)
        entering = hidden_states_entering(model, ids, chosen)
        vocabulary = model.get_output_embeddings().weight.shape[0]
        cut = {}  # layer -> (B * T, E): small next to the logits, so the full model's head runs once per chunk
        for layer in chosen:
            with (
                window_restricted(model, window, sinks, layers=[layer]),
                starting_at_layer(model, layer, entering.pop(layer)),
            ):
                cut[layer] = final_hidden_states(model, ids).flatten(0, 1)
        for rows in row_chunks(len(reference), vocabulary):
            full = torch.log_softmax(output_logits(model, reference[rows]), -1)
            probabilities = full.exp()
            for layer in chosen:
                restricted = torch.log_softmax(output_logits(model, cut[layer][rows]), -1)
                totals[layer] += float(kl_from_teacher(full, probabilities, restricted).sum())
        tokens += ids.numel()
    return [total / max(tokens, 1) for total in totals]
