"""Token data: packing the user's text (:mod:`dofla.text_files`) into token rows, held-out splits, rows
that repeat spans or state facts, teacher-sampled text.

Text is tokenised in order and only as far as a caller asks (:func:`read_tokens`): a run that needs a
million tokens reads that much of a file of any size, and a text longer than :data:`TOKENIZE_CHARS`
characters reaches the tokenizer in pieces. When no data is given, text is sampled from the teacher itself
(:func:`sample_teacher_texts`) and cached as JSONL, so the same settings give the same text without
sampling again.
"""

from __future__ import annotations

import array
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dofla.errors import DoflaError
from dofla.io import write_text_atomic
from dofla.text_files import TEXT_SUFFIXES, check_data_path, iter_documents, iter_texts, load_texts  # noqa: F401

TOKENIZE_CHARS = 1 << 18  # about the most characters one tokenizer call gets: longer texts go in pieces


def text_pieces(text: str, size: int = TOKENIZE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``size`` characters, each cut before a space or line break
    in its second half where there is one (so words stay whole)."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
        cut = cut if cut > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


@dataclass
class TokenRead:
    """What :func:`read_tokens` read: the token ids, how many texts it took, and whether it read them all."""

    ids: array.array
    texts: int
    complete: bool


def read_tokens(
    tokenizer, texts: Iterable[str | Iterable[str]], *, add_eos: bool = True, limit: int | None = None
) -> TokenRead:
    """The texts' tokens in order (an end-of-text token after each text if ``add_eos``), read until at least
    ``limit`` tokens are there (None: every text); texts are tokenised in batches of about
    :data:`TOKENIZE_CHARS` characters, a longer text in pieces of it. A text may come as an iterable of
    its pieces (:func:`dofla.text_files.iter_documents`), taken only as far as needed."""
    eos = getattr(tokenizer, "eos_token_id", None) if add_eos else None
    ids = array.array("q")
    pieces: list[tuple[str, bool]] = []  # (piece, whether it ends its text), waiting for the tokenizer
    waiting = count = 0
    for count, text in enumerate(texts, start=1):
        parts = [text] if isinstance(text, str) else text  # a text, or a text in pieces
        cut = (piece for part in parts for piece in text_pieces(part, TOKENIZE_CHARS))
        piece = next(cut, None)
        while piece is not None:
            following = next(cut, None)
            pieces.append((piece, following is None))
            waiting += len(piece)
            piece = following
            if waiting >= TOKENIZE_CHARS:
                _tokenise(tokenizer, pieces, eos, ids)
                pieces, waiting = [], 0
                if limit is not None and len(ids) >= limit:
                    return TokenRead(ids, count, False)
    _tokenise(tokenizer, pieces, eos, ids)
    return TokenRead(ids, count, True)


def _tokenise(tokenizer, pieces: list[tuple[str, bool]], eos: int | None, ids: array.array) -> None:
    """Append the pieces' tokens to ``ids`` (one tokenizer call), ``eos`` after each piece that ends a text."""
    if not pieces:
        return
    texts = [piece for piece, _ in pieces]
    for piece_ids, (_, end) in zip(
        tokenizer(texts, add_special_tokens=False)["input_ids"], pieces, strict=True
    ):
        ids.extend(piece_ids)
        if end and eos is not None:
            ids.append(eos)


def token_rows(ids: array.array, length: int) -> torch.Tensor:
    """Token ids cut into rows (N, length), the tail shorter than ``length`` dropped."""
    count = len(ids) // length
    if count == 0:
        return torch.empty((0, length), dtype=torch.long)
    return torch.frombuffer(ids, dtype=torch.int64)[: count * length].clone().view(count, length)


def pack_token_sequences(
    tokenizer, texts: Iterable[str], seq_len: int, *, add_eos: bool = True, max_rows: int | None = None
) -> torch.Tensor:
    """Tokenise texts, join them (an end-of-text token after each if ``add_eos``), cut into (N, seq_len).

    The tail shorter than ``seq_len`` is dropped; with ``max_rows`` the text is read only until that many
    rows are full (and at most that many are returned). Raises DoflaError when not one sequence fits.
    """
    if seq_len < 2:
        raise DoflaError(f"seq_len must be at least 2 tokens, got {seq_len}.")
    limit = None if max_rows is None else max_rows * seq_len
    ids = read_tokens(tokenizer, texts, add_eos=add_eos, limit=limit).ids
    if len(ids) < seq_len:
        raise DoflaError(
            f"the data has {len(ids)} tokens but one sequence needs {seq_len}; give more text or a "
            "shorter sequence length."
        )
    return token_rows(ids, seq_len)[:max_rows]


def rows_of_tokens(ids, lengths: list[int], seq_len: int) -> torch.Tensor:
    """Token ids packed into rows of the longest of ``lengths`` that still gives 2 rows (at least
    ``seq_len``): see :func:`pack_rows`."""
    if len(ids) < seq_len:
        raise DoflaError(
            f"the data has {len(ids)} tokens but one sequence needs {seq_len}; give more text or a "
            "shorter sequence length."
        )
    token_count = len(ids) // seq_len * seq_len
    for length in sorted(lengths, reverse=True):
        if token_count // length >= 2 or length == seq_len:
            break
    rows = token_count // length
    if rows < 2:
        raise DoflaError(
            f"the data packs into only {rows} sequence(s) of {seq_len} tokens; at least 2 are "
            "needed: give more text or a shorter --seq-len."
        )
    return token_rows(ids, length)


def pack_rows(
    tokenizer, texts: Iterable[str], lengths: list[int], seq_len: int, *, max_tokens: int | None = None
) -> torch.Tensor:
    """Texts packed into rows of the longest of ``lengths`` that still gives 2 rows (at least ``seq_len``),
    reading the text only until ``max_tokens`` tokens are there (None: all of it).

    Rows are split into training and held-out rows before anything is cut (:func:`cut_rows`), so held-out
    text at every length is text the student never trained on.
    """
    ids = read_tokens(tokenizer, texts, limit=max_tokens).ids
    return rows_of_tokens(ids if max_tokens is None else ids[:max_tokens], lengths, seq_len)


def cut_rows(rows: torch.Tensor, length: int) -> torch.Tensor:
    """(N, L) -> (N * (L // length), length): each row cut into consecutive pieces, the remainder dropped."""
    pieces = rows.shape[1] // length
    return rows[:, : pieces * length].reshape(-1, length)


REPEAT_SPANS_SEED = 104_729  # offset of repeat_spans' seed from the run's


def min_span_length(gap: int) -> int:
    """The shortest rows :func:`span_placements` can repeat a span of 2 tokens in, ``gap`` tokens later."""
    return max(16, gap + 4)


def span_placements(
    count: int, length: int, fraction: float, *, gap: int, seed: int = 0
) -> list[tuple[int, int, int, int]]:
    """Where :func:`repeat_spans` copies a span in rows (count, length): (row, source, target, span) each.

    ``round(count * fraction)`` rows, seeded; a span of ``length // 8`` tokens (shorter where ``length`` is
    short) from ``source`` is copied to ``target >= source + span + gap``. The rows are drawn from a seed
    stream apart from the trainer's batch order (``torch.randperm`` seeded with the run's seed), which would
    otherwise put every chosen row in a run's first steps.
    """
    if not 0.0 <= fraction <= 1.0:
        raise DoflaError(f"the share of rows with a repeated span must lie in [0, 1], got {fraction}.")
    chosen = round(count * fraction)
    if chosen == 0:
        return []
    span = min(length // 8, (length - gap) // 2)
    if span < 2:
        raise DoflaError(
            f"rows of {length} tokens are too short to repeat a span more than {gap} tokens later; use rows "
            f"of at least {min_span_length(gap)} tokens."
        )
    generator = torch.Generator().manual_seed(REPEAT_SPANS_SEED + seed)
    placements = []
    for row in torch.randperm(count, generator=generator)[:chosen].tolist():
        source = int(torch.randint(0, length - 2 * span - gap + 1, (1,), generator=generator))
        target = int(torch.randint(source + span + gap, length - span + 1, (1,), generator=generator))
        placements.append((row, source, target, span))
    return placements


def repeat_spans(rows: torch.Tensor, fraction: float, *, gap: int, seed: int = 0) -> torch.Tensor:
    """A copy of ``rows`` (N, T) in which a seeded ``fraction`` of the rows repeat a span of their own text.

    In each chosen row a span of ``T // 8`` tokens is copied over a later part of the same row, starting at
    least ``gap`` tokens after the span ends (:func:`span_placements`). Predicting a repeated token then
    means finding its first occurrence, more than ``gap`` tokens back: the recall a window of ``gap``
    tokens cannot do and a linear state must. Rows not chosen are left as they are.
    """
    return copy_spans(rows, span_placements(*rows.shape, fraction, gap=gap, seed=seed))


def copy_spans(rows: torch.Tensor, placements: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """``rows`` with each (row, source, target, span) of ``placements`` copied (a copy; ``rows`` if none)."""
    if not placements:
        return rows
    out = rows.clone()
    for row, source, target, span in placements:
        out[row, target : target + span] = rows[row, source : source + span]
    return out


NEEDLE_SEED = 7_919  # offset of insert_needles' seed from the run's
NEEDLE_NAMES = (
    "secret code",
    "magic number",
    "access code",
    "room number",
    "order number",
    "ticket number",
    "serial number",
    "account number",
    "lucky number",
    "door code",
)  # the pass-key test asks for "the pass key": a name the needles never use


def needle_texts(rng, needles: int) -> tuple[list[str], str]:
    """``needles`` statements (" The magic number is 48213.") and the questions that ask for them all
    (" What is the magic number? The magic number is 48213." ...), in a drawn order; distinct names,
    five-digit keys."""
    names = rng.sample(NEEDLE_NAMES, needles)
    keys = [f"{rng.randrange(10_000, 100_000)}" for _ in names]
    statements = [f" The {name} is {key}." for name, key in zip(names, keys, strict=True)]
    order = rng.sample(range(needles), needles)
    questions = "".join(f" What is the {names[i]}? The {names[i]} is {keys[i]}." for i in order)
    return statements, questions


def insert_needles(
    rows: torch.Tensor, tokenizer, fraction: float, *, gap: int, needles: int = 4, seed: int = 0
) -> torch.Tensor:
    """A copy of ``rows`` (N, T) in which a seeded ``fraction`` of the rows state ``needles`` facts and
    end by asking for each.

    In each chosen row, statements like " The door code is 48213." overwrite the row's text at drawn
    places, one in each of ``needles`` equal slots of the row's first part, and the row's last tokens
    become the questions, each followed by its answer (" What is the door code? The door code is
    48213."). Every statement ends at least ``gap`` tokens before the first question, so answering
    means reading further back than a window of ``gap`` tokens: the retrieval a pass-key test asks
    for, taught on the next-token loss of the answers. Names come from :data:`NEEDLE_NAMES` (never
    "pass key"); keys are random five-digit numbers. Rows not chosen are left as they are.
    """
    import random

    if not 0.0 <= fraction <= 1.0:
        raise DoflaError(f"the share of rows with needles must lie in [0, 1], got {fraction}.")
    count, length = rows.shape
    generator = torch.Generator().manual_seed(NEEDLE_SEED + seed)
    chosen = torch.randperm(count, generator=generator)[: round(count * fraction)].tolist()
    if not chosen:
        return rows
    rng = random.Random(NEEDLE_SEED + seed)
    out = rows.clone()

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=rows.dtype)

    for row in chosen:
        statements, questions = needle_texts(rng, needles)
        tail = ids(questions)
        pieces = [ids(text) for text in statements]
        slot = (length - len(tail) - gap) // needles
        if slot < max(len(piece) for piece in pieces):
            raise DoflaError(
                f"rows of {length} tokens are too short for {needles} needles more than {gap} tokens "
                f"before their questions; use rows of at least {len(tail) + gap + needles * 32} tokens "
                "or a smaller share of needle rows (0 turns them off)."
            )
        for index, piece in enumerate(pieces):
            start = index * slot + rng.randrange(slot - len(piece) + 1)
            out[row, start : start + len(piece)] = piece
        out[row, length - len(tail) :] = tail
    return out


def parse_tokens(text: str | int) -> int:
    """'2M' -> 2_000_000, '500k' -> 500_000, '1e6' -> 1_000_000, 1234 -> 1234."""
    if isinstance(text, int):
        return text
    value = str(text).strip().lower().replace("_", "")
    multiplier = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "b": 1_000_000_000}.get(value[-1:], 1)
    number = value[:-1] if multiplier != 1 else value
    try:
        tokens = int(float(number) * multiplier)
    except ValueError as error:
        raise DoflaError(f"cannot read the token count {text!r}; write e.g. 2M, 500k or 100000.") from error
    return tokens


def row_start_token(model, tokenizer) -> int | None:
    """The token every packed row starts with: the tokenizer's beginning-of-sequence token where the
    teacher's family reads every sequence from one (Gemma), else None (rows are plain text)."""
    from dofla.models import get_adapter

    if tokenizer is None or not get_adapter(model).family.needs_bos:
        return None
    return getattr(tokenizer, "bos_token_id", None)


def start_rows(rows: torch.Tensor, token: int | None) -> torch.Tensor:
    """Rows (N, T) whose first token is ``token`` (a copy; the text's first token of each row gives way, so
    every length stays as it was); None: the rows as they are."""
    if token is None or rows.numel() == 0:
        return rows
    started = rows.clone()
    started[:, 0] = int(token)
    return started


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length")  # where configs say it


def context_length(model) -> int | None:
    """The longest sequence the model's config allows, if it says."""
    config = model.config.get_text_config(decoder=True)
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def split_train_heldout(
    sequences: torch.Tensor, heldout_fraction: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded, disjoint split of sequences (N, T) into (train, heldout); at least one of each."""
    if not 0.0 < heldout_fraction < 1.0:
        raise DoflaError(f"heldout_fraction must lie strictly between 0 and 1, got {heldout_fraction}.")
    count = len(sequences)
    if count < 2:
        raise DoflaError(
            f"the data gives {count} sequence(s); at least 2 are needed to hold some out: give more text."
        )
    heldout = min(count - 1, max(1, round(count * heldout_fraction)))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return sequences[order[heldout:]], sequences[order[:heldout]]


def _model_fingerprint(model) -> str:
    """A short hash naming a model's weights (its name, shapes and a few embedding values)."""
    embedding = model.get_input_embeddings().weight
    digest = hashlib.sha256()
    digest.update(str(getattr(model.config, "_name_or_path", "")).encode())
    digest.update(str(getattr(model.config, "model_type", "")).encode())
    digest.update(str(tuple(embedding.shape)).encode())
    digest.update(embedding.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def sample_teacher_texts(
    model,
    tokenizer,
    num_texts: int,
    max_new_tokens: int,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    *,
    batch_size: int = 8,
    temperature: float = 1.0,
    progress: bool = False,
) -> list[str]:
    """Texts sampled from the teacher itself, starting from its begin-of-text token.

    Cached in ``cache_dir`` (default ``$DOFLA_CACHE/samples``) as JSONL named by a hash of the model and
    the settings; a second call with the same settings reads the file instead of sampling (a damaged
    cache file is sampled again). ``progress`` shows a bar over the texts.
    """
    from dofla.models.loading import cache_root

    if num_texts < 1 or max_new_tokens < 1:
        raise DoflaError(
            f"num_texts and max_new_tokens must be positive, got {num_texts} and {max_new_tokens}."
        )
    settings = {
        "model": _model_fingerprint(model),
        "num_texts": num_texts,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "temperature": temperature,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    cache_path = Path(cache_dir or cache_root() / "samples") / f"teacher-samples-{key}.jsonl"
    if cache_path.is_file():
        try:
            return [
                json.loads(line)["text"]
                for line in cache_path.read_text(encoding="utf-8").split("\n")
                if line
            ]
        except (ValueError, KeyError, TypeError):  # a damaged cache file: dofla's own, so sample again
            pass
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise DoflaError(
            "the tokenizer has neither a begin- nor an end-of-text token to start sampling from."
        )
    from tqdm import tqdm

    device = next(model.parameters()).device
    texts: list[str] = []
    bar = tqdm(
        total=num_texts, disable=not progress, unit="text", desc="sampling text from the teacher", leave=False
    )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        while len(texts) < num_texts:
            count = min(batch_size, num_texts - len(texts))
            prompt = torch.full((count, 1), start, dtype=torch.long, device=device)  # (B, 1)
            generated = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else start,
            )  # (B, 1 + new)
            texts.extend(tokenizer.batch_decode(generated[:, 1:], skip_special_tokens=True))
            bar.update(count)
    bar.close()
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    write_text_atomic(cache_path, lines)
    return texts
