"""The gated delta rule (``gated_delta``) student cell.

``gated_delta``: the state is an associative memory S (K x Dv per state head) updated with the gated delta
rule, ``S_t = a_t (S_{t-1} - b_t k_t k_t^T S_{t-1}) + b_t k_t v_t^T``, read as ``out_t = S_t^T q_t``
(:mod:`dofla.ops.delta`). Keys and queries are the layer's feature map of the teacher's k and q, L2-normalised
(any map, signed ones such as ``projection`` included, so a plan's per-layer dimension K still applies; a
map's per-key log scale cancels in the normalisation). The decay a_t and the write strength b_t are per-head,
per-token gates from the token's value, starting at memories ``decay_memory`` and strength ``beta``.
With a window (kind "hybrid"), the sliding-window softmax over the teacher's own q and k (plus ``sinks``
first tokens) and the memory's read-out are mixed per head, ``gamma window + (1 - gamma) memory``: both are
bounded, whatever the length (unlike a shared normalisation with an unbounded linear sum). With option
``mix="fixed"`` (the default) gamma is one learned number per head; with ``mix="adaptive"`` it is per token,
``gamma_t = sigmoid(l_h + c_h lse_t + v_t . u_h / sqrt(Dv))`` with lse_t the log-sum-exp of the window
softmax's scores (how strongly the query matches a key in the window) and v_t the token's value: c_h = 1,
u_h = 0 makes the memory one more softmax key with logit -l_h, the way a query that finds nothing in the
window can turn to the memory. c and u start at 0, so training starts from the fixed mix.
With option ``short_conv`` W (0: none, the default), each channel of the memory's inputs (the query and
key features before their normalisation, and the values written) is first mixed with the same channel of
the W - 1 tokens before it by a causal depthwise convolution, ``x'_t = sum_i c_i x_{t-W+1+i}``, learned
per channel and starting as the identity (c = (0, ..., 0, 1)): the memory then sees the last few tokens
precisely, as the window does for a hybrid. Its state keeps those W - 1 tokens' inputs; the gates still read
the token's own value.
With option ``output_gate`` (default false), the memory's read-out is scaled per query head and channel by
a gate from the token's value, ``out_t * 2 sigmoid(v_t W_h / sqrt(Dv) + b_h)`` (W_h a Dv x Dv matrix per query
head): the memory's output magnitude can follow the token, as a softmax's normalisation does. W and b start
at 0, so the gate starts at 1 (the cell without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dofla.attention import LinearAttention
from dofla.cell_inputs import AttendInputs, StepInputs
from dofla.cells.gated import DEFAULT_DECAY_MEMORY, TokenGate, initial_gate_logits
from dofla.cells.recall_cache import (
    check_recall_call,
    recall_budget,
    recall_kinds,
    window_step_with_recall_cache,
    window_with_recall_cache,
)
from dofla.cells.registry import register_cell
from dofla.cells.window import takes_window_step, window_part
from dofla.derived import DerivedTensor
from dofla.errors import DoflaError
from dofla.masks import key_mask_from_attention_mask
from dofla.ops import (
    DeltaInputs,
    DeltaState,
    WindowState,
    chunked_gated_delta_rule,
    fla_backend,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)
from dofla.ops.delta.short_conv import causal_depthwise_conv
from dofla.ops.delta.step import DeltaStepWeights, gated_delta_step, output_gated
from dofla.ops.recall_cache import RecallCache
from dofla.ops.state import BatchedState
from dofla.ops.window.step import RingWindow, ring_window, ring_window_step

DEFAULT_BETA = 0.5
MIXES = ("fixed", "adaptive")  # how a hybrid layer mixes window and memory (option ``mix``)
DEFAULT_DELTA_WINDOW_FACTOR = 0.5


@dataclass
class ConvDeltaState(BatchedState):
    """A gated-delta memory with a short convolution (option ``short_conv`` W): the memory and the last
    W - 1 tokens' convolution inputs, ``tail`` (B, W - 1, C) (zeros before the first token)."""

    memory: DeltaState
    tail: Tensor

    @property
    def num_tokens(self) -> int:
        return self.memory.num_tokens


@dataclass
class DeltaHybridState(BatchedState):
    """A hybrid gated-delta layer's state: the window's last keys (and sinks) and the memory; decoding steps
    keep the window as a ``RingWindow`` (``general_layout`` gives the ``WindowState`` back)."""

    window: WindowState | RingWindow
    delta: DeltaState | ConvDeltaState
    recall: RecallCache | None = None  # the recall cache's kept tokens (option recall_cache)

    @property
    def num_tokens(self) -> int:
        return self.delta.num_tokens


@register_cell("gated_delta")
class GatedDeltaAttention(LinearAttention):
    """Gated delta rule memory, alone or mixed with the sliding window (see the module docstring).

    Options: ``decay_memory`` (shortest, longest) initial memories in tokens (default 128, 2048), ``beta``
    the initial write strength in (0, 1) (default 0.5), ``window_factor`` the initial window share gamma
    (default 0.5), ``mix`` "fixed" (gamma per head, the default) or "adaptive" (per token, hybrid only),
    ``mix_lr`` the adaptive mix's learning rate as a multiple of the base one (default 1), ``short_conv``
    the width W of the memory inputs' causal convolution (default 0: none), ``output_gate`` whether a gate
    from the token's value scales the memory's read-out (default false).
    """

    CELL_OPTIONS = (
        "decay_memory",
        "beta",
        "mix",
        "mix_lr",
        "short_conv",
        "output_gate",
        "recall_cache",
        "heavy_hitters",
    )
    requires_nonnegative_features = False
    default_window_factor = DEFAULT_DELTA_WINDOW_FACTOR

    def __init__(self, plan, **shape) -> None:
        super().__init__(plan, **shape)
        shortest, longest = self.cell_options.get("decay_memory", DEFAULT_DECAY_MEMORY)
        beta = float(self.cell_options.get("beta", DEFAULT_BETA))
        if not 0.0 < beta < 1.0:
            raise DoflaError(f"layer {self.layer_index}: beta must lie strictly between 0 and 1, got {beta}.")
        heads = self.state_heads
        self.decay = TokenGate(heads, self.head_dim, initial_gate_logits(heads, shortest, longest))
        self.write = TokenGate(heads, self.head_dim, torch.full((heads,), math.log(beta / (1 - beta))))
        self._kept_step_weights = DerivedTensor()  # see step_weights
        mix = self.cell_options.get("mix", "fixed")
        if mix not in MIXES:
            raise DoflaError(
                f"layer {self.layer_index}: unknown mix {mix!r} for the gated_delta cell; use one of: "
                f"{', '.join(MIXES)}."
            )
        if mix == "adaptive" and self.kind != "hybrid":
            raise DoflaError(
                f"layer {self.layer_index}: mix 'adaptive' mixes the window with the memory; it needs kind "
                "hybrid (a window)."
            )
        self.adaptive_mix = mix == "adaptive"
        self.recall_budget = recall_budget(self, self.cell_options)  # dofla.cells.recall_cache; 0: none
        self.recall_kinds, self.recall_budgets = recall_kinds(self.cell_options)
        self.mix_lr = float(self.cell_options.get("mix_lr", 1.0))
        if not self.mix_lr > 0:
            raise DoflaError(f"layer {self.layer_index}: mix_lr must be positive, got {self.mix_lr}.")
        self.short_conv = self.cell_options.get("short_conv", 0)
        if isinstance(self.short_conv, bool) or not isinstance(self.short_conv, int) or self.short_conv < 0:
            raise DoflaError(
                f"layer {self.layer_index}: short_conv is the width of the memory inputs' convolution in "
                f"tokens, a whole number >= 2 (0: none); got {self.short_conv!r}."
            )
        if self.short_conv == 1:
            raise DoflaError(f"layer {self.layer_index}: short_conv 1 mixes no tokens; use 0 (none) or >= 2.")
        if self.short_conv:  # (W, C): C channels = the grouped query and key features, then the values
            feature_dim = self.feature_map.feature_dim
            channels = heads * ((self.num_heads // heads + 1) * feature_dim + self.head_dim)
            identity = torch.zeros(self.short_conv, channels)
            identity[-1] = 1.0
            self.conv_weight = nn.Parameter(identity)
        self.output_gate = self.cell_options.get("output_gate", False)
        if not isinstance(self.output_gate, bool):
            raise DoflaError(
                f"layer {self.layer_index}: output_gate is true or false, got {self.output_gate!r}."
            )
        if self.output_gate:  # W (Hs, G, Dv, Dv) and b (H, Dv) from 0: the gate starts at 1
            group = self.num_heads // heads
            self.output_gate_weight = nn.Parameter(torch.zeros(heads, group, self.head_dim, self.head_dim))
            self.output_gate_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        if self.adaptive_mix:  # gamma_t's lse weight c (H,) and value weight u (Hs, G, Dv), both from 0
            self.mix_lse_weight = nn.Parameter(torch.zeros(self.num_heads))
            self.mix_value_weight = nn.Parameter(torch.zeros(heads, self.num_heads // heads, self.head_dim))

    def window_share_logits(self, lse: Tensor, values: Tensor) -> Tensor:
        """The adaptive mix's logit of gamma: lse (B, H, T) of the window softmax, values (B, Hs, T, Dv) ->
        (B, H, T). A query that sees no key (lse -inf, only with padding) counts as lse 0."""
        batch, heads, length, value_dim = values.shape
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        by_value = torch.einsum("bstd,sgd->bsgt", values, self.mix_value_weight.to(values.dtype))
        return (
            self.window_factor_logit.to(lse.dtype)[:, None]
            + self.mix_lse_weight.to(lse.dtype)[:, None] * lse
            + by_value.reshape(batch, self.num_heads, length).to(lse.dtype) * value_dim**-0.5
        )

    def gated_read_out(self, memory: Tensor, values: Tensor) -> Tensor:
        """The memory's read-out (B, Hs, G, T, Dv) scaled by the output gate from the tokens' values (B, Hs, T,
        Dv): ``2 sigmoid(v W / sqrt(Dv) + b)`` per query head and channel (option ``output_gate``)."""
        weight, bias = self._output_gate_weights(memory.dtype)
        return output_gated(memory, values.to(memory.dtype), weight, bias)

    def _output_gate_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The output gate's weight (Hs, G, Dv, Dv) scaled by Dv ** -0.5 and bias (Hs, G, 1, Dv) in ``dtype``."""
        weight = self.output_gate_weight.to(dtype) * self.head_dim**-0.5
        return weight, self.output_gate_bias.to(dtype).view(*weight.shape[:2], 1, -1)

    def attend(self, form: str, inputs: AttendInputs):
        parts = self.parts(form, inputs)
        memory, new_memory = parts["memory"], parts["memory_state"]
        if self.kind == "linear":
            return memory, new_memory
        output = parts["gamma"] * parts["window"].to(memory.dtype) + (1 - parts["gamma"]) * memory
        new_state = (
            None
            if new_memory is None
            else DeltaHybridState(window=parts["window_state"], delta=new_memory, recall=parts.get("recall"))
        )
        return output.to(inputs.values.dtype), new_state

    def parts(self, form: str, inputs: AttendInputs, need_lse: bool = False) -> dict:
        """The memory's read-out (B, H, T, Dv) and state; with a window also the window's output (B, H, T, Dv),
        its log-sum-exp (B, H, T; None unless the mix is adaptive or ``need_lse``), its state and gamma
        ((B, H, T, 1) adaptive, else (1, H, 1, 1)), in the memory's dtype; ``inputs.sink_query`` scores the
        window's sinks (see ``edge_sink_query``)."""
        state, values, key_mask = inputs.state, inputs.values, inputs.key_mask
        q_features, k_features = inputs.q_features, inputs.k_features
        memory_state = state.delta if isinstance(state, DeltaHybridState) else state
        tail = None
        if isinstance(memory_state, ConvDeltaState):
            memory_state, tail = memory_state.memory, memory_state.tail
        log_decay = self.decay.log_gate(values, key_mask)  # (B, Hs, T), from the token's own value
        beta = torch.sigmoid(self.write.logits(values))  # (B, Hs, T)
        written = values
        if self.short_conv:
            q_features, k_features, written, tail = self._convolve(
                q_features, k_features, values, tail, key_mask
            )
        q = F.normalize(q_features, dim=-1)  # (B, H, T, K)
        k = F.normalize(k_features, dim=-1)  # (B, Hs, T, K); a map's log scale cancels here
        delta_inputs = DeltaInputs(q, k, written, log_decay, beta, key_mask)
        if form == "naive":
            memory, new_memory = gated_delta_rule(delta_inputs), None
        elif form == "recurrent":
            memory, new_memory = recurrent_gated_delta_rule(delta_inputs, state=memory_state)
        else:
            memory, new_memory = chunked_gated_delta_rule(
                delta_inputs,
                chunk_size=self.chunk_size_for("delta", q.shape[2]),
                initial_state=memory_state,
                return_state=True,
                kernel=fla_backend.gated_delta_kernel(values, q.shape[-1]),  # None unless CUDA with fla
            )
        memory = memory.to(values.dtype)
        if self.output_gate:
            batch, heads, length, value_dim = values.shape
            grouped = memory.view(batch, heads, -1, length, value_dim)  # (B, Hs, G, T, Dv)
            memory = self.gated_read_out(grouped, values).view_as(memory)
        if self.short_conv and new_memory is not None:
            new_memory = ConvDeltaState(new_memory, tail)
        parts = dict(memory=memory, memory_state=new_memory)
        if self.kind == "linear":
            return parts
        window_state = state.window if isinstance(state, DeltaHybridState) else None
        recall = None
        if self.recall_budget:  # the recall cache joins the window's softmax (dofla.cells.recall_cache)
            check_recall_call(self, key_mask)
            recall_state = state.recall if isinstance(state, DeltaHybridState) else None
            window, lse, new_window, recall = window_with_recall_cache(
                self, form, inputs, k, log_decay, beta, memory_state, window_state, recall_state
            )
        elif self.adaptive_mix or need_lse:
            window, lse, new_window = window_part(self, form, inputs, window_state, return_lse=True)
        else:
            window, new_window = window_part(self, form, inputs, window_state)
            lse = None
        if self.adaptive_mix:
            gamma = torch.sigmoid(self.window_share_logits(lse, values))[..., None].to(memory.dtype)
        else:
            gamma = self.window_factor().to(memory.dtype).view(1, -1, 1, 1)  # (1, H, 1, 1)
        return dict(
            parts,
            window=window.to(memory.dtype),
            lse=lse,
            window_state=new_window,
            gamma=gamma,
            recall=recall,
        )

    def _convolve(self, q_features, k_features, values, tail, key_mask):
        """The short convolution (option ``short_conv``) over this call's tokens, continuing ``tail``
        (B, W - 1, C) or zeros: q_features (B, H, T, K), k_features (B, Hs, T, K), values (B, Hs, T, Dv) ->
        the three convolved (float32, float64 for float64 inputs) and the new tail. Channels are laid out as
        a decoding step groups them: each state head's G queries and its key, then the values. Padded
        tokens (``key_mask`` False) enter as zeros."""
        batch, heads, length, key_dim = k_features.shape
        group, value_dim = q_features.shape[1] // heads, values.shape[-1]
        dtype = torch.promote_types(values.dtype, torch.float32)
        width, features_width = self.short_conv, heads * (group + 1) * key_dim
        # the tail, then this call's inputs (B, W - 1 + T, C), each written once into its place
        inputs = values.new_empty(batch, width - 1 + length, features_width + heads * value_dim, dtype=dtype)
        if tail is None:
            inputs[:, : width - 1] = 0.0
        else:
            inputs[:, : width - 1] = tail
        body = inputs[:, width - 1 :]
        grouped = body[..., :features_width].unflatten(
            -1, (heads, group + 1, key_dim)
        )  # (B, T, Hs, G + 1, K)
        grouped[..., :group, :] = q_features.view(batch, heads, group, length, key_dim).permute(0, 3, 1, 2, 4)
        grouped[..., group, :] = k_features.transpose(1, 2)
        body[..., features_width:].unflatten(-1, (heads, value_dim))[:] = values.transpose(1, 2)
        if key_mask is not None:
            body *= key_mask[:, :, None].to(dtype)
        mixed = causal_depthwise_conv(inputs, self.conv_weight.to(dtype), length)  # (B, T, C)
        features, written = mixed.split([features_width, heads * value_dim], -1)
        features = features.view(batch, length, heads, group + 1, key_dim).permute(0, 2, 3, 1, 4)
        q_features = features[:, :, :group].reshape(batch, heads * group, length, key_dim)
        written = written.view(batch, length, heads, -1).transpose(1, 2)  # (B, Hs, T, Dv)
        # the new tail a copy: a view would keep this call's whole input buffer alive in the state
        return q_features, features[:, :, group], written, inputs[:, length:].clone()

    def window_memory_parts(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None, *, scaling=None
    ) -> dict[str, Tensor]:
        """The two halves of a hybrid layer's output on one call without a cache (the chunked form), for
        losses that train them apart (``dofla.distill.losses``): window and memory (B, T, H, Dv), gamma
        (B, T, H, 1) or (1, 1, H, 1), and the window softmax's log-sum-exp ``window_lse`` (B, H, T)
        (computed here for either mix); the output is ``gamma * window + (1 - gamma) * memory``."""
        if self.kind != "hybrid":
            raise DoflaError(f"layer {self.layer_index}: window_memory_parts needs a window (kind hybrid).")
        scaling = self.scaling if scaling is None else float(scaling)
        key_mask = key_mask_from_attention_mask(attention_mask, query.shape[2])
        q_features, k_features, _ = self.features(query, key)
        values = self.state_heads_view(value)
        sink_query = self.edge_sink_query(query, None)  # an uncached call: its tokens from position 0
        inputs = AttendInputs(
            query, key, q_features, k_features, values, None, key_mask, scaling, None, sink_query
        )
        parts = self.parts("chunked", inputs, need_lse=True)
        return dict(
            window=parts["window"].transpose(1, 2),
            memory=parts["memory"].transpose(1, 2),
            gamma=parts["gamma"].transpose(1, 2),
            window_lse=parts["lse"],
        )

    def decode_step(self, step: StepInputs):
        """One token (see ``LinearAttention.decode_step``): the memory's step
        (``dofla.ops.delta.step.gated_delta_step``); with a window, its ring step (``dofla.ops.window.step``)
        mixed in per head."""
        state, query = step.state, step.query
        memory_state = state.delta if isinstance(state, DeltaHybridState) else state
        if self.kind == "hybrid" and not isinstance(state, DeltaHybridState):
            return None
        sinks = self.step_sinks(query, step.edge) if self.kind == "hybrid" else {}
        if self.recall_budget and (
            step.slot is not None or not isinstance(state.recall, RecallCache) or "sink_queries" in sinks
        ):  # frozen decoding steps (dofla.graph_decode), a state without the cache, sinks scored by turned
            return None  # queries: the general forms
        tail = None
        if isinstance(memory_state, ConvDeltaState):
            memory_state, tail = memory_state.memory, memory_state.tail
        if not isinstance(memory_state, DeltaState) or (tail is not None) != bool(self.short_conv):
            return None
        dtype = memory_state.kv.dtype
        if self.kind == "hybrid" and not takes_window_step(self, state.window, dtype):
            return None
        inputs = self.step_features(step, dtype)
        if inputs is None:
            return None
        features, _, values = inputs  # a map's log scale cancels in the normalisation
        output, updated, tail = gated_delta_step(
            self.step_weights(dtype), features, values, memory_state, tail
        )
        new_memory = updated if tail is None else ConvDeltaState(updated, tail)
        batch, heads = query.shape[0], self.state_heads
        if self.kind == "linear":
            return output.view(batch, 1, self.num_heads, -1), new_memory
        group = self.num_heads // heads
        ring = state.window
        if not isinstance(ring, RingWindow):
            ring = ring_window(ring, ring.num_tokens)
        ring_inputs = (
            ring,
            self.step_queries(query),
            self.state_heads_view(step.key).view(batch, heads, self.head_dim),
            values,
        )
        ring_options = dict(scaling=step.scaling, slot=step.slot, **sinks)
        recall = None
        if self.recall_budget:  # the window's softmax over the recall cache too (dofla.cells.recall_cache)
            window, lse, ring, recall = window_step_with_recall_cache(
                self, ring_inputs, updated.kv, state.recall, return_lse=self.adaptive_mix, **ring_options
            )
        elif self.adaptive_mix:
            window, lse, ring = ring_window_step(*ring_inputs, return_lse=True, **ring_options)
        else:
            window, ring = ring_window_step(*ring_inputs, **ring_options)  # (B, Hs, G, Dv)
        if self.adaptive_mix:
            logits = self.window_share_logits(lse.reshape(batch, -1, 1), values[:, :, None])  # (B, H, 1)
            gamma = torch.sigmoid(logits).view(batch, heads, group, 1)
        else:
            gamma = self.step_window_factor()
        output = torch.lerp(output, window.to(output.dtype), gamma)
        new_state = DeltaHybridState(window=ring, delta=new_memory, recall=recall)
        return output.view(batch, 1, self.num_heads, -1), new_state

    def step_weights(self, dtype: torch.dtype) -> DeltaStepWeights:
        """The weights of ``gated_delta_step`` in ``dtype`` (the gates in at least float32), kept between
        calls without autograd until a parameter changes."""
        gate_dtype = torch.promote_types(dtype, torch.float32)
        gates = (self.decay, self.write)

        def build() -> DeltaStepWeights:
            weight = torch.stack([gate.weight for gate in gates], dim=-1).to(gate_dtype)  # (Hs, Dv, 2)
            bias = torch.stack([gate.bias for gate in gates], dim=-1).to(gate_dtype)[:, None, :]  # (Hs, 1, 2)
            conv = self.conv_weight.to(dtype) if self.short_conv else None
            output_gate = self._output_gate_weights(dtype) if self.output_gate else (None, None)
            return DeltaStepWeights(weight * self.head_dim**-0.5, bias, conv, *output_gate)

        parameters = [parameter for gate in gates for parameter in (gate.weight, gate.bias)]
        if self.short_conv:
            parameters.append(self.conv_weight)
        if self.output_gate:
            parameters += [self.output_gate_weight, self.output_gate_bias]
        return self._kept_step_weights.get(parameters, build, dtype)

    def parameter_groups(self, base_lr: float) -> list[dict]:
        groups = super().parameter_groups(base_lr)
        gates = [*self.decay.parameters(), *self.write.parameters()]
        if self.short_conv:
            gates.append(self.conv_weight)
        if self.output_gate:
            gates += [self.output_gate_weight, self.output_gate_bias]
        if self.adaptive_mix:
            mix = [self.mix_lse_weight, self.mix_value_weight]
            groups.append({"params": mix, "lr": float(base_lr) * self.mix_lr, "name": "mix"})
        groups.append({"params": gates, "lr": float(base_lr), "name": "gates"})
        return groups
