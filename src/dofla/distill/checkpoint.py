"""Atomic, resumable training checkpoints.

Layout under ``<run>/checkpoints/``: one folder per saved step (``step-00000040/`` with
``trainable.safetensors`` (student parameters, best-so-far copies and the RNG state as tensors),
``optimizer.pt`` (AdamW state: tensors and numbers only, read back with ``torch.load(weights_only=True)``)
and ``state.json`` (counters, history, the run's fingerprint)), and ``latest.json`` naming the newest
complete folder. A folder is written under a temporary name and renamed when complete; ``latest.json`` is
replaced atomically afterwards; older folders are deleted last. A crash or a full disk at any moment
leaves the previous checkpoint reachable and intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from dofla.errors import DoflaError
from dofla.io import (
    remove_stale_temporaries,
    save_safetensors_atomic,
    temporary_folder,
    to_json,
    write_atomic,
    write_text_atomic,
)

LATEST_FILE = "latest.json"
TENSORS_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"
_CHECKPOINT_NAME = re.compile(r"step-\d{8}")


def save_checkpoint(
    folder: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    optimizer_state: dict,
    state: dict[str, Any],
    *,
    keep: int = 1,
) -> Path:
    """Write checkpoint ``step`` under ``folder`` (atomically) and return its path.

    tensors: name -> tensor (all finite: the caller refuses to save NaNs); optimizer_state: the optimizer's
    ``state_dict()``; state: JSON-serialisable counters. ``keep`` newest checkpoints are kept.
    Raises DoflaError (and keeps the previous checkpoint) when writing fails, e.g. a full disk.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder, "step-*")  # left by a process killed while writing a checkpoint
    name = f"step-{step:08d}"

    def failure(reason: str) -> str:
        return (
            f"could not write the checkpoint of step {step} in {folder} ({reason}); the previous checkpoint "
            "was kept: free some disk space and rerun with --resume."
        )

    with temporary_folder(folder, name, failure, errors=(OSError, DoflaError)) as temporary:
        save_safetensors_atomic(tensors, temporary / TENSORS_FILE)
        write_atomic(temporary / OPTIMIZER_FILE, lambda path: torch.save(optimizer_state, path))
        write_text_atomic(temporary / STATE_FILE, to_json(state, indent=1) + "\n")
        final = folder / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        write_text_atomic(folder / LATEST_FILE, to_json({"step": step, "folder": name}) + "\n")
    old = sorted(path for path in folder.glob("step-*") if path.is_dir() and path.name != name)
    for path in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint folder, or None when there is none."""
    pointer = Path(folder) / LATEST_FILE
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text(encoding="utf-8"))["folder"]
    except (ValueError, KeyError, TypeError) as error:
        raise DoflaError(
            f"{pointer} is damaged; start over with --overwrite (or delete {folder})."
        ) from error
    if not isinstance(name, str) or not _CHECKPOINT_NAME.fullmatch(name):  # never a path out of the folder
        raise DoflaError(
            f"{pointer} names {name!r}, which is not a checkpoint folder name like step-00000040; it is "
            "damaged: start over with --overwrite."
        )
    path = Path(folder) / name
    if not (path / STATE_FILE).is_file():
        raise DoflaError(f"{pointer} names {path}, which is incomplete; start over with --overwrite.")
    return path


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict[str, Any]]:
    """(tensors, optimizer state, state) of the checkpoint folder ``path``; nothing is unpickled."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path / TENSORS_FILE))
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except Exception as error:  # safetensors, torch.load and json fail in many ways on damaged files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DoflaError(
            f"could not read the checkpoint {path} ({reason}); it is damaged: start over with --overwrite."
        ) from None
    if not isinstance(state, dict):
        raise DoflaError(
            f"{path / STATE_FILE} is not a JSON object; it is damaged: start over with --overwrite."
        )
    return tensors, optimizer_state, state


def check_state(path: Path, state: dict, keys: tuple[str, ...]) -> None:
    """Refuse a checkpoint whose state lacks one of ``keys`` (a damaged or foreign file)."""
    missing = [key for key in keys if key not in state]
    if missing:
        raise DoflaError(
            f"the checkpoint {path} lacks {missing[0]!r} in {STATE_FILE}; it is damaged: start over with "
            "--overwrite."
        )


# what a stage's checkpoint keeps of its NonFinitePolicy (dofla.distill.nonfinite)
_POLICY_FIELDS = ("lr_scale", "bad_in_a_row", "skipped")
# what every stage's state.json holds (save_training_state); a stage may add its own keys
_STAGE_STATE_KEYS = ("fingerprint", "step", *_POLICY_FIELDS, "history")


def write_log(path: Path, records: list[dict]) -> None:
    """A stage's JSONL log holding ``records`` (one line each; none: an empty log), written atomically."""
    write_text_atomic(path, "".join(to_json(record) + "\n" for record in records))


def append_log(path: Path, record: dict) -> None:
    """One more line of a stage's JSONL log."""
    with open(path, "a") as stream:
        stream.write(to_json(record) + "\n")


def settings_digest(settings: dict, plan) -> Any:
    """The start of a stage's fingerprint: a sha256 of its settings (JSON, keys sorted) and then of the
    model's plan (None: no plan; its position period left out); the stage adds what else determines its
    result (rows, starting weights)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    described = None if plan is None else plan.to_dict()
    if described is not None:  # how a trained model reads positions afterwards, not what trains it
        described.pop("position_period", None)
        if not described.get("sinks_at_edge"):  # off: as plans were before the option
            described.pop("sinks_at_edge", None)
    digest.update(json.dumps(described, sort_keys=True).encode())
    return digest


def save_training_state(
    folder: Path,
    step: int,
    parameters: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    policy,
    state: dict[str, Any],
    *,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    nonfinite_warning: str,
) -> bool:
    """A stage's checkpoint of ``step``: its trained ``parameters`` (``param/NAME``), ``extra_tensors``, the
    torch RNG, the optimizer, the policy's counters and ``state`` (fingerprint, history, ...). Saves nothing
    and warns ``nonfinite_warning`` while a parameter is not finite (the previous checkpoint stays);
    returns whether it saved."""
    if not all(torch.isfinite(parameter).all() for parameter in parameters.values()):
        warnings.warn(nonfinite_warning, stacklevel=3)
        return False
    tensors = {f"param/{name}": parameter for name, parameter in parameters.items()}
    tensors.update(extra_tensors or {})
    tensors["rng/torch"] = torch.get_rng_state()
    counters = {name: getattr(policy, name) for name in _POLICY_FIELDS}
    save_checkpoint(folder, step, tensors, optimizer.state_dict(), dict(state, step=step, **counters))
    return True


def restore_training_state(
    latest: Path,
    parameters: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    policy,
    *,
    extra_keys: tuple[str, ...] = (),
    fingerprint: str | None,
    foreign: str,
    damaged: str,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load the checkpoint folder ``latest`` into a stage's trained ``parameters``, its optimizer, the torch
    RNG and the policy's counters, after checking it: its state has every stage's keys and ``extra_keys``
    (the stage's own), its fingerprint is
    ``fingerprint`` (else DoflaError ``foreign``), it holds every parameter (else a sentence ending with
    ``damaged``, what to do). Returns (tensors, state) for what else the stage keeps."""
    tensors, optimizer_state, state = load_checkpoint(latest)
    check_state(latest, state, (*_STAGE_STATE_KEYS, *extra_keys))
    if state["fingerprint"] != fingerprint:
        raise DoflaError(foreign)
    missing = [f"param/{name}" for name in parameters if f"param/{name}" not in tensors]
    missing += [name for name in ("rng/torch",) if name not in tensors]
    if missing:
        raise DoflaError(
            f"the checkpoint {latest} lacks {missing[0].removeprefix('param/')}; it is damaged: {damaged}"
        )
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(tensors[f"param/{name}"])
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, RuntimeError) as error:
        raise DoflaError(f"the optimizer state in {latest} does not fit ({error}); {damaged}") from None
    torch.set_rng_state(tensors["rng/torch"])
    for name in _POLICY_FIELDS:
        setattr(policy, name, state[name])
    return tensors, state
