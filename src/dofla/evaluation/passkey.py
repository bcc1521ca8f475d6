"""Long-context retrieval: find a pass key hidden at a given depth in filler text.

The standard synthetic test for whether a model can still read far back: a five-digit key is
stated once inside repeated filler, and the model must repeat it when asked at the end. Scoring is
exact match of the greedily generated digits. Deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dofla.errors import DoflaError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyResult:
    context_tokens: int
    depth: float
    accuracy: float
    trials: int


def build_prompt(tokenizer, passkey: str, context_tokens: int, depth: float) -> torch.Tensor:
    """Token ids (1, ~context_tokens) with the key stated at ``depth`` (0 = start, 1 = end) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise DoflaError(f"depth must be between 0 and 1, got {depth}.")
    intro = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it. "
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    filler_ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    fixed = len(tokenizer(intro + needle + QUESTION, add_special_tokens=False)["input_ids"])
    repeats = max(1, (context_tokens - fixed) // max(1, len(filler_ids)))
    before = round(repeats * depth)
    text = intro + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return torch.tensor([ids])


@torch.no_grad()
def passkey_retrieval(
    model,
    tokenizer,
    *,
    context_lengths: Sequence[int] = (256, 1024),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 3,
    seed: int = 0,
) -> list[PasskeyResult]:
    """Exact-match accuracy of the generated key per (context length, depth)."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    results = []
    for context in context_lengths:
        for depth in depths:
            hits = 0
            for _ in range(trials):
                passkey = str(rng.randint(10000, 99999))
                prompt = build_prompt(tokenizer, passkey, context, depth).to(device)
                output = model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=8,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
                answer = tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)
                digits = "".join(ch for ch in answer if ch.isdigit())[:5]
                hits += int(digits == passkey)
            results.append(
                PasskeyResult(context_tokens=context, depth=depth, accuracy=hits / trials, trials=trials)
            )
    return results
