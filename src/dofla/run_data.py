"""The run's data policy: which token rows train, which are held out, at which lengths, and what the
training and LoRA rows repeat or state beyond the window (:class:`RunData`, :func:`prepare_data`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dofla import data
from dofla.data import (
    context_length,
    cut_rows,
    insert_needles,
    pack_rows,
    read_tokens,
    repeat_spans,
    row_start_token,
    rows_of_tokens,
    split_train_heldout,
    start_rows,
)
from dofla.distill import distributed
from dofla.distill.curriculum import check_schedule_context
from dofla.errors import DoflaError
from dofla.run_config import LinearizeConfig

DEFAULT_EVAL_LENGTHS = (1024, 2048)


@dataclass
class RunData:
    """The run's token rows: training (N, T) at the training length, held-out rows at every length."""

    train: torch.Tensor
    heldout_by_length: dict[int, torch.Tensor]
    seq_len: int
    skipped_lengths: list[int]  # asked for, but the data was too short
    source: str  # a sentence saying where the text came from
    rows: torch.Tensor  # (N, T) every packed row, before the split (what a caller may pass back as sequences)
    # a length curriculum's shorter stages: {length: (M, length)} cut from the training rows only
    shorter_train: dict[int, torch.Tensor] = field(default_factory=dict)
    # the LoRA stage's rows where --lora-seq-len differs from the training length, cut from the same rows
    lora_train: torch.Tensor | None = None

    @property
    def heldout(self) -> torch.Tensor:
        return self.heldout_by_length[self.seq_len]


def prepare_data(
    config: LinearizeConfig, model, tokenizer, sequences, cache_dir: Path, *, whole_data: bool = False
) -> RunData:
    """Training rows at ``data.seq_len`` (and at a length curriculum's shorter lengths) and held-out rows
    at every evaluation length, split before cutting: no training row holds held-out text.

    sequences (N, T): rows given by the caller; else the text of ``data.path`` (or sampled from the
    teacher, cached in ``cache_dir``) packed into the longest evaluation length it fills twice, read only
    as far as the run needs (:func:`tokens_needed`; all of it with ``whole_data``).
    """
    seq_len = config.data.seq_len
    limit = context_length(model)
    check_schedule_context(config.distill.length_schedule, limit)
    if limit is not None and seq_len > limit:
        raise DoflaError(
            f"--seq-len {seq_len} is beyond the model's context of {limit} tokens; use at most {limit}."
        )
    lengths = evaluation_lengths(config, limit)
    rank = distributed.rank_and_world_size()[0]
    if sequences is None:  # under torchrun rank 0 reads (or samples) the text and shares the packed rows
        rows, source = (None, "")
        if rank == 0:
            rows, source = data_rows(config, model, tokenizer, lengths, cache_dir, whole=whole_data)
        sequences = distributed.share_tensor(rows)
    else:
        source = f"{len(sequences)} packed sequences given by the caller"
        if sequences.shape[1] > (limit or sequences.shape[1]):
            raise DoflaError(f"sequences of {sequences.shape[1]} tokens exceed the context of {limit}.")
        if sequences.shape[1] < seq_len:
            raise DoflaError(
                f"the given sequences have {sequences.shape[1]} tokens, fewer than --seq-len {seq_len}."
            )
    token = row_start_token(model, tokenizer)  # every row starts with it where the family needs one (Gemma)
    if config.data.heldout_path is None:
        train_rows, heldout_rows = split_train_heldout(sequences, config.data.heldout_fraction, config.seed)
    else:  # held-out text of another source: every training row trains
        train_rows, heldout_rows = sequences, heldout_rows_from(config, tokenizer, lengths)
        source += f"; held-out text: {config.data.heldout_path}"
    heldout_rows = heldout_rows[: config.data.heldout_sequences]
    heldout_by_length = {
        length: start_rows(cut_rows(heldout_rows, length), token)
        for length in lengths
        if length <= heldout_rows.shape[1]
    }
    skipped = [length for length in lengths if length not in heldout_by_length]
    if skipped:
        warnings.warn(
            f"the data is too short for held-out rows of {skipped} tokens; those lengths are not "
            f"evaluated (give more text with {'--heldout-data' if config.data.heldout_path else '--data'})",
            stacklevel=2,
        )
    shorter_train = {
        length: start_rows(with_recall(config, cut_rows(train_rows, length)), token)
        for length, _ in config.distill.length_schedule or ()
        if length < seq_len
    }
    train = start_rows(with_recall(config, cut_rows(train_rows, seq_len)), token)
    lora_length = lora_seq_len(config)
    lora_train = None
    if config.lora.enabled and lora_length != seq_len:
        if lora_length > train_rows.shape[1]:
            raise DoflaError(
                f"--lora-seq-len {lora_length} is longer than the packed rows ({train_rows.shape[1]} tokens, the "
                "longest of --seq-len and --eval-lengths the data fills twice); add it to --eval-lengths or "
                "give more text."
            )
        lora_train = start_rows(with_recall(config, cut_rows(train_rows, lora_length)), token)
    if config.data.recall_fraction > 0:
        source += (
            f"; {config.data.recall_fraction:.0%} of the training rows repeat a span of their own text "
            f"at least {recall_gap(config)} tokens later (--recall-fraction)"
        )
    return RunData(train, heldout_by_length, seq_len, skipped, source, sequences, shorter_train, lora_train)


def heldout_rows_from(config: LinearizeConfig, tokenizer, lengths: list[int]) -> torch.Tensor:
    """The held-out rows (N, L) of ``data.heldout_path``'s text, packed at the longest of ``lengths`` it
    fills twice, read only as far as ``data.heldout_sequences`` rows need (rank 0 reads it and shares the
    rows under torchrun)."""
    if tokenizer is None:
        raise DoflaError(
            "--heldout-data is text, which needs the teacher's tokenizer; give a teacher with one."
        )
    rows = None
    if distributed.rank_and_world_size()[0] == 0:
        limit = (max(config.data.heldout_sequences, 2) + 1) * max(lengths)
        read = read_tokens(tokenizer, data.iter_documents(config.data.heldout_path), limit=limit)
        rows = rows_of_tokens(read.ids[:limit], lengths, config.data.seq_len)
    return distributed.share_tensor(rows)


def tokens_needed(config: LinearizeConfig, lengths: list[int]) -> int:
    """How many tokens of ``data.path`` a run reads: rows of the longest of ``lengths`` enough for the
    training's (and the LoRA stage's) tokens and, split by ``data.heldout_fraction``, for
    ``data.heldout_sequences`` held-out rows, plus one row; the rest of the text is never read."""
    longest = max(lengths)
    train_rows = math.ceil(
        max(config.distill.tokens, config.lora.tokens if config.lora.enabled else 0) / longest
    )
    rows = train_rows
    if config.data.heldout_path is None:
        fraction = config.data.heldout_fraction
        rows = max(
            math.ceil(train_rows / (1 - fraction)), math.ceil(config.data.heldout_sequences / fraction)
        )
    return (max(rows, 2) + 1) * longest


def evaluation_lengths(config: LinearizeConfig, limit: int | None) -> list[int]:
    """The held-out lengths: the training length and ``evaluate.lengths`` (default 1024 and 2048 where the
    teacher's context allows them; a length given explicitly beyond the context is an error naming both)."""
    if config.evaluate.lengths is None:
        extra = [length for length in DEFAULT_EVAL_LENGTHS if limit is None or length <= limit]
    else:
        extra = [int(length) for length in config.evaluate.lengths]
        beyond = [length for length in extra if limit is not None and length > limit]
        if beyond:
            raise DoflaError(
                f"evaluation length {beyond[0]} is beyond the teacher's context of {limit} tokens; "
                f"use lengths of at most {limit}."
            )
    return sorted({config.data.seq_len, *extra})


def data_rows(
    config: LinearizeConfig, model, tokenizer, lengths: list[int], cache_dir: Path, *, whole: bool = False
) -> tuple[torch.Tensor, str]:
    """The run's packed rows (:func:`dofla.data.rows_of_tokens`) and a sentence saying where their text came
    from: ``data.path`` read as far as :func:`tokens_needed` (to its end with ``whole``), else text sampled
    from the teacher."""
    settings = config.data
    if settings.path is None:
        texts = data.sample_teacher_texts(
            model,
            tokenizer,
            num_texts=settings.sampled_texts,
            max_new_tokens=settings.sampled_tokens,
            seed=config.seed,
            cache_dir=cache_dir,
            batch_size=min(32, settings.sampled_texts),  # one generate call for small samples
        )
        source = (
            f"{len(texts)} texts of up to {settings.sampled_tokens} tokens sampled from the teacher itself "
            f"(seed {config.seed}, cached in {cache_dir})"
        )
        return pack_rows(tokenizer, texts, lengths, settings.seq_len), source
    limit = None if whole else tokens_needed(config, lengths)
    read = read_tokens(tokenizer, data.iter_documents(settings.path), limit=limit)
    rows = rows_of_tokens(read.ids if limit is None else read.ids[:limit], lengths, settings.seq_len)
    if read.complete:
        return rows, f"{settings.path} ({read.texts} texts)"
    return rows, f"{settings.path} (read as far as the {limit:,} tokens this run needs)"


def trained_length(config: LinearizeConfig) -> int:
    """The longest rows the students train on: the training length, or the LoRA stage's where longer."""
    return max(config.data.seq_len, lora_seq_len(config) if config.lora.enabled else 0)


def lora_seq_len(config: LinearizeConfig) -> int:
    """The LoRA stage's row length: ``lora.seq_len``, else the training length."""
    return config.lora.seq_len or config.data.seq_len


def recall_gap(config: LinearizeConfig) -> int:
    """How many tokens lie at least between a span and its repeat: the window's length."""
    return config.plan.window


def with_recall(config: LinearizeConfig, rows: torch.Tensor) -> torch.Tensor:
    """Training rows with ``data.recall_fraction`` of them repeating a span beyond the window
    (:func:`dofla.data.repeat_spans`)."""
    return repeat_spans(rows, config.data.recall_fraction, gap=recall_gap(config), seed=config.seed)


def lora_rows(config: LinearizeConfig, tokenizer, train: torch.Tensor) -> torch.Tensor:
    """The LoRA stage's rows: the training rows with ``lora.needle_fraction`` of them stating facts that
    their last tokens ask for, more than the window back (:func:`dofla.data.insert_needles`); a row's
    first token (the beginning-of-sequence token where the family needs one) stays."""
    needled = insert_needles(
        train, tokenizer, config.lora.needle_fraction, gap=recall_gap(config), seed=config.seed
    )
    needled[:, 0] = train[:, 0]
    return needled
