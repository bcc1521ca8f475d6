"""A length curriculum for distillation: shorter training sequences first, then the full length.

A schedule is a list of ``(length, share)`` stages, shortest first, ending at the training length; each
stage trains on ``share`` of the token budget. A stage's batch holds about as many tokens as a batch at
the full length (``batch_size * full // length`` sequences, rounded down to a multiple of the processes
that slice it), so every optimiser step sees about the same number of tokens and activation memory stays
at most that of the full length. The learning-rate schedule spans all stages' steps. Steps are counted
over the whole run and a step's stage and batch follow from the step alone (:func:`stage_at`), so a
resumed run continues in the right stage at the right batch.

Without a schedule there is one stage: the training rows at their own length, ``batch_size`` sequences
per step, ``ceil(tokens / (batch_size * length))`` steps, exactly the run without a curriculum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dofla.errors import DoflaError

FLAG = "--length-schedule"
EXAMPLE = "256:0.5,512:0.5"


@dataclass(frozen=True)
class LengthStage:
    """One stage: its training rows (N, length), sequences per step, steps, and where it starts."""

    length: int
    share: float
    rows: torch.Tensor  # (N, length) token ids
    batch_size: int
    steps: int
    first_step: int  # the run's step count when the stage starts
    tokens_before: int  # tokens trained in the stages before it

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.length

    def tokens_after(self, step: int) -> int:
        """Tokens trained once the run has taken ``step`` steps (a step of this stage or its end)."""
        return self.tokens_before + (step - self.first_step) * self.tokens_per_step

    def summary(self) -> dict:
        """What result.json records of the stage."""
        return dict(
            length=self.length,
            share=self.share,
            batch_size=self.batch_size,
            steps=self.steps,
            tokens=self.steps * self.tokens_per_step,
            sequences=len(self.rows),
        )


def check_length_schedule(schedule: Sequence[Sequence] | None, seq_len: int | None = None) -> None:
    """Refuse a schedule that is not increasing lengths with positive shares summing to 1, ending at
    ``seq_len`` (when given); one sentence each. An empty or None schedule is no curriculum."""
    if not schedule:
        return
    for stage in schedule:
        if len(stage) != 2:
            raise DoflaError(f"each stage of {FLAG} is a (length, share) pair like {EXAMPLE}, got {stage!r}.")
    lengths = [stage[0] for stage in schedule]
    shares = [stage[1] for stage in schedule]
    short = [length for length in lengths if length < 2]
    if short:
        raise DoflaError(f"every length of {FLAG} must be at least 2 tokens, got {short[0]}.")
    if any(later <= earlier for earlier, later in zip(lengths, lengths[1:], strict=False)):
        raise DoflaError(
            f"the lengths of {FLAG} must increase, shortest first, got {lengths}; e.g. {EXAMPLE}."
        )
    bad = [share for share in shares if not (math.isfinite(share) and share > 0)]
    if bad:
        raise DoflaError(f"every share of {FLAG} must be a positive fraction of --tokens, got {bad[0]}.")
    if abs(sum(shares) - 1) > 1e-6:
        raise DoflaError(
            f"the shares of {FLAG} must sum to 1, got {sum(shares):g} ({', '.join(map(str, shares))}); "
            f"e.g. {EXAMPLE}."
        )
    if seq_len is not None and lengths[-1] != seq_len:
        raise DoflaError(
            f"the last length of {FLAG} must be the training length {seq_len} (--seq-len), got {lengths[-1]}; "
            f"end the schedule with {seq_len}:SHARE."
        )


def check_schedule_context(schedule: Sequence[Sequence] | None, limit: int | None) -> None:
    """Refuse a stage longer than the teacher's maximum positions ``limit`` (None: no limit known)."""
    beyond = [stage[0] for stage in schedule or () if limit is not None and stage[0] > limit]
    if beyond:
        raise DoflaError(
            f"length {beyond[0]} of {FLAG} is beyond the teacher's context of {limit} tokens; use lengths of "
            f"at most {limit}."
        )


def stage_token_budgets(shares: Sequence[float], tokens: int) -> list[int]:
    """Each stage's whole tokens of ``tokens``: rounded shares, the last stage taking the remainder."""
    budgets = [round(share * tokens) for share in shares[:-1]]
    return [*budgets, max(0, tokens - sum(budgets))]


def length_stages(
    schedule: Sequence[Sequence] | None,
    train: torch.Tensor,
    tokens: int,
    batch_size: int,
    *,
    shorter_rows: Mapping[int, torch.Tensor] | None = None,
    divisor: int = 1,
) -> list[LengthStage]:
    """The run's stages. train (N, T): the rows at the full length T, which the schedule must end at.

    shorter_rows: ``{length: (M, length)}`` rows for the shorter stages (the pipeline cuts them from the
    training rows before they were cut to T, so nothing is lost at lengths that do not divide T); a length
    not given is cut from ``train``. divisor: a shorter stage's batch is a multiple of it (the processes
    that slice each batch). Without a schedule: one stage, exactly the run without a curriculum.
    """
    from dofla.data import cut_rows

    full = train.shape[1]
    if not schedule:
        return [LengthStage(full, 1.0, train, batch_size, math.ceil(tokens / (batch_size * full)), 0, 0)]
    check_length_schedule(schedule, full)
    shorter_rows = shorter_rows or {}
    budgets = stage_token_budgets([share for _, share in schedule], tokens)
    stages: list[LengthStage] = []
    first_step = tokens_before = 0
    for (length, share), budget in zip(schedule, budgets, strict=True):
        if length == full:
            rows, batch = train, batch_size
        else:
            rows = shorter_rows[length] if length in shorter_rows else cut_rows(train, length)
            batch = max(divisor, batch_size * full // length // divisor * divisor)
        if rows.dim() != 2 or rows.shape[1] != length or len(rows) == 0:
            raise DoflaError(
                f"the training rows for length {length} of {FLAG} have shape {tuple(rows.shape)}; they need "
                f"at least one row of {length} tokens."
            )
        steps = math.ceil(budget / (batch * length))
        stages.append(LengthStage(length, share, rows, batch, steps, first_step, tokens_before))
        first_step += steps
        tokens_before += steps * batch * length
    return stages


def stage_at(stages: Sequence[LengthStage], step: int) -> LengthStage:
    """The stage that trains step ``step`` (counted from 0 over the whole run)."""
    for stage in stages:
        if step < stage.first_step + stage.steps:
            return stage
    return stages[-1]


def tokens_after(stages: Sequence[LengthStage], steps: int) -> int:
    """Tokens trained in the run's first ``steps`` steps."""
    if steps == 0:
        return 0
    return stage_at(stages, steps - 1).tokens_after(steps)
