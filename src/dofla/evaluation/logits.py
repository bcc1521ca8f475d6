"""Next-token scores without materialising (B, T, V) logits.

A forward of a causal LM's base model gives the final hidden states (B, T, E), small next to the logits
(E = 576 against V = 49,152 for SmolLM2: 85 times smaller). The output head then runs on a few rows at
a time, in float32, and each chunk of log-probabilities is reduced (negative log-likelihood, KL, top-1)
before the next is made. This is what keeps evaluating 32 x 1,024 tokens within memory and fast: one
(4, 1024, 49152) float32 logits tensor alone is 800 MB.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

ROW_ELEMENTS = 1 << 23  # logits per chunk (32 MiB in float32): rows per chunk = ROW_ELEMENTS // vocabulary


def final_hidden_states(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The hidden states the output head reads (after the final norm): (B, T, E), no cache kept."""
    device = next(model.parameters()).device
    mask = None if attention_mask is None else attention_mask.to(device)
    output = model.base_model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False)
    return output.last_hidden_state


def output_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits for hidden states (..., E), in float32, with its final soft-capping (Gemma 2/3)."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def available_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """Memory free now on ``device``: a CUDA device's free memory, else the host's MemAvailable
    (``/proc/meminfo``, Linux); None where unknown."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rows_per_piece(vocabulary: int, copies: int = 1, device: torch.device | str | None = None) -> int:
    """How many rows of ``vocabulary``-wide float32 tensors a piece holds, ``copies`` of them alive at once
    (logits, softmaxes, their gradients): at most :data:`ROW_ELEMENTS` per copy, and at most a sixteenth of
    the memory free now on ``device`` (default: the host) between all copies; at least one row."""
    elements = ROW_ELEMENTS
    free = available_memory_bytes(device)
    if free is not None:
        elements = min(elements, free // (16 * 4 * max(1, copies)))
    return max(1, elements // max(1, vocabulary))


def row_chunks(rows: int, vocabulary: int) -> Iterator[slice]:
    """Slices of ``rows`` so that one chunk's (rows, vocabulary) float32 logits stay near 32 MiB (less where
    memory is short, :func:`rows_per_piece`)."""
    step = rows_per_piece(vocabulary)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


@torch.no_grad()
def kl_from_teacher(
    teacher_log_probs: torch.Tensor, teacher_probs: torch.Tensor, log_probs: torch.Tensor
) -> torch.Tensor:
    """KL(teacher || row) per row, (R,) float32, from (R, V) log-probabilities; ``log_probs`` is overwritten.

    sum_v p_v (log p_v - log q_v) with terms where p_v = 0 counting 0, clamped at 0 (rounding can take
    an exact 0 a hair below). The difference is written into ``log_probs`` and reduced by one dot product
    per row (no (R, V) product or mask is made); a row whose dot product is not finite (a q_v of 0 where
    p_v = 0 gives 0 * inf) is summed again with the masked terms.
    """
    teacher_probs = teacher_probs.to(log_probs.device)
    difference = torch.sub(teacher_log_probs.to(log_probs.device), log_probs, out=log_probs)  # (R, V)
    divergence = torch.linalg.vecdot(teacher_probs, difference)  # (R,)
    broken = ~torch.isfinite(divergence)
    if bool(broken.any()):
        terms = teacher_probs[broken] * difference[broken]
        divergence[broken] = torch.where(teacher_probs[broken] > 0, terms, 0.0).sum(-1)
    return divergence.clamp_min(0.0)


def vocabulary_size(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
