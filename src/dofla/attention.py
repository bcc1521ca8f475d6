"""The linear-attention module that replaces a layer's softmax attention (the "student").

It is attached to a transformers attention module as ``dofla_student`` (see :mod:`dofla.dispatch`), so it
receives the teacher's own q (after rotary and q-norm), k and v and returns the attention output before
the teacher's output projection: the projections, rotary and norms are the teacher's, by reference.
It holds only the feature map (and, for hybrid layers, the per-head window factors).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor, nn

from dofla.cell_inputs import AttendInputs, StepInputs
from dofla.config import LayerPlan
from dofla.derived import DerivedTensor
from dofla.errors import DoflaError
from dofla.feature_maps import FEATURE_MAPS, build_feature_map
from dofla.masks import key_mask_from_attention_mask
from dofla.ops import (
    HybridInputs,
    HybridOptions,
    LinearInputs,
    chunked_hybrid_attention,
    chunked_linear_attention,
    fla_backend,
    hybrid_attention,
    linear_attention,
    recurrent_hybrid_attention,
    recurrent_linear_attention,
)
from dofla.ops.chunk_sizes import choose_chunk_size
from dofla.ops.hybrid.step import RingHybridState, hybrid_decode_step
from dofla.ops.linear.step import linear_decode_step
from dofla.ops.state import HybridState, LinearState
from dofla.rotary import PositionTurns, Turns

FORMS = ("naive", "chunked", "recurrent")
DEFAULT_WINDOW_FACTOR = 0.1  # LoLCATs: gamma = sigmoid(w) starts near 0.1
DEFAULT_DECODE_TOKENS = 4  # calls with at most this many new tokens and a state run the recurrent form


def state_dtype(state) -> torch.dtype:
    """The dtype of a linear or hybrid state's sums (a hybrid's buffers must share it, see ``step_features``)."""
    if isinstance(state, RingHybridState):
        return state.sums.dtype
    return state.kv.dtype if isinstance(state, LinearState) else state.linear.kv.dtype


class LinearAttention(PositionTurns, nn.Module):
    """Causal linear (or sliding-window hybrid) attention with the teacher's q, k, v: the ``linear`` cell.

    This is the base class of every student cell (see :mod:`dofla.cells`): a cell overrides ``attend``
    and ``decode_step`` (and adds its own parameters and ``CELL_OPTIONS``); everything else (features, masks, cache) is shared.

    plan: the layer's LayerPlan (kind "linear" or "hybrid", feature map, dimension(s), sharing, window).
    num_heads H, num_kv_heads Hkv, head_dim D, scaling: the teacher layer's attention shape and logit scale;
    softcap: the teacher's logit soft-capping (Gemma-2's ``attn_logit_softcapping``), applied to the window
    softmax of hybrid layers (a linear kernel cannot apply it; the distillation learns around it).
    With ``plan.share_kv_heads`` the feature map has one parameter set per key/value head and the state is
    per key/value head (H / Hkv times smaller); otherwise one per query head, keys and values repeated.
    Module options in ``plan.options`` (the rest goes to the feature map): ``window_factor`` (initial
    gamma of hybrid layers, default 0.1), ``chunk_size`` (default: per op and length from
    ``dofla.ops.chunk_sizes.CHUNK_SIZES``), ``decode_tokens`` (default 4).
    A feature map that takes a ``seed`` gets the layer index unless the plan gives one, so layers draw
    different random features.
    """

    cell_name = "linear"
    CELL_OPTIONS: tuple[str, ...] = ()  # options of plan.options read by the cell itself (subclasses)
    requires_nonnegative_features = True
    uses_features = True  # False for cells that only run the window (no feature map, no linear part)
    default_window_factor = DEFAULT_WINDOW_FACTOR

    def __init__(
        self,
        plan: LayerPlan,
        *,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if plan.kind not in ("linear", "hybrid"):
            raise DoflaError(
                f"layer {layer_index}: LinearAttention needs kind linear or hybrid, got {plan.kind!r}."
            )
        plan.validate(layer_index, num_heads, num_kv_heads)
        self.layer_index = int(layer_index)
        self.kind = plan.kind
        self.num_heads, self.num_kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.scaling = float(scaling)
        self.softcap = float(softcap) if softcap else None
        self.share_kv_heads = bool(plan.share_kv_heads)
        self.window = int(plan.window)
        options = dict(plan.options)
        initial_gamma = float(options.pop("window_factor", self.default_window_factor))
        chunk_size = options.pop("chunk_size", None)  # None: chosen per op and length (CHUNK_SIZES)
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self.decode_tokens = int(options.pop("decode_tokens", DEFAULT_DECODE_TOKENS))
        # rotary positions modulo this period in the memory's features (dofla.rotary; None: true positions),
        # with the teacher's rotary frequencies (float32, set by dofla.convert.set_position_period)
        self.position_period: int | None = None
        self.rotary_frequencies: Tensor | None = None
        # sinks seen from the window's edge: the teacher's rotary frequencies (float32, set by
        # dofla.convert.set_sinks_at_edge; None: the sinks at their true positions), see edge_sink_query
        self.edge_sink_frequencies: Tensor | None = None
        self.cell_options = {name: options.pop(name) for name in self.CELL_OPTIONS if name in options}
        self.sinks = int(plan.sinks)
        if plan.feature_map in FEATURE_MAPS and "seed" not in options:
            if "seed" in inspect.signature(FEATURE_MAPS[plan.feature_map].__init__).parameters:
                options["seed"] = self.layer_index
        map_heads = self.num_kv_heads if self.share_kv_heads else self.num_heads
        self.feature_map = (
            None
            if not self.uses_features
            else build_feature_map(
                plan.feature_map,
                num_heads=map_heads,
                head_dim=self.head_dim,
                feature_dim=int(plan.feature_dim),
                scaling=self.scaling,
                head_feature_dims=plan.head_feature_dims,
                **options,
            )
        )
        positive = self.feature_map is not None and (
            self.feature_map.nonnegative or self.feature_map.positive_kernel
        )
        if self.uses_features and self.requires_nonnegative_features and not positive:
            raise DoflaError(
                f"layer {layer_index}: the {self.cell_name} cell normalises by its feature sums and needs a "
                f"non-negative feature map; {plan.feature_map!r} is signed (use it with the gated_delta cell)."
            )
        if self.kind == "hybrid" and self.uses_features:
            if not 0.0 < initial_gamma < 1.0:
                raise DoflaError(
                    f"layer {layer_index}: window_factor must lie strictly between 0 and 1, got {initial_gamma}."
                )
            logit = math.log(initial_gamma / (1.0 - initial_gamma))
            self.window_factor_logit = nn.Parameter(torch.full((self.num_heads,), logit))  # (H,)
        else:
            self.window_factor_logit = None
        # The cache layer of the current forward (set by convert's pre-hook, taken by forward); not a module.
        self.pending_cache_layer = None
        self._kept_step_window_factor = DerivedTensor()  # see step_window_factor

    @property
    def state_heads(self) -> int:
        """Heads of the recurrent state: Hkv when shared, else H."""
        return self.num_kv_heads if self.share_kv_heads else self.num_heads

    def window_factor(self) -> Tensor | None:
        """gamma (H,) in (0, 1): weight of the sliding-window softmax part (hybrid layers), else None."""
        return None if self.window_factor_logit is None else torch.sigmoid(self.window_factor_logit)

    def step_window_factor(self) -> Tensor:
        """gamma as (Hs, G, 1) for decoding steps (G = H // Hs); kept between calls without autograd until
        the logits change (an optimiser step, a load), a step's cost being its number of operators."""
        heads, group = self.state_heads, self.num_heads // self.state_heads
        return self._kept_step_window_factor.get(
            [self.window_factor_logit], lambda: self.window_factor().view(heads, group, 1)
        )

    def state_heads_view(self, tensor: Tensor) -> Tensor:
        """(B, Hkv, T, X) -> (B, Hs, T, X): repeat key/value heads when each query head has its own map."""
        if self.share_kv_heads or self.num_heads == tensor.shape[1]:
            return tensor
        return tensor.repeat_interleave(self.num_heads // tensor.shape[1], dim=1)

    def features(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """query (B, H, T, D), key (B, Hkv, T, D) -> q_features (B, H, T, F), k_features (B, Hs, T, F),
        k_log_scale (B, Hs, T) or None; Hs = Hkv when heads share maps, else H.

        True key features are ``k_features * exp(k_log_scale)``; the query's own factor cancels.
        """
        if query.shape[1] != self.num_heads or key.shape[1] != self.num_kv_heads:
            raise DoflaError(
                f"layer {self.layer_index}: expected {self.num_heads} query and {self.num_kv_heads} key/value "
                f"heads, got {query.shape[1]} and {key.shape[1]}."
            )
        if query.shape[2] > self.decode_tokens:
            q_features, _ = self.feature_map(query, is_query=True)
            k_features, k_log_scale = self.feature_map(self.state_heads_view(key), is_query=False)
            return q_features, k_features, k_log_scale
        return self._joint_features(query, key)

    def _joint_features(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``features`` in one feature-map call for queries and keys together (decoding, where a step's cost
        is its number of small operators), through the map's ``decode_features`` (equal up to rounding).
        Every map treats each token and head alike, whether query or key; a query's log scale is dropped
        (it cancels), as the map does for ``is_query=True``."""
        batch, num_heads, length, _ = query.shape
        features, log_scale = self._grouped_features(query, self.state_heads_view(key))
        group = features.shape[2] - 1
        q_features = features[:, :, :group].reshape(batch, num_heads, length, features.shape[-1])
        return q_features, features[:, :, group], None if log_scale is None else log_scale[:, :, group]

    def _grouped_features(self, query: Tensor, keys: Tensor) -> tuple[Tensor, Tensor | None]:
        """query (B, H, T, D), keys (B, Hs, T, D) -> features (B, Hs, G + 1, T, F) (each state head's
        G = H // Hs queries, then its key) and their log scales (B, Hs, G + 1, T) or None, from one
        ``decode_features`` call (map head h reads its G queries and its key)."""
        batch, num_heads, length, head_dim = query.shape
        heads = keys.shape[1]
        group = num_heads // heads
        both = torch.cat(
            [query.view(batch, heads, group, length, head_dim), keys.unsqueeze(2)], dim=2
        )  # (B, Hs, G + 1, T, D)
        features, log_scale = self.feature_map.decode_features(
            both.view(batch, heads * (group + 1), length, head_dim)
        )
        features = features.view(batch, heads, group + 1, length, features.shape[-1])
        return features, None if log_scale is None else log_scale.view(batch, heads, group + 1, length)

    def step_features(self, step: StepInputs, dtype: torch.dtype):
        """One token's features grouped by state head, for ``decode_step``: features (B, Hs, G + 1, F) (each
        state head's G = H // Hs queries, then its key) of ``step.feature_qk``, their log scales (B, Hs, G + 1)
        or None, values (B, Hs, Dv); None when the inputs are not in ``dtype`` (the state's)."""
        query, key = step.feature_qk
        if query.dtype != dtype or step.value.dtype != dtype:
            return None
        values = self.state_heads_view(step.value)  # (B, Hs, 1, Dv)
        features, log_scale = self._grouped_features(query, self.state_heads_view(key))
        log_scale = None if log_scale is None else log_scale.squeeze(-1)
        return features.squeeze(-2), log_scale, values.squeeze(-2)

    def decode_step(self, step: StepInputs) -> tuple[Tensor, object] | None:
        """One new token with a state and no padding, in the fewest operators (a decoding step's cost is
        its number of small operators): output (B, 1, H, Dv) and the new state, as the recurrent form gives
        them up to rounding. None where the layer has no such step (the general forms run then)."""
        if not self._has_decode_step(step.state):
            return None
        inputs = self.step_features(step, state_dtype(step.state))
        if inputs is None:
            return None
        features, log_scale, values = inputs
        k_log_scale = (
            values.new_zeros(values.shape[:2]) if log_scale is None else log_scale[..., -1]
        )  # (B, Hs)
        return self.state_step(step, step.state, features, values, k_log_scale)

    def _has_decode_step(self, state) -> bool:
        """Whether ``state`` (the inner op's) can take the one-token step: a linear layer's LinearState, or
        a hybrid layer's HybridState of this layer's window and sinks without soft-capping."""
        if self.kind == "linear":
            return isinstance(state, LinearState)
        if isinstance(state, RingHybridState):  # made by an earlier step, in its one dtype
            return self.softcap is None and state.window == self.window and state.sinks == self.sinks
        return (
            isinstance(state, HybridState)
            and self.softcap is None
            and state.keys.dtype
            == state.key_features.dtype
            == state.key_log_scales.dtype
            == state_dtype(state)
            and state.window == self.window
            and state.sinks == self.sinks
        )

    def step_queries(self, query: Tensor | None) -> Tensor | None:
        """One token's queries (B, H, 1, D) grouped by state head for a ring step: (B, Hs, G, D) (G = H // Hs);
        None stays None."""
        if query is None:
            return None
        return query.view(query.shape[0], self.state_heads, -1, self.head_dim)

    def step_sinks(self, query: Tensor, edge: Turns | None) -> dict:
        """How a ring step (``dofla.ops.window.step``) scores the sinks of one token's query (B, H, 1, D) whose
        sinks are seen from the window's edge by the turn ``edge`` (None: at their true positions, nothing
        to pass): the sink keys turned the opposite way where the turn is one product (the queries then
        score every slot in the one fused softmax), else the turned queries."""
        if edge is None:
            return {}
        if edge.matrix is not None:
            return dict(sink_key_turn=edge.keys_for_turned_query)
        return dict(sink_queries=self.step_queries(edge(query)))

    def state_step(self, step: StepInputs, state, features, values, k_log_scale):
        """The step on the inner op's ``state`` (the cell's own, or inside it): features (B, Hs, G + 1, F)
        (queries, then the key), values (B, Hs, Dv), k_log_scale (B, Hs) -> output (B, 1, H, Dv) and the new
        inner state."""
        batch = step.query.shape[0]
        if self.kind == "linear":
            output, new_state = linear_decode_step(
                state, features[:, :, :-1], features[:, :, -1], values, k_log_scale
            )
            return output.view(batch, 1, self.num_heads, -1), new_state  # (B, 1, H, Dv)
        keys = self.state_heads_view(step.key)  # (B, Hs, 1, D)
        output, new_state = hybrid_decode_step(
            state,
            self.step_queries(step.query),
            features[:, :, :-1],
            keys.squeeze(2),
            features[:, :, -1],
            values,
            k_log_scale,
            self.step_window_factor(),
            scaling=step.scaling,
            slot=step.slot,
            **self.step_sinks(step.query, step.edge),
        )
        return output.view(batch, 1, self.num_heads, -1), new_state  # (B, 1, H, Dv)

    def chunk_size_for(self, op: str, length: int) -> int:
        """The chunked form's chunk size: the plan's ``chunk_size`` option, else the measured table's for
        ``op`` ("linear", "delta", "window", "window+sinks") at ``length`` tokens."""
        return self.chunk_size or choose_chunk_size(op, length)

    def take_cache_layer(self):
        """The cache layer for this call, at most once per module forward."""
        layer, self.pending_cache_layer = self.pending_cache_layer, None
        return layer

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None = None,
        *,
        scaling: float | None = None,
        form: str | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv) -> output (B, T, H, Dv).

        Without a cache: the chunked form (``form`` picks "naive" | "chunked" | "recurrent" for tests).
        With a cache layer attached by the conversion hook: the state continues from earlier calls;
        calls of at most ``decode_tokens`` tokens run the recurrent form, longer ones (prefill) the chunked;
        a single unpadded token takes the cell's ``decode_step`` (the recurrent form's step, fewer operators).
        Padded keys (from a 4-D ``attention_mask``) take part nowhere. ``scaling`` is the teacher's logit
        scale for the window softmax of hybrid layers (default: the one given at construction).
        ``position_ids`` (B, T): the tokens' positions, with which a ``position_period`` turns the memory's
        q and k back to positions modulo the period (:mod:`dofla.rotary`); the window keeps the true ones.
        They also place the window's edge for sinks seen from it (``edge_sink_query``; without them the
        call's tokens follow the state's).
        """
        length = query.shape[2]
        if key.shape[2] != length:
            raise DoflaError(
                f"layer {self.layer_index}: got {key.shape[2]} keys for {length} queries; the cache holds "
                "softmax keys of past tokens, so decode with a fresh cache after converting."
            )
        if form is not None and form not in FORMS:
            raise DoflaError(f"unknown attention form {form!r}; use one of {', '.join(FORMS)}.")
        scaling = self.scaling if scaling is None else float(scaling)
        cache_layer = self.take_cache_layer()
        state = None if cache_layer is None else cache_layer.state
        # a decoding step, see decode_step; under a frozen decoding step (dofla.graph_decode, which holds the
        # cache layer) a window's ring step writes the slot the decoder keeps as a tensor, and a window
        # without one (not a ring in its steady state) takes the general recurrent form
        edge = self.edge_sink_turns(query, position_ids, state)
        slot = None if cache_layer is None else cache_layer.frozen_slot
        frozen = cache_layer is not None and cache_layer.frozen
        fast_step = form is None and state is not None and length == 1
        feature_query, feature_key = self._wrapped(query, key, position_ids)
        wrapped = feature_query is not query
        if self.kind == "linear":  # no window: the whole layer reads the wrapped q and k
            query, key = feature_query, feature_key
        fast_step = fast_step and not (frozen and slot is None and self.kind == "hybrid")
        if form is None:
            form = "recurrent" if state is not None and length <= self.decode_tokens else "chunked"
        if form == "naive" and state is not None:
            raise DoflaError("the naive form cannot continue from a cache state; use chunked or recurrent.")
        key_mask = key_mask_from_attention_mask(attention_mask, length)
        if fast_step and key_mask is None:
            memory_qk = (feature_query, feature_key) if wrapped else None
            step = self.decode_step(StepInputs(query, key, value, state, scaling, memory_qk, edge, slot))
            if step is not None:
                output, cache_layer.state = step
                return output
        if slot is not None:  # the general forms would read the frozen token count
            raise DoflaError(
                f"layer {self.layer_index}: its window cannot take its ring step under the frozen decoding "
                "step (padding, autograd or a state that changed); decode without --compile or --graph."
            )
        if state is not None:  # a decoding step's ring buffers, put back in order for the general forms
            state = state.general_layout()
        sink_query = None if edge is None else edge(query)
        q_features, k_features, k_log_scale = (
            self.features(feature_query, feature_key) if self.uses_features else (None, None, None)
        )
        values = self.state_heads_view(value)  # (B, Hs, T, Dv)
        inputs = AttendInputs(
            query, key, q_features, k_features, values, k_log_scale, key_mask, scaling, state, sink_query
        )
        output, new_state = self.attend(form, inputs)
        if cache_layer is not None:
            cache_layer.state = new_state
        return output.transpose(1, 2).contiguous()  # (B, T, H, Dv)

    def attend(self, form: str, inputs: AttendInputs):
        """Run one form ("naive", "chunked" or "recurrent") on a call's inputs: out (B, H, T, Dv) and the new
        state (None for the naive form)."""
        state, values = inputs.state, inputs.values
        chunk_size = self.chunk_size_for("linear", inputs.q_features.shape[2])
        chunked = dict(chunk_size=chunk_size, initial_state=state, return_state=True)
        if self.kind == "linear":
            linear = LinearInputs(
                inputs.q_features, inputs.k_features, values, inputs.k_log_scale, inputs.key_mask
            )
            if form == "naive":
                return linear_attention(linear), None
            if form == "recurrent":
                return recurrent_linear_attention(linear, state=state)
            kernel = fla_backend.simple_gla_kernel(values)  # None (PyTorch) unless CUDA with fla
            return chunked_linear_attention(linear, kernel=kernel, **chunked)
        hybrid = HybridInputs(
            query=inputs.query,
            key=self.state_heads_view(inputs.key),  # (B, Hs, T, D)
            q_features=inputs.q_features,
            k_features=inputs.k_features,
            v=values,
            window_factor=self.window_factor(),
            k_log_scale=inputs.k_log_scale,
            key_mask=inputs.key_mask,
            sink_query=inputs.sink_query,
        )
        options = HybridOptions(inputs.scaling, self.window, self.sinks, self.softcap)
        if form == "naive":
            return hybrid_attention(hybrid, options), None
        if form == "recurrent":
            return recurrent_hybrid_attention(hybrid, options, state=state)
        kernel = fla_backend.simple_gla_kernel(values)  # None (PyTorch) unless CUDA with fla
        return chunked_hybrid_attention(hybrid, options, kernel=kernel, **chunked)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [parameter for parameter in self.parameters() if parameter.requires_grad]

    def parameter_groups(self, base_lr: float) -> list[dict]:
        """AdamW groups: the feature map's own (e.g. z at 0.02, alpha at 0.2) and the window factors."""
        groups = self.feature_map.parameter_groups(base_lr) if self.feature_map is not None else []
        if self.window_factor_logit is not None and self.window_factor_logit.requires_grad:
            groups.append(
                {"params": [self.window_factor_logit], "lr": float(base_lr), "name": "window_factor"}
            )
        return groups

    def extra_repr(self) -> str:
        window = f", window={self.window}, sinks={self.sinks}" if self.kind == "hybrid" else ""
        return (
            f"layer={self.layer_index}, cell={self.cell_name}, kind={self.kind}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"share_kv_heads={self.share_kv_heads}{window}"
        )
