"""Atomic file writes: a crash or a full disk never leaves a half-written file in place.

Temporary files and folders are named ``.NAME.dofla-PID-XXXX`` beside their target, so the leftovers of a
killed process are recognisable as dofla's own and removed by :func:`remove_stale_temporaries` at the
next write of the same target. JSON is always written as valid JSON (:func:`to_json`: no bare NaN).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dofla.errors import DoflaError

# exactly what :func:`temporary_prefix` and ``tempfile.mkstemp``/``mkdtemp`` make: 8 random characters, then
# dofla's suffix; a user's file like ``.notes.dofla-99999-v1.txt`` is not one
_TEMPORARY = re.compile(r"^\..+\.dofla-(\d+)-[a-z0-9_]{8}\.(tmp|old)$")
TEMPORARY_SUFFIXES = (".tmp", ".old")


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` is one of dofla's temporary files or folders (see :func:`temporary_prefix`)."""
    return _TEMPORARY.match(name) is not None


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def temporary_prefix(name: str) -> str:
    """'.NAME.dofla-PID-': the start of this process's temporary files and folders for ``name``, which
    ``tempfile`` completes with 8 random characters and a suffix of :data:`TEMPORARY_SUFFIXES`."""
    return f".{name}.dofla-{os.getpid()}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folder: str | Path, name: str = "*") -> list[Path]:
    """Delete dofla temporaries for ``name`` (a glob) in ``folder`` whose process no longer runs.

    Only entries named like :func:`temporary_prefix` are touched; those of running processes are kept.
    Returns what was removed.
    """
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.glob(f".{name}.dofla-*"):
        match = _TEMPORARY.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or _running(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError from Python, SafetensorError from safetensors, RuntimeError from
    torch.save (``PytorchStreamWriter failed writing file``)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return (OSError, RuntimeError)
    return (OSError, RuntimeError, SafetensorError)


WRITE_ERRORS = _write_errors()


@contextmanager
def temporary_folder(
    parent: Path, name: str, failure: Callable[[str], str] | None = None, errors=WRITE_ERRORS
) -> Iterator[Path]:
    """A fresh temporary folder for ``name`` in ``parent`` (see :func:`temporary_prefix`) that the block
    fills and moves into place; if the block raises, the folder is removed. A write error (one of
    ``errors``, e.g. a full disk) then becomes a DoflaError whose sentence is ``failure(reason)`` where
    ``failure`` is given; anything else is raised as it is."""
    temporary = Path(tempfile.mkdtemp(prefix=temporary_prefix(name), suffix=".tmp", dir=parent))
    try:
        yield temporary
    except errors as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if failure is None:
            raise
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise DoflaError(failure((reason or repr(error)).splitlines()[0])) from error
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` in one step."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent, glob.escape(path.name))
        handle, temporary = tempfile.mkstemp(
            prefix=temporary_prefix(path.name), suffix=".tmp", dir=path.parent
        )
    except OSError as error:  # the folder is a file, read-only, or cannot be made
        raise DoflaError(
            f"could not write {path}: {error.strerror or error} ({path.parent}); choose a writable place."
        ) from None
    os.close(handle)
    temporary = Path(temporary)
    os.chmod(temporary, 0o666 & ~_UMASK)  # mkstemp makes 0600; saved files get ordinary permissions
    try:
        write(temporary)
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except WRITE_ERRORS as error:  # a full disk reaches us as any of these, by the library that wrote
        temporary.unlink(missing_ok=True)
        reason = (
            error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0]
        )
        raise DoflaError(
            f"could not write {path}: {reason or type(error).__name__}; the previous file was kept: free some "
            "disk space or choose another place."
        ) from error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def finite_or_none(data: Any) -> Any:
    """``data`` with every NaN or infinite float (in nested dicts, lists and tuples) replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite_or_none(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_none(value) for value in data]
    return data


def to_json(data: Any, indent: int | None = None) -> str:
    """Valid JSON text of ``data``: non-finite numbers become null (JSON has no NaN or Infinity)."""
    return json.dumps(finite_or_none(data), indent=indent, allow_nan=False)


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    """Write ``data`` as valid JSON (see :func:`to_json`) atomically, with a final newline."""
    return write_text_atomic(path, to_json(data, indent) + "\n")


def check_free_space(folder: str | Path, size: int, what: str) -> None:
    """Refuse, before writing, ``size`` bytes of ``what`` that the disk holding ``folder`` has no room for."""
    existing = Path(folder)
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if size > free:
        raise DoflaError(
            f"{what} needs {size / 2**20:,.1f} MiB and the disk holding {folder} has {free / 2**20:,.1f} MiB "
            "free; free some disk space or choose another place."
        )


def save_safetensors_atomic(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` as safetensors atomically, refusing first when the disk has no room for them."""
    from safetensors.torch import save_file

    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    check_free_space(Path(path).parent, size, f"writing {path}")
    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    return write_atomic(path, lambda tmp: save_file(contiguous, str(tmp), metadata=metadata))
