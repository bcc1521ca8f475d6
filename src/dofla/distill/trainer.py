"""The distillation training loop: read it top to bottom.

``distill(model, train, heldout, config, run_dir)`` trains the students of a converted model on packed
token sequences for a token budget: AdamW with linear warm-up and cosine decay, gradient clipping,
held-out validation every ``eval_every`` steps with early stopping (the best students are kept), JSONL
logs, atomic checkpoints every ``checkpoint_every`` steps and exact resumption. Layer-wise losses
(softmax, l2, output_mse) train every converted layer at once from one teacher-forced forward per batch;
the ``direct`` loss trains the students end to end on next-token cross-entropy (+ KL to the teacher).
Layer-sharded runs can start each forward from teacher hidden states stored on disk
(:mod:`dofla.distill.hidden_store`) instead of running the teacher's earlier layers.

Under ``torch.distributed`` (e.g. ``torchrun``, gloo on CPUs) the work is sharded one of two ways
(:mod:`dofla.distill.distributed`): by data (``data_parallel=True``: every rank takes its slice of each batch
and gradients are averaged) or by layers (``data_parallel=False``: every rank trains its own ``layers`` on
whole batches, in its own ``run_dir``; the loss, weighted by layers, and the gradient norm are combined
across ranks, so every rank logs, clips, skips and stops early as one process training all layers would).
Either way the result equals a single-process run up to float rounding.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dofla import dispatch
from dofla.distill import distributed
from dofla.distill.checkpoint import (
    append_log,
    latest_checkpoint,
    restore_training_state,
    save_training_state,
    settings_digest,
    write_log,
)
from dofla.distill.curriculum import LengthStage, check_length_schedule, length_stages, stage_at, tokens_after
from dofla.distill.graphed import LayerLossGraphs
from dofla.distill.hidden_store import TeacherStates, open_teacher_states
from dofla.distill.losses import LOSSES, layerwise_loss_names
from dofla.distill.nonfinite import NonFinitePolicy, first_nonfinite_layer, first_nonfinite_output_layer
from dofla.distill.teacher_forcing import freeze_teacher, teacher_forced_step, teacher_forced_step_from_states
from dofla.errors import DoflaError
from dofla.io import to_json, write_text_atomic
from dofla.models.surgery import autocast_for
from dofla.outputs import remove_known_files

CONFIG_FILE = "distill_config.json"
LOG_FILE = "log.jsonl"
CHECKPOINT_FOLDER = "checkpoints"
# Fields that do not change the result, so a resumed run may differ in them.
_NOT_IN_FINGERPRINT = ("progress", "checkpoint_every", "cuda_graphs")


@dataclass
class DistillConfig:
    """Every knob of the distillation stage (saved as JSON with the run).

    tokens: training budget in tokens (steps = ceil(tokens / (batch_size * sequence length)));
    lr: base learning rate (feature maps with their own rates, e.g. learnable_prf, use those);
    warmup_fraction: share of steps with linear warm-up; min_lr_fraction: cosine floor relative to the peak;
    eval_every: steps between held-out evaluations (0 = only at the end); patience: evaluations without
    improvement before stopping early (0 = never); checkpoint_every: steps between checkpoints (0 = none);
    max_bad_steps: consecutive non-finite steps tolerated (each halves the learning rate);
    length_schedule: a length curriculum, (length, share of ``tokens``) stages shortest first, ending at the
    training rows' length (:mod:`dofla.distill.curriculum`; None or empty: none);
    cuda_graphs: each layer's loss and backward replayed from CUDA graphs (:mod:`dofla.distill.graphed`; a
    layer-wise loss on a CUDA device); the same training up to rounding, so not part of the run's identity.
    """

    loss: str = "softmax"
    tokens: int = 2_000_000
    batch_size: int = 4
    lr: float = 1e-2
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    patience: int = 0
    checkpoint_every: int = 50
    max_bad_steps: int = 5
    query_chunk: int = 128
    kl_weight: float = 0.0
    temperature: float = 1.0
    seed: int = 0
    progress: bool = True
    length_schedule: list[tuple[int, float]] | None = None
    cuda_graphs: bool = False

    def validate(self) -> None:
        LOSSES[self.loss]  # an unknown name is refused with the registered ones
        if self.tokens <= 0:
            raise DoflaError(f"the token budget must be positive, got {self.tokens}; pass e.g. --tokens 2M.")
        if self.batch_size <= 0:
            raise DoflaError(f"batch size must be positive, got {self.batch_size}; pass e.g. --batch-size 4.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise DoflaError(f"learning rate must be a positive number, got {self.lr}; pass e.g. --lr 1e-2.")
        if not (math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise DoflaError(f"the KL weight must be zero or positive, got {self.kl_weight}.")
        for name in ("eval_every", "checkpoint_every", "patience"):
            if getattr(self, name) < 0:
                raise DoflaError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}.")
        if self.max_bad_steps < 1:
            raise DoflaError(f"max_bad_steps must be at least 1, got {self.max_bad_steps}.")
        check_length_schedule(self.length_schedule)
        if self.cuda_graphs and not LOSSES[self.loss].layerwise:
            raise DoflaError(
                f"--cuda-graphs captures the layer-wise losses one layer at a time; the {self.loss} loss runs "
                "the whole model end to end: drop --cuda-graphs or choose a layer-wise --loss."
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillConfig:
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DoflaError(f"unknown distillation settings {unknown}; known ones are {sorted(known)}.")
        return cls(**data)


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


def learning_rate_factor(step: int, total_steps: int, config: DistillConfig) -> float:
    """Linear warm-up to 1 then cosine decay to ``min_lr_fraction`` (step counted from 0)."""
    warmup = max(1, round(config.warmup_fraction * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return config.min_lr_fraction + (1 - config.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(step: int, batch_size: int, num_sequences: int, seed: int) -> list[int]:
    """Sequence indices of batch ``step``: a fresh seeded permutation every pass over the data.

    A pure function of (step, seed), so a resumed run sees exactly the batches it would have seen.
    """
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_sequences)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        indices.append(int(torch.randperm(num_sequences, generator=generator)[offset]))
    return indices


def run_fingerprint(
    config: DistillConfig,
    model: nn.Module,
    train: torch.Tensor,
    layers: list[int],
    stages: list[LengthStage] | None = None,
) -> str:
    """A hash of what determines the result: settings, plan, trained layers and training data (with a
    length curriculum, every stage's rows and batch too)."""
    settings = {name: value for name, value in asdict(config).items() if name not in _NOT_IN_FINGERPRINT}
    if not settings["length_schedule"]:  # a run without a curriculum hashes as it did before there was one
        del settings["length_schedule"]
    digest = settings_digest(settings, getattr(model, "dofla_plan", None))
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


@dataclass
class _StoredStart:
    """Where a layer-wise forward starts from stored teacher states: the store and its start layer."""

    states: TeacherStates
    layer: int


def _step_loss(
    model,
    students,
    input_ids,
    config,
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
    if LOSSES[config.loss].layerwise:
        options = dict(backward=backward, query_chunk=config.query_chunk, loss_weight=loss_weight)
        options["graphs"] = graphs
        if start_states is None:
            layer_losses = teacher_forced_step(model, input_ids, students, config.loss, **options)
        else:
            layer_losses = teacher_forced_step_from_states(
                model, input_ids, start_layer, start_states, students, config.loss, **options
            )
        return sum(layer_losses.values()) / len(layer_losses), layer_losses
    teacher_logits = None
    if config.kl_weight > 0:
        with torch.no_grad(), dispatch.teacher_forced():
            teacher_logits = model(input_ids=input_ids, use_cache=False).logits
    with torch.set_grad_enabled(backward), autocast_for(input_ids.device):
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = LOSSES[config.loss].function(
            logits,
            input_ids,
            teacher_logits,
            kl_weight=config.kl_weight,
            temperature=config.temperature,
        )
    if backward:
        (loss * loss_weight).backward()
    return float(loss.detach()), {}


def _stored_start(store, model, sequences: torch.Tensor, students, config: DistillConfig, name: str):
    """Open and check a teacher-state store for ``sequences``; None where no store is given."""
    if store is None:
        return None
    if not LOSSES[config.loss].layerwise:
        raise DoflaError(
            f"{name}: stored teacher states serve the layer-wise losses ({', '.join(layerwise_loss_names())}); "
            f"the {config.loss} loss runs the whole model end to end. Drop the stored states or choose a "
            "layer-wise loss."
        )
    states = open_teacher_states(store)
    return _StoredStart(states, states.check(model, sequences, min(students)))


def _start_options(stored: _StoredStart | None, indices, device: torch.device) -> dict:
    """The :func:`_step_loss` arguments that start a batch's forward from its stored teacher states."""
    if stored is None:
        return {}
    start_states = stored.states.read(list(indices), stored.layer).to(device)  # (B, T, hidden)
    return dict(start_states=start_states, start_layer=stored.layer)


def evaluate(
    model, students, heldout: torch.Tensor, config: DistillConfig, stored: _StoredStart | None = None
) -> tuple[float, dict[int, float]]:
    """Mean held-out loss over the first ``eval_batches`` batches, and per layer (layer-wise losses).

    stored: the held-out sequences' teacher states (from ``heldout_teacher_states`` of :func:`distill`).
    """
    device = next(model.parameters()).device
    totals: dict[int, float] = {}
    means = []
    for start in range(0, min(len(heldout), config.eval_batches * config.batch_size), config.batch_size):
        batch = heldout[start : start + config.batch_size].to(device)
        options = _start_options(stored, range(start, start + len(batch)), device)
        with torch.no_grad():
            mean, layer_losses = _step_loss(model, students, batch, config, backward=False, **options)
        means.append(mean)
        for layer, value in layer_losses.items():
            totals[layer] = totals.get(layer, 0.0) + value
    count = max(1, len(means))
    return sum(means) / count, {layer: value / count for layer, value in totals.items()}


def distill(
    model: nn.Module,
    train: torch.Tensor,
    heldout: torch.Tensor,
    config: DistillConfig,
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

    run_dir receives distill_config.json, log.jsonl and checkpoints/ (None: nothing is written and no
    resumption is possible). ``resume`` continues from the newest checkpoint of the same run (same
    settings, plan and data) and ends with the same students as an uninterrupted run. ``on_step(step,
    record)`` is called after every step (progress hooks, tests). ``layers``: train only these converted
    layers (layer sharding: separate processes, each with its own layers and run_dir; the teacher forward
    stops after the last of them, and layers are independent given the teacher's inputs). Only the
    students' parameters train; the teacher's are frozen (``requires_grad`` False) and unchanged.

    ``teacher_states``: a :class:`~dofla.distill.hidden_store.TeacherStates` (or its folder) written for
    ``train`` by :func:`~dofla.distill.hidden_store.write_teacher_states` with a boundary at or below the
    first trained layer; each layer-wise forward then starts from the stored hidden states and the layers
    below are not run. ``heldout_teacher_states`` does the same for validation. The students end as
    without the stores (up to float rounding).

    ``data_parallel`` (only matters under an initialised process group): True slices every batch across
    ranks and averages gradients (rank 0 alone writes ``run_dir``); False is layer sharding: each rank
    passes its own ``layers`` and its own ``run_dir`` (which it writes: config, log, checkpoints), trains on
    whole batches, and the ranks share only numbers: the mean loss over all ranks' layers (for the log,
    the non-finite policy and early stopping) and the global gradient norm (clipping scales every rank's
    gradients by the same factor, as clipping all layers together in one process does). Returns a
    :class:`DistillResult` (the same history on every rank; ``val_layer_losses`` holds every rank's layers).

    ``config.length_schedule`` (a length curriculum, :mod:`dofla.distill.curriculum`): the run trains
    first on shorter rows, ``shorter_train[length]`` (M, length) where given, else cut from ``train``, with
    batches of about the same tokens; its last stage is ``train`` itself. Validation stays on ``heldout``.
    """
    config.validate()
    _check_sequences("training", train, 1)
    _check_sequences("held-out", heldout, 1)
    rank, world_size = distributed.rank_and_world_size()
    layer_sharded = world_size > 1 and not data_parallel
    if layer_sharded and not LOSSES[config.loss].layerwise:
        raise DoflaError(
            f"layer sharding trains each process's layers on their own, which the {config.loss} loss (the whole "
            f"model end to end) cannot; choose a layer-wise loss ({', '.join(layerwise_loss_names())}) or "
            "data sharding."
        )
    if world_size > 1 and not layer_sharded and config.batch_size % world_size:
        raise DoflaError(f"batch size {config.batch_size} must be divisible by the {world_size} processes.")
    if config.length_schedule and teacher_states is not None:
        raise DoflaError(
            "stored teacher states hold the rows at the full length, which a length curriculum's shorter "
            "stages do not train on; drop the length schedule or the stored teacher states."
        )
    writes = rank == 0 or layer_sharded  # layer sharding: every rank keeps its own run_dir
    device = next(model.parameters()).device
    students = freeze_teacher(model, layers)
    if layer_sharded:
        check_disjoint_layers(sorted(students) if layers is not None else None)
    # layer sharding: each rank's mean is weighted by its layer count to give the mean over all layers
    all_layers = distributed.sum_across_ranks(len(students)) if layer_sharded else len(students)
    model.eval()  # no dropout: the students learn the teacher's deterministic attention
    trainable = _trainable(model)
    groups = [group for index in sorted(students) for group in students[index].parameter_groups(config.lr)]
    for group in groups:
        group["initial_lr"] = group["lr"]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    stages = length_stages(
        config.length_schedule,
        train,
        config.tokens,
        config.batch_size,
        shorter_rows=shorter_train,
        divisor=1 if layer_sharded else world_size,  # data parallel: every rank takes an equal slice
    )
    total_steps = sum(stage.steps for stage in stages)  # the learning-rate schedule spans every stage
    fingerprint = run_fingerprint(config, model, train, sorted(students), stages)
    train_stored = _stored_start(teacher_states, model, train, students, config, "teacher_states")
    heldout_stored = _stored_start(
        heldout_teacher_states, model, heldout, students, config, "heldout_teacher_states"
    )

    run_dir = Path(run_dir) if run_dir is not None else None
    checkpoints = run_dir / CHECKPOINT_FOLDER if run_dir is not None else None
    torch.manual_seed(config.seed)
    step = 0
    policy = NonFinitePolicy("distillation", config.max_bad_steps, "lower --lr or try another feature map")
    best_val, evals_since_best, stopped_early = math.inf, 0, False
    best_state: dict[str, torch.Tensor] = {}
    history: list[dict] = []
    check_run_folder(run_dir, resume)
    if resume:
        tensors, state = restore_training_state(
            latest_checkpoint(checkpoints),
            trainable,
            optimizer,
            policy,
            extra_keys=("best_val", "evals_since_best"),
            fingerprint=fingerprint,
            foreign=f"the checkpoint in {checkpoints} belongs to a different run (other settings, plan or data); "
            "use the same command as the interrupted run, or another --out to start a new one.",
            damaged="start over with --overwrite.",
        )
        best_state = {name[len("best/") :]: t for name, t in tensors.items() if name.startswith("best/")}
        step, history = state["step"], state["history"]
        best_val = state["best_val"] if state["best_val"] is not None else math.inf
        evals_since_best = state["evals_since_best"]
    if run_dir is not None and writes:
        write_text_atomic(run_dir / CONFIG_FILE, to_json(asdict(config), indent=2) + "\n")
        write_log(run_dir / LOG_FILE, history)

    def save(at_step: int) -> None:
        if checkpoints is None or not writes:
            return
        state = dict(
            fingerprint=fingerprint,
            best_val=None if math.isinf(best_val) else best_val,
            evals_since_best=evals_since_best,
            history=history,
        )
        save_training_state(
            checkpoints,
            at_step,
            trainable,
            optimizer,
            policy,
            state,
            extra_tensors={f"best/{name}": tensor for name, tensor in best_state.items()},
            nonfinite_warning=f"step {at_step}: the students hold NaN/inf values; this checkpoint is not saved.",
        )

    def log(record: dict) -> None:
        history.append(record)
        if run_dir is not None and writes:
            append_log(run_dir / LOG_FILE, record)

    from tqdm import tqdm

    bar = tqdm(
        total=total_steps,
        initial=step,
        disable=not config.progress or rank != 0,
        unit="step",
        dynamic_ncols=True,
    )
    started = time.perf_counter()
    shard = 0 if layer_sharded else rank  # which slice of the batch this rank trains
    graphs = LayerLossGraphs(config.loss, query_chunk=config.query_chunk) if config.cuda_graphs else None

    def combined(value: float) -> float:
        """A loss over this rank's layers (or slice) -> the loss over all layers (or the whole batch)."""
        if layer_sharded:
            return distributed.sum_across_ranks(value * len(students)) / all_layers
        return distributed.mean_across_ranks(value)

    while step < total_steps and not stopped_early:
        # ---- one optimisation step
        step_started = time.perf_counter()
        factor = learning_rate_factor(step, total_steps, config) * policy.lr_scale
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        stage = stage_at(stages, step)  # a pure function of the step: a resumed run is in the right stage
        local = stage.batch_size if layer_sharded else stage.batch_size // world_size
        indices = batch_indices(step - stage.first_step, stage.batch_size, len(stage.rows), config.seed)
        mine = indices[shard * local : (shard + 1) * local]
        batch = stage.rows[mine].to(device)  # (B / world, T) data-parallel, else (B, T)
        options = _start_options(train_stored, mine, device)
        optimizer.zero_grad(set_to_none=True)
        loss, layer_losses = _step_loss(
            model, students, batch, config, backward=True, graphs=graphs, **options
        )
        loss = combined(loss)
        if layer_sharded:
            grad_norm = clip_global_norm(list(trainable.values()), config.grad_clip)
        else:
            distributed.average_gradients(trainable.values())
            grad_norm = torch.nn.utils.clip_grad_norm_(list(trainable.values()), config.grad_clip)

        def local_bad_layer(layer_losses=layer_losses, batch=batch) -> int | None:
            bad = [layer for layer, value in layer_losses.items() if not math.isfinite(value)]
            if bad:
                return min(bad)
            layer = first_nonfinite_layer(trainable.items())  # a student gone non-finite
            if layer is not None or config.loss != "direct":
                return layer
            return first_nonfinite_output_layer(model, batch)

        def bad_layer(local_bad_layer=local_bad_layer) -> int | None:  # called on every rank alike
            return distributed.min_across_ranks(local_bad_layer()) if layer_sharded else local_bad_layer()

        if policy.accept(step + 1, loss, float(grad_norm), bad_layer, lambda: _kept_checkpoint(checkpoints)):
            optimizer.step()
        else:  # skipped: no update (the policy lowered the learning rate)
            optimizer.zero_grad(set_to_none=True)
        step += 1
        seconds = time.perf_counter() - step_started
        tokens = stage.tokens_after(step)
        record = dict(step=step, tokens=tokens, loss=loss, lr_factor=factor, seconds=seconds)
        record["grad_norm"] = float(grad_norm)
        if len(stages) > 1:
            record["length"] = stage.length
        log(record)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{stage.tokens_per_step / max(seconds, 1e-9):.0f}")
        bar.update(1)

        # ---- held-out validation and early stopping
        if (config.eval_every and step % config.eval_every == 0) or step == total_steps:
            val_loss, val_layers = evaluate(model, students, heldout, config, heldout_stored)
            val_loss = combined(val_loss)
            if layer_sharded:
                val_layers = gathered_layer_losses(val_layers)
            if val_loss < best_val:
                best_val, evals_since_best = val_loss, 0
                best_state = {name: parameter.detach().clone() for name, parameter in trainable.items()}
            else:
                evals_since_best += 1
                # a length curriculum stops early only in its last stage: the run always trains at length
                patience_over = bool(config.patience) and evals_since_best >= config.patience
                stopped_early = patience_over and stage is stages[-1]
            log(dict(step=step, val_loss=val_loss, val_layers={str(k): v for k, v in val_layers.items()}))
        if on_step is not None:
            on_step(step, record)
        if checkpoints is not None and (
            (config.checkpoint_every and step % config.checkpoint_every == 0) or step == total_steps
        ):
            save(step)
    bar.close()

    # keep the best students seen on held-out data
    if best_state:
        with torch.no_grad():
            for name, parameter in trainable.items():
                parameter.copy_(best_state[name])
    final_val, final_layers = evaluate(model, students, heldout, config, heldout_stored)
    if layer_sharded:
        final_val, final_layers = combined(final_val), gathered_layer_losses(final_layers)
    return DistillResult(
        steps=step,
        tokens=tokens_after(stages, step),
        seconds=time.perf_counter() - started,
        history=history,
        best_val_loss=None if math.isinf(best_val) else best_val,
        final_val_loss=final_val,
        val_layer_losses=final_layers,
        stopped_early=stopped_early,
        skipped_steps=policy.skipped,
        stages=[stage.summary() for stage in stages] if len(stages) > 1 else [],
    )


def clip_global_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of every rank's parameters by their joint norm, as if all were in one process
    (layer sharding); returns that norm. Each rank adds its squared norm to the others'."""
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    total = torch.tensor(math.sqrt(distributed.sum_across_ranks(float(local) ** 2)), dtype=torch.float32)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def gathered_layer_losses(layer_losses: dict[int, float]) -> dict[int, float]:
    """Every rank's per-layer losses in one dict, on every rank (layer sharding)."""
    gathered = distributed.gather_json({str(layer): value for layer, value in layer_losses.items()})
    return dict(sorted((int(layer), value) for part in gathered for layer, value in part.items()))


def check_disjoint_layers(layers: list[int] | None) -> None:
    """Layer sharding: refuse, on every rank alike, a rank without its own ``layers`` or two ranks sharing one
    (each would count in the loss and the gradient norm twice)."""
    owned = distributed.gather_json(layers)
    if any(part is None for part in owned):
        raise DoflaError(
            f"layer sharding needs each process's own layers (distill(..., layers=...)); rank "
            f"{owned.index(None)} gave none: pass dofla.distill.distributed.layer_blocks(...)[rank]."
        )
    shared = sorted({layer for part in owned for layer in part if sum(layer in other for other in owned) > 1})
    if shared:
        raise DoflaError(
            f"layer sharding needs each layer on one process, but layers {shared} are on several ({owned}); "
            "pass dofla.distill.distributed.layer_blocks(...)[rank]."
        )


def _kept_checkpoint(checkpoints: Path | None) -> str:
    """What survives a stopped run, for its error message."""
    latest = latest_checkpoint(checkpoints) if checkpoints is not None else None
    if latest is None:
        return "no checkpoint was written"
    return f"the last good checkpoint ({latest.name}) is kept"


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
