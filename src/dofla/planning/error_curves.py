"""Each layer's measured distillation error as a function of its feature dimension (the input of the
``measured`` allocation and softmax-layer choice, :mod:`dofla.dof.error_curves`).

:func:`measure_error_curves` captures every layer's teacher attention call once (the teacher's q, k, v and
softmax output on calibration rows, teacher-forced, all layers in one forward per batch), then fits, for
each layer and each dimension of ``dims`` (default 16/32/64/128), a fresh student of the planned cell and
feature map for ``steps`` AdamW steps with the distillation's own layer loss, and scores it on held-out
calibration rows. Calibration rows are cut into pieces of ``length`` tokens; the last ``heldout_pieces`` are
held out, each fit step takes one of the others. Three scores (``criterion``):

- ``kl``: the end-to-end KL(teacher || model) per token on the held-out pieces when that layer alone runs its
  fitted student (the forward starts at that layer from the teacher's stored hidden states, so every score
  costs part of one forward) -- the cost of converting that layer, in the model's own units;
- ``kl_scaled`` (default): that KL measured at one dimension only (the middle of ``dims``) and carried to the
  others in proportion to the layer's relative output error (both are quadratic in the output error for
  small errors): one forward per layer instead of one per layer and dimension;
- ``relative``: the held-out attention-output error ||y_s - y_t||^2 / ||y_t||^2 of the layer itself.

:func:`cached_error_curves` keeps each measurement in a file named by its key, so a resumed run or a frontier
grid measures once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dofla.config import ConversionPlan, LayerPlan
from dofla.convert import convert, student_for, unconvert
from dofla.dispatch import AttentionCall
from dofla.distill.losses import LOSSES, layer_loss
from dofla.dof.error_curves import CRITERIA, CURVES_FILE, ErrorCurves
from dofla.errors import DoflaError
from dofla.models.capture import capture_attention
from dofla.models.surgery import (
    architecture,
    autocast_for,
    hidden_states_entering,
    is_converted,
    starting_at_layer,
    students,
)
from dofla.settings import PlanSettings, StudentSettings


@dataclass(frozen=True)
class CurveSettings:
    """What an error-curve measurement fits and how (every field is part of the cache key).

    dims: feature dimensions fitted per layer; steps, lr, loss: each short fit (AdamW steps over the fit rows,
    base learning rate, registered layer-wise loss); length: tokens per calibration piece; heldout_pieces:
    pieces kept out of the fits and scored; criterion: "kl", "kl_scaled" or "relative" (module docstring);
    student: the planned layer (kind, feature map,
    cell, window, sinks, options, share_kv_heads) with its feature_dim replaced by each of ``dims``.
    """

    dims: tuple[int, ...] = (16, 32, 64, 128)
    steps: int = 15
    lr: float = 1e-2
    loss: str = "output_mse"
    length: int = 128
    heldout_pieces: int = 2
    criterion: str = "kl_scaled"
    seed: int = 0
    kind: str = LayerPlan.kind  # the planned layer: its plan's defaults
    feature_map: str = LayerPlan.feature_map
    cell: str = LayerPlan.cell
    window: int = LayerPlan.window
    sinks: int = LayerPlan.sinks
    options: tuple[tuple[str, Any], ...] = ()
    share_kv_heads: bool = LayerPlan.share_kv_heads

    def validate(self) -> None:
        if not self.dims or min(self.dims) < 1 or list(self.dims) != sorted(set(self.dims)):
            raise DoflaError(
                f"the fitted dimensions must be distinct positive integers in increasing order, got {list(self.dims)}."
            )
        if self.steps < 0:
            raise DoflaError(f"the fit steps per dimension must be 0 or more, got {self.steps}.")
        if self.criterion not in CRITERIA:
            raise DoflaError(
                f"unknown error criterion {self.criterion!r}; choose one of: {', '.join(CRITERIA)}."
            )
        if not LOSSES[self.loss].layerwise:
            raise DoflaError(f"the short fits train one layer at a time; {self.loss!r} is not a layer loss.")
        if self.heldout_pieces < 1:
            raise DoflaError(f"at least one held-out calibration piece is needed, got {self.heldout_pieces}.")
        if self.length < 2:
            raise DoflaError(f"calibration pieces need at least 2 tokens, got length {self.length}.")

    def layer_plan(self, feature_dim: int):
        return LayerPlan(
            kind=self.kind,
            feature_map=self.feature_map,
            feature_dim=int(feature_dim),
            share_kv_heads=self.share_kv_heads,
            window=int(self.window),
            options=dict(self.options),
            cell=self.cell,
            sinks=int(self.sinks),
        )


def settings_for(plan: PlanSettings, student: StudentSettings, **curve_options) -> CurveSettings:
    """The curve settings for a plan made from the settings sections ``plan`` (kind, window, sinks,
    per_query_head) and ``student`` (cell, feature_map, cell_options), and the curve knobs
    ``curve_options``."""
    planned = dict(
        kind=plan.kind,
        feature_map=student.feature_map,
        cell=student.cell,
        window=plan.window,
        sinks=plan.sinks,
        share_kv_heads=not plan.per_query_head,
        options=tuple(sorted(student.cell_options.items())),
    )
    if "dims" in curve_options:
        curve_options["dims"] = tuple(int(d) for d in curve_options["dims"])
    known = set(CurveSettings.__dataclass_fields__)
    unknown = sorted(set(curve_options) - known)
    if unknown:
        raise DoflaError(f"unknown error-curve settings {unknown}; known ones are {sorted(known)}.")
    settings = CurveSettings(**{**planned, **curve_options})
    settings.validate()
    return settings


def curves_key(
    settings: CurveSettings, model: torch.nn.Module, rows: torch.Tensor, layers: Sequence[int]
) -> str:
    """sha256 of what the scores depend on: the settings, the calibration token ids, the layers and the teacher
    (its config and a sample of its weights: the same name with other weights is a different key)."""
    return measurement_key(asdict(settings), model, rows, layers)


def measurement_key(
    settings: dict[str, Any], model: torch.nn.Module, rows: torch.Tensor, layers: Sequence[int]
) -> str:
    """sha256 of a measurement's inputs on a teacher: ``settings`` (JSON), the layers, the token ids and the
    teacher (its config and a sample of its weights), for the name of the file that keeps its result."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(json.dumps(sorted(int(layer) for layer in layers)).encode())
    digest.update(rows.to(torch.int64).cpu().numpy().tobytes())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items())[:: max(1, len(model.state_dict()) // 16)]:
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1)[:4096].to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()[:32]


def calibration_rows(batches: Sequence[torch.Tensor]) -> torch.Tensor:
    if not batches:
        raise DoflaError("no calibration batches were given; give at least 2 rows of token ids.")
    lengths = {int(batch.shape[1]) for batch in batches}
    if len(lengths) != 1:
        raise DoflaError(f"calibration batches must share one length, got lengths {sorted(lengths)}.")
    return torch.cat([batch.cpu() for batch in batches])  # (N, T)


def measure_error_curves(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    settings: CurveSettings | None = None,
    *,
    layers: Sequence[int] | None = None,
    progress: bool = False,
) -> ErrorCurves:
    """Each layer's held-out error at each of ``settings.dims`` features, from short teacher-forced fits on
    calibration batches (B, T) of token ids (module docstring). The model is left as it was (unconverted)."""
    settings = settings or CurveSettings()
    settings.validate()
    if is_converted(model):
        raise DoflaError(
            "measure error curves on the unconverted teacher; call dofla.convert.unconvert(model) first."
        )
    facts = architecture(model)
    chosen = list(range(facts.num_layers)) if layers is None else sorted({int(layer) for layer in layers})
    outside = [layer for layer in chosen if not 0 <= layer < facts.num_layers]
    if outside or not chosen:
        raise DoflaError(
            f"layer {outside[0] if outside else chosen} does not exist: the model has layers 0..{facts.num_layers - 1}."
        )
    rows = calibration_rows(batches)
    pieces = _pieces(rows, settings.length)
    if len(pieces) <= settings.heldout_pieces:
        raise DoflaError(
            f"{len(rows)} calibration rows of {rows.shape[1]} tokens give {len(pieces)} pieces of "
            f"{min(settings.length, rows.shape[1])} tokens, too few to hold {settings.heldout_pieces} out and fit on "
            f"the rest; give more calibration rows (more --dof-batches) or fewer held-out pieces."
        )
    started = time.perf_counter()
    fit_pieces, heldout = pieces[: -settings.heldout_pieces], pieces[-settings.heldout_pieces :]
    fit_calls = _captured_calls(model, fit_pieces.split(1), chosen, facts)
    heldout_calls = _captured_calls(model, heldout.split(len(heldout)), chosen, facts)
    scorer = _KlScorer(model, heldout, chosen) if settings.criterion != "relative" else None
    reference = len(settings.dims) // 2  # kl_scaled: the dimension whose KL is measured
    map_heads = facts.num_kv_heads if settings.share_kv_heads else facts.num_heads
    errors, losses, head_errors = [], [], []
    for layer in chosen:
        row_losses, relatives, kls, shares = [], [], {}, []
        for position, dim in enumerate(settings.dims):
            with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
                torch.manual_seed(settings.seed * 1_000_003 + layer * 1_009 + dim)
                student = _fit(settings, facts, layer, dim, [calls[layer] for calls in fit_calls])
            loss, per_head = _heldout_scores(settings, student, [calls[layer] for calls in heldout_calls])
            row_losses.append(loss)
            relatives.append(float(per_head.sum()))
            shares.append(per_head.reshape(map_heads, -1).sum(-1) / per_head.sum().clamp_min(1e-30))
            if settings.criterion == "kl" or (settings.criterion == "kl_scaled" and position == reference):
                kls[position] = scorer.score(layer, student, settings.layer_plan(dim))
        if settings.criterion == "kl":
            row_errors = [kls[position] for position in range(len(settings.dims))]
        elif settings.criterion == "kl_scaled":
            scale = kls[reference] / max(relatives[reference], 1e-30)
            row_errors = [scale * relative for relative in relatives]
        else:
            row_errors = relatives
        if progress:
            print(
                f"error curve layer {layer}: "
                + ", ".join(f"{d}: {e:.4g}" for d, e in zip(settings.dims, row_errors, strict=True))
            )
        errors.append(row_errors)
        losses.append(row_losses)
        head_errors.append(
            [(value * share).tolist() for value, share in zip(row_errors, shares, strict=True)]
        )
    return ErrorCurves(
        dims=list(settings.dims),
        layers=chosen,
        errors=errors,
        layer_loss=losses,
        criterion=settings.criterion,
        settings=asdict(settings),
        key=curves_key(settings, model, rows, chosen),
        seconds=round(time.perf_counter() - started, 2),
        head_errors=head_errors,
    )


def _pieces(rows: torch.Tensor, length: int) -> torch.Tensor:
    """(N, T) -> (N * (T // length), length) consecutive pieces (rows shorter than ``length`` stay whole)."""
    if rows.shape[1] <= length:
        return rows
    count = rows.shape[1] // length
    return rows[:, : count * length].reshape(-1, length)


def _captured_calls(model, batches, layers: list[int], facts) -> list[dict[int, Any]]:
    """One teacher forward per batch: {layer: AttentionCall} with the teacher's q, k, v and output."""
    calls = []
    for captured in capture_attention(model, batches, layers=layers, device=next(model.parameters()).device):
        calls.append(
            {
                layer: AttentionCall(
                    module=facts.attention_modules[layer],
                    layer_index=layer,
                    attention_mask=None,
                    scaling=facts.scalings[layer],
                    **captured[layer],
                )
                for layer in layers
            }
        )
    return calls


def _build(settings: CurveSettings, facts, layer: int, dim: int):
    return student_for(facts, settings.layer_plan(dim), layer)


def _fit(settings: CurveSettings, facts, layer: int, dim: int, calls: list) -> torch.nn.Module:
    """A fresh student of ``layer`` at ``dim`` features after ``settings.steps`` AdamW steps on the fit calls."""
    student = _build(settings, facts, layer, dim)
    groups = [group for group in student.parameter_groups(settings.lr) if group["params"]]
    if not groups or settings.steps == 0:
        return student.eval()
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, weight_decay=0.0)
    student.train()
    for step in range(settings.steps):
        call = calls[step % len(calls)]
        with autocast_for(call.query.device):
            loss = layer_loss(settings.loss, student, call)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
    return student.eval()


@torch.no_grad()
def _heldout_scores(settings: CurveSettings, student, calls: list) -> tuple[float, torch.Tensor]:
    """The held-out layer loss (mean over batches) and each query head's part of the relative output error
    sum||y_s - y_t||^2 / sum||y_t||^2, (H,) float64 (summing to the layer's relative error)."""
    loss, squared_error, squared_norm = 0.0, 0.0, 0.0
    for call in calls:
        loss += float(layer_loss(settings.loss, student, call))
        output = student(
            call.query, call.key, call.value, None, scaling=call.scaling
        ).float()  # (B, T, H, Dv)
        squared_error = squared_error + (output - call.output.float()).pow(2).sum((0, 1, 3)).double()  # (H,)
        squared_norm += float(call.output.float().pow(2).sum())
    return loss / len(calls), squared_error / max(squared_norm, 1e-30)


class _KlScorer:
    """End-to-end KL(teacher || model) per token on held-out rows with one layer converted, each forward
    started at that layer from the teacher's hidden states entering it."""

    def __init__(self, model, heldout: torch.Tensor, layers: list[int]) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.ids = heldout.to(self.device)  # (R, T)
        with torch.no_grad():
            self.teacher_log = torch.log_softmax(
                self.model(input_ids=self.ids, use_cache=False).logits.float(), -1
            )
        self.entering = hidden_states_entering(model, self.ids, layers)

    @torch.no_grad()
    def score(self, layer: int, student, layer_plan) -> float:
        facts = architecture(self.model)
        plan = ConversionPlan(
            model_type=facts.model_type,
            num_layers=facts.num_layers,
            num_heads=facts.num_heads,
            num_kv_heads=facts.num_kv_heads,
            head_dim=facts.head_dim,
            layers=[
                layer_plan if index == layer else LayerPlan(kind="softmax")
                for index in range(facts.num_layers)
            ],
        )
        convert(self.model, plan)
        try:
            students(self.model)[layer].load_state_dict(student.state_dict())
            with starting_at_layer(self.model, layer, self.entering[layer]):
                logits = self.model(input_ids=self.ids, use_cache=False).logits.float()  # (R, T, V)
        finally:
            unconvert(self.model)
        student_log = torch.log_softmax(logits, -1)
        kl = (self.teacher_log.exp() * (self.teacher_log - student_log)).sum(-1)  # (R, T)
        return float(kl.mean())


# ------------------------------------------------------------------------------------------ caching

_CACHE_FOLDERS: list[Path] = []


@contextlib.contextmanager
def curve_cache(folder: str | Path) -> Iterator[Path]:
    """Within this block, :func:`cached_error_curves` without a folder keeps its curves in ``folder`` (a
    frontier grid measures the curves once for all its runs)."""
    _CACHE_FOLDERS.append(Path(folder))
    try:
        yield Path(folder)
    finally:
        _CACHE_FOLDERS.pop()


def cache_folder(folder: str | Path | None) -> Path | None:
    """Where a cached measurement is written: ``folder``, else the innermost :func:`curve_cache` (or None)."""
    return Path(folder) if folder is not None else (_CACHE_FOLDERS[-1] if _CACHE_FOLDERS else None)


def cached_error_curves(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    settings: CurveSettings,
    *,
    layers: Sequence[int] | None = None,
    folder: str | Path | None = None,
    progress: bool = False,
) -> ErrorCurves:
    """:func:`measure_error_curves`, read from a file with the same key in ``folder`` or in any enclosing
    :func:`curve_cache` folder, else measured; then written to ``folder`` (default: the innermost cache
    folder; none at all: not written) atomically as ``error_curves.json`` and ``error_curves-KEY.json`` (one
    file per key, so different settings do not overwrite each other)."""
    settings.validate()
    target = cache_folder(folder)
    if target is None:
        return measure_error_curves(model, batches, settings, layers=layers, progress=progress)
    count = architecture(model).num_layers
    chosen = list(range(count)) if layers is None else sorted({int(layer) for layer in layers})
    name = f"error_curves-{curves_key(settings, model, calibration_rows(batches), chosen)}.json"
    found = next(
        (place / name for place in [target, *reversed(_CACHE_FOLDERS)] if (place / name).is_file()), None
    )
    if found is not None:
        curves = ErrorCurves.load(found)
    else:
        curves = measure_error_curves(model, batches, settings, layers=chosen, progress=progress)
    if found != target / name or not (target / CURVES_FILE).is_file():
        curves.save(target / name)
        curves.save(target / CURVES_FILE)  # the curves this folder's plan used
    return curves
