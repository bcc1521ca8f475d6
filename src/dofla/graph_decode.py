"""Decoding steps of a converted model replayed from one captured CUDA graph.

A decoding step of a converted model is a few hundred small operators; on a GPU each is a kernel launched
from Python, so at small batch a step costs the host's time (tens of milliseconds on a slow host) whatever
the work. Every layer converted without a window holds a state of fixed size, so one step can be captured
once as a CUDA graph and replayed: the states are static buffers that the step reads and, at its end,
writes its new states back into; the token and its position are static inputs (the position advances
inside the graph).

What it needs: a cache holding the converted layers' states (after a prefill; with a window, a prompt at
least as long as the window, so the window's state has its final size). Layers a plan keeps as full softmax
(the ``gated-delta-retrieval`` recipe's four) are held in their ``GrowingKVLayer`` with room for the steps
to come (``steps``): a step writes its key at a token count kept on the device and attends over every slot
with the unwritten ones masked by that count, so the graph need not know the length. Sliding-window softmax
layers are refused. A window held as a ring in its steady state (full, every sink kept, no slot hidden) takes
its ring step with its next slot a tensor the step advances (the cache layer's ``frozen_slot``), since the
ring's token count is frozen; other windows decode in their general recurrent form here. The Python part of the model's step (the
cache's token counters, mask sizes) runs once, at capture; a layer's step reads nothing of it, which the
CPU tests check by replaying the step with that Python state frozen as a graph freezes it
(:class:`CapturedDecoder` with ``graph=False``). Off CUDA the decoder runs that same frozen step eagerly, or,
with ``compiled=True`` (the CPU's ``dofla generate --compile``), as one program that ``torch.compile`` traces
once: the whole model's step (projections, norms, MLP and every layer's attention step) as generated C++
kernels called in turn, where the eager step costs each of its few hundred operators a Python dispatch whose
code and data the MLP's weights have pushed out of the CPU's caches since the step before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace

import torch
from torch import Tensor

from dofla.cache import GrowingKVLayer, RecurrentCacheLayer, self_attention_cache
from dofla.dispatch import SOFTMAX_OVERRIDE_ATTRIBUTE, teacher_attention
from dofla.errors import DoflaError
from dofla.ops.compiled import compiled_method
from dofla.ops.window.step import RingWindow, frozen_slot, steady_ring

WARM_UP_STEPS = 2  # eager steps on a side stream before capture (CUDA's libraries allocate their workspaces)


def _advanced(state, steps: int):
    """``state`` with every ``num_tokens`` field (nested states too) moved on by ``steps``."""
    if not is_dataclass(state):
        return state
    changes = {}
    for item in fields(state):
        value = getattr(state, item.name)
        if item.name == "num_tokens" and isinstance(value, int):
            changes[item.name] = value + steps
        elif is_dataclass(value):
            changes[item.name] = _advanced(value, steps)
    return replace(state, **changes)


def _ring_of(state):
    """The ``RingWindow`` a layer's state holds (nested states searched), or None."""
    if isinstance(state, RingWindow):
        return state
    if not is_dataclass(state):
        return None
    for item in fields(state):
        found = _ring_of(getattr(state, item.name))
        if found is not None:
            return found
    return None


def check_graph_decodable(model) -> tuple[list, list[tuple[int, object]]]:
    """The converted layers in order and the (index, attention module) of the layers kept as softmax, after
    checking that a decoding step of ``model`` can be captured: a converted model whose kept layers attend
    to every token (no sliding window). A DoflaError says what is not and what to do."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from dofla.models.surgery import architecture, students

    converted = students(model)
    if not converted:
        raise DoflaError("graph decoding needs a converted model; convert it or decode without a graph.")
    fresh = self_attention_cache(DynamicCache(config=model.config)).layers  # the layers generation gets
    kept = []
    for index, module in enumerate(architecture(model).attention_modules):
        if index in converted:
            continue
        kind = type(fresh[index]).__name__ if index < len(fresh) else "DynamicLayer"
        if kind != DynamicLayer.__name__:
            raise DoflaError(
                f"layer {index}, kept as softmax, keeps its keys in a {kind} (a sliding window); graph "
                "decoding holds only softmax layers that attend to every token, so decode without a graph."
            )
        kept.append((index, module))
    return [module for _, module in sorted(converted.items())], kept


def students_of(model) -> list:
    """The converted layers of ``model`` that hold a window (hybrid)."""
    from dofla.models.surgery import students

    return [module for module in students(model).values() if module.kind == "hybrid"]


def rings_ready(model, cache) -> bool:
    """Whether every window of ``model`` holds, in ``cache``, a ring in its steady state (``steady_ring``:
    full, every sink kept, no slot hidden), so that a frozen step keeps them all as rings (a window whose
    step makes no ring never does: ``generate_greedy`` waits for it a window at most)."""
    layers = self_attention_cache(cache).layers
    for module in students_of(model):
        state = layers[module.layer_index].state if module.layer_index < len(layers) else None
        if not steady_ring(_ring_of(state)):
            return False
    return True


def frozen_step_length(model) -> int | None:
    """The tokens after which a :class:`CapturedDecoder` takes ``model``: those that fill its windows and
    their sinks, so that every state has its final size (0 without windows); None where no decoder takes it
    (not converted, or a kept softmax layer with a sliding window: :func:`check_graph_decodable`)."""
    try:
        check_graph_decodable(model)
    except DoflaError:
        return None
    return max((module.window + module.sinks for module in students_of(model)), default=0)


def capturable_layers(
    model, cache
) -> tuple[list, list[RecurrentCacheLayer], list[tuple[object, GrowingKVLayer]]]:
    """The converted layers and their cache layers, in order, and the kept softmax layers' (attention
    module, cache layer), after :func:`check_graph_decodable` and checking that each cache layer holds what
    the prefill left."""
    modules, kept = check_graph_decodable(model)
    layers = list(self_attention_cache(cache).layers)

    def slot(index: int):
        return layers[index] if index < len(layers) else None

    recurrent = [slot(module.layer_index) for module in modules]
    for module, layer in zip(modules, recurrent, strict=True):
        if not isinstance(layer, RecurrentCacheLayer) or layer.state is None:
            raise DoflaError(
                f"layer {module.layer_index} has no recurrent state in the cache; prefill the prompt with "
                "this cache before building the decoder."
            )
    held = []
    for index, module in kept:
        layer = slot(index)
        if not isinstance(layer, GrowingKVLayer) or layer.get_seq_length() == 0:
            raise DoflaError(
                f"layer {index}, kept as softmax, holds {type(layer).__name__ if layer else 'nothing'} in the "
                "cache, not the prompt's keys in the GrowingKVLayer a converted model's prefill into a fresh "
                "DynamicCache gives it; prefill that way before building the decoder, or decode without a graph."
            )
        held.append((module, layer))
    return modules, recurrent, held


def _attend_up_to(count: Tensor) -> Callable:
    """A softmax override for a kept layer held for graph decoding: the teacher's attention over every slot
    of its buffers, the slots at or after ``count`` (not written yet) masked out."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        slots = torch.arange(key.shape[2], device=key.device)
        bias = torch.zeros(key.shape[2], dtype=query.dtype, device=key.device)
        bias = bias.masked_fill(slots >= count, float("-inf"))
        return teacher_attention(module, query, key, value, bias.view(1, 1, 1, -1), **kwargs)

    return attention


class CapturedDecoder:
    """One decoding step of a converted model, replayed from a CUDA graph (``graph=None``: on CUDA only).

    Build it after prefilling ``cache`` with the prompt: ``position`` is the next token's position (the
    prompt's length). ``step(tokens)`` takes the (B, 1) next tokens and returns the (B, vocab) logits of the
    token after them; with a graph the returned tensor is the graph's own output, overwritten by the next
    step (use it, or clone it, first). ``finish()`` hands the cache back to ordinary use, states and token
    counts up to date. ``compiled=True`` (without a graph): the step runs as one ``torch.compile``d program
    (traced and compiled at the first step: about a minute for SmolLM2-135M on 2 cores, less with inductor's
    disk cache; where compiling fails, one warning and the step runs eagerly).
    """

    def __init__(
        self,
        model,
        cache,
        batch_size: int,
        position: int,
        *,
        graph: bool | None = None,
        steps: int | None = None,
        compiled: bool = False,
    ) -> None:
        if compiled and graph:
            raise DoflaError("a decoder replays a CUDA graph or runs a compiled step, not both; pick one.")
        self.model, self.cache = model, cache
        self.students, self.layers, self.kept = capturable_layers(model, cache)
        device = next(model.parameters()).device
        self.graph_wanted = device.type == "cuda" if graph is None else bool(graph)
        if self.graph_wanted and device.type != "cuda":
            raise DoflaError("a CUDA graph needs the model on a CUDA device; use graph=False elsewhere.")
        # the step as one compiled program (None: eager or a graph)
        self.compiled_body = compiled_method(self._body, "the whole decoding step") if compiled else None
        if self.kept and (steps is None or int(steps) < 1):
            raise DoflaError(
                "this model keeps softmax layers, whose keys a graph writes into buffers of fixed size; "
                "give the number of steps to decode (steps=N)."
            )
        self.max_steps = None if steps is None else int(steps)
        # kept softmax layers: buffers with room for every step, a token count on the device, the override
        self.counts = [layer.hold_for_graph(self.max_steps) for _, layer in self.kept]
        self.overrides = [getattr(module, SOFTMAX_OVERRIDE_ATTRIBUTE, None) for module, _ in self.kept]
        for (module, _), count in zip(self.kept, self.counts, strict=True):
            setattr(module, SOFTMAX_OVERRIDE_ATTRIBUTE, _attend_up_to(count))
        for layer in self.layers:
            # windows step as the rings of earlier steps in their steady state, else in their general form
            # (see the module docstring)
            layer.frozen = True
            ring = _ring_of(layer.state)
            if steady_ring(ring):
                layer.frozen_slot = frozen_slot(ring)
                state = layer.state
            else:
                state = layer.state.general_layout()
            if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in state.tensors()):
                state = state.map_tensors(
                    torch.clone
                )  # a prefill under inference_mode: buffers the step may write
            layer.state = state
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.positions = torch.full((batch_size, 1), int(position), dtype=torch.long, device=device)
        # the Python side of the cache as the graph will see it at every replay
        self.frozen = [(layer.num_tokens, layer.state) for layer in self.layers]
        self.buffers = [tensor for _, state in self.frozen for tensor in state.tensors()]
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if self.graph_wanted:
            try:
                self._capture()
            except BaseException:
                self.finish()  # the model and cache back to ordinary use
                raise

    @torch.no_grad()
    def _body(self) -> Tensor:
        """The step as the graph holds it: the frozen cache, one forward, the new states into the buffers."""
        for layer, (count, state) in zip(self.layers, self.frozen, strict=True):
            layer.num_tokens, layer.state = count, state
        logits = self.model(
            input_ids=self.tokens, position_ids=self.positions, past_key_values=self.cache, use_cache=True
        ).logits[:, -1]
        new = [tensor for layer in self.layers for tensor in layer.state.tensors()]
        if [(t.shape, t.dtype) for t in new] != [(t.shape, t.dtype) for t in self.buffers]:
            raise DoflaError(
                "a decoding step changed the states' layout (a window still filling: prompts shorter than "
                "the window); decode without a graph, or give a longer prompt."
            )
        for buffer, value in zip(self.buffers, new, strict=True):
            if value is not buffer:  # a ring and its memory are written in place
                buffer.copy_(value)
        self.positions.add_(1)
        return logits

    def _capture(self) -> None:
        # the warm-up steps write the kept layers' keys past their counts, masked out and later overwritten
        restored = [*self.buffers, self.positions, *self.counts]
        saved = [buffer.clone() for buffer in restored]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_STEPS):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        for buffer, value in zip(restored, saved, strict=True):
            buffer.copy_(value)  # the warm-up steps leave no trace
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._body()

    def step(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (B, 1); the (B, vocab) logits of the next position."""
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise DoflaError(
                f"this decoder was built for {self.max_steps} steps (its kept softmax layers have room for "
                "no more); build a new one with more steps."
            )
        self.tokens.copy_(tokens)
        self.steps += 1
        if self.graph is None:
            return self._body() if self.compiled_body is None else self.compiled_body()
        self.graph.replay()
        return self.logits

    def finish(self) -> None:
        """Put the states (the buffers, now current) back into the cache with their token counts, and the
        layers' own decoding steps back in use."""
        for layer, (count, state) in zip(self.layers, self.frozen, strict=True):
            layer.num_tokens, layer.state = count + self.steps, _advanced(state, self.steps)
        for layer in self.layers:
            layer.frozen, layer.frozen_slot = False, None
        for (module, layer), override in zip(self.kept, self.overrides, strict=True):
            layer.release_from_graph()
            setattr(module, SOFTMAX_OVERRIDE_ATTRIBUTE, override)
        self.graph, self.logits = None, None


@torch.no_grad()
def generate_greedy(
    model,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    graph: bool | None = None,
    prefill_chunk: int | None = None,
    eos_token_id: int | None = None,
    on_tokens: Callable[[Tensor], None] | None = None,
    compiled: bool = False,
) -> Tensor:
    """Greedy continuation of ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens, decoding through a
    :class:`CapturedDecoder` (a CUDA graph on CUDA): (B, T + new) token ids. ``prefill_chunk``: prefill in
    pieces of that many tokens; ``eos_token_id``: stop once every row has produced it; ``on_tokens``: called
    with the prompt, then with each new (B, 1) token (a transformers streamer's ``put``); ``compiled``: without
    a graph, the decoder's step as one compiled program (:class:`CapturedDecoder`), after ordinary steps
    until the windows are full (:func:`frozen_step_length`; at least one, which makes them rings)."""
    from transformers import DynamicCache

    from dofla.prefill import prefill

    emit = on_tokens or (lambda tokens: None)
    emit(input_ids)
    cache = DynamicCache(config=model.config)
    token = prefill(model, input_ids, cache, prefill_chunk).argmax(-1, keepdim=True)
    tokens, decoder = [token], None
    emit(token)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    position = input_ids.shape[1]
    # compiled: ordinary steps until the windows are full and, where their cells have a compiled step, their
    # rings hide no slot (at most a window more), then the frozen step; at least one ordinary step (rings)
    fill = (frozen_step_length(model) or 0) if compiled else 0
    ordinary_until = max(position + 1, fill) if compiled else position
    ordinary_at_most = position + 1 + fill
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None:
            finished |= token[:, 0] == eos_token_id
            if bool(finished.all()):
                break
        ordinary = position < ordinary_until
        if compiled and decoder is None and not ordinary and position < ordinary_at_most:
            ordinary = not rings_ready(model, cache)
        if ordinary:
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        else:
            if decoder is None:
                decoder = CapturedDecoder(
                    model,
                    cache,
                    input_ids.shape[0],
                    position,
                    graph=graph,
                    steps=max_new_tokens - 1,
                    compiled=compiled,
                )
            logits = decoder.step(token)
        position += 1
        token = logits.argmax(-1, keepdim=True)
        if eos_token_id is not None:  # a row that has ended repeats its end
            token = token.masked_fill(finished[:, None], eos_token_id)
        tokens.append(token)
        emit(token)
    if decoder is not None:
        decoder.finish()
    return torch.cat([input_ids, *tokens], dim=1)
