"""The distillation training loop: read it top to bottom.

``distill(model, train, heldout, config, run_dir)`` trains the students of a converted model on packed
token sequences for a token budget: AdamW with linear warm-up and cosine decay, gradient clipping,
held-out validation every ``eval_every`` steps with early stopping (the best students are kept), JSONL
logs, atomic checkpoints every ``checkpoint_every`` steps and exact resumption. Layer-wise losses
(softmax, l2, output_mse) train every converted layer at once from one teacher-forced forward per batch;
the ``direct`` loss trains the students end to end on next-token cross-entropy (+ KL to the teacher).
Layer-sharded runs can start each forward from teacher hidden states stored on disk
(:mod:`dofla.distill.hidden_store`) instead of running the teacher's earlier layers.

Under ``torch.distributed`` (e.g. ``torchrun``, gloo on CPUs) the work is sharded by data or by layers
(:class:`dofla.distill.distributed.ProcessShare`); either way the result equals a single-process run up to
float rounding.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from dofla import dispatch
from dofla.distill.checkpoint import (
    append_log,
    latest_checkpoint,
    restore_training_state,
    save_training_state,
    settings_digest,
    write_log,
)
from dofla.distill.curriculum import LengthStage, length_stages, stage_at, tokens_after
from dofla.distill.distributed import ProcessShare
from dofla.distill.graphed import LayerLossGraphs
from dofla.distill.hidden_store import StoredStart, TeacherStates, start_options, stored_start
from dofla.distill.losses import LOSSES
from dofla.distill.nonfinite import NonFinitePolicy, first_bad_layer
from dofla.distill.teacher_forcing import freeze_teacher, teacher_forced_step, teacher_forced_step_from_states
from dofla.errors import DoflaError
from dofla.io import to_json, write_text_atomic
from dofla.models.surgery import autocast_for
from dofla.outputs import remove_known_files
from dofla.run_config import LinearizeConfig
from dofla.settings import DistillSettings

CONFIG_FILE = "distill_config.json"
LOG_FILE = "log.jsonl"
CHECKPOINT_FOLDER = "checkpoints"
# Fields that do not change the result, so a resumed run may differ in them (sharding and stored teacher
# states train the same students up to rounding).
_NOT_IN_FINGERPRINT = ("checkpoint_every", "cuda_graphs", "sharding", "teacher_states")


@dataclass
class DistillResult:
    steps: int
    tokens: int
    seconds: float
    history: list[dict] = field(default_factory=list)  # one record per step and per evaluation
    best_val_loss: float | None = None
    final_val_loss: float | None = None
    val_layer_losses: dict[int, float] = field(default_factory=dict)
    stopped_early: bool = False
    skipped_steps: int = 0
    stages: list[dict] = field(default_factory=list)  # a length curriculum's stages (LengthStage.summary)


def learning_rate_factor(step: int, total_steps: int, settings) -> float:
    """Linear warm-up to 1 then cosine decay to ``min_lr_fraction`` (step counted from 0); ``settings``: a
    section with ``warmup_fraction`` and ``min_lr_fraction`` (``distill`` or ``lora``)."""
    warmup = max(1, round(settings.warmup_fraction * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return settings.min_lr_fraction + (1 - settings.min_lr_fraction) * 0.5 * (
        1 + math.cos(math.pi * progress)
    )


def batch_indices(step: int, batch_size: int, num_sequences: int, seed: int) -> list[int]:
    """Sequence indices of batch ``step``: a fresh seeded permutation every pass over the data.

    A pure function of (step, seed), so a resumed run sees exactly the batches it would have seen.
    """
    indices: list[int] = []
    position, end = step * batch_size, (step + 1) * batch_size
    while position < end:  # one permutation for each pass the batch reaches into
        epoch, offset = divmod(position, num_sequences)
        take = min(end - position, num_sequences - offset)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        indices += torch.randperm(num_sequences, generator=generator)[offset : offset + take].tolist()
        position += take
    return indices


def run_fingerprint(
    settings: DistillSettings,
    seed: int,
    model: nn.Module,
    train: torch.Tensor,
    layers: list[int],
    stages: list[LengthStage] | None = None,
) -> str:
    """A hash of what determines the result: settings, seed, plan, trained layers and training data (with a
    length curriculum, every stage's rows and batch too)."""
    named = {name: value for name, value in asdict(settings).items() if name not in _NOT_IN_FINGERPRINT}
    named["seed"] = seed
    if not named["length_schedule"]:  # a run without a curriculum hashes as it did before there was one
        del named["length_schedule"]
    digest = settings_digest(named, getattr(model, "dofla_plan", None))
    digest.update(f"{tuple(train.shape)} {layers}".encode())
    digest.update(train.to(torch.int64).cpu().numpy().tobytes())
    for stage in stages if stages is not None and len(stages) > 1 else ():
        digest.update(f"{stage.length} {stage.batch_size} {stage.steps} {tuple(stage.rows.shape)}".encode())
        digest.update(stage.rows.to(torch.int64).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _check_sequences(name: str, sequences: torch.Tensor, minimum: int) -> None:
    if sequences.dim() != 2 or sequences.shape[0] < minimum or sequences.shape[1] < 2:
        raise DoflaError(
            f"the {name} data has shape {tuple(sequences.shape)}; it needs at least {minimum} sequences of "
            "2 or more tokens: give more text or a shorter --seq-len."
        )


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


def _optimizer(students: dict[int, nn.Module], settings: DistillSettings) -> torch.optim.AdamW:
    """AdamW over every student's parameter groups (each group's own rate kept as its ``initial_lr``)."""
    groups = [group for index in sorted(students) for group in students[index].parameter_groups(settings.lr)]
    for group in groups:
        group["initial_lr"] = group["lr"]
    return torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay)


def step_loss(
    model,
    students,
    input_ids,
    settings: DistillSettings,
    *,
    backward: bool,
    loss_weight: float = 1.0,
    start_states: torch.Tensor | None = None,
    start_layer: int = 0,
    graphs: LayerLossGraphs | None = None,
):
    """Mean loss over layers (layer-wise) or the direct loss for one batch; (mean, {layer: loss}).

    start_states: the teacher's stored hidden states (B, T, hidden) entering ``start_layer``; the layer-wise
    forward then starts there instead of at the embeddings. graphs: the layers' losses replayed from CUDA
    graphs (with ``backward``).
    """
    if LOSSES[settings.loss].layerwise:
        options = dict(backward=backward, query_chunk=settings.query_chunk, loss_weight=loss_weight)
        options["graphs"] = graphs
        if start_states is None:
            layer_losses = teacher_forced_step(model, input_ids, students, settings.loss, **options)
        else:
            layer_losses = teacher_forced_step_from_states(
                model, input_ids, start_layer, start_states, students, settings.loss, **options
            )
        return sum(layer_losses.values()) / len(layer_losses), layer_losses
    teacher_logits = None
    if settings.kl_weight > 0:
        with torch.no_grad(), dispatch.teacher_forced():
            teacher_logits = model(input_ids=input_ids, use_cache=False).logits
    with torch.set_grad_enabled(backward), autocast_for(input_ids.device):
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = LOSSES[settings.loss].function(
            logits,
            input_ids,
            teacher_logits,
            kl_weight=settings.kl_weight,
            temperature=settings.temperature,
        )
    if backward:
        (loss * loss_weight).backward()
    return float(loss.detach()), {}


def evaluate(
    model, students, heldout: torch.Tensor, settings: DistillSettings, stored: StoredStart | None = None
) -> tuple[float, dict[int, float]]:
    """Mean held-out loss over the first ``eval_batches`` batches, and per layer (layer-wise losses).

    stored: the held-out sequences' teacher states (from ``heldout_teacher_states`` of :func:`distill`).
    """
    device = next(model.parameters()).device
    totals: dict[int, float] = {}
    means = []
    for start in range(
        0, min(len(heldout), settings.eval_batches * settings.batch_size), settings.batch_size
    ):
        batch = heldout[start : start + settings.batch_size].to(device)
        options = start_options(stored, range(start, start + len(batch)), device)
        with torch.no_grad():
            mean, layer_losses = step_loss(model, students, batch, settings, backward=False, **options)
        means.append(mean)
        for layer, value in layer_losses.items():
            totals[layer] = totals.get(layer, 0.0) + value
    count = max(1, len(means))
    return sum(means) / count, {layer: value / count for layer, value in totals.items()}


class _Run:
    """What a run keeps and writes as it trains: the step, the log, the best students on held-out data and
    early stopping, and (with a ``run_dir``) its settings, log and checkpoints, read back by ``resume``."""

    def __init__(self, run_dir, writes: bool, fingerprint: str, trainable, optimizer, max_bad_steps: int):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.checkpoints = self.run_dir / CHECKPOINT_FOLDER if self.run_dir is not None else None
        self.writes, self.fingerprint = (
            writes,
            fingerprint,
        )  # layer sharding: every rank keeps its own run_dir
        self.trainable, self.optimizer = trainable, optimizer
        self.policy = NonFinitePolicy("distillation", max_bad_steps, "lower --lr or try another feature map")
        self.step, self.history = 0, []
        self.best_val, self.evals_since_best, self.stopped_early = math.inf, 0, False
        self.best_state: dict[str, torch.Tensor] = {}

    def begin(self, resume: bool, settings: dict) -> None:
        """Refuse an earlier run's folder without ``resume``; with it, continue from its newest checkpoint."""
        check_run_folder(self.run_dir, resume)
        if resume:
            tensors, state = restore_training_state(
                latest_checkpoint(self.checkpoints),
                self.trainable,
                self.optimizer,
                self.policy,
                extra_keys=("best_val", "evals_since_best"),
                fingerprint=self.fingerprint,
                foreign=f"the checkpoint in {self.checkpoints} belongs to a different run (other settings, plan or "
                "data); use the same command as the interrupted run, or another --out to start a new one.",
                damaged="start over with --overwrite.",
            )
            self.best_state = {
                name[len("best/") :]: t for name, t in tensors.items() if name.startswith("best/")
            }
            self.step, self.history = state["step"], state["history"]
            self.best_val = state["best_val"] if state["best_val"] is not None else math.inf
            self.evals_since_best = state["evals_since_best"]
        if self.run_dir is not None and self.writes:
            write_text_atomic(self.run_dir / CONFIG_FILE, to_json(settings, indent=2) + "\n")
            write_log(self.run_dir / LOG_FILE, self.history)

    def log(self, record: dict) -> None:
        self.history.append(record)
        if self.run_dir is not None and self.writes:
            append_log(self.run_dir / LOG_FILE, record)

    def validated(self, val_loss: float, patience: int, last_stage: bool) -> None:
        """Keep the students if ``val_loss`` is the best yet; stop once ``patience`` evaluations did not
        improve (a length curriculum stops early only in its last stage: the run always trains at length)."""
        if val_loss < self.best_val:
            self.best_val, self.evals_since_best = val_loss, 0
            self.best_state = {name: parameter.detach().clone() for name, parameter in self.trainable.items()}
        else:
            self.evals_since_best += 1
            self.stopped_early = bool(patience) and self.evals_since_best >= patience and last_stage

    def save(self) -> None:
        if self.checkpoints is None or not self.writes:
            return
        state = dict(
            fingerprint=self.fingerprint,
            best_val=None if math.isinf(self.best_val) else self.best_val,
            evals_since_best=self.evals_since_best,
            history=self.history,
        )
        save_training_state(
            self.checkpoints,
            self.step,
            self.trainable,
            self.optimizer,
            self.policy,
            state,
            extra_tensors={f"best/{name}": tensor for name, tensor in self.best_state.items()},
            nonfinite_warning=f"step {self.step}: the students hold NaN/inf values; this checkpoint is not saved.",
        )

    def keep_best(self) -> None:
        """Put back the best students seen on held-out data."""
        if self.best_state:
            with torch.no_grad():
                for name, parameter in self.trainable.items():
                    parameter.copy_(self.best_state[name])

    def result(
        self, stages: list[LengthStage], seconds: float, final_val: float, final_layers
    ) -> DistillResult:
        """What the run did and reached, once it ends."""
        return DistillResult(
            steps=self.step,
            tokens=tokens_after(stages, self.step),
            seconds=seconds,
            history=self.history,
            best_val_loss=None if math.isinf(self.best_val) else self.best_val,
            final_val_loss=final_val,
            val_layer_losses=final_layers,
            stopped_early=self.stopped_early,
            skipped_steps=self.policy.skipped,
            stages=[stage.summary() for stage in stages] if len(stages) > 1 else [],
        )

    def kept_checkpoint(self) -> str:
        """What survives a stopped run, for its error message."""
        latest = latest_checkpoint(self.checkpoints) if self.checkpoints is not None else None
        if latest is None:
            return "no checkpoint was written"
        return f"the last good checkpoint ({latest.name}) is kept"


def distill(
    model: nn.Module,
    train: torch.Tensor,
    heldout: torch.Tensor,
    config: LinearizeConfig,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    on_step=None,
    layers: list[int] | None = None,
    teacher_states: TeacherStates | str | Path | None = None,
    heldout_teacher_states: TeacherStates | str | Path | None = None,
    data_parallel: bool = True,
    shorter_train: dict[int, torch.Tensor] | None = None,
) -> DistillResult:
    """Train the students of converted ``model`` on train (N, T) token ids; evaluate on heldout (M, T).

    The settings are ``config.distill`` with the run's ``seed`` and ``progress``. run_dir receives
    distill_config.json, log.jsonl and checkpoints/ (None: nothing is written and no resumption is
    possible). ``resume`` continues from the newest checkpoint of the same run (same settings, plan and
    data) and ends with the same students as an uninterrupted run. ``on_step(step, record)`` is called
    after every step (progress hooks, tests). ``layers``: train only these converted layers (layer sharding:
    separate processes, each with its own layers and run_dir; the teacher forward stops after the last of
    them, and layers are independent given the teacher's inputs). Only the students' parameters train; the
    teacher's are frozen (``requires_grad`` False) and unchanged.

    ``teacher_states``: a :class:`~dofla.distill.hidden_store.TeacherStates` (or its folder) written for
    ``train`` with a boundary at or below the first trained layer; each layer-wise forward then starts from
    the stored hidden states (``heldout_teacher_states``: the same for validation), with the same students
    up to float rounding. ``data_parallel`` (under an initialised process group): True slices every batch
    across ranks (rank 0 alone writes ``run_dir``), False is layer sharding
    (:class:`~dofla.distill.distributed.ProcessShare`). Returns a :class:`DistillResult` (the same on
    every rank; ``val_layer_losses`` holds every rank's layers).

    ``distill.length_schedule`` (a length curriculum, :mod:`dofla.distill.curriculum`): the run trains
    first on shorter rows, ``shorter_train[length]`` (M, length) where given, else cut from ``train``, with
    batches of about the same tokens; its last stage is ``train`` itself. Validation stays on ``heldout``.
    """
    settings = config.distill
    share = _checked(settings, train, heldout, data_parallel, teacher_states)
    device = next(model.parameters()).device
    students = freeze_teacher(model, layers)
    share.count_layers(students, given=layers is not None)
    model.eval()  # no dropout: the students learn the teacher's deterministic attention
    trainable = _trainable(model)
    optimizer = _optimizer(students, settings)
    stages = length_stages(
        settings.length_schedule,
        train,
        settings.tokens,
        settings.batch_size,
        shorter_rows=shorter_train,
        divisor=share.batch_divisor,
    )
    total_steps = sum(stage.steps for stage in stages)  # the learning-rate schedule spans every stage
    fingerprint = run_fingerprint(settings, config.seed, model, train, sorted(students), stages)
    train_stored = stored_start(teacher_states, model, train, students, settings.loss, "teacher_states")
    heldout_stored = stored_start(
        heldout_teacher_states, model, heldout, students, settings.loss, "heldout_teacher_states"
    )
    run = _Run(run_dir, share.writes, fingerprint, trainable, optimizer, settings.max_bad_steps)
    torch.manual_seed(config.seed)
    run.begin(resume, dict(asdict(settings), seed=config.seed, progress=config.progress))
    from tqdm import tqdm

    quiet = not config.progress or share.rank != 0
    bar = tqdm(total=total_steps, initial=run.step, disable=quiet, unit="step", dynamic_ncols=True)
    started = time.perf_counter()
    graphs = (
        LayerLossGraphs(settings.loss, query_chunk=settings.query_chunk) if settings.cuda_graphs else None
    )
    while run.step < total_steps and not run.stopped_early:
        # ---- one optimisation step
        step_started = time.perf_counter()
        factor = learning_rate_factor(run.step, total_steps, settings) * run.policy.lr_scale
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        stage = stage_at(stages, run.step)  # a pure function of the step: a resumed run is in the right stage
        indices = batch_indices(run.step - stage.first_step, stage.batch_size, len(stage.rows), config.seed)
        mine = share.slice(indices)
        batch = stage.rows[mine].to(device)  # (B / world, T) data-parallel, else (B, T)
        optimizer.zero_grad(set_to_none=True)
        loss, layer_losses = step_loss(
            model,
            students,
            batch,
            settings,
            backward=True,
            graphs=graphs,
            **start_options(train_stored, mine, device),
        )
        loss = share.loss(loss)
        grad_norm = share.clip_gradients(list(trainable.values()), settings.grad_clip)
        bad_layer = partial(
            share.bad_layer, first_bad_layer, model, trainable, layer_losses, batch, settings.loss
        )
        if run.policy.accept(run.step + 1, loss, float(grad_norm), bad_layer, run.kept_checkpoint):
            optimizer.step()
        else:  # skipped: no update (the policy lowered the learning rate)
            optimizer.zero_grad(set_to_none=True)
        run.step += 1
        seconds = time.perf_counter() - step_started
        record = dict(step=run.step, tokens=stage.tokens_after(run.step), loss=loss, lr_factor=factor)
        record.update(seconds=seconds, grad_norm=float(grad_norm))
        if len(stages) > 1:
            record["length"] = stage.length
        run.log(record)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{stage.tokens_per_step / max(seconds, 1e-9):.0f}")
        bar.update(1)

        # ---- held-out validation, early stopping and checkpoints
        if (settings.eval_every and run.step % settings.eval_every == 0) or run.step == total_steps:
            val_loss, val_layers = share.validation(
                *evaluate(model, students, heldout, settings, heldout_stored)
            )
            run.validated(val_loss, settings.patience, last_stage=stage is stages[-1])
            log = dict(
                step=run.step, val_loss=val_loss, val_layers={str(k): v for k, v in val_layers.items()}
            )
            run.log(log)
        if on_step is not None:
            on_step(run.step, record)
        if (
            settings.checkpoint_every and run.step % settings.checkpoint_every == 0
        ) or run.step == total_steps:
            run.save()
    bar.close()
    run.keep_best()
    final_val, final_layers = evaluate(model, students, heldout, settings, heldout_stored)
    if share.by_layers:
        final_val, final_layers = share.validation(final_val, final_layers)
    return run.result(stages, time.perf_counter() - started, final_val, final_layers)


def _checked(settings: DistillSettings, train, heldout, data_parallel: bool, teacher_states) -> ProcessShare:
    """Everything refused before any work (the settings, the rows, how processes share the run); returns
    this process's share."""
    settings.validate()
    _check_sequences("training", train, 1)
    _check_sequences("held-out", heldout, 1)
    share = ProcessShare.of(data_parallel, settings.loss, settings.batch_size)
    if settings.length_schedule and teacher_states is not None:
        raise DoflaError(
            "stored teacher states hold the rows at the full length, which a length curriculum's shorter "
            "stages do not train on; drop the length schedule or the stored teacher states."
        )
    return share


def check_run_folder(run_dir: Path | None, resume: bool) -> None:
    """Refuse to start over an earlier run's checkpoints or log without ``resume`` (its progress would be
    lost), and ``resume`` where there is no checkpoint. Cheap: call it before any expensive work."""
    if run_dir is None:
        if resume:
            raise DoflaError("--resume needs an output folder holding the interrupted run's checkpoints.")
        return
    run_dir = Path(run_dir)
    latest = latest_checkpoint(run_dir / CHECKPOINT_FOLDER)
    if resume and latest is None:
        raise DoflaError(
            f"--resume: no checkpoint in {run_dir / CHECKPOINT_FOLDER} to continue from; run without --resume to "
            "start."
        )
    log = run_dir / LOG_FILE
    if not resume and (latest is not None or (log.is_file() and log.stat().st_size > 0)):
        progress = f"a checkpoint at {latest.name}" if latest is not None else f"a log in {log}"
        raise DoflaError(
            f"{run_dir} holds an earlier run ({progress}); pass --resume to continue it, --overwrite to discard "
            "it and start over, or choose another --out."
        )


def discard_run(run_dir: Path) -> None:
    """Delete an earlier run's files (config, log, checkpoints) from ``run_dir``, and nothing else."""
    patterns = [CONFIG_FILE, LOG_FILE, f"{CHECKPOINT_FOLDER}/*"]
    remove_known_files(run_dir, patterns)
