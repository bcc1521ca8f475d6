"""What each op's forms read, as bundles passed whole: the tensors of one call (``DeltaInputs``,
``GatedDeltaNetInputs``, ``LinearInputs``, ``WindowInputs``, ``HybridInputs``) and the op's fixed options (``WindowOptions``, ``HybridOptions``), so that
the naive, chunked and recurrent forms of an op share one signature and each default is written once, as
the cells' ``dofla.cell_inputs`` bundles do one level up."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class DeltaInputs:
    """One call of the gated delta rule (``dofla.ops.delta``): ``q`` (B, H, T, K), ``k`` (B, Hk, T, K), ``v``
    (B, Hk, T, Dv), ``log_decay`` (B, Hk, T) <= 0, ``beta`` (B, Hk, T) in (0, 1); ``key_mask`` (B, T), True
    for real tokens, or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    log_decay: Tensor
    beta: Tensor
    key_mask: Tensor | None = None


@dataclass
class GatedDeltaNetInputs:
    """One call of the gated delta net (``dofla.ops.gated_delta_net``): ``mixed`` (B, T, C) the projected q,
    k, v; ``conv_weight`` (C, W) the short convolution's taps; ``log_decay`` (B, T, Hv) <= 0; ``beta``
    (B, T, Hv) in (0, 1); ``key_mask`` (B, T), True for real tokens, or None."""

    mixed: Tensor
    conv_weight: Tensor
    log_decay: Tensor
    beta: Tensor
    key_mask: Tensor | None = None


@dataclass
class LinearInputs:
    """One call of linear attention (``dofla.ops.linear``): ``q_features`` (B, H, T, F) and ``k_features``
    (B, Hk, T, F) >= 0, ``v`` (B, Hk, T, Dv), ``k_log_scale`` (B, Hk, T) or None (all 0); ``key_mask``
    (B, T), True for real tokens, or None."""

    q_features: Tensor
    k_features: Tensor
    v: Tensor
    k_log_scale: Tensor | None = None
    key_mask: Tensor | None = None


@dataclass
class WindowInputs:
    """One call of sliding-window softmax attention (``dofla.ops.window``): ``query`` (B, H, T, D), ``key``
    (B, Hk, T, D) after rotary, ``v`` (B, Hk, T, Dv); ``key_mask`` (B, T), True for real tokens, or None;
    ``sink_query`` (B, H, T, D) the queries that score the sinks, or None (the queries)."""

    query: Tensor
    key: Tensor
    v: Tensor
    key_mask: Tensor | None = None
    sink_query: Tensor | None = None


@dataclass
class HybridInputs:
    """One call of hybrid attention (``dofla.ops.hybrid``): ``query``, ``key``, ``v``, ``key_mask`` and
    ``sink_query`` as in ``WindowInputs``; ``q_features`` (B, H, T, F) and ``k_features`` (B, Hk, T, F) >= 0,
    ``k_log_scale`` (B, Hk, T) or None, as in ``dofla.ops.linear``; ``window_factor`` (H,) the window's
    share gamma in (0, 1) per query head."""

    query: Tensor
    key: Tensor
    q_features: Tensor
    k_features: Tensor
    v: Tensor
    window_factor: Tensor
    k_log_scale: Tensor | None = None
    key_mask: Tensor | None = None
    sink_query: Tensor | None = None


@dataclass(frozen=True)
class WindowOptions:
    """How the sliding-window softmax of the window and hybrid ops scores (semantics in ``dofla.ops``):
    ``scaling`` the logit scale, ``window`` the keys a query sees (> 0), ``sinks`` the attention-sink keys
    (>= 0) and ``softcap`` the teacher's logit soft-capping (Gemma-2), or None."""

    scaling: float
    window: int
    sinks: int = 0
    softcap: float | None = None


@dataclass(frozen=True)
class HybridOptions(WindowOptions):
    """The window's options and ``eps``, the floor of the mixed normaliser (see ``dofla.ops``)."""

    eps: float = 1e-6
