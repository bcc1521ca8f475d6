"""Read a folder written by :func:`dofla.saving.save_converted` back into a converted model, with strict key
checks and the teacher's fingerprint (teachers themselves load with :mod:`dofla.models.loading`). Folders
saved before config.json became a :class:`~dofla.auto.DoflaConfig` (it held the teacher's config) still load.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dofla._registration import MODEL_TYPE
from dofla.config import ConversionPlan
from dofla.convert import convert
from dofla.errors import DoflaError
from dofla.models.surgery import is_converted
from dofla.saving import (
    PLAN_FILE,
    SAVE_FORMAT,
    STUDENT_WEIGHTS_FILE,
    WEIGHTS_FILE,
    is_student_key,
    teacher_architecture,
    teacher_fingerprint,
)


def read_record(path: str | Path) -> dict[str, Any]:
    """The ``dofla_plan.json`` record of a converted folder (plan, fingerprint, format)."""
    path = Path(path)
    record_file = path / PLAN_FILE
    if not record_file.is_file():
        raise DoflaError(
            f"{path} is not a converted dofla model (no {PLAN_FILE}); make one with `dofla convert`."
        )
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except ValueError as error:  # invalid JSON or not UTF-8
        raise DoflaError(f"{record_file} is not valid JSON ({error}); convert the model again.") from None
    if not isinstance(record, dict) or "plan" not in record or record.get("format") != SAVE_FORMAT:
        raise DoflaError(
            f"{record_file} is not a dofla save of format {SAVE_FORMAT}; convert the model again with this dofla."
        )
    if record.get("weights") not in (WEIGHTS_FILE, STUDENT_WEIGHTS_FILE):  # never a path out of the folder
        raise DoflaError(
            f"{record_file} names the weights file {record.get('weights')!r}, which is neither {WEIGHTS_FILE} "
            f"nor {STUDENT_WEIGHTS_FILE}; the folder is damaged: convert the model again."
        )
    return record


def check_teacher(path: str | Path, teacher: nn.Module, student: nn.Module | None = None) -> None:
    """Refuse a teacher that is not the one the converted folder ``path`` was made from, naming what differs.

    The architecture recorded at saving time (or, for older folders, that of ``student``) is compared field
    by field, then the teacher's weights fingerprint where one was recorded.
    """
    record = read_record(path)
    recorded = record.get("teacher_architecture")
    if recorded is None and student is not None:
        recorded = teacher_architecture(student)
    given = teacher_architecture(teacher)
    named = record.get("teacher") or "the recorded one"
    for field, value in (recorded or {}).items():
        if given.get(field) != value:
            raise DoflaError(
                f"the teacher is not the model {path} was converted from: its {field} is {given.get(field)}, "
                f"the recorded teacher's is {value}; pass that teacher ({named}) or --any-teacher to compare "
                "anyway."
            )
    weights = record.get("teacher_weights")
    if weights and teacher_fingerprint(teacher) != weights:
        raise DoflaError(
            f"the teacher is not the model {path} was converted from: same architecture but other weights "
            f"(teacher_weights fingerprint differs); pass that teacher ({named}) or --any-teacher to compare "
            "anyway."
        )


def _parse_dtype(dtype) -> torch.dtype | None:
    """None keeps each stored tensor's dtype; anything else is read as ``load_teacher`` reads it."""
    from dofla.models.loading import resolve_dtype

    return None if dtype is None else resolve_dtype(dtype, torch.device("cpu"))


def _load_state_strictly(model: nn.Module, tensors: dict[str, torch.Tensor], expected: set[str], where: Path):
    """Load ``tensors`` into ``model``; any key missing from ``expected`` or not expected is an error.

    Each tensor keeps its stored dtype (a bf16 teacher with float32 students reloads as it was saved).
    """
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} ({', '.join(missing[:5])})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} ({', '.join(unexpected[:5])})")
        raise DoflaError(
            f"{where} does not match the model built from its plan: {'; '.join(parts)}; "
            "the folder is damaged or from another model, convert and save it again."
        )
    targets = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, tensor in tensors.items():
        if name in targets:
            target = targets[name]
        elif name in buffers:
            target = buffers[name]
        else:
            raise DoflaError(f"{where}: {name} is neither a parameter nor a buffer of the model.")
        if tuple(target.shape) != tuple(tensor.shape):
            raise DoflaError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}; "
                "the folder is from another model."
            )
        target.data = tensor.to(target.device)


def skipped_weight_initialisation():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise (slower, same result after loading)
        return contextlib.nullcontext()
    return no_init_weights()


def _resolve_teacher(teacher, record: dict, dtype, device):
    """A teacher model from a module, a spec string, or the folder's recorded teacher; plus its tokenizer."""
    if isinstance(teacher, nn.Module):
        return teacher, None
    spec = teacher or record.get("teacher")
    if not spec:
        raise DoflaError("this student-only folder does not name its teacher; pass teacher=MODEL.")
    from dofla.models import load_teacher

    loaded = load_teacher(spec, dtype=dtype, device=device)
    return loaded.model, loaded.tokenizer


def saved_before_auto_config(path: str | Path) -> bool:
    """Whether a converted folder's config.json is the teacher's own (saved before DoflaConfig): such a folder
    loads with :func:`load_converted`, but ``AutoModelForCausalLM`` would open it as the plain teacher.
    Re-save it with ``save_converted(*load_converted(path)[:2] ...)`` (see the README)."""
    path = Path(path)
    if not (path / PLAN_FILE).is_file():
        return False
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") != MODEL_TYPE


def teacher_config_of(path: Path, plan: ConversionPlan):
    """The teacher's config from a folder's config.json: a DoflaConfig's base config, or (folders saved before
    it became one) the teacher's config itself."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DoflaError(
            f"{path / 'config.json'} is missing or damaged ({first}); the folder is incomplete: save the model "
            "again."
        ) from None
    if config.model_type != MODEL_TYPE:  # dofla.auto.DoflaConfig
        return config
    if config.plan and ConversionPlan.from_dict(config.plan).to_dict() != plan.to_dict():
        raise DoflaError(
            f"{path / 'config.json'} and {path / PLAN_FILE} hold different plans; the folder is damaged or "
            "mixed: save the model again."
        )
    return config.teacher_config()


def load_converted(path: str | Path, *, teacher=None, dtype=None, device=None):
    """Load a folder written by :func:`save_converted`. Returns (model, tokenizer or None, plan).

    Full folders: the model is built from ``config.json`` (``from_config``, never remote code), converted
    with the saved plan, and loaded with strict key checking. Student-only folders need the teacher
    (a model, a spec for ``dofla.models.load_teacher``, or the recorded one), whose weights must have the
    fingerprint recorded at saving time.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dofla.models.loading import check_finite_weights

    path = Path(path)
    record = read_record(path)
    plan = ConversionPlan.from_dict(record["plan"])
    torch_dtype = _parse_dtype(dtype)
    weights_file = path / record["weights"]
    if not weights_file.is_file():
        raise DoflaError(f"{weights_file} is missing; the folder is incomplete, save the model again.")
    tokenizer = None
    if record["student_only"]:
        model, tokenizer = _resolve_teacher(teacher, record, dtype, device)
        if is_converted(model):
            raise DoflaError("the teacher given is already converted; pass the plain teacher model.")
        if teacher_fingerprint(model) != record["teacher_fingerprint"]:
            raise DoflaError(
                f"the teacher's weights differ from those {path} was trained on (fingerprint mismatch); "
                f"load the teacher it names ({record.get('teacher') or 'unknown'})."
            )
    else:
        config = teacher_config_of(path, plan)
        with skipped_weight_initialisation():  # every weight is loaded below, under strict key checks
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    convert(model, plan)
    expected = {name for name in model.state_dict() if (is_student_key(name) or not record["student_only"])}
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as error:
        raise DoflaError(
            f"{weights_file} is corrupt or truncated ({error}); the folder is damaged: save the model again."
        ) from None
    check_finite_weights(
        tensors.items(), str(weights_file), "the folder is damaged: convert or train the model again"
    )
    for alias, original in record.get("tied_weights", {}).items():
        if original in tensors and alias in expected:
            tensors[alias] = tensors[original]
    _load_state_strictly(model, tensors, expected, weights_file)
    model.tie_weights()  # tied embeddings (Gemma's) are one parameter again, as in the teacher
    if not record["student_only"] and teacher_fingerprint(model) != record["teacher_fingerprint"]:
        raise DoflaError(
            f"the teacher weights in {weights_file} do not match their recorded fingerprint; save again."
        )
    if teacher is not None and not record["student_only"] and isinstance(teacher, nn.Module):
        if teacher_fingerprint(teacher) != record["teacher_fingerprint"]:
            raise DoflaError(
                f"the teacher given is not the one {path} was converted from (fingerprint mismatch)."
            )
    if torch_dtype is not None or device is not None:
        from dofla.models.loading import resolve_device

        model.to(device=resolve_device(device) if device is not None else None, dtype=torch_dtype)
    if tokenizer is None and any(
        (path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model.dofla_teacher_weights = record.get("teacher_weights")  # kept by save_pretrained
    model.eval()
    return model, tokenizer, plan
