"""Decoding cache for converted layers: a transformers cache layer that holds a recurrent state, not keys.

transformers' attention modules call ``past_key_values.update(k, v, layer_idx)`` before the attention
function and attend over what it returns. For a converted layer :class:`RecurrentCacheLayer` returns just
the new keys/values (so nothing grows), counts the tokens it has seen (so position ids and masks stay
right: it answers ``get_seq_length`` / ``get_mask_sizes`` exactly like a ``DynamicLayer``), and keeps the
student's state (``LinearState`` or ``HybridState``, or a decoding step's ring-buffer layout of one, see
:mod:`dofla.ops.decode`), which :class:`dofla.attention.LinearAttention` reads and replaces. :func:`attach_cache_layer` swaps these layers into whatever cache ``generate()`` or the user
made (``DynamicCache``, or the self-attention half of an ``EncoderDecoderCache`` for GPT-2).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, EncoderDecoderCache, StaticLayer

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

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]  # (B, Hkv, 0, D): holds no memory
        self.values = value_states[:, :, :0]
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


def self_attention_cache(cache):
    """The cache holding this model's self-attention layers (GPT-2 wraps it in an EncoderDecoderCache)."""
    if isinstance(cache, EncoderDecoderCache):
        return cache.self_attention_cache
    return cache


def attach_cache_layer(cache, layer_index: int) -> RecurrentCacheLayer:
    """Make ``cache``'s layer ``layer_index`` a :class:`RecurrentCacheLayer` (in place) and return it.

    A fresh layer (no tokens yet) is replaced; a layer already holding softmax keys is refused, because
    the linear state of those tokens cannot be rebuilt from a cache that dofla did not fill.
    """
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
