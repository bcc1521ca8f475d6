"""The ``gated_delta_net`` cell: exactly transformers' ``Qwen3_5GatedDeltaNet`` (Qwen3.5's linear-attention
layer), so a model whose converted layers are all this cell can be written as a standard ``qwen3_5_text``
checkpoint (:mod:`dofla.export`) that transformers, vLLM, SGLang and llama.cpp run without dofla.

Unlike the other cells it does not read the teacher's q, k, v (they carry rotary positions, which the
Qwen3.5 layer has none of): it reads the hidden states entering the attention module (handed over by the
conversion's pre-hook as ``pending_hidden_states``) and has its own projections, as the Qwen3.5 layer does:
``in_proj_qkv`` to q (H x D), k (H x D), v (H x D); a depthwise causal convolution of width W (option
``conv_size``, default 4) with SiLU over them; q and k L2-normalised (q also scaled by D ** -0.5); the
decay ``g = -exp(A_log) softplus(a + dt_bias)`` and the write strength ``beta = sigmoid(b)`` from their own
projections ``in_proj_a``, ``in_proj_b``; the gated delta rule (:mod:`dofla.ops.gated_delta_net`); the
read-out RMS-normalised per head, times ``norm.weight`` and ``silu(z)`` with z from ``in_proj_z``. The
teacher's output projection follows, by reference (it is the Qwen3.5 layer's ``out_proj``).

Initialisation from the teacher's attention module: ``in_proj_qkv`` holds its q, k, v weights (key/value
heads repeated for grouped-query attention; biases, which the Qwen3.5 layer has not, are dropped), the
convolution passes each token's own inputs scaled by ``conv_scale`` (the normalisations remove the scale
from q and k, so it sets how far SiLU is from linear there), ``in_proj_a`` and ``in_proj_b`` start at 0 (a
constant decay per head, with memories ``1 / (1 - a)`` spread geometrically over ``decay_memory`` tokens,
and beta = 1/2), and ``in_proj_z`` is the teacher's value projection times ``gate_scale`` with the read-out
norm's weight ``output_scale / gate_scale`` (the output follows ``silu(gate_scale v) / gate_scale`` of the
token's values v, between ``silu(v)`` and ``relu(v)``, times ``output_scale``, until training finds its own
gate). The defaults of ``conv_scale`` (0.05: SiLU near linear, so the stored values keep their sign),
``gate_scale`` (4), ``decay_memory`` (64 to 1,024 tokens) and ``projection_lr`` (1) are the start that
trained best on SmolLM2-135M (docs/results/export/portable_150k/ and portable_projected/), not the one
closest to the teacher before training (conv_scale 4, gate_scale 16, memories 4 to 64:
``experiments/gated_delta_net_init.py``, docs/results/export/); ``output_scale`` (0.1) is the start closest
in size (relative error).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dofla.attention import LinearAttention
from dofla.cells.registry import register_cell
from dofla.errors import DoflaError
from dofla.masks import key_mask_from_attention_mask
from dofla.ops.gated_delta_net import (
    GatedDeltaNetInputs,
    GatedDeltaNetShape,
    GatedDeltaNetState,
    chunked_gated_delta_net,
    gated_delta_net,
    gated_delta_net_step,
    recurrent_gated_delta_net,
)
from dofla.ops.gated_delta_net.common import empty_state

DEFAULT_CONV_SIZE = 4
# the start that trained best on SmolLM2-135M (docs/results/export/portable_150k/, portable_projected/)
DEFAULT_DECAY_MEMORY = (64.0, 1024.0)
DEFAULT_CONV_SCALE = 0.05
DEFAULT_GATE_SCALE = 4.0
DEFAULT_OUTPUT_SCALE = 0.1  # the start closest in size: experiments/gated_delta_net_init.py
PROJECTION_LR = 1.0  # the projections copied from the teacher train at this multiple of the base rate


class GatedRMSNorm(nn.Module):
    """Qwen3.5's ``Qwen3_5RMSNormGated``: ``weight * x / rms(x) * silu(gate)`` over the last dimension, the
    normalisation in float32 (float64 for float64 inputs), the product with ``weight`` in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = float(eps)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        wide = torch.promote_types(dtype, torch.float32)
        x = x.to(wide)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.to(wide))).to(dtype)


def decay_bias(memories: Tensor) -> Tensor:
    """dt_bias giving the decay ``a = 1 - 1 / memory`` with A_log = 0 and a zero ``a`` projection:
    ``softplus(dt_bias) = -log(a)``."""
    rate = -torch.log1p(-1.0 / memories)
    return rate + torch.log(-torch.expm1(-rate))  # the inverse of softplus


@register_cell("gated_delta_net")
class GatedDeltaNet(LinearAttention):
    """Qwen3.5's gated delta net layer (see the module docstring), built from the teacher's attention module
    with :meth:`from_teacher_attention`. Kind "linear" only (no window).

    Options: ``conv_size`` W (default 4), ``decay_memory`` (shortest, longest) initial memories in tokens
    (default 64, 1024), ``conv_scale`` the convolution's initial tap on the token itself (default 0.05),
    ``gate_scale`` the factor on the teacher's value projection that starts ``in_proj_z`` (default 4),
    ``output_scale`` the read-out norm's initial weight times ``gate_scale`` (default 0.1), ``projection_lr``
    the multiple of the base learning rate the projections copied from the teacher train at (default 1).
    """

    CELL_OPTIONS = ("conv_size", "decay_memory", "conv_scale", "gate_scale", "output_scale", "projection_lr")
    uses_features = False
    reads_hidden_states = True  # the conversion's pre-hook hands it the layer's hidden states

    def __init__(self, plan, *, hidden_size: int, rms_norm_eps: float = 1e-6, **shape) -> None:
        if plan.kind != "linear":
            raise DoflaError(
                "the gated_delta_net cell is Qwen3.5's linear-attention layer and has no window: use kind "
                "linear with it."
            )
        super().__init__(plan, **shape)
        conv_size = self.cell_options.get("conv_size", DEFAULT_CONV_SIZE)
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 1:
            raise DoflaError(
                f"layer {self.layer_index}: conv_size is the convolution's width in tokens, a whole number "
                f">= 1; got {conv_size!r}."
            )
        heads, size = self.num_heads, self.head_dim
        self.shape = GatedDeltaNetShape(heads, size, heads, size)
        channels = self.shape.channels
        self.hidden_size = int(hidden_size)
        self.in_proj_qkv = nn.Linear(self.hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, heads * size, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, conv_size, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(size, rms_norm_eps)
        self.projection_lr = float(self.cell_options.get("projection_lr", PROJECTION_LR))
        if not self.projection_lr > 0:
            raise DoflaError(
                f"layer {self.layer_index}: projection_lr must be positive, got {self.projection_lr}."
            )
        self.pending_hidden_states: Tensor | None = None  # set and cleared by dofla.convert's hooks
        self._initialise_gates()

    def _initialise_gates(self) -> None:
        """A constant decay per head over ``decay_memory`` and beta 1/2, the convolution passing each token's
        own inputs times ``conv_scale``; the projections are the teacher's (``from_teacher_attention``)."""
        shortest, longest = self.cell_options.get("decay_memory", DEFAULT_DECAY_MEMORY)
        if not 1.0 < float(shortest) <= float(longest):
            raise DoflaError(
                f"layer {self.layer_index}: decay_memory must be (shortest, longest) tokens with "
                f"1 < shortest <= longest, got ({shortest}, {longest})."
            )
        scale = float(self.cell_options.get("conv_scale", DEFAULT_CONV_SCALE))
        if not scale > 0:
            raise DoflaError(f"layer {self.layer_index}: conv_scale must be positive, got {scale}.")
        memories = torch.logspace(
            math.log10(shortest), math.log10(longest), self.num_heads, dtype=torch.float64
        )
        with torch.no_grad():
            self.dt_bias.copy_(decay_bias(memories).float())
            self.A_log.zero_()
            self.in_proj_a.weight.zero_()
            self.in_proj_b.weight.zero_()
            self.conv1d.weight.zero_()
            self.conv1d.weight[:, 0, -1] = scale

    @classmethod
    def from_teacher_attention(cls, plan, module: nn.Module, **shape) -> GatedDeltaNet:
        """The cell for ``module`` (a transformers attention with separate ``q_proj``, ``k_proj``, ``v_proj``)
        initialised from its weights, as the module docstring says."""
        projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if not all(isinstance(projection, nn.Linear) for projection in projections):
            raise DoflaError(
                f"the gated_delta_net cell starts from the teacher's q_proj, k_proj and v_proj; "
                f"{type(module).__name__} has no such separate projections: use another cell."
            )
        query, key, value = (projection.weight.detach() for projection in projections)
        config = getattr(module, "config", None)
        eps = getattr(config, "rms_norm_eps", None) or 1e-6
        cell = cls(plan, hidden_size=query.shape[1], rms_norm_eps=float(eps), **shape)
        group = cell.num_heads // cell.num_kv_heads

        def per_query_head(weight: Tensor) -> Tensor:  # (Hkv * D, hidden) -> (H * D, hidden)
            return (
                weight.view(cell.num_kv_heads, -1, weight.shape[-1]).repeat_interleave(group, 0).flatten(0, 1)
            )

        gate = float(cell.cell_options.get("gate_scale", DEFAULT_GATE_SCALE))
        scale = float(cell.cell_options.get("output_scale", DEFAULT_OUTPUT_SCALE))
        if not (gate > 0 and scale > 0):
            raise DoflaError(
                f"layer {cell.layer_index}: gate_scale and output_scale must be positive, got {gate} and {scale}."
            )
        with torch.no_grad():
            weights = torch.cat([query, per_query_head(key), per_query_head(value)])
            cell.in_proj_qkv.weight.copy_(weights.to(cell.in_proj_qkv.weight.dtype))
            cell.in_proj_z.weight.copy_((gate * per_query_head(value)).to(cell.in_proj_z.weight.dtype))
            cell.norm.weight.fill_(
                scale / gate
            )  # silu(gate z) / gate: the gate's shape, not its size, changes
        return cell.to(query.device)

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
        """The layer's output (B, T, H, D) before the teacher's output projection, from the hidden states
        the conversion's pre-hook handed over (the teacher's query, key and value give only the call's
        shape and dtype). ``form`` as in ``LinearAttention.forward``; with a cache layer the state
        continues, one token at a time through the one-token step."""
        hidden = self.pending_hidden_states
        length = query.shape[2]
        if hidden is None or hidden.shape[:2] != (query.shape[0], length):
            raise DoflaError(
                f"layer {self.layer_index}: the gated_delta_net cell reads the hidden states entering its "
                "attention module; run it through the converted model, not on q, k, v alone."
            )
        if form is not None and form not in ("naive", "chunked", "recurrent"):
            raise DoflaError(f"unknown attention form {form!r}; use one of naive, chunked, recurrent.")
        cache_layer = self.take_cache_layer()
        state = None if cache_layer is None else cache_layer.state
        if form == "naive" and state is not None:
            raise DoflaError("the naive form cannot continue from a cache state; use chunked or recurrent.")
        key_mask = key_mask_from_attention_mask(attention_mask, length)
        output, new_state = self.mix(hidden, key_mask, form, state)
        if cache_layer is not None:
            cache_layer.state = new_state
        return output.to(query.dtype)

    def mix(
        self, hidden: Tensor, key_mask: Tensor | None, form: str | None, state: GatedDeltaNetState | None
    ) -> tuple[Tensor, GatedDeltaNetState | None]:
        """hidden (B, T, hidden) -> the gated, normalised read-out (B, T, H, D) and the new state (None for
        the naive form). Padded tokens (``key_mask`` False) enter as zeros and leave the memory unchanged."""
        if key_mask is not None:  # as Qwen3.5 zeroes padded tokens' hidden states
            hidden = hidden * key_mask[:, :, None].to(hidden.dtype)
        batch, length, _ = hidden.shape
        mixed = self.in_proj_qkv(hidden)  # (B, T, C)
        gate = self.in_proj_z(hidden).view(batch, length, self.num_heads, self.head_dim)
        beta = torch.sigmoid(self.in_proj_b(hidden))  # (B, T, H)
        log_decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        conv_weight = self.conv1d.weight[:, 0]  # (C, W)
        inputs = GatedDeltaNetInputs(mixed, conv_weight, log_decay, beta, key_mask)
        if form is None:
            form = "recurrent" if state is not None and length <= self.decode_tokens else "chunked"
        if form == "naive":
            core, new_state = gated_delta_net(inputs, self.shape), None
        elif form == "recurrent" and length == 1 and key_mask is None:  # decoding: the one-token step
            start = empty_state(mixed, conv_weight.shape[1], self.shape) if state is None else state
            core, new_state = gated_delta_net_step(
                mixed[:, 0], conv_weight, log_decay[:, 0], beta[:, 0], start, self.shape
            )
            core = core[:, None].to(mixed.dtype)
        elif form == "recurrent":
            core, new_state = recurrent_gated_delta_net(inputs, self.shape, state=state)
        else:
            chunk_size = self.chunk_size_for("delta", length)
            core, new_state = chunked_gated_delta_net(inputs, self.shape, state=state, chunk_size=chunk_size)
        return self.norm(core, gate), new_state

    def parameter_groups(self, base_lr: float) -> list[dict]:
        projections = [self.in_proj_qkv.weight, self.in_proj_z.weight]
        chosen = {id(parameter) for parameter in projections}
        rest = [parameter for parameter in self.parameters() if id(parameter) not in chosen]
        return [
            {"params": projections, "lr": float(base_lr) * self.projection_lr, "name": "projections"},
            {"params": rest, "lr": float(base_lr), "name": "gates"},
        ]
