"""Reading the user's text: documents from a file or folder, one at a time, as far as the caller reads.

Accepted inputs for :func:`iter_texts` and :func:`load_texts`:

- ``.txt``: if the file has a blank line anywhere, each blank-line-separated block is one document;
  otherwise each non-empty line is one document (one-article-per-line files).
- ``.jsonl``: one JSON object per line with a ``"text"`` field.
- ``.json``: an array of strings, of ``{"text": ...}`` records, or of alpaca-style records
  (``instruction``, ``input``, ``output`` joined by blank lines).
- a folder saved by ``datasets.Dataset.save_to_disk`` (needs the ``datasets`` package) with a ``text``
  column, or a folder of ``.txt`` / ``.jsonl`` / ``.json`` files (read in name order).

``.txt`` and ``.jsonl`` files are read line by line and a folder file by file, so a caller that stops
early (a run that has the tokens it needs) never reads the rest; whether a ``.txt`` file has a blank line
is found by a scan in pieces of 1 MiB that keeps nothing, and a line of a one-text-per-line file is read
in pieces of 1 MiB (:func:`iter_documents`). A ``.json`` array, a ``.jsonl`` line and a blank-line
separated block are read whole.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

from dofla.errors import DoflaError

TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
_ALPACA_FIELDS = ("instruction", "input", "output")
_SCAN_BYTES = 1 << 20  # the blank-line scan reads this much at a time
_SPACE = b" \t\r\n\f\v"
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_BOM = b"\xef\xbb\xbf"
_LINE_BYTES = 1 << 20  # a longer line of a one-text-per-line file is read in pieces of this many bytes


def _decoded(raw: bytes, path: Path, offset: int, start: int = 0, end: int | None = None) -> str:
    """``raw[start:end]`` (``raw`` being the bytes at ``offset`` of ``path``) as text, without a copy of the
    bytes; binary or non-UTF-8 content is refused with the offending position in the file."""
    end = len(raw) if end is None else end
    nul = raw.find(bytes(1), start, end)
    if nul >= 0:
        raise DoflaError(
            f"{path} holds a NUL byte at offset {offset + nul}: it is binary data, not text; give a UTF-8 "
            "text file."
        )
    try:
        return str(memoryview(raw)[start:end], "utf-8")
    except UnicodeDecodeError as error:
        where = start + error.start
        raise DoflaError(
            f"{path} is not UTF-8 text (byte 0x{raw[where]:02x} at offset {offset + where}); "
            "convert it to UTF-8, e.g. with iconv."
        ) from None


def _lines(path: Path) -> Iterator[str]:
    """The file's lines as text, without their line ending (``\\n`` or ``\\r\\n``), read one at a time; a
    leading byte-order mark is dropped."""
    with path.open("rb") as file:
        offset = 0
        for raw in file:
            start = len(_BOM) if offset == 0 and raw.startswith(_BOM) else 0
            end = len(raw) - (2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0)
            yield _decoded(raw, path, offset, start, end)
            offset += len(raw)


def _has_blank_line(path: Path) -> bool:
    """Whether a line holding nothing but spaces lies between two lines of text, found by reading the file in
    pieces (a byte-order mark and blank lines before the first or after the last text do not count); a
    file unchanged since its last scan (size and time) is not scanned again."""
    stat = path.stat()
    return _scan_for_blank_line(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _scan_for_blank_line(path: Path, size: int, modified_ns: int) -> bool:
    seen_text, carry = False, b""
    with path.open("rb") as file:
        if file.read(len(_BOM)) != _BOM:
            file.seek(0)
        piece = file.read(_SCAN_BYTES)
        while piece:
            piece = carry + piece
            body = piece.rstrip(_SPACE)  # ends with text, or is empty
            if body:
                start = 0 if seen_text else len(body) - len(body.lstrip(_SPACE))  # from the first text
                if _BLANK_LINE.search(body, start):
                    return True
                seen_text = True
            trailing = piece[len(body) :]  # what matters of it for the next piece: a blank line, a newline
            carry = b"\n\n" if _BLANK_LINE.search(trailing) else b"\n" if b"\n" in trailing else b""
            carry = carry if seen_text else b""
            piece = file.read(_SCAN_BYTES)
    return False


def _missing_bytes(raw: bytes) -> int:
    """How many bytes the last UTF-8 character of ``raw`` lacks (0 if it is whole)."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character starts here
            size = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
            return max(0, size - back)
    return 0


def _long_line(file, raw: bytes, offset: int, start: int, path: Path) -> Iterator[str]:
    """The text of a line longer than :data:`_LINE_BYTES` whose first bytes are ``raw`` (at ``offset``), in
    pieces read from ``file`` as they are taken, stripped at both ends like a short line."""
    pending, began = "", False  # white space kept only if text follows it; whether text has begun
    while True:
        ends = raw.endswith(b"\n") or len(raw) < _LINE_BYTES  # a line break or the end of the file
        if not ends:
            raw += file.read(_missing_bytes(raw))  # a character cut in two: its other bytes
        end = len(raw) - (2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0)
        text = _decoded(raw, path, offset, start, end)
        text = text if began else text.lstrip()
        began = began or bool(text)
        body = text.rstrip()
        if body:
            yield pending + body
            pending = text[len(body) :]
        else:
            pending += text
        if ends:
            return
        offset, start = offset + len(raw), 0
        raw = file.readline(_LINE_BYTES)


def _line_documents(path: Path) -> Iterator[str | Iterator[str]]:
    """Each non-empty line of the file, stripped: a string, or for a line longer than :data:`_LINE_BYTES`
    an iterator over its text in pieces, read only as far as they are taken."""
    with path.open("rb") as file:
        if file.read(len(_BOM)) != _BOM:  # a leading byte-order mark is dropped
            file.seek(0)
        while True:
            offset = file.tell()
            raw = file.readline(_LINE_BYTES)
            if not raw:
                return
            if raw.endswith(b"\n") or len(raw) < _LINE_BYTES:
                end = len(raw) - (2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0)
                if stripped := _decoded(raw, path, offset, 0, end).strip():
                    yield stripped
                continue
            pieces = _long_line(file, raw, offset, 0, path)
            first = next(pieces, None)
            if first is not None:  # else the line held only white space
                yield itertools.chain([first], pieces)
            for _ in pieces:  # what the caller left of the line, before the next one
                pass


def _read_txt(path: Path) -> Iterator[str | Iterator[str]]:
    if not _has_blank_line(path):
        yield from _line_documents(path)
        return
    block: list[str] = []
    finished = None  # the last finished block, yielded once another starts (the file's last one is stripped)
    for line in _lines(path):
        if line.strip():
            block.append(line if block or finished is not None else line.lstrip())
        elif block:
            if finished is not None:
                yield finished
            finished, block = "\n".join(block), []
    if block:
        if finished is not None:
            yield finished
        finished = "\n".join(block)
    if finished is not None:
        yield finished.rstrip()


def _read_jsonl(path: Path) -> Iterator[str]:
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DoflaError(
                f"{path} line {number} is not valid JSON ({error.msg}); fix that line."
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DoflaError(
                f'{path} line {number} has no string "text" field; every line must be {{"text": "..."}}.'
            )
        yield record["text"]


def _record_text(record: object, path: Path, index: int) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        parts = [str(record[name]) for name in _ALPACA_FIELDS if record.get(name)]
        if parts:
            return "\n\n".join(parts)
    raise DoflaError(
        f'{path} record {index} has neither a "text" field nor instruction/input/output fields; '
        "give records with one of those."
    )


def _read_json(path: Path) -> Iterator[str]:
    raw = path.read_bytes()
    start = len(_BOM) if raw.startswith(_BOM) else 0
    try:
        records = json.loads(_decoded(raw, path, 0, start))
    except json.JSONDecodeError as error:
        raise DoflaError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}); fix the file."
        ) from None
    if not isinstance(records, list):
        raise DoflaError(f"{path} must hold a JSON array of records; for one record per line use .jsonl.")
    for index, record in enumerate(records):
        yield _record_text(record, path, index)


def _read_saved_dataset(folder: Path) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DoflaError(
            f"{folder} is a folder saved by `datasets`, which is not installed; `pip install datasets` or "
            "export the text to .txt/.jsonl."
        ) from None
    dataset = datasets.load_from_disk(str(folder))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    if "text" not in dataset.column_names:
        raise DoflaError(
            f"the dataset in {folder} has no 'text' column (columns: {', '.join(dataset.column_names)})."
        )
    for batch in dataset.select_columns(["text"]).iter(batch_size=256):
        yield from (str(text) for text in batch["text"])


def _read_texts(path: Path) -> Iterator[str]:
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            yield from _read_saved_dataset(path)
            return
        files = sorted(item for item in path.iterdir() if item.is_file() and item.suffix in TEXT_SUFFIXES)
        if not files:
            raise DoflaError(f"the folder {path} holds no .txt, .jsonl or .json files; put the text there.")
        for item in files:
            yield from _read_texts(item)
        return
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".json": _read_json}
    if path.suffix not in readers:
        raise DoflaError(f"data file {path} has suffix {path.suffix!r}; use .txt, .jsonl or .json.")
    yield from readers[path.suffix](path)


def iter_documents(path: str | Path) -> Iterator[str | Iterator[str]]:
    """The documents of a text file, JSONL/JSON file or folder (see the module docstring), one at a time and
    read only as far as the caller takes them: each a string, or an iterator over its text in pieces (a
    line of a one-text-per-line ``.txt`` longer than 1 MiB, read as the pieces are taken). Texts that are
    empty or only white space are left out, and data holding no text is refused once read to its end."""
    path = Path(path).expanduser()
    found = False
    try:
        for document in _read_texts(path):
            if not isinstance(document, str) or document.strip():
                found = True
                yield document
    except OSError as error:
        where = error.filename or path
        raise DoflaError(
            f"cannot read the data {where}: {error.strerror or error}; check its permissions."
        ) from None
    if not found:
        raise DoflaError(f"{path} holds no text (every record is empty); give a file with text in it.")


def iter_texts(path: str | Path) -> Iterator[str]:
    """The documents of :func:`iter_documents`, each as one string."""
    for document in iter_documents(path):
        yield document if isinstance(document, str) else "".join(document)


def load_texts(path: str | Path) -> list[str]:
    """Every document of a text file, JSONL/JSON file or folder (:func:`iter_texts`, read to the end)."""
    check_data_path(path)
    return list(iter_texts(path))


def check_data_path(path: str | Path | None, option: str = "--data") -> None:
    """Refuse, before any work, a data path that is empty (an unset shell variable: it would name the current
    folder), missing, neither a file nor a folder (a FIFO or device would block or never end), unreadable,
    or holding no text before its end (an empty folder or mount point, a file of empty records): its first
    document is read. None: no data given."""
    if path is None:
        return
    if not str(path).strip():
        raise DoflaError(
            f"{option} is empty (an unset shell variable?); give a .txt, .jsonl or .json file or a folder, or "
            f"leave {option} out."
        )
    path = Path(path).expanduser()
    if not path.exists():
        raise DoflaError(f"data path {path} does not exist; pass a .txt, .jsonl or .json file or a folder.")
    if not (path.is_file() or path.is_dir()):
        raise DoflaError(
            f"data path {path} is neither a file nor a folder (a pipe or device); save the text to a file."
        )
    documents = iter_documents(path)
    next(documents)  # refuses data that cannot be read or holds no text
    documents.close()
