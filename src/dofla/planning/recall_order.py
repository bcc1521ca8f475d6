"""The greedy order in which a hybrid should keep layers as full softmax for recall beyond the window (the
input of ``softmax_choice="recall"``), measured on the teacher with the other layers cut to the window, and
kept in a file named by its key so a rerun measures it once."""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from dofla.errors import DoflaError
from dofla.evaluation.logits import final_hidden_states
from dofla.evaluation.recall import RECALL_SEED, repeated_rows, row_scores
from dofla.evaluation.window_baseline import window_restricted
from dofla.io import write_json_atomic
from dofla.models import get_adapter
from dofla.planning.error_curves import cache_folder, calibration_rows, measurement_key


@contextmanager
def _replayed(layers: Sequence[torch.nn.Module], outputs: Sequence[object]):
    """Within this block each of ``layers`` returns its entry of ``outputs`` instead of computing it (the
    layer object stays in place, so what the model reads from it, e.g. its attention type, is unchanged)."""
    for layer, output in zip(layers, outputs, strict=True):
        layer.forward = lambda *args, _output=output, **kwargs: _output
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextmanager
def _recorded(layers: Sequence[torch.nn.Module]):
    """Within this block each forward of ``layers`` stores what the layer returned in the yielded list."""
    outputs: list[object] = [None] * len(layers)

    def store(index, module, inputs, output):
        outputs[index] = output

    handles = [layer.register_forward_hook(partial(store, index)) for index, layer in enumerate(layers)]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def recall_layer_order(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    count: int,
    *,
    window: int,
    sinks: int = 0,
    layers: Sequence[int] | None = None,
    seed: int = RECALL_SEED,
    reuse_prefix: bool = True,
) -> list[tuple[int, float]]:
    """Which layers a hybrid should keep as full softmax for recall beyond the window, greedily.

    Every layer of ``layers`` (default all) is restricted to the last ``window`` keys plus ``sinks`` first
    ones except those kept; one at a time, the layer kept next is the one whose full softmax most lowers the
    loss on the repeated tokens of the batches (B, T) (each row repeating one span beyond the window, as
    :func:`~dofla.evaluation.recall.recall_beyond_window` scores), given those kept before. Returns ``count`` (layer, loss once it is
    kept) pairs in that order. Layers that recall only together (an induction circuit spread over layers)
    are found this way where one-layer-at-a-time scores miss them. Costs ``count`` x ``len(layers)`` forwards
    of the batches; with ``reuse_prefix`` (the default) each candidate's forward starts at the candidate's
    own layer, the layers below it returning what they returned in one forward of those already kept
    (they see the same inputs under the same restriction), which about halves the work and changes no
    number (``reuse_prefix=False`` computes every layer every time: the reference).
    """
    adapter = get_adapter(model)
    decoder_layers = adapter.decoder_layers(model)
    candidates = (
        list(range(len(list(adapter.attention_modules(model)))))
        if layers is None
        else sorted({int(layer) for layer in layers})
    )
    if not 0 < count <= len(candidates):
        raise DoflaError(f"the recall order can keep 1 to {len(candidates)} layers, got {count}.")
    device = next(model.parameters()).device
    repeated = [repeated_rows(batch.cpu(), window, seed) for batch in batches]

    def loss(rows, scored) -> tuple[float, int]:
        hidden = final_hidden_states(model, rows.to(device))
        total, _, tokens = row_scores(model, hidden, scored, 0)
        return total, tokens

    def losses_given(kept: list[int]) -> dict[int, float]:
        """Per candidate not in ``kept``: the mean loss with it and ``kept`` at full softmax."""
        sums = {layer: [0.0, 0] for layer in candidates if layer not in kept}
        for rows, scored in repeated:
            outputs: list[object] = []  # per decoder layer, what it returned with only ``kept`` full
            if reuse_prefix:
                restricted = [layer for layer in candidates if layer not in kept]
                with (
                    window_restricted(model, window, sinks, layers=restricted),
                    _recorded(decoder_layers) as outputs,
                ):
                    final_hidden_states(model, rows.to(device))
            for layer, entry in sums.items():
                restricted = [other for other in candidates if other not in kept and other != layer]
                below = decoder_layers[:layer] if reuse_prefix else []
                with (
                    window_restricted(model, window, sinks, layers=restricted),
                    _replayed(below, outputs[: len(below)]),
                ):
                    total, tokens = loss(rows, scored)
                entry[0], entry[1] = entry[0] + total, entry[1] + tokens
        return {layer: total / max(tokens, 1) for layer, (total, tokens) in sums.items()}

    order: list[tuple[int, float]] = []
    for _ in range(count):
        losses = losses_given([layer for layer, _ in order])
        best = min(losses, key=lambda layer: (losses[layer], layer))
        order.append((best, losses[best]))
    return order


def cached_recall_order(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    count: int,
    *,
    window: int,
    sinks: int = 0,
    layers: Sequence[int] | None = None,
    folder: str | Path | None = None,
) -> list[tuple[int, float]]:
    """:func:`recall_layer_order`, read from ``recall_order-KEY.json`` in ``folder`` (default: the innermost
    :func:`dofla.planning.error_curves.curve_cache`; none: measured, not kept) where one holds at least ``count`` layers for
    the same teacher, rows, window, sinks and layers; else measured and written there atomically, with each
    layer's loss once it is kept (where adding layers stops paying). The greedy adds one layer at a time
    given those before, so a longer order's first ``count`` layers are the order for ``count``: a rerun or a
    resumed run does not measure it again.
    """
    target = cache_folder(folder)
    if target is None:
        return recall_layer_order(model, batches, count, window=window, sinks=sinks, layers=layers)
    chosen = "all" if layers is None else sorted({int(layer) for layer in layers})
    settings = dict(measurement="recall order", window=window, sinks=sinks, seed=RECALL_SEED, layers=chosen)
    path = target / f"recall_order-{measurement_key(settings, model, calibration_rows(batches), [])}.json"
    stored = _stored_order(path)
    if len(stored) >= count:
        return stored[:count]
    order = recall_layer_order(model, batches, count, window=window, sinks=sinks, layers=layers)
    write_json_atomic(path, dict(settings, order=[[layer, loss] for layer, loss in order]))
    return order


def _stored_order(path: Path) -> list[tuple[int, float]]:
    """The (layer, loss) pairs kept in ``path``; none where it is missing or not such a file."""
    try:
        return [(int(layer), float(loss)) for layer, loss in json.loads(path.read_text())["order"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
