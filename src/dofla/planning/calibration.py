"""The text a plan is measured on (``dofla dof``, ``dofla convert``): a file the user gives, else the real
text shipped with dofla (:data:`dofla.demo.DEMO_TRAIN_TEXT`, 100 C4 web documents), read at once where
sampling text from the teacher took minutes on a CPU."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from dofla.data import pack_token_sequences, row_start_token, start_rows
from dofla.demo import DEMO_TRAIN_TEXT
from dofla.errors import DoflaError
from dofla.text_files import iter_documents

SHIPPED_TEXT_SOURCE = "the web text shipped with dofla (dofla/demo_text/c4_train.jsonl)"


def calibration_texts(path: str | Path | None) -> tuple[Iterable, str]:
    """(the documents at ``path``, else the shipped text's, read only as far as they are taken
    (:func:`dofla.text_files.iter_documents`); a line naming them)."""
    if path is None:
        return iter_documents(DEMO_TRAIN_TEXT), SHIPPED_TEXT_SOURCE
    return iter_documents(path), f"file {path}"


def calibration_rows(
    model, tokenizer, texts: Iterable, source: str, seq_len: int, rows: int, *, what: str
) -> torch.Tensor:
    """``rows`` token rows (rows, seq_len) of ``texts`` (:func:`calibration_texts`, named by ``source``; read
    only until they are full), each started as the teacher's family needs (Gemma's ``<bos>``). ``what``
    names the settings that ask for the rows in the sentence that says the text is too short."""
    if tokenizer is None:
        raise DoflaError("the teacher has no tokenizer, which calibration needs.")
    sequences = pack_token_sequences(tokenizer, texts, seq_len, max_rows=rows)
    if sequences.shape[0] < rows:
        raise DoflaError(
            f"{source} gives {sequences.shape[0]} sequences of {seq_len} tokens, {rows} are needed ({what}); "
            "give more text (--data) or fewer, shorter sequences."
        )
    return start_rows(sequences[:rows], row_start_token(model, tokenizer))
