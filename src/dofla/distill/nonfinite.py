"""The one policy for non-finite losses, shared by the distillation loop and the LoRA stage.

A step whose loss or gradient norm is NaN or infinite is skipped (no optimizer step), a warning names the
stage, the layer (where known) and the step, and the learning rate is halved; after ``max_bad_steps``
such steps in a row the stage stops with a :class:`dofla.errors.DoflaError` saying the same, so a broken
model is never trained on, and never saved (the save paths check parameters and logits too).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dofla.errors import DoflaError

_LAYER_IN_NAME = re.compile(r"\.(\d+)\.")  # model.layers.3.self_attn..., transformer.h.3.attn...


def layer_of(name: str) -> int | None:
    """The layer index in a parameter name ('model.layers.3.self_attn.q_proj.weight' -> 3), or None."""
    match = _LAYER_IN_NAME.search(f".{name}.")
    return int(match.group(1)) if match else None


def first_nonfinite_layer(named_tensors: Iterable[tuple[str, torch.Tensor | None]]) -> int | None:
    """The layer of the first tensor (in order) holding NaN or infinite values, or None."""
    for name, tensor in named_tensors:
        if tensor is not None and not bool(torch.isfinite(tensor).all()):
            return layer_of(name)
    return None


def first_nonfinite_output_layer(model: torch.nn.Module, input_ids: torch.Tensor) -> int | None:
    """The first layer whose output hidden states (B, T, hidden) hold NaN or infinite values on
    ``input_ids``, by one more forward (run only for a bad step); None where all are finite."""
    with torch.no_grad():
        hidden = model(input_ids=input_ids, use_cache=False, output_hidden_states=True).hidden_states
    for index, states in enumerate(hidden):  # hidden[0] is the embeddings' output
        if not bool(torch.isfinite(states).all()):
            return max(0, index - 1)
    return None


@dataclass
class NonFinitePolicy:
    """What a training loop does when a step's loss or gradient is not finite (see the module docstring).

    stage: "distillation" or "LoRA" (shown in messages); advice: what the user should change;
    lr_scale, bad_in_a_row, skipped: the running state (checkpointed by the distillation loop).
    """

    stage: str
    max_bad_steps: int = 5
    advice: str = "lower the learning rate"
    lr_scale: float = 1.0
    bad_in_a_row: int = 0
    skipped: int = 0

    def accept(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        layer: Callable[[], int | None] | None = None,
        kept: Callable[[], str] | None = None,
    ) -> bool:
        """True when step ``step`` (counted from 1) may update the weights; else skip it as the policy says.

        layer: called only for a bad step, gives the layer where the values first went non-finite;
        kept: called only when the stage stops, says what survives (default "nothing was saved").
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.bad_in_a_row = 0
            return True
        self.bad_in_a_row += 1
        self.skipped += 1
        self.lr_scale *= 0.5
        index = layer() if layer is not None else None
        where = f"{self.stage} stage, " + (f"layer {index}, " if index is not None else "") + f"step {step}"
        if self.bad_in_a_row >= self.max_bad_steps:
            raise DoflaError(
                f"{where}: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient (loss {loss}, "
                f"gradient norm {grad_norm}); stopping, {kept() if kept else 'nothing was saved'}: {self.advice}."
            )
        warnings.warn(
            f"{where}: loss {loss} / gradient norm {grad_norm} is not finite; step skipped, learning rate "
            f"halved (x{self.lr_scale:g}).",
            stacklevel=2,
        )
        return False


def first_bad_layer(model, trainable, layer_losses, batch, loss_name) -> int | None:
    """The first layer this process sees go non-finite in a step (its loss, its students, else, for the
    direct loss, the first layer whose output is), or None."""
    bad = [layer for layer, value in layer_losses.items() if not math.isfinite(value)]
    if bad:
        return min(bad)
    layer = first_nonfinite_layer(trainable.items())  # a student gone non-finite
    if layer is not None or loss_name != "direct":
        return layer
    return first_nonfinite_output_layer(model, batch)
