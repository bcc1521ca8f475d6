"""The teacher-state store: the format of teacher hidden states computed once and saved to disk.

A process that trains only converted layers a..b needs, per batch, the teacher's hidden state entering
layer a; everything after it is computed from there (layers are independent given the teacher's inputs).
:func:`write_teacher_states` runs the teacher once over the training sequences and stores the hidden state
entering each ``boundaries`` layer (captured by :func:`dofla.models.surgery.hidden_states_entering`);
:class:`TeacherStates` reads rows back by sequence index (memory-mapped). Training from them is teacher
forcing's business (:func:`dofla.distill.teacher_forcing.teacher_forced_step_from_states`).

Store layout (one folder): ``manifest.json`` (teacher fingerprint, sequence shape, boundaries, dtype, a hash
of the token ids, the shard list, ``complete``), ``tokens.safetensors`` (the token ids themselves, so every
process can train on exactly these sequences) and ``states-00000.safetensors``, ... one per batch of
``sequences_per_shard`` sequences, each holding ``layer_{i}`` (sequences, T, hidden) for every boundary i and
naming its store and row range in its metadata. Every file is written atomically; a rerun of
:func:`write_teacher_states` skips the shards already complete, so a killed write resumes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dofla.errors import DoflaError
from dofla.io import save_safetensors_atomic, write_text_atomic
from dofla.models.surgery import hidden_states_entering
from dofla.saving import teacher_fingerprint

MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.safetensors"
STORE_FORMAT = 1
STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shard_name(index: int) -> str:
    return f"states-{index:05d}.safetensors"


def tensor_key(layer: int) -> str:
    return f"layer_{layer}"


def tokens_hash(sequences: torch.Tensor) -> str:
    """sha256 of the token ids (as int64) and their shape: which data a store was computed for."""
    digest = hashlib.sha256(f"{tuple(sequences.shape)};".encode())
    digest.update(sequences.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _storage_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype the states are stored in, read as ``load_teacher`` reads dtypes (float32, bf16, ...)."""
    from dofla.models.loading import resolve_dtype

    resolved = resolve_dtype(dtype, torch.device("cpu"))
    if resolved not in STORAGE_DTYPES:
        raise DoflaError(f"teacher states can be stored as float32, bfloat16 or float16, not {dtype}.")
    return resolved


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise DoflaError(
            f"{path} is not valid JSON ({error}); delete the folder and write the store again."
        ) from None


def _shard_store_id(path: Path) -> str | None:
    """The store a shard file belongs to (from its metadata); None when it is unreadable or foreign."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("store")
    except Exception:  # a damaged file reads as no shard: it is written again
        return None


def write_teacher_states(
    model: nn.Module,
    sequences: torch.Tensor,
    out_dir: str | Path,
    boundaries: list[int],
    *,
    batch_size: int = 8,
    dtype: torch.dtype | str = torch.float32,
    progress: bool = False,
) -> Path:
    """Store the teacher's hidden state entering each ``boundaries`` layer for sequences (N, T) in out_dir.

    One teacher forward per batch of ``batch_size`` sequences (converted layers run the teacher's softmax;
    bf16 autocast on CUDA, as in training), stopped before the last boundary layer; one shard per batch.
    Shards already complete from an earlier, interrupted call with the same arguments are kept. Disk use:
    N * T * hidden * len(boundaries) * (4 bytes float32, 2 bfloat16). Returns out_dir.
    """
    from tqdm import tqdm

    from dofla.models import get_adapter

    out_dir = Path(out_dir)
    adapter = get_adapter(model)
    if sequences.dim() != 2 or sequences.shape[0] < 1 or sequences.shape[1] < 2:
        raise DoflaError(
            f"teacher states need token ids of shape (sequences, length >= 2), got {tuple(sequences.shape)}."
        )
    if sequences.is_floating_point():
        raise DoflaError(f"teacher states need integer token ids, got {sequences.dtype}.")
    boundaries = sorted({int(index) for index in boundaries})
    outside = [index for index in boundaries if not 0 <= index < adapter.num_layers]
    if not boundaries or outside:
        raise DoflaError(
            f"boundaries {outside or boundaries} are not decoder layers; choose among 0..{adapter.num_layers - 1} "
            "(the first layer of each process's shard)."
        )
    if batch_size <= 0:
        raise DoflaError(f"the batch size must be positive, got {batch_size}.")
    count, length = sequences.shape
    storage = _storage_dtype(dtype)
    identity = dict(
        format=STORE_FORMAT,
        teacher_fingerprint=teacher_fingerprint(model),
        model_type=adapter.model_type,
        num_layers=adapter.num_layers,
        hidden_size=adapter.hidden_size,
        num_sequences=int(count),
        sequence_length=int(length),
        tokens_sha256=tokens_hash(sequences),
        boundaries=boundaries,
        dtype=str(storage).removeprefix("torch."),
        sequences_per_shard=int(batch_size),
    )
    store_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    starts = list(range(0, count, batch_size))
    manifest = dict(
        identity, store_id=store_id, shards=[shard_name(i) for i in range(len(starts))], complete=False
    )
    existing = _read_manifest(out_dir)
    if existing is not None and existing.get("store_id") != store_id:
        raise DoflaError(
            f"{out_dir} already holds teacher states for another teacher, data, boundaries, dtype or batch size; "
            "write to another folder or delete this one."
        )
    write_text_atomic(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    tokens = {"input_ids": sequences.to(torch.int64)}
    save_safetensors_atomic(tokens, out_dir / TOKENS_FILE, metadata=dict(store=store_id))

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout: the stored states are the teacher's deterministic ones
    try:
        for index, start in enumerate(tqdm(starts, disable=not progress, unit="shard", dynamic_ncols=True)):
            path = out_dir / shard_name(index)
            if path.exists():
                found = _shard_store_id(path)
                if found == store_id:
                    continue
                if found is not None:
                    raise DoflaError(
                        f"{path} belongs to another store ({found}, this one is {store_id}); write to another "
                        "folder or delete this one."
                    )
            stop = min(start + batch_size, count)
            captured = hidden_states_entering(model, sequences[start:stop].to(device), boundaries)
            tensors = {
                tensor_key(layer): captured[layer].to(storage) for layer in boundaries
            }  # (B, T, hidden)
            metadata = dict(store=store_id, start=str(start), stop=str(stop))
            save_safetensors_atomic(tensors, path, metadata=metadata)
    finally:
        model.train(was_training)
    manifest["complete"] = True
    write_text_atomic(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------------------------- reading


class TeacherStates:
    """A complete store written by :func:`write_teacher_states`, read by sequence index.

    Opening checks the manifest and that every shard is present and belongs to this store, so a store
    left incomplete by a killed write is refused before training starts, not halfway through.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        manifest = _read_manifest(self.folder)
        if manifest is None:
            raise DoflaError(
                f"{self.folder} has no {MANIFEST_FILE}: it is not a teacher-state store, or its write was "
                "interrupted; run write_teacher_states (dofla teacher-states) again with the same arguments."
            )
        if manifest.get("format") != STORE_FORMAT:
            raise DoflaError(
                f"{self.folder} is a teacher-state store of format {manifest.get('format')}; this dofla reads "
                f"format {STORE_FORMAT}: write it again."
            )
        if not manifest.get("complete"):
            raise DoflaError(
                f"the teacher states in {self.folder} are incomplete (the write was interrupted); run "
                "write_teacher_states (dofla teacher-states) again with the same arguments to finish it."
            )
        self.manifest = manifest
        self._handles: dict[int, object] = {}
        for name in [TOKENS_FILE, *manifest["shards"]]:
            found = _shard_store_id(self.folder / name)
            if found != manifest["store_id"]:
                problem = (
                    "is missing or unreadable" if found is None else f"belongs to another store ({found})"
                )
                raise DoflaError(
                    f"{self.folder / name} {problem}; run write_teacher_states (dofla teacher-states) again "
                    "with the same arguments to rewrite it."
                )

    @property
    def boundaries(self) -> list[int]:
        return list(self.manifest["boundaries"])

    @property
    def num_sequences(self) -> int:
        return int(self.manifest["num_sequences"])

    def token_ids(self) -> torch.Tensor:
        """The token ids (N, T) the states were computed for: train on these, in this order."""
        from safetensors.torch import load_file

        return load_file(self.folder / TOKENS_FILE)["input_ids"]

    def start_layer(self, first_trained_layer: int) -> int:
        """The deepest stored boundary at or below the first trained layer (where the forward starts)."""
        usable = [index for index in self.boundaries if index <= first_trained_layer]
        if not usable:
            raise DoflaError(
                f"the teacher states in {self.folder} hold the hidden states entering layers {self.boundaries}, "
                f"but the first trained layer is {first_trained_layer}; write a store with a boundary at "
                f"{first_trained_layer} (the first layer of this process's shard)."
            )
        return max(usable)

    def check(self, model: nn.Module, sequences: torch.Tensor, first_trained_layer: int) -> int:
        """Refuse a store made by another teacher or for other token ids; returns the start layer."""
        manifest = self.manifest
        fingerprint = teacher_fingerprint(model)
        if fingerprint != manifest["teacher_fingerprint"]:
            raise DoflaError(
                f"the teacher states in {self.folder} were computed by another teacher (fingerprint "
                f"{manifest['teacher_fingerprint'][:12]}, this model's is {fingerprint[:12]}); write them again "
                "with this model."
            )
        if tuple(sequences.shape) != (manifest["num_sequences"], manifest["sequence_length"]) or (
            tokens_hash(sequences) != manifest["tokens_sha256"]
        ):
            raise DoflaError(
                f"the teacher states in {self.folder} were computed for other token ids ({manifest['num_sequences']} "
                f"x {manifest['sequence_length']}, here {tuple(sequences.shape)}); write a store for this data "
                "(the same sequences, in the same order)."
            )
        return self.start_layer(first_trained_layer)

    def _shard(self, index: int):
        from safetensors import safe_open

        if index not in self._handles:
            self._handles[index] = safe_open(
                str(self.folder / self.manifest["shards"][index]), framework="pt"
            )
        return self._handles[index]

    def read(self, indices: list[int], layer: int) -> torch.Tensor:
        """The stored hidden states entering ``layer`` for these sequence indices: (len(indices), T, hidden)."""
        if layer not in self.boundaries:
            raise DoflaError(
                f"the teacher states in {self.folder} hold layers {self.boundaries}, not {layer}."
            )
        per_shard = self.manifest["sequences_per_shard"]
        rows = []
        for index in indices:
            if not 0 <= index < self.num_sequences:
                raise DoflaError(f"sequence {index} is not in the store ({self.num_sequences} sequences).")
            shard, row = divmod(int(index), per_shard)
            rows.append(self._shard(shard).get_slice(tensor_key(layer))[row : row + 1])
        return torch.cat(rows)


def open_teacher_states(store: TeacherStates | str | Path) -> TeacherStates:
    return store if isinstance(store, TeacherStates) else TeacherStates(store)


@dataclass
class StoredStart:
    """Where a layer-wise forward starts from stored teacher states: the store and its start layer."""

    states: TeacherStates
    layer: int


def stored_start(store, model: nn.Module, sequences: torch.Tensor, students, loss: str, name: str):
    """Open and check a teacher-state store for ``sequences`` (N, T) trained by the ``loss`` of that name; None
    where no store is given. ``name`` says which store in errors."""
    from dofla.distill.losses import LOSSES, layerwise_loss_names

    if store is None:
        return None
    if not LOSSES[loss].layerwise:
        raise DoflaError(
            f"{name}: stored teacher states serve the layer-wise losses ({', '.join(layerwise_loss_names())}); "
            f"the {loss} loss runs the whole model end to end. Drop the stored states or choose a "
            "layer-wise loss."
        )
    states = open_teacher_states(store)
    return StoredStart(states, states.check(model, sequences, min(students)))


def start_options(stored: StoredStart | None, indices, device: torch.device) -> dict:
    """The keyword arguments that start a batch's forward from its stored teacher states (B, T, hidden)
    entering the start layer; none without a store."""
    if stored is None:
        return {}
    start_states = stored.states.read(list(indices), stored.layer).to(device)  # (B, T, hidden)
    return dict(start_states=start_states, start_layer=stored.layer)
