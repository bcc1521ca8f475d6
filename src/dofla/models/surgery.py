"""Model surgery shared by planning, distillation and evaluation: a converted model's students, its
architecture facts, and a teacher forward read or started between decoder layers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from dofla import dispatch
from dofla.attention import LinearAttention
from dofla.errors import DoflaError
from dofla.models.adapters import get_adapter


@dataclass
class Architecture:
    """What conversion needs to know about a model: shape facts and its attention modules by layer."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_modules: list[nn.Module]
    scalings: list[float]
    softcaps: list[float | None]  # the teacher's logit soft-capping per layer (Gemma 2 and 3)


def architecture(model: nn.Module) -> Architecture:
    """Architecture facts and attention modules, from ``dofla.models.get_adapter`` (one table for all)."""
    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    return Architecture(
        model_type=str(adapter.model_type),
        num_layers=int(adapter.num_layers),
        num_heads=int(adapter.num_heads),
        num_kv_heads=int(adapter.num_kv_heads),
        head_dim=int(adapter.head_dim),
        attention_modules=modules,
        scalings=[float(adapter.attention_scaling(index, model)) for index in range(len(modules))],
        softcaps=[adapter.attention_softcap(module) for module in modules],
    )


def is_converted(model: nn.Module) -> bool:
    return getattr(model, "dofla_plan", None) is not None


def students(model: nn.Module) -> dict[int, LinearAttention]:
    """The converted layers' students by layer index."""
    return {module.layer_index: module for module in model.modules() if isinstance(module, LinearAttention)}


def autocast_for(device: torch.device, *, cache: bool = True):
    """bf16 autocast on CUDA; CPUs (no bf16 units here) compute in float32. ``cache=False``: without
    autocast's cache of cast weights, which CUDA graph capture needs."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


# ------------------------------------------------------------------------------ hidden states between layers


def _hidden_states_argument(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer is called with (first positional argument or ``hidden_states=``)."""
    return args[0] if args else kwargs["hidden_states"]


class _BoundariesSeen(Exception):
    """Raised before the last boundary layer runs: the rest of the teacher's forward is unused."""


def hidden_states_entering(
    model: nn.Module, input_ids: torch.Tensor, boundaries: list[int]
) -> dict[int, torch.Tensor]:
    """One teacher forward over input_ids (B, T) (converted layers run the teacher's softmax), stopped before
    the last boundary layer: the hidden state entering each boundary layer, {layer: (B, T, hidden)}."""
    layers = get_adapter(model).decoder_layer_list(model)
    captured: dict[int, torch.Tensor] = {}
    last = max(boundaries)

    def hook_for(index: int):
        def capture(module, args, kwargs):
            captured[index] = _hidden_states_argument(args, kwargs).detach()
            if index == last:
                raise _BoundariesSeen

        return capture

    handles = [
        layers[index].register_forward_pre_hook(hook_for(index), with_kwargs=True) for index in boundaries
    ]
    try:
        with torch.no_grad(), dispatch.teacher_forced(), autocast_for(input_ids.device):
            model(input_ids=input_ids, use_cache=False)
    except _BoundariesSeen:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return captured


# ------------------------------------------------------------------------------ starting from stored states


class PassThroughLayer(nn.Module):
    """Stands in for a decoder layer that is not run: returns the hidden states it is given.

    transformers 5 decoder layers (all supported families) return the hidden-state tensor itself.
    """

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


@contextmanager
def starting_at_layer(model: nn.Module, layer: int, hidden_states: torch.Tensor) -> Iterator[None]:
    """Within this block the model's forward skips decoder layers below ``layer`` and feeds ``layer`` with
    hidden_states (B, T, hidden) instead.

    The embeddings still run (cheap), so position embeddings and attention masks come from the model's own
    forward; the skipped layers are swapped for :class:`PassThroughLayer` and put back afterwards.
    """
    layers = get_adapter(model).decoder_layer_list(model)
    if not 0 <= layer < len(layers):
        raise DoflaError(f"layer {layer} does not exist: the model has layers 0..{len(layers) - 1}.")
    originals = [layers[index] for index in range(layer)]

    def swap_in(module, args, kwargs):
        current = _hidden_states_argument(args, kwargs)
        if current.shape != hidden_states.shape:
            raise DoflaError(
                f"the stored hidden states have shape {tuple(hidden_states.shape)} but layer {layer} receives "
                f"{tuple(current.shape)}; give the token ids the states were computed for."
            )
        stored = hidden_states.to(current.device, current.dtype)
        if args:
            return (stored, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": stored}

    handle = layers[layer].register_forward_pre_hook(swap_in, with_kwargs=True)
    for index in range(layer):
        layers[index] = PassThroughLayer()
    try:
        yield
    finally:
        handle.remove()
        for index, original in enumerate(originals):
            layers[index] = original
