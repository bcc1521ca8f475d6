"""Write a converted model to a folder: ``config.json`` (a :class:`dofla.auto.DoflaConfig`, ``model_type`` "dofla": the
teacher's config and the plan), ``model.safetensors`` (all weights; tied weights stored once),
``dofla_plan.json`` (the plan, the teacher's fingerprint, the format), tokenizer files. ``student_only=True``
writes ``student.safetensors`` with only the dofla parameters. A converted model's class gains
:class:`ConvertedModel`, so its ``save_pretrained`` writes such a folder; :mod:`dofla.loading` reads one back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig

from dofla import dispatch, outputs
from dofla._registration import MODEL_TYPE
from dofla.config import ConversionPlan
from dofla.errors import DoflaError
from dofla.io import (
    remove_stale_temporaries,
    save_safetensors_atomic,
    temporary_folder,
    temporary_prefix,
    to_json,
    write_text_atomic,
)
from dofla.models.adapters import get_adapter

PLAN_FILE = "dofla_plan.json"
WEIGHTS_FILE = "model.safetensors"
STUDENT_WEIGHTS_FILE = "student.safetensors"
SAVE_FORMAT = 1


def is_student_key(name: str) -> bool:
    return f".{dispatch.STUDENT_ATTRIBUTE}." in f".{name}"


def teacher_fingerprint(model: nn.Module) -> str:
    """sha256 over the names, shapes and bfloat16-rounded values of the model's non-dofla tensors.

    Values are rounded to bfloat16 before hashing, so the same teacher loaded in float32 or bfloat16 gives
    the same fingerprint: it tells a different teacher apart, not a different precision.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if is_student_key(name):
            continue
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        values = tensor.detach().to("cpu", torch.bfloat16).contiguous().reshape(-1)
        digest.update(values.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def _deduplicated(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that share memory with an earlier one (tied embeddings); returns (tensors, aliases)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        identity = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if tensor.numel() and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        kept[name] = tensor
    return kept, aliases


MODEL_KIND = "converted model"  # the kind in the marker of a saved folder (dofla.outputs)


def teacher_architecture(model: nn.Module) -> dict[str, Any]:
    """The shape facts that tell teachers apart (recorded at saving time, compared by :func:`check_teacher`)."""
    adapter = get_adapter(model)
    config = model.config.get_text_config(decoder=True)
    return {
        "model_type": str(adapter.model_type),
        "num_layers": int(adapter.num_layers),
        "num_heads": int(adapter.num_heads),
        "num_kv_heads": int(adapter.num_kv_heads),
        "head_dim": int(adapter.head_dim),
        "hidden_size": int(adapter.hidden_size),
        "vocab_size": int(getattr(config, "vocab_size", 0) or 0),
    }


def check_finite_model(
    model: nn.Module, input_ids: torch.Tensor | None = None, what: str = "the model"
) -> None:
    """Refuse a model whose weights, or whose logits on ``input_ids`` (B, T), hold NaN or infinite values."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DoflaError(
                f"{what} holds NaN or infinite values (first in {name}); it was not saved: lower the learning "
                "rate and train again."
            )
    if input_ids is None or len(input_ids) == 0:
        return
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False).logits
    if not bool(torch.isfinite(logits).all()):
        raise DoflaError(
            f"{what} gives NaN or infinite logits on held-out text; it was not saved: lower the learning rate "
            "(--lr, --lora-lr) and train again."
        )


def check_model_folder(out_dir: str | Path, *, overwrite: bool, inputs=()) -> Path:
    """Refuse, before any work, a folder :func:`save_converted` must not write; returns it resolved.

    It must be new, empty, or (with ``overwrite``) a converted model holding only the files dofla wrote;
    see :func:`dofla.outputs.check_output_folder` for the rest (inputs, files, other dofla outputs).
    """
    out_dir = outputs.check_output_folder(out_dir, MODEL_KIND, inputs=inputs)
    if out_dir.is_mount():  # the model is written beside its folder and renamed into place
        raise DoflaError(
            f"{out_dir} is a mount point, which a saved model cannot replace (dofla writes the model beside "
            f"its folder and renames it into place); give a folder inside it, e.g. {out_dir / 'model'}."
        )
    if out_dir.is_dir() and outputs.user_entries(out_dir):
        if not overwrite:
            raise DoflaError(
                f"{out_dir} already holds a converted model; pass --overwrite to replace it, or choose another "
                "folder."
            )
        foreign = outputs.foreign_files(out_dir)
        if foreign:
            raise DoflaError(
                f"{out_dir} holds files dofla did not write ({', '.join(foreign[:3])}); move them away and "
                "save again."
            )
    return out_dir


def save_converted(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer=None,
    extra_metadata: dict[str, Any] | None = None,
    student_only: bool = False,
    overwrite: bool = False,
    teacher_weights: str | None = None,
) -> Path:
    """Write a converted model to ``out_dir`` atomically (a temporary sibling folder renamed into place).

    extra_metadata goes into the saved plan's ``metadata`` (e.g. ``{"teacher": "smollm2-135m"}``, which
    ``load_converted`` uses to find the teacher of a student-only folder). ``out_dir`` must be new, empty,
    or (with ``overwrite``) a converted model saved by dofla holding only the files dofla wrote; it is
    replaced only once the new folder is complete. A model with NaN or infinite values is refused.
    teacher_weights: the teacher's :func:`teacher_fingerprint` before any training of its own weights (a
    LoRA stage changes them); default: that of ``model``'s non-dofla weights.
    """
    plan: ConversionPlan | None = getattr(model, "dofla_plan", None)
    if plan is None:
        raise DoflaError(
            "this model is not converted; convert it with dofla.convert.convert(model, plan) first."
        )
    given, out_dir = Path(out_dir), check_model_folder(out_dir, overwrite=overwrite)
    check_finite_model(model)
    saved_plan = ConversionPlan.from_dict(plan.to_dict())
    saved_plan.metadata = {**saved_plan.metadata, **(extra_metadata or {})}
    state = model.state_dict()
    tensors, aliases = _deduplicated(state)
    if student_only:
        tensors = {name: tensor for name, tensor in tensors.items() if is_student_key(name)}
        aliases = {}
    fingerprint = teacher_fingerprint(model)
    record = {
        "format": SAVE_FORMAT,
        "student_only": bool(student_only),
        "weights": STUDENT_WEIGHTS_FILE if student_only else WEIGHTS_FILE,
        "teacher_fingerprint": fingerprint,
        "teacher": saved_plan.metadata.get("teacher") or getattr(model.config, "_name_or_path", "") or None,
        "teacher_architecture": teacher_architecture(model),
        "teacher_weights": teacher_weights or fingerprint,
        "tied_weights": aliases,
        "plan": saved_plan.to_dict(),
    }
    with outputs.output_lock(out_dir):
        check_model_folder(out_dir, overwrite=overwrite)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out_dir.parent, out_dir.name)
        remove_stale_temporaries(out_dir)
        umask = os.umask(0)
        os.umask(umask)

        def failure(reason: str) -> str:
            return (
                f"could not write the converted model to {out_dir} ({reason}); nothing was replaced: free some "
                "disk space or choose another --out."
            )

        with temporary_folder(out_dir.parent, out_dir.name, failure) as temporary:
            # the registered "dofla" config (dofla.auto.DoflaConfig): the teacher's config and the plan
            config = AutoConfig.for_model(
                MODEL_TYPE, base_config=model.config.to_dict(), plan=saved_plan.to_dict()
            )
            config.save_pretrained(temporary)
            save_safetensors_atomic(tensors, temporary / record["weights"], metadata={"format": "pt"})
            if tokenizer is not None:
                tokenizer.save_pretrained(temporary)
            write_text_atomic(temporary / PLAN_FILE, to_json(record, indent=2) + "\n")
            outputs.write_marker(
                temporary, MODEL_KIND, files=sorted(item.name for item in temporary.iterdir())
            )
            # temporary files and folders are private; the saved model gets ordinary permissions
            for item in temporary.iterdir():
                item.chmod(0o666 & ~umask)
            temporary.chmod(0o777 & ~umask)
            if (
                out_dir.exists()
            ):  # replace: move the old folder aside first so one complete folder always exists
                old = Path(
                    tempfile.mkdtemp(prefix=temporary_prefix(out_dir.name), suffix=".old", dir=out_dir.parent)
                )
                os.replace(out_dir, old / out_dir.name)
                os.replace(temporary, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(temporary, out_dir)
    return given


class ConvertedModel:
    """Mixed into the class of every converted transformers model by :func:`dofla.convert.convert`.

    ``save_pretrained`` writes a converted folder (:func:`dofla.saving.save_converted`), which
    ``AutoModelForCausalLM.from_pretrained`` opens again after ``import dofla``.
    """

    def save_pretrained(self, save_directory, is_main_process: bool = True, **kwargs: Any):
        if kwargs.get("push_to_hub"):
            raise DoflaError("dofla saves converted models to a local folder only; push the folder yourself.")
        if kwargs.get("state_dict") is not None:
            raise DoflaError("save_pretrained of a converted model saves its own weights; drop state_dict.")
        if not is_main_process:
            return None
        save_converted(
            self,
            save_directory,
            overwrite=True,
            teacher_weights=getattr(self, "dofla_teacher_weights", None),
        )
        return None


_CONVERTED_CLASSES: dict[type, type] = {}


def converted_class(base: type) -> type:
    """``base`` with :class:`ConvertedModel` mixed in (one class per base, named ``Dofla<base name>``)."""
    if issubclass(base, ConvertedModel):
        return base
    if base not in _CONVERTED_CLASSES:
        _CONVERTED_CLASSES[base] = type(
            f"Dofla{base.__name__}",
            (ConvertedModel, base),
            {"__module__": __name__, "__qualname__": f"Dofla{base.__name__}", "_dofla_base_class": base},
        )
    return _CONVERTED_CLASSES[base]
