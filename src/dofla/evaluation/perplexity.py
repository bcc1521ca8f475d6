"""Perplexity of a causal LM on packed token sequences."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def perplexity(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    *,
    batch_size: int = 4,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Token-weighted next-token perplexity over sequences (N, T) of token ids.

    Every position but the first of each sequence is predicted once. Returns ``perplexity`` (exp of
    ``nll``), ``nll`` (mean negative log-likelihood in nats per token) and ``tokens`` (predicted tokens).
    Runs without gradients; the logits are scored in float32.
    """
    if sequences.dim() != 2 or sequences.shape[1] < 2:
        raise ValueError(f"sequences must be (N, T) with T >= 2, got shape {tuple(sequences.shape)}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for batch in sequences.split(batch_size):
            batch = batch.to(device)  # (B, T)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
            targets = batch[:, 1:]  # (B, T-1)
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
            total_nll += float(nll)
            total_tokens += targets.numel()
    mean_nll = total_nll / total_tokens
    return {"perplexity": math.exp(mean_nll), "nll": mean_nll, "tokens": float(total_tokens)}
