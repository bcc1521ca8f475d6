"""Convert a transformers model in place from a ConversionPlan; save and reload converted models.

Conversion attaches a :class:`dofla.attention.LinearAttention` as ``dofla_student`` to each selected
attention module and routes attention through :mod:`dofla.dispatch`; the teacher's projections, rotary
and norms are reused by reference, so the same code serves every family. A forward pre-hook on each
converted attention module swaps a :class:`dofla.cache.RecurrentCacheLayer` into the cache it is given
(``generate()`` works unchanged) and hands that layer to the student for the call.

Saved folder (``save_converted``): ``config.json`` (a :class:`dofla.auto.DoflaConfig`, ``model_type``
"dofla": the teacher's config and the plan), ``model.safetensors`` (all weights; tied weights stored once),
``dofla_plan.json`` (the plan, the teacher's fingerprint, the format), tokenizer files.
``student_only=True`` writes ``student.safetensors`` with only the dofla parameters. After ``import dofla``
the folder also opens with ``AutoModelForCausalLM.from_pretrained`` (see :mod:`dofla.auto`); a converted
model's ``save_pretrained`` writes such a folder. Folders saved before config.json became a DoflaConfig
(it held the teacher's config) still load here.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from dofla import dispatch
from dofla.attention import LinearAttention
from dofla.auto import DoflaConfig, converted_class
from dofla.cache import attach_cache_layer, attach_kv_layer
from dofla.cells import build_student, cell_class
from dofla.config import ConversionPlan
from dofla.dof import make_plan
from dofla.errors import DoflaError
from dofla.io import save_safetensors_atomic, to_json, write_text_atomic
from dofla.models.adapters import CACHE_ARGUMENTS

PLAN_FILE = "dofla_plan.json"
WEIGHTS_FILE = "model.safetensors"
STUDENT_WEIGHTS_FILE = "student.safetensors"
SAVE_FORMAT = 1
STUDENT_PREFIX = dispatch.STUDENT_ATTRIBUTE  # every dofla parameter name contains ".dofla_student."
_HOOKS_ATTRIBUTE = "_dofla_hook_handles"


@dataclass
class Architecture:
    """What conversion needs to know about a model: shape facts and its attention modules by layer."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_modules: list[nn.Module]
    scalings: list[float]
    softcaps: list[float | None]  # the teacher's logit soft-capping per layer (Gemma 2 and 3)

    def student_for(self, layer_plan, index: int) -> LinearAttention:
        """The student for layer ``index`` as ``layer_plan`` says, on the device of that layer's attention."""
        shape = dict(
            layer_index=index,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scaling=self.scalings[index],
            softcap=self.softcaps[index],
        )
        module = self.attention_modules[index]
        # a cell with projections of its own starts from the teacher's (dofla.cells.gated_delta_net)
        from_teacher = getattr(cell_class(layer_plan.cell), "from_teacher_attention", None)
        if from_teacher is not None:
            return from_teacher(layer_plan, module, **shape)
        student = build_student(layer_plan, **shape)
        parameter = next(module.parameters(), None)
        return student.to(parameter.device) if parameter is not None else student


def architecture(model: nn.Module) -> Architecture:
    """Architecture facts and attention modules, from ``dofla.models.get_adapter`` (one table for all)."""
    from dofla.models import get_adapter

    adapter = get_adapter(model)
    modules = list(adapter.attention_modules(model))
    return Architecture(
        model_type=str(adapter.model_type),
        num_layers=int(adapter.num_layers),
        num_heads=int(adapter.num_heads),
        num_kv_heads=int(adapter.num_kv_heads),
        head_dim=int(adapter.head_dim),
        attention_modules=modules,
        scalings=[float(adapter.attention_scaling(index, model)) for index in range(len(modules))],
        softcaps=[adapter.attention_softcap(module) for module in modules],
    )


def plan_for(
    model: nn.Module,
    kind: str = "linear",
    feature_map: str = "learnable_prf",
    feature_dim: int = 64,
    layers: list[int] | None = None,
    window: int = 64,
    share_kv_heads: bool = True,
    options: dict[str, Any] | None = None,
    cell: str = "linear",
    sinks: int = 0,
    convert_windowed: bool = False,
) -> ConversionPlan:
    """A plan giving every layer in ``layers`` the same kind, cell, map and dimension: the ``fix`` allocation
    of :func:`dofla.dof.make_plan` (default layers: those whose cache grows, all with ``convert_windowed``)."""
    return make_plan(
        model,
        budget=int(feature_dim),
        variant="fix",
        kind=kind,
        feature_map=feature_map,
        window=window,
        share_kv_heads=share_kv_heads,
        layers=layers,
        options=options,
        cell=cell,
        sinks=sinks,
        convert_windowed=convert_windowed,
        metadata={"made_by": "plan_for"},
    )


def _attention_cache_argument(module: nn.Module, args: tuple, kwargs: dict):
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    if args:  # passed by position (not done by the supported families, but cheap to allow)
        parameters = list(inspect.signature(module.forward).parameters)
        for name in CACHE_ARGUMENTS:
            if name in parameters and parameters.index(name) < len(args):
                return args[parameters.index(name)]
    return None


def _before_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Give the student this call's cache layer, swapping a RecurrentCacheLayer into the cache if needed."""
    student = getattr(module, STUDENT_PREFIX)
    student.pending_cache_layer = None
    if getattr(student, "reads_hidden_states", False):  # a cell with its own projections
        student.pending_hidden_states = args[0] if args else kwargs.get("hidden_states")
    if dispatch.is_teacher_forced():  # the teacher's softmax runs and needs its ordinary cache layer
        return
    cache = _attention_cache_argument(module, args, kwargs)
    if cache is not None:
        # the slot the module itself updates (its layer_idx), which is the plan's layer index
        slot = int(getattr(module, "layer_idx", student.layer_index))
        student.pending_cache_layer = attach_cache_layer(cache, slot)


def _before_kept_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A softmax layer the plan keeps: its cache layer grows in place instead of by concatenation."""
    cache = _attention_cache_argument(module, args, kwargs)
    if cache is not None:
        attach_kv_layer(cache, int(getattr(module, "layer_idx", module._dofla_kept_index)))


def _after_attention(module: nn.Module, args: tuple, output) -> None:
    student = getattr(module, STUDENT_PREFIX)
    student.pending_cache_layer = None
    if getattr(student, "reads_hidden_states", False):
        student.pending_hidden_states = None


def is_converted(model: nn.Module) -> bool:
    return getattr(model, "dofla_plan", None) is not None


def convert(model: nn.Module, plan: ConversionPlan) -> nn.Module:
    """Convert ``model`` in place as ``plan`` says and return it.

    Everything is checked before the model changes: the plan's own consistency, that it was made for this
    architecture (type, layers, heads, head size), and that every student can be built.
    """
    if is_converted(model):
        raise DoflaError("this model is already converted; call dofla.convert.unconvert(model) first.")
    if not isinstance(plan, ConversionPlan):
        raise DoflaError(
            f"convert needs a ConversionPlan, got {type(plan).__name__}; load one with ConversionPlan.load."
        )
    plan.validate()
    facts = architecture(model)
    plan.check_matches(
        facts.model_type, facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim
    )
    if len(facts.attention_modules) != facts.num_layers:
        raise DoflaError(
            f"found {len(facts.attention_modules)} attention modules in a {facts.num_layers}-layer "
            f"{facts.model_type} model; this architecture is not supported."
        )
    built: dict[int, LinearAttention] = {}
    for index in plan.converted_layers:
        built[index] = facts.student_for(plan.layers[index], index)

    dispatch.install(model)
    for index, student in built.items():
        module = facts.attention_modules[index]
        setattr(module, STUDENT_PREFIX, student)
        handles = [
            module.register_forward_pre_hook(_before_attention, with_kwargs=True),
            module.register_forward_hook(_after_attention),
        ]
        setattr(module, _HOOKS_ATTRIBUTE, handles)
    for index, module in enumerate(facts.attention_modules):
        if index not in built:
            module._dofla_kept_index = index
            handle = module.register_forward_pre_hook(_before_kept_attention, with_kwargs=True)
            setattr(module, _HOOKS_ATTRIBUTE, [handle])
    model.dofla_plan = plan
    if isinstance(model, PreTrainedModel):  # save_pretrained now writes a converted folder
        model.__class__ = converted_class(type(model))
    if plan.position_period is not None:
        set_position_period(model, plan.position_period)
    if plan.sinks_at_edge:
        set_sinks_at_edge(model, True)
    return model


_PERIOD_HOOK_ATTRIBUTE = "_dofla_position_period_hook"


def set_position_period(model: nn.Module, period: int | None) -> None:
    """Let every converted layer's memory read rotary positions modulo ``period`` tokens (None: the true
    positions), and record it in the model's plan (saved with it): :mod:`dofla.rotary`."""
    from dofla.rotary import check_period, rotary_embedding, wrap_positions_hook

    check_period(period)
    plan = getattr(model, "dofla_plan", None)
    if plan is None:
        raise DoflaError("a position period applies to a converted model; convert it first.")
    found = None if period is None else rotary_embedding(model)
    if period is not None and found is None:
        raise DoflaError(
            "this model has no rotary position embeddings, so a position period has nothing to wrap; leave "
            "it unset."
        )
    previous = getattr(model, _PERIOD_HOOK_ATTRIBUTE, None)
    if previous is not None:
        previous.remove()
        delattr(model, _PERIOD_HOOK_ATTRIBUTE)
    layers = students(model)
    # no softmax anywhere (every layer converted, none with a window): the positions wrapped once, at the
    # rotary embedding; else each converted layer turns its memory's q and k back itself
    whole = len(layers) == plan.num_layers and all(student.kind == "linear" for student in layers.values())
    per_layer = found is not None and not whole
    for student in layers.values():
        wraps = per_layer and student.uses_features  # a window-only cell has no memory to wrap
        student.position_period = period if wraps else None
        student.rotary_frequencies = found[1] if wraps else None
    if found is not None and whole:
        handle = found[0].register_forward_pre_hook(wrap_positions_hook(period), with_kwargs=True)
        setattr(model, _PERIOD_HOOK_ATTRIBUTE, handle)
    plan.position_period = period


def set_sinks_at_edge(model: nn.Module, on: bool) -> None:
    """Let every converted layer's window see its sinks from the window's edge (``on``) or at their true
    positions, and record it in the model's plan (saved with it). From the edge, token t scores the sinks
    with its query turned back to position ``min(t, window + sinks)`` (``LinearAttention.edge_sink_query``):
    they stay just before its window, at the distances the teacher read them in training, instead of
    moving ever further away (the teacher stops reading sinks some thousands of tokens away). Needs the
    model's one rotary embedding with fixed frequencies; layers without a window or sinks are unchanged."""
    from dofla.rotary import check_edge_sinks

    plan = getattr(model, "dofla_plan", None)
    if plan is None:
        raise DoflaError("sinks at the window's edge apply to a converted model; convert it first.")
    frequencies = check_edge_sinks(model) if on else None
    for student in students(model).values():
        student.edge_sink_frequencies = frequencies
    plan.sinks_at_edge = bool(on)


def set_compiled_steps(model: nn.Module, on: bool) -> None:
    """Let every converted layer whose cell has one decode through its compiled step (``on``) or its eager
    one: :mod:`dofla.ops.compiled` (the CPU, generation without autograd; the first step of each shape
    compiles). A setting of this process, not saved with the model."""
    if getattr(model, "dofla_plan", None) is None:
        raise DoflaError("compiled decoding steps apply to a converted model; convert it first.")
    for student in students(model).values():
        student.compiled_steps = bool(on)


def unconvert(model: nn.Module) -> nn.Module:
    """Remove the students and hooks: the model is its teacher again (the dispatcher stays installed)."""
    period_hook = getattr(model, _PERIOD_HOOK_ATTRIBUTE, None)
    if period_hook is not None:
        period_hook.remove()
        delattr(model, _PERIOD_HOOK_ATTRIBUTE)
    for module in model.modules():
        for handle in getattr(module, _HOOKS_ATTRIBUTE, []):
            handle.remove()
        for name in (_HOOKS_ATTRIBUTE, "_dofla_kept_index"):
            if hasattr(module, name):
                delattr(module, name)
        if isinstance(getattr(module, STUDENT_PREFIX, None), nn.Module):
            delattr(module, STUDENT_PREFIX)
    model.dofla_plan = None
    model.__class__ = getattr(type(model), "_dofla_base_class", type(model))
    return model


def students(model: nn.Module) -> dict[int, LinearAttention]:
    """The converted layers' students by layer index."""
    return {module.layer_index: module for module in model.modules() if isinstance(module, LinearAttention)}


# ---------------------------------------------------------------------------------------------------- saving


def _is_student_key(name: str) -> bool:
    return f".{STUDENT_PREFIX}." in f".{name}"


def teacher_fingerprint(model: nn.Module) -> str:
    """sha256 over the names, shapes and bfloat16-rounded values of the model's non-dofla tensors.

    Values are rounded to bfloat16 before hashing, so the same teacher loaded in float32 or bfloat16 gives
    the same fingerprint: it tells a different teacher apart, not a different precision.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if _is_student_key(name):
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
    from dofla.models import get_adapter

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
    from dofla import outputs

    out_dir = outputs.check_output_folder(out_dir, MODEL_KIND, inputs=inputs)
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
    from dofla import outputs
    from dofla.io import remove_stale_temporaries, temporary_prefix

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
        tensors = {name: tensor for name, tensor in tensors.items() if _is_student_key(name)}
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
        temporary = Path(
            tempfile.mkdtemp(prefix=temporary_prefix(out_dir.name), suffix=".tmp", dir=out_dir.parent)
        )
        umask = os.umask(0)
        os.umask(umask)
        try:
            DoflaConfig.for_model(model, saved_plan).save_pretrained(temporary)
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
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
    return given


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


def _skipped_weight_initialisation():
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
    return isinstance(config, dict) and config.get("model_type") != DoflaConfig.model_type


def _teacher_config(path: Path, plan: ConversionPlan):
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
    if not isinstance(config, DoflaConfig):
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
        config = _teacher_config(path, plan)
        with _skipped_weight_initialisation():  # every weight is loaded below, under strict key checks
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    convert(model, plan)
    expected = {name for name in model.state_dict() if (_is_student_key(name) or not record["student_only"])}
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
