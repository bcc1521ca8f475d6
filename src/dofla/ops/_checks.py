"""Shape checks shared by the three forms, so all of them refuse the same inputs with the same sentence."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.errors import DoflaError
from dofla.ops.inputs import DeltaInputs, HybridInputs, LinearInputs, WindowOptions
from dofla.ops.state import DeltaState


def check_grouped_inputs(
    op: str, names: tuple[str, str, str], q: Tensor, k: Tensor, v: Tensor, hint: str = ""
) -> int:
    """Check an op's queries (B, H, T, X), keys (B, Hk, T, X) and values (B, Hk, T, Dv), named ``names`` in
    the sentences, for ``op`` (what the op is called in them; ``hint`` ends the sentence of a query and key
    that do not match); return the group size H // Hk."""
    q_name, k_name, v_name = names
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise DoflaError(
            f"{op} expects 4-d (batch, heads, tokens, dim) inputs, got {q_name} {tuple(q.shape)}, "
            f"{k_name} {tuple(k.shape)}, {v_name} {tuple(v.shape)}."
        )
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.shape[3] != q.shape[3]:
        raise DoflaError(
            f"{q_name} {tuple(q.shape)} and {k_name} {tuple(k.shape)} must share batch, tokens and last "
            f"dimension{hint}."
        )
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise DoflaError(
            f"{v_name} {tuple(v.shape)} must have the batch, heads and tokens of {k_name} {tuple(k.shape)}."
        )
    if q.shape[1] % k.shape[1] != 0:
        raise DoflaError(
            f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads; "
            "pass key/value tensors with a divisor of the query heads."
        )
    return q.shape[1] // k.shape[1]


def check_linear_inputs(q_features: Tensor, k_features: Tensor, v: Tensor, k_log_scale: Tensor | None) -> int:
    """Check (B, H, T, F), (B, Hk, T, F), (B, Hk, T, Dv), (B, Hk, T); return the group size H // Hk."""
    names = ("q_features", "k_features", "v")
    hint = "; build both with the same feature map"
    group = check_grouped_inputs("linear attention", names, q_features, k_features, v, hint)
    if k_log_scale is not None and tuple(k_log_scale.shape) != tuple(k_features.shape[:3]):
        raise DoflaError(
            f"k_log_scale {tuple(k_log_scale.shape)} must be (batch, kv heads, tokens) = "
            f"{tuple(k_features.shape[:3])}."
        )
    return group


def check_hybrid_inputs(
    query: Tensor, key: Tensor, q_features: Tensor, window: int, window_factor: Tensor
) -> None:
    same_tokens = key.shape[0] == query.shape[0] and key.shape[2] == query.shape[2]
    if (
        tuple(query.shape[:3]) != tuple(q_features.shape[:3])
        or not same_tokens
        or key.shape[3] != query.shape[3]
    ):
        raise DoflaError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must share batch, tokens and head size, "
            f"and query must have the batch, heads and tokens of q_features {tuple(q_features.shape)}."
        )
    if int(window) <= 0:
        raise DoflaError(f"the sliding window must be positive, got {window}.")
    if not torch.is_tensor(window_factor) or tuple(window_factor.shape) != (query.shape[1],):
        raise DoflaError(
            f"window_factor must be a tensor of one factor per query head, shape ({query.shape[1]},), "
            f"got {getattr(window_factor, 'shape', window_factor)}."
        )


def prepare_linear_inputs(inputs: LinearInputs) -> tuple[int, Tensor, Tensor, Tensor | None]:
    """Check one linear call and mask its absent keys (``mask_absent_keys``): returns the group size H // Hk
    and the masked k_features, v and k_log_scale."""
    group = check_linear_inputs(inputs.q_features, inputs.k_features, inputs.v, inputs.k_log_scale)
    return group, *mask_absent_keys(inputs.k_features, inputs.v, inputs.k_log_scale, inputs.key_mask)


def prepare_hybrid_inputs(inputs: HybridInputs, options: WindowOptions) -> tuple[int, int, int, HybridInputs]:
    """Check one hybrid call (its linear part's inputs, its window's, its sink queries) and mask its absent
    keys (``mask_absent_keys``). Returns the group size H // Hk, the window and the number of sinks as
    ints, and the inputs with the masked key features, values and log scales."""
    group = check_linear_inputs(inputs.q_features, inputs.k_features, inputs.v, inputs.k_log_scale)
    check_hybrid_inputs(inputs.query, inputs.key, inputs.q_features, options.window, inputs.window_factor)
    check_sink_query(inputs.query, inputs.sink_query)
    sinks = check_sinks(options.sinks)
    k_features, v, k_log_scale = mask_absent_keys(
        inputs.k_features, inputs.v, inputs.k_log_scale, inputs.key_mask
    )
    masked = replace(inputs, k_features=k_features, v=v, k_log_scale=k_log_scale)
    return group, int(options.window), sinks, masked


def check_sinks(sinks: int) -> int:
    if int(sinks) < 0:
        raise DoflaError(f"the number of attention-sink tokens must be 0 or more, got {sinks}.")
    return int(sinks)


def check_window_inputs(query: Tensor, key: Tensor, v: Tensor, window: int, sinks: int) -> int:
    """Check (B, H, T, D), (B, Hk, T, D), (B, Hk, T, Dv), window > 0, sinks >= 0; return H // Hk."""
    group = check_grouped_inputs("window attention", ("query", "key", "v"), query, key, v)
    if int(window) <= 0:
        raise DoflaError(f"the sliding window must be positive, got {window}.")
    check_sinks(sinks)
    return group


def check_sink_query(query: Tensor, sink_query: Tensor | None) -> None:
    """A sink query (the queries that score the sinks) must have the queries' shape."""
    if sink_query is not None and tuple(sink_query.shape) != tuple(query.shape):
        raise DoflaError(
            f"sink_query {tuple(sink_query.shape)} must have the shape of query {tuple(query.shape)}."
        )


def check_delta_inputs(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor) -> int:
    """Check (B, H, T, K), (B, Hk, T, K), (B, Hk, T, Dv), (B, Hk, T), (B, Hk, T); return H // Hk."""
    group = check_grouped_inputs("the gated delta rule", ("q", "k", "v"), q, k, v)
    for name, gate in (("log_decay", log_decay), ("beta", beta)):
        if tuple(gate.shape) != tuple(k.shape[:3]):
            raise DoflaError(
                f"{name} {tuple(gate.shape)} must be (batch, kv heads, tokens) = {tuple(k.shape[:3])}."
            )
    return group


def check_state_window(state, window: int, sinks: int) -> None:
    """A window or hybrid state continues only a call with its own window and number of sinks."""
    if state.window != int(window) or state.sinks != int(sinks):
        raise DoflaError(
            f"the state was built with window {state.window} and {state.sinks} sinks, this call uses "
            f"window {window} and {sinks} sinks; continue with the settings that built it."
        )


def check_key_mask(key_mask: Tensor, batch: int, length: int) -> Tensor:
    """key_mask (B, T), True = a real token, as a bool tensor."""
    if tuple(key_mask.shape) != (batch, length):
        raise DoflaError(
            f"key_mask must be (batch, tokens) = ({batch}, {length}) with True for real tokens, "
            f"got {tuple(key_mask.shape)}."
        )
    return key_mask.to(torch.bool)


def present_keys(key_mask: Tensor | None, key: Tensor) -> Tensor:
    """(B, Hk, T) bool, True for real tokens: ``key_mask`` (B, T) per key/value head of key (B, Hk, T, D)."""
    batch, num_kv_heads, length, _ = key.shape
    if key_mask is None:
        return torch.ones(batch, num_kv_heads, length, dtype=torch.bool, device=key.device)
    return check_key_mask(key_mask, batch, length)[:, None, :].expand(batch, num_kv_heads, length)


def soft_cap(scores: Tensor, softcap: float | None) -> Tensor:
    """Gemma-2 style logit soft-capping ``c * tanh(s / c)``; the scores unchanged when ``softcap`` is None/0."""
    if not softcap:
        return scores
    return softcap * torch.tanh(scores / softcap)


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (tests' ground truth), else float32 accumulation."""
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def mask_absent_keys(
    k_features: Tensor, v: Tensor, k_log_scale: Tensor | None, key_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Apply ``key_mask`` (B, T) bool, True = a real token: absent keys get zero features and values and
    log scale -inf, which every form (linear part and sliding window alike) treats as "no such key".

    Returns k_features (B, Hk, T, F), v (B, Hk, T, Dv), log scale (B, Hk, T) (None when both inputs were None).
    """
    if key_mask is None:
        return k_features, v, k_log_scale
    batch, _, length, _ = k_features.shape
    present = check_key_mask(key_mask, batch, length)[:, None, :]  # (B, 1, T)
    if k_log_scale is None:
        k_log_scale = torch.zeros(k_features.shape[:3], dtype=torch.float32, device=k_features.device)
    k_log_scale = k_log_scale.masked_fill(~present, float("-inf"))
    k_features = k_features.masked_fill(~present[..., None], 0)
    v = v.masked_fill(~present[..., None], 0)
    return k_features, v, k_log_scale


def stack_tokens(outputs: list[Tensor]) -> Tensor:
    """Per-token outputs (B, Hk, G, Dv) of a token loop -> (B, Hk, G, T, Dv); one token (decoding) needs no copy."""
    return outputs[0].unsqueeze(3) if len(outputs) == 1 else torch.stack(outputs, dim=3)


def prepare_delta_inputs(inputs: DeltaInputs, normalize_keys: bool):
    """Checks, compute dtype, optional key normalisation and masking of absent keys (a = 1, beta = 0).

    Returns group H // Hk, q, k, v, log_decay, beta, all in the compute dtype.
    """
    q, k, v, log_decay, beta, key_mask = (
        inputs.q,
        inputs.k,
        inputs.v,
        inputs.log_decay,
        inputs.beta,
        inputs.key_mask,
    )
    group = check_delta_inputs(q, k, v, log_decay, beta)
    dtype = compute_dtype(q, k, v, log_decay, beta)
    q, k, v, log_decay, beta = (tensor.to(dtype) for tensor in (q, k, v, log_decay, beta))
    if normalize_keys:
        k = F.normalize(k, dim=-1, eps=1e-6)
    if key_mask is not None:
        absent = ~check_key_mask(key_mask, k.shape[0], k.shape[2])[:, None, :]  # (B, 1, T)
        log_decay, beta = log_decay.masked_fill(absent, 0.0), beta.masked_fill(absent, 0.0)
        k, v = k.masked_fill(absent[..., None], 0.0), v.masked_fill(absent[..., None], 0.0)
    return group, q, k, v, log_decay, beta


def initial_delta_kv(state: DeltaState | None, k: Tensor, value_dim: int) -> Tensor:
    """(B, Hk, K, Dv) in k's dtype: the state's memory, or zeros."""
    batch, num_kv_heads, _, key_dim = k.shape
    if state is None:
        return k.new_zeros(batch, num_kv_heads, key_dim, value_dim)
    if tuple(state.kv.shape) != (batch, num_kv_heads, key_dim, value_dim):
        raise DoflaError(
            f"the delta state {tuple(state.kv.shape)} does not fit (batch, kv heads, key dim, value dim) = "
            f"{(batch, num_kv_heads, key_dim, value_dim)}; continue with the state of the same layer."
        )
    return state.kv.to(k.dtype)


def expand_kv_heads(tensor: Tensor | None, group: int) -> Tensor | None:
    """(B, Hk, ...) -> (B, H, ...): query head h reads key/value head h // group."""
    return None if tensor is None else tensor.repeat_interleave(group, dim=1)
