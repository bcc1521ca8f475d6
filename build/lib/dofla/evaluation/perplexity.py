"""Perplexity of a causal LM on packed token sequences."""

from __future__ import annotations

import math

import torch

from dofla.evaluation.logits import final_hidden_states, output_logits, row_chunks


def token_nll(
    model: torch.nn.Module, batch: torch.Tensor, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    """Negative log-likelihood (nats) of every token but the first of ``batch`` (B, T): (B, T-1) float32.

    ``hidden`` (B, T, E): the model's final hidden states for ``batch`` if already computed. The logits
    are made and reduced a few rows at a time (see :mod:`dofla.evaluation.logits`).
    """
    if hidden is None:
        hidden = final_hidden_states(model, batch)
    rows = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (B*(T-1), E)
    targets = batch[:, 1:].reshape(-1).to(rows.device)  # (B*(T-1),)
    nll = torch.empty(targets.shape[0], dtype=torch.float32, device=rows.device)
    vocabulary = model.get_output_embeddings().weight.shape[0]
    for chunk in row_chunks(rows.shape[0], vocabulary):
        log_probs = torch.log_softmax(output_logits(model, rows[chunk]), dim=-1)  # (R, V)
        nll[chunk] = -log_probs.gather(-1, targets[chunk, None]).squeeze(-1)
    return nll.view(batch.shape[0], -1)


def perplexity(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    *,
    batch_size: int = 4,
) -> dict[str, float]:
    """Token-weighted next-token perplexity over sequences (N, T) of token ids.

    Every position but the first of each sequence is predicted once. Returns ``perplexity`` (exp of
    ``nll``), ``nll`` (mean negative log-likelihood in nats per token) and ``tokens`` (predicted tokens).
    Runs without gradients on the model's device; the logits are scored in float32, a chunk of rows at a
    time. A mean NLL too large for ``exp`` gives an infinite perplexity.
    """
    if sequences.dim() != 2 or sequences.shape[1] < 2:
        raise ValueError(f"sequences must be (N, T) with T >= 2, got shape {tuple(sequences.shape)}")
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for batch in sequences.split(batch_size):
            nll = token_nll(model, batch)  # (B, T-1)
            total_nll += float(nll.double().sum())
            total_tokens += nll.numel()
    mean_nll = total_nll / total_tokens
    return {"perplexity": exp_or_inf(mean_nll), "nll": mean_nll, "tokens": float(total_tokens)}


def exp_or_inf(nll: float) -> float:
    """exp(nll), infinite where it overflows and NaN for NaN (math.exp raises on overflow)."""
    if math.isnan(nll):
        return math.nan
    return math.exp(nll) if nll < 709.0 else math.inf
