"""References for the recall cache (tests only): the recall errors from the literal delta-rule loop and the
window's softmax with the cache as one dense mask, each kept set chosen by sorting."""

from __future__ import annotations

import torch
from torch import Tensor

from dofla.ops._checks import compute_dtype, soft_cap


def recall_scores_naive(
    keys: Tensor, values: Tensor, log_decay: Tensor, beta: Tensor, *, window: int, sinks: int
) -> Tensor:
    """Each token's recall error when it leaves the window, from the gated delta rule written out token by
    token: keys (B, Hs, T, K) unit-norm, values (B, Hs, T, Dv), log_decay and beta (B, Hs, T) -> (B, Hs, T)
    float32 indexed by token: ``|| S_{j+W}^T k_j - v_j ||^2`` for token j, -inf for sinks and for tokens
    still in the window at the end."""
    dtype = compute_dtype(keys, values)
    keys, values, log_decay, beta = (tensor.detach().to(dtype) for tensor in (keys, values, log_decay, beta))
    batch, heads, length, key_dim = keys.shape
    memory = keys.new_zeros(batch, heads, key_dim, values.shape[-1])
    identity = torch.eye(key_dim, dtype=dtype, device=keys.device)
    scores = torch.full((batch, heads, length), float("-inf"))
    for t in range(length):
        key = keys[:, :, t, :, None]  # (B, Hs, K, 1)
        a, b = log_decay[:, :, t, None, None].exp(), beta[:, :, t, None, None]
        memory = a * (identity - b * key @ key.transpose(-1, -2)) @ memory + b * key @ values[:, :, t, None]
        leaving = t - window
        if leaving >= sinks:
            recalled = (memory.transpose(-1, -2) @ keys[:, :, leaving, :, None])[..., 0]  # (B, Hs, Dv)
            scores[:, :, leaving] = (recalled - values[:, :, leaving]).square().sum(-1).float()
    return scores


def kept_tokens(scores: Tensor, query_index: int, *, window: int, sinks: int, budgets) -> list[int]:
    """The tokens the cache holds for query ``query_index`` of one head: of those that have left the window
    (sinks excepted), for each score s the ``budgets[s]`` best by (score descending, position ascending),
    together. scores (T, S) by token."""
    left = [j for j in range(sinks, query_index - window + 1) if torch.isfinite(scores[j, 0])]
    kept = set()
    for kind, budget in enumerate(budgets):
        kept.update(sorted(left, key=lambda j: (-float(scores[j, kind]), j))[:budget])
    return sorted(kept)


def recall_cache_window_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    token_scores: Tensor,
    *,
    scaling: float,
    window: int,
    sinks: int,
    budget: int,
    softcap: float | None = None,
    return_lse: bool = False,
    budgets=None,
):
    """The window's softmax over its last ``window`` keys, the first ``sinks`` tokens and the recall cache's
    kept tokens, as one dense mask: query (B, H, T, D), key (B, Hs, T, D), value (B, Hs, T, Dv),
    token_scores (B, Hs, T) each token's recall error (``recall_scores_naive``), or (B, Hs, T, S) S scores
    each keeping ``budgets[s]`` tokens -> (B, H, T, Dv) in value's dtype (with ``return_lse`` also the
    log-sum-exp (B, H, T))."""
    token_scores = token_scores.detach()
    token_scores = token_scores[..., None] if token_scores.dim() == 3 else token_scores
    budgets = (budget,) if budgets is None else tuple(budgets)
    batch, heads, length, _ = key.shape
    group = query.shape[1] // heads
    dtype = compute_dtype(query, key, value)
    visible = torch.zeros(batch, heads, length, length, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for t in range(length):
                for j in range(max(0, t - window + 1), t + 1):
                    visible[b, h, t, j] = True
                for j in range(min(sinks, t + 1)):
                    visible[b, h, t, j] = True
                for j in kept_tokens(token_scores[b, h], t, window=window, sinks=sinks, budgets=budgets):
                    visible[b, h, t, j] = True
    visible = visible.repeat_interleave(group, dim=1)
    keys = key.to(dtype).repeat_interleave(group, dim=1)
    values = value.to(dtype).repeat_interleave(group, dim=1)
    scores = soft_cap(scaling * (query.to(dtype) @ keys.transpose(-1, -2)), softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ values).to(value.dtype)
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out
