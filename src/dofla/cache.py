"""Decoding cache for converted layers: a transformers cache layer that holds a recurrent state, not keys.

transformers' attention modules call ``past_key_values.update(k, v, layer_idx)`` before the attention
function and attend over what it returns. For a converted layer :class:`RecurrentCacheLayer` returns just
the new keys/values (so nothing grows), counts the tokens it has seen (so position ids and masks stay
right: it answers ``get_seq_length`` / ``get_mask_sizes`` exactly like a ``DynamicLayer``), and keeps the
student's state (``LinearState`` or ``HybridState``, or a decoding step's ring-buffer layout of one, see
:mod:`dofla.ops.window.step`), which :class:`dofla.attention.LinearAttention` reads and replaces. :func:`attach_cache_layer` swaps these layers into whatever cache ``generate()`` or the user
made (``DynamicCache``, or the self-attention half of an ``EncoderDecoderCache`` for GPT-2).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, EncoderDecoderCache, StaticLayer

from dofla.errors import DoflaError
from dofla.ops import HybridState, LinearState


class RecurrentCacheLayer(CacheLayerMixin):
    """One converted layer's cache: the number of tokens seen and the student's recurrent state.

    ``keys`` / ``values`` stay empty (B, Hkv, 0, D) tensors so that generic cache code keeps working;
    ``state`` is None before the first forward. Memory is constant in the number of tokens for linear
    layers and bounded by the window for hybrid layers.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.num_tokens = 0
        self.state: LinearState | HybridState | None = None
        # set while a frozen decoding step holds this layer (dofla.graph_decode.CapturedDecoder): its window's
        # next slot as a tensor the step advances (a ring in its steady state), else the general forms
        self.frozen = False
        self.frozen_slot: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        # (B, Hkv, 0, D) of their own: a slice of the prefill's keys would keep all their storage alive
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Count the new tokens and hand back only them: key_states (B, Hkv, T, D) -> the same tensors."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) as a DynamicLayer would give, so shared masks have the usual shape."""
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the state is small; it stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.num_tokens = 0
        self.state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows of the state (beam search)."""
        if self.state is not None:
            self.state = self.state.index_select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            index = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
            self.state = self.state.index_select(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = self.state.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise DoflaError(
            "a linear-attention cache cannot be cropped (its state sums every past token); "
            "use plain greedy or sampling generation instead of assisted or speculative decoding."
        )

    def nbytes(self) -> int:
        """Bytes of the recurrent state (0 before the first forward)."""
        return 0 if self.state is None else self.state.nbytes()


class GrowingKVLayer(DynamicLayer):
    """A softmax layer's keys and values, kept by a partly converted model, in buffers with room to grow.

    transformers' ``DynamicLayer`` concatenates each new token onto its whole cache, so every decoding step
    copies the cache (at 16k tokens and batch 8 that copy is most of a softmax layer's step). This layer
    writes new tokens into the spare room of a buffer, grown by a quarter (at least ``SPARE`` tokens) when
    full, and hands back views of its filled front: the same keys, values and mask sizes as a
    ``DynamicLayer``. Whatever replaces ``keys`` / ``values`` (crop, beam reordering, batch selection) is
    taken over into a fresh buffer at the next update. New keys that need gradients are concatenated as a
    ``DynamicLayer`` does (an in-place write would change tensors autograd keeps).
    """

    SPARE = 256  # tokens of room at least, after a prefill or a growth

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.count: torch.Tensor | None = None  # graph decoding: the tokens held, on the device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers = None

    def _filled(self) -> int | None:
        """Tokens held at the front of the buffers, or None where keys / values are not their front."""
        if self.buffers is None:
            return None
        for view, buffer in zip((self.keys, self.values), self.buffers, strict=True):
            if (
                view.dim() != 4
                or view.data_ptr() != buffer.data_ptr()
                or view.stride() != buffer.stride()
                or view.shape[:2] != buffer.shape[:2]
                or view.shape[3:] != buffer.shape[3:]
                or view.dtype != buffer.dtype
            ):
                return None
        if self.keys.shape[2] != self.values.shape[2]:
            return None
        return self.keys.shape[2]

    def _grown(self, held: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
        """A buffer of ``capacity`` tokens shaped like ``new`` with ``held`` (or nothing) at its front and zeros
        after it (graph decoding reads every slot, masked: no NaN may hide in the unwritten ones)."""
        buffer = new.new_empty((*new.shape[:2], capacity, new.shape[3]))
        front = held.shape[2] if held.dim() == 4 else 0
        if front:
            buffer[:, :, :front].copy_(held)
        buffer[:, :, front:].zero_()
        return buffer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key_states / value_states (B, Hkv, T, D) after the held tokens -> every token's keys and
        values (views of the buffers)."""
        if self.count is not None:
            return self._write_at_count(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self.buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        filled = self._filled()
        held = self.get_seq_length()
        needed = held + key_states.shape[2]
        if (
            filled is None
            or needed > self.buffers[0].shape[2]
            or self.buffers[0].shape[:2] != key_states.shape[:2]
            or self.buffers[0].dtype != key_states.dtype
            or self.buffers[0].device != key_states.device
            or (self.buffers[0].is_inference() and not torch.is_inference_mode_enabled())
        ):  # (made in inference mode, they take no in-place write outside it)
            capacity = needed + max(self.SPARE, needed // 4)
            self.buffers = (
                self._grown(self.keys, key_states, capacity),
                self._grown(self.values, value_states, capacity),
            )
        keys, values = self.buffers
        keys[:, :, held:needed].copy_(key_states)
        values[:, :, held:needed].copy_(value_states)
        self.keys, self.values = keys[:, :, :needed], values[:, :, :needed]
        return self.keys, self.values

    def hold_for_graph(self, steps: int) -> torch.Tensor:
        """Graph decoding: room for ``steps`` more tokens in the buffers, and from now on one token per update
        written at a count kept on the device (returned; the update advances it) and the whole buffers
        handed back, every slot (the count says which hold tokens). What the cache tells transformers
        (``keys``, lengths, mask sizes) stays as it was, as a captured graph freezes it.
        :meth:`release_from_graph` ends it."""
        held = self.get_seq_length()
        keys, values = self.keys, self.values
        if (
            self._filled() is None
            or self.buffers[0].shape[2] < held + steps
            or (self.buffers[0].is_inference() and not torch.is_inference_mode_enabled())
        ):
            self.buffers = tuple(self._grown(t, t, held + int(steps)) for t in (keys, values))
        self.keys, self.values = (buffer[:, :, :held] for buffer in self.buffers)
        self.count = torch.tensor(held, dtype=torch.long, device=self.buffers[0].device)
        return self.count

    def _write_at_count(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if key_states.shape[2] != 1:
            raise DoflaError("a cache layer held for graph decoding takes one token per step.")
        index = self.count.view(1)
        for buffer, states in zip(self.buffers, (key_states, value_states), strict=True):
            buffer.index_copy_(2, index, states)
        self.count.add_(1)
        return self.buffers

    def release_from_graph(self) -> None:
        """Back to ordinary use: keys and values are the buffers' first ``count`` tokens."""
        held = int(self.count)
        self.keys, self.values = (buffer[:, :, :held] for buffer in self.buffers)
        self.count = None

    def reset(self) -> None:
        self.buffers, self.count = None, None
        super().reset()

    def nbytes(self) -> int:
        """Bytes held: the buffers, spare room included."""
        tensors = self.buffers if self.buffers is not None else (self.keys, self.values)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def self_attention_cache(cache):
    """The cache holding this model's self-attention layers (GPT-2 wraps it in an EncoderDecoderCache)."""
    if isinstance(cache, EncoderDecoderCache):
        return cache.self_attention_cache
    return cache


def _cache_layers(cache, layer_index: int) -> list:
    """The self-attention layers of ``cache``, extended as the cache itself would up to ``layer_index``."""
    cache = self_attention_cache(cache)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise DoflaError(
            f"dofla cannot decode with a cache of type {type(cache).__name__}; pass a DynamicCache or none."
        )
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while len(layers) <= layer_index:
        if replicate is None:
            raise DoflaError(f"the cache has {len(layers)} layers, the model needs layer {layer_index}.")
        layers.append(replicate())
    return layers


def attach_kv_layer(cache, layer_index: int) -> None:
    """Make ``cache``'s layer ``layer_index``, a softmax layer a converted model keeps, a
    :class:`GrowingKVLayer` (in place) where it is a plain ``DynamicLayer`` holding nothing yet; any other
    layer (sliding, static, offloaded, already filled) stays as it is."""
    cache = self_attention_cache(cache)
    if getattr(cache, "offloading", False) or getattr(cache, "layers", None) is None:
        return
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if len(cache.layers) <= layer_index and replicate is not DynamicLayer:
        return
    layers = _cache_layers(cache, layer_index)
    layer = layers[layer_index]
    if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
        layers[layer_index] = GrowingKVLayer()


def attach_cache_layer(cache, layer_index: int) -> RecurrentCacheLayer:
    """Make ``cache``'s layer ``layer_index`` a :class:`RecurrentCacheLayer` (in place) and return it.

    A fresh layer (no tokens yet) is replaced; a layer already holding softmax keys is refused, because
    the linear state of those tokens cannot be rebuilt from a cache that dofla did not fill.
    """
    layers = _cache_layers(cache, layer_index)
    layer = layers[layer_index]
    if isinstance(layer, RecurrentCacheLayer):
        return layer
    if isinstance(layer, StaticLayer):
        raise DoflaError(
            "static caches are not supported for converted layers (their state does not grow anyway); "
            "generate with the default dynamic cache."
        )
    if layer.get_seq_length() > 0:
        raise DoflaError(
            f"the cache already holds {layer.get_seq_length()} softmax keys for converted layer {layer_index}; "
            "start generation with a new cache (or none) after converting the model."
        )
    if getattr(cache, "offloading", False):
        raise DoflaError("offloaded caches are not supported for converted models; use a plain DynamicCache.")
    layer = RecurrentCacheLayer()
    layers[layer_index] = layer
    return layer


def recurrent_cache_bytes(cache) -> int:
    """Bytes held by the recurrent states of a cache's converted layers."""
    cache = self_attention_cache(cache)
    return sum(layer.nbytes() for layer in cache.layers if isinstance(layer, RecurrentCacheLayer))


def held_bytes(*objects) -> int:
    """Bytes of tensor storage that ``objects`` keep alive: a transformers cache (every layer: keys, values,
    buffers, recurrent states), a cache layer, a state or tensors.

    Each distinct untyped storage reachable from them counts once and whole: a view (a slice, a zero-length
    tensor cut from a prefill's keys) holds its whole storage, which is what a user's memory pays.
    """
    storages: dict[tuple, int] = {}
    visited: set[int] = set()

    def visit(item) -> None:
        if id(item) in visited:
            return
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[(item.device, storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        elif isinstance(item, (list, tuple)):
            for element in item:
                visit(element)
        elif isinstance(item, dict):
            for element in item.values():
                visit(element)
        elif (dataclasses.is_dataclass(item) and not isinstance(item, type)) or isinstance(
            item, (Cache, CacheLayerMixin)
        ):
            for element in vars(item).values():
                visit(element)

    for item in objects:
        visit(item)
    return sum(storages.values())
