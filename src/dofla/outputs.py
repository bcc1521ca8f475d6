"""Output folders: dofla writes only into folders it made, and never deletes a file it did not write.

Every output folder dofla makes carries a marker file, ``.dofla`` (JSON: ``{"made_by": "dofla", "kind":
...}``, plus the list of files for a saved model). :func:`check_output_folder` refuses, before any work,
an ``--out`` that is a file, that holds files but no marker (``thesis.txt`` is never touched), that is
another kind of dofla output, or that is an input or holds one (the teacher's own folder, a parent of
``--data``). :func:`output_lock` keeps two dofla processes from writing one folder at once. Replacing
dofla's own earlier output needs an explicit ``overwrite`` (``--overwrite``), and even then only files
named in the marker or in dofla's fixed layout are removed (:func:`remove_known_files`).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dofla.errors import DoflaError
from dofla.io import is_temporary_name, remove_stale_temporaries, write_json_atomic

MARKER_FILE = ".dofla"
LOCK_SUFFIX = ".dofla-lock"

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the other checks still apply
    fcntl = None


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The marker of a folder dofla wrote, or None when it has none (or an unreadable one)."""
    path = Path(folder) / MARKER_FILE
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("made_by") == "dofla" else None


def write_marker(folder: str | Path, kind: str, **fields: Any) -> Path:
    return write_json_atomic(Path(folder) / MARKER_FILE, {"made_by": "dofla", "kind": kind, **fields})


def _is_dofla_bookkeeping(name: str) -> bool:
    """The marker, lock files and temporaries dofla leaves beside or inside its outputs."""
    return name == MARKER_FILE or name.endswith(LOCK_SUFFIX) or is_temporary_name(name)


def user_entries(folder: str | Path) -> list[str]:
    """Names in ``folder`` other than dofla's marker, locks and temporaries, sorted."""
    return sorted(entry.name for entry in Path(folder).iterdir() if not _is_dofla_bookkeeping(entry.name))


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _input_paths(inputs: Iterable[str | Path | None]) -> list[Path]:
    paths = []
    for item in inputs:
        if item is None or str(item) == "":
            continue
        path = Path(item).expanduser()
        if path.exists():
            paths.append(path.resolve())
    return paths


def check_output_folder(
    path: str | Path, kind: str, *, inputs: Iterable[str | Path | None] = (), option: str = "--out"
) -> Path:
    """Refuse an output folder dofla must not write into; returns it resolved. Creates nothing.

    Refused: a path that is a file or lies under one; an unwritable place; an input (``inputs``: the
    teacher, data, plan... those that are paths) or a folder holding one; a folder with files but no
    dofla marker; a dofla output of another ``kind``.
    """
    given = Path(path).expanduser()
    if given.is_symlink():  # replacing it would move the link, not the folder: name the folder itself
        raise DoflaError(
            f"{option} {given} is a symbolic link to {given.resolve()}; give that folder itself (or another)."
        )
    path = given.resolve()
    if path.exists() and not path.is_dir():
        raise DoflaError(f"{option} {path} is a file, not a folder; choose a folder for dofla's outputs.")
    for source in _input_paths(inputs):
        if source == path:
            raise DoflaError(
                f"{option} {path} is an input of this command; dofla never writes into its inputs: choose "
                "another folder."
            )
        if path in source.parents:
            raise DoflaError(
                f"{option} {path} holds the input {source}; dofla never writes around its inputs: choose "
                "another folder."
            )
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DoflaError(f"{option} {path} lies under {existing}, which is a file; choose another folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DoflaError(f"{option} {path}: {existing} is not writable by you; choose another folder.")
    if existing != path:
        return path
    marker = read_marker(path)
    if marker is None:
        foreign = user_entries(path)
        if foreign:
            raise DoflaError(
                f"{option} {path} already holds files dofla did not write ({_shown(foreign)}); dofla writes "
                "only into new or empty folders or its own outputs: choose another folder."
            )
    elif marker.get("kind") != kind:
        raise DoflaError(
            f"{option} {path} holds a dofla {marker.get('kind')} output, not a {kind}; choose another folder."
        )
    return path


def claim_output_folder(path: str | Path, kind: str) -> Path:
    """Create ``path`` (checked by :func:`check_output_folder`) if needed and mark it as dofla's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if read_marker(path) is None:
        write_marker(path, kind)
    return path


def check_output_file(
    path: str | Path,
    option: str,
    *,
    inputs: Iterable[str | Path | None] = (),
    overwrite: bool = False,
    ours: Callable[[Path], bool] | None = None,
) -> Path:
    """Refuse, before any work, an output file dofla must not write; returns it resolved. Creates nothing.

    Refused: a folder; a path under a file; an unwritable place; an input (``inputs``) or a file inside an
    input folder (the teacher's, the converted model's); an existing file without ``overwrite``, and with it
    one that ``ours`` does not recognise as written by dofla.
    """
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        raise DoflaError(f"{option} {path} is a folder; give a file name.")
    for source in _input_paths(inputs):
        if source == path:
            raise DoflaError(
                f"{option} {path} is an input of this command; dofla never writes over its inputs: choose "
                "another path."
            )
        if source in path.parents:
            raise DoflaError(
                f"{option} {path} lies in the input {source}; dofla never writes into its inputs: choose "
                "another path."
            )
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DoflaError(f"{option} {path} lies under {existing}, which is a file; choose another path.")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise DoflaError(
                f"{option} {path} already exists; choose a new path, or pass --overwrite to replace dofla's "
                "own earlier file."
            )
        if path.is_symlink() or not path.is_file() or (ours is not None and not ours(path)):
            raise DoflaError(
                f"{option} {path} was not written by dofla, so --overwrite leaves it alone; choose another path."
            )
    writable = os.access(path, os.W_OK) if path.exists() else os.access(existing, os.W_OK | os.X_OK)
    if not writable:
        raise DoflaError(f"{option} {path} is not writable by you; choose another path.")
    return path


def is_dofla_json(path: Path) -> bool:
    """A JSON object dofla wrote (``{"made_by": "dofla", ...}``, as the results of `dofla evaluate --json`)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("made_by") == "dofla"


def is_matplotlib_figure(path: Path) -> bool:
    """A PNG, PDF or SVG figure matplotlib drew (it signs each in the file's first or last bytes)."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(65536)
            stream.seek(max(0, path.stat().st_size - 65536))
            tail = stream.read()
    except OSError:
        return False
    return b"matplotlib" in head.lower() or b"matplotlib" in tail.lower()


def _matches(relative: str, pattern: str) -> bool:
    """Whether the '/'-separated ``relative`` path is ``pattern`` or lies in a folder ``pattern`` names,
    segment by segment: a ``*`` never crosses a '/' (``*.png`` is not ``photos/holiday.png``)."""
    parts, wanted = relative.split("/"), pattern.split("/")
    return len(parts) >= len(wanted) and all(
        fnmatch.fnmatchcase(part, item) for part, item in zip(parts, wanted, strict=False)
    )


def remove_known_files(folder: str | Path, patterns: Iterable[str]) -> None:
    """Delete the files under ``folder`` whose relative path matches one of ``patterns`` (fnmatch per '/'
    separated segment; a pattern naming a folder covers what it holds), then the folders this left empty.
    Every other file stays, so nothing dofla did not write goes.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return
    patterns = list(patterns)
    emptied: set[Path] = set()  # folders in which something was deleted
    for root, directories, files in os.walk(folder, topdown=False):
        here = Path(root)
        for name in files:
            relative = (here / name).relative_to(folder).as_posix()
            if any(_matches(relative, pattern) for pattern in patterns):
                (here / name).unlink(missing_ok=True)
                emptied.add(here)
        for name in directories:
            inner = here / name
            if inner in emptied and inner.is_dir() and not inner.is_symlink() and not any(inner.iterdir()):
                inner.rmdir()
                emptied.add(here)
    remove_stale_temporaries(folder)


_HELD: dict[str, int] = {}


@contextmanager
def output_lock(path: str | Path, option: str = "--out") -> Iterator[None]:
    """Hold the lock of the output folder ``path`` (re-entrant within a process).

    The lock is an advisory ``flock`` on ``.NAME.dofla-lock`` beside the folder, released by the system
    when the process dies (a killed run leaves no stale lock). A second process is refused at once.
    """
    path = Path(path).expanduser().resolve()
    lock_path = path.parent / f".{path.name}{LOCK_SUFFIX}"
    key = str(lock_path)
    if fcntl is None or key in _HELD:
        _HELD[key] = _HELD.get(key, 0) + 1
        try:
            yield
        finally:
            _HELD[key] -= 1
            if not _HELD[key]:
                del _HELD[key]
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise DoflaError(
                f"cannot lock {option} {path} ({error.strerror or error}); choose a writable folder."
            ) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 32).decode(errors="replace").strip()
            os.close(descriptor)
            raise DoflaError(
                f"another dofla process{f' (pid {holder})' if holder.isdigit() else ''} is writing to {path}; "
                f"wait for it to finish or choose another {option}."
            ) from None
        try:  # the previous holder may have removed the file between our open and our lock
            current = os.path.samestat(os.fstat(descriptor), os.stat(lock_path))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"{os.getpid()}\n".encode())
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        lock_path.unlink(missing_ok=True)
        os.close(descriptor)


def foreign_files(folder: str | Path) -> list[str]:
    """Names in a dofla output folder that its marker does not list (all of them without a marker)."""
    marker = read_marker(folder) or {}
    known = set(marker.get("files", []))
    return [name for name in user_entries(folder) if name not in known]


def remove_tree_if_ours(folder: Path, kind: str) -> None:
    """Delete a dofla output folder of ``kind`` whole, but only if every file in it is dofla's (its marker
    lists them); else refuse, naming a file dofla did not write."""
    marker = read_marker(folder)
    if marker is None or marker.get("kind") != kind:
        raise DoflaError(f"{folder} is not a dofla {kind} folder; dofla leaves it alone: move it away.")
    foreign = foreign_files(folder)
    if foreign:
        raise DoflaError(
            f"{folder} holds files dofla did not write ({_shown(foreign)}); move them away and run again."
        )
    shutil.rmtree(folder)
