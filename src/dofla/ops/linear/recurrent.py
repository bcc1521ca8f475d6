"""Linear attention's recurrent form (decoding), one token at a time; semantics in ``dofla.ops``."""

from __future__ import annotations

from torch import Tensor

from dofla.ops._checks import compute_dtype, prepare_linear_inputs, stack_tokens
from dofla.ops.inputs import LinearInputs
from dofla.ops.linear.step import linear_decode_step, log_scale_or_zeros
from dofla.ops.state import LinearState


def recurrent_linear_attention(
    inputs: LinearInputs, *, state: LinearState | None = None, eps: float = 1e-6
) -> tuple[Tensor, LinearState]:
    """Causal linear attention token by token.

    inputs: the call's tensors (shapes in ``LinearInputs``; absent keys take no part, see ``dofla.ops``);
    state from an earlier call (recurrent or chunked with return_state=True) or None. Returns out
    (B, H, T, Dv) in v's dtype and the state after the T tokens (float32, or float64 inputs).
    """
    q_features = inputs.q_features
    group, k_features, v, k_log_scale = prepare_linear_inputs(inputs)
    dtype = compute_dtype(q_features, k_features, v, k_log_scale)
    batch, num_heads, length, feature_dim = q_features.shape
    num_kv_heads, value_dim = k_features.shape[1], v.shape[-1]
    if state is None:
        state = LinearState.empty(batch, num_kv_heads, feature_dim, value_dim, q_features.device, dtype)
    q = q_features.to(dtype).view(batch, num_kv_heads, group, length, feature_dim)  # (B, Hk, G, T, F)
    k, values = k_features.to(dtype), v.to(dtype)
    log_scale = log_scale_or_zeros(k_log_scale, k_features, dtype)  # (B, Hk, T)
    outputs = []
    for t in range(length):
        output, state = linear_decode_step(
            state, q[:, :, :, t], k[:, :, t], values[:, :, t], log_scale[:, :, t], eps
        )
        outputs.append(output)  # (B, Hk, G, Dv)
    out = stack_tokens(outputs).reshape(batch, num_heads, length, value_dim)
    return out.to(v.dtype), state
