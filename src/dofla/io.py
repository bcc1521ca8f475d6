"""Atomic file writes: a crash or a full disk never leaves a half-written file in place."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from dofla.errors import DoflaError


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    temporary = Path(temporary)
    os.chmod(temporary, 0o666 & ~_UMASK)  # mkstemp makes 0600; saved files get ordinary permissions
    try:
        write(temporary)
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise DoflaError(
            f"could not write {path}: {error.strerror or error}; the previous file was kept."
        ) from error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def save_safetensors_atomic(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    return write_atomic(path, lambda tmp: save_file(contiguous, str(tmp), metadata=metadata))
