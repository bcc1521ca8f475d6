"""Causal attention ops, one folder per operation: ``linear`` (linear attention), ``window`` (sliding-window
softmax with sinks), ``hybrid`` (the two mixed in one normalisation), ``delta`` (the gated delta rule),
``gated_delta_net`` (Qwen3.5's gated delta net) and ``recall_cache`` (kept tokens read in the window's
softmax).

Each folder holds the operation's forms, with identical semantics and one signature (the call's tensors
and the op's options each as one bundle of ``dofla.ops.inputs``): ``naive`` (the quadratic reference, every
pair written out; tests only), ``chunked`` (training and prefill), ``recurrent`` (decoding, any number of
tokens) and ``step`` (one token, in the fewest operators: generation, and the frozen decoding steps that a
CUDA graph replays or ``torch.compile`` traces). States from the chunked form continue in the recurrent
form and back. Shared here: the states (``state``), the inputs' checks, the sinks' bookkeeping (``sinks``),
the chunk sizes (``chunk_sizes``), the fla kernels (``fla_backend``) and compiling a whole decoding step
(``compiled``).

Semantics of the linear, window and hybrid ops (the gated delta rule's are in ``dofla.ops.delta``):

Linear attention. Key j's features are ``phi(k_j) * exp(s_j)`` with s = ``k_log_scale`` (0 when None).
For query i let ``m_i = max_{j<=i} s_j`` (the running maximum, which the states keep as their offset), and
``a_ij = phi(q_i).phi(k_j) * exp(s_j - m_i)`` for j <= i. Then
``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)``.
Dividing by ``exp(m_i)`` changes nothing but the size of eps relative to the sums: eps is measured against
the largest-scaled key, so it is independent of how large the log scales are (scale-robust), and it only
matters when all features of a query are (nearly) orthogonal to those of its keys (e.g. ReLU features).

Hybrid attention (LoLCATs). Query i's softmax set is W_i = the keys j in (i - window, i] plus the sinks
j <= i (below). Keys in W_i get ``gamma_h * exp(scaling q_i.k_j - c_i)`` with ``c_i`` the maximum of
``scaling q_i.k_j`` over W_i; the other keys j <= i (older than the window, not sinks) get
``(1 - gamma_h) * phi(q_i).phi(k_j) * exp(s_j - m_i)`` where here ``m_i`` is the maximum of s_j over those
linear-part keys (the running maximum over the keys that have left the window, which is the hybrid
state's linear offset). ``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)``. Both parts are thus normalised by
their own maximum, as LoLCATs does: the relative scale of the two parts is what gamma and the feature maps
learn.

Window attention. Plain softmax over W_i: ``out_i = sum_{j in W_i} exp(scaling q_i.k_j - c_i) v_j /
sum_{j in W_i} exp(scaling q_i.k_j - c_i)`` (no eps; 0 when W_i is empty).

Attention sinks (``sinks`` = S >= 0). The first S present keys of the sequence (without padding: the keys
at positions 0 .. S-1) are in the softmax set of every query i >= j, however far back, and never in the
linear part. The count is per batch row and key/value head and runs from the start of the sequence
across calls (states carry it); absent keys do not count, so left padding gives the unpadded outputs.
S = 0 is plain sliding-window (hybrid) attention.

Sinks seen by other queries (``sink_query``, same shape as the queries, None: the queries). The sinks'
scores are ``scaling sink_query_i.k_j`` (soft-capped as the rest) instead of ``scaling q_i.k_j``; nothing
else changes. The attention module passes its queries turned back to the window's edge (position
``min(t, window + sinks)``), so that the sinks sit just before every window, where the teacher saw them
in training, instead of ever further away.

Absent keys (padding). ``key_mask`` (B, T), True for real tokens, gives absent keys log scale -inf (and
zero features and values): they take part nowhere, neither in the linear sums nor in the window. A key
whose given log scale is -inf is absent in the same way. A query with no present key returns 0.
"""

from dofla.ops.delta import (
    DeltaInputs,
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
    update_delta_state,
)
from dofla.ops.hybrid import (
    HybridInputs,
    HybridOptions,
    chunked_hybrid_attention,
    empty_hybrid_state,
    hybrid_attention,
    recurrent_hybrid_attention,
)
from dofla.ops.linear import (
    LinearInputs,
    chunked_linear_attention,
    linear_attention,
    recurrent_linear_attention,
    update_linear_state,
)
from dofla.ops.state import DeltaState, HybridState, LinearState, WindowState, exp_relative
from dofla.ops.window import (
    WindowInputs,
    WindowOptions,
    chunked_window_attention,
    recurrent_window_attention,
    window_attention,
)

__all__ = [
    "DeltaInputs",
    "DeltaState",
    "HybridInputs",
    "HybridOptions",
    "HybridState",
    "LinearInputs",
    "LinearState",
    "WindowInputs",
    "WindowOptions",
    "WindowState",
    "chunked_gated_delta_rule",
    "chunked_hybrid_attention",
    "chunked_linear_attention",
    "chunked_window_attention",
    "empty_hybrid_state",
    "exp_relative",
    "gated_delta_rule",
    "hybrid_attention",
    "linear_attention",
    "recurrent_gated_delta_rule",
    "recurrent_hybrid_attention",
    "recurrent_linear_attention",
    "recurrent_window_attention",
    "update_delta_state",
    "update_linear_state",
    "window_attention",
]
