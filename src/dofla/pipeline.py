"""The main job: teacher -> data -> plan -> convert -> distill (-> LoRA) -> evaluate -> save + report.

``linearize(config)`` runs every stage of a :class:`~dofla.run_config.LinearizeConfig` and writes into
``out_dir``: ``config.toml`` (the resolved settings), ``model/`` (the converted model,
:func:`dofla.saving.save_converted`), ``distill/`` (config, JSONL log, checkpoints for ``resume``),
``lora/`` (the LoRA stage's JSONL log and checkpoints for ``resume``),
``plan.json``, the plots, ``result.json`` and ``report.md`` (:mod:`dofla.report`). Held-out perplexity is
measured on sequences split off before training and never trained on.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dofla import dof, report
from dofla.config import ConversionPlan
from dofla.distill import distributed
from dofla.distill.sharding import (
    check_layer_sharding,
    check_processes,
    checked_layer_stores,
    layer_sharding,
    rank_run_dir,
)
from dofla.errors import DoflaError
from dofla.run_config import CONFIG_FILE, LinearizeConfig, save_config

RUN_KIND = "linearize run"  # the kind in the marker of a run folder (dofla.outputs)
RESULT_FILES = ("plan.json", "result.json", "report.md", "loss_curves.png", "loss_by_position.png")
LORA_FOLDER = "lora"  # the LoRA stage's log and checkpoints
RUN_FILES = (CONFIG_FILE, *RESULT_FILES)  # beside model/ and distill/; removed by overwrite
DEFAULT_EVAL_LENGTHS = (1024, 2048)
DEFAULT_BASELINE_SINKS = 4  # sink tokens of the window baseline when the student has none


@dataclass
class LinearizeResult:
    out_dir: Path  # the saved converted model (load with dofla.loading.load_converted)
    report_path: Path
    teacher_ppl: float
    student_ppl: float
    run_dir: Path
    plan_table: list[dict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    data_source: str = ""
    train_tokens: int = 0
    lora_teacher_ppl: float | None = None  # the teacher after the same LoRA stage (``lora.baseline``)


@dataclass
class RunData:
    """The run's token rows: training (N, T) at the training length, held-out rows at every length."""

    train: torch.Tensor
    heldout_by_length: dict[int, torch.Tensor]
    seq_len: int
    skipped_lengths: list[int]  # asked for, but the data was too short
    source: str  # a sentence saying where the text came from
    rows: torch.Tensor  # (N, T) every packed row, before the split (what a caller may pass back as sequences)
    # a length curriculum's shorter stages: {length: (M, length)} cut from the training rows only
    shorter_train: dict[int, torch.Tensor] = field(default_factory=dict)
    # the LoRA stage's rows where --lora-seq-len differs from the training length, cut from the same rows
    lora_train: torch.Tensor | None = None

    @property
    def heldout(self) -> torch.Tensor:
        return self.heldout_by_length[self.seq_len]


@dataclass
class Evaluation:
    """Held-out quality after training: by length (teacher, window baselines, student), pass key, errors."""

    quality: dict
    passkeys: dict | None
    recall: list[dict] | None
    layer_errors: dict[int, dict]
    teacher_ppl: float
    student_ppl: float


class Timings(dict):
    """Stage name -> wall-clock seconds since the previous stage ended."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self[name] = round(now - self._clock, 2)
        self._clock = now


# ------------------------------------------------------------------------------------------------ the job


def linearize(
    config: LinearizeConfig, *, teacher=None, tokenizer=None, sequences: torch.Tensor | None = None
) -> LinearizeResult | None:
    """Run the whole pipeline as ``config`` says; returns where things are and the two perplexities.

    Under ``torchrun`` (several processes) rank 0 prepares the data and the plan and shares them; then, by
    ``distill.sharding``, every rank trains all layers on its slice of each batch ("data") or its own block
    of converted layers on whole batches, optionally from stored teacher states ("layers"; rank 0 then
    gathers every block's students); rank 0 alone runs LoRA, evaluates, saves and returns the result (the
    other ranks return None).

    teacher/tokenizer: an already loaded model (else ``dofla.models.load_teacher(config.teacher.model)``);
    sequences (N, T): already packed token ids (else read from ``config.data.path`` or sampled from the
    teacher). ``out_dir`` must be new, empty, or an earlier run (see :func:`open_run_folder`); it is locked
    for the run, and the resolved config is written there first (``config.toml``).
    """
    from dofla import outputs

    config.apply_recipe()
    config.validate()
    inputs = [config.data.path] + ([config.teacher.model] if teacher is None else [])
    outputs.check_output_folder(config.out_dir, RUN_KIND, inputs=inputs)
    with distributed.process_group_from_environment(config.teacher.device) as world_size:
        check_processes(config, world_size, f"the {world_size} processes")
        if distributed.rank_and_world_size()[0] != 0:  # a helper rank: trains its slice, writes nothing
            out_dir = Path(config.out_dir).expanduser().resolve()
            return run_stages(config, out_dir, teacher=teacher, tokenizer=tokenizer, sequences=sequences)
        with outputs.output_lock(config.out_dir):
            out_dir = open_run_folder(config)
            save_config(config, out_dir / CONFIG_FILE)
            return run_stages(config, out_dir, teacher=teacher, tokenizer=tokenizer, sequences=sequences)


def run_stages(
    config: LinearizeConfig, out_dir: Path, *, teacher, tokenizer, sequences: torch.Tensor | None
) -> LinearizeResult | None:
    """The stages of :func:`linearize`, in its checked and locked ``out_dir`` (None on a helper rank)."""
    from dofla.convert import convert
    from dofla.models.surgery import students
    from dofla.saving import check_finite_model, save_converted, teacher_fingerprint

    timings = Timings()
    torch.manual_seed(config.seed)
    rank, processes = distributed.rank_and_world_size()
    teacher, tokenizer = load_teacher_for(config, teacher, tokenizer)
    timings.lap("load teacher")
    check_teacher_for_run(config, teacher, tokenizer, sequences)
    if layer_sharding(config):  # the layers the plan will convert, before the data and the plan
        check_layer_sharding(config, layers_to_convert(config, teacher), processes)
    teacher_weights = teacher_fingerprint(teacher) if config.lora.enabled else None  # LoRA changes them
    data = prepare_data(config, teacher, tokenizer, sequences, out_dir / "data_cache")
    stores = checked_layer_stores(config, teacher, data) if config.distill.teacher_states else None
    # the LoRA stage's rows, once for the stage and its baseline on the teacher (rank 0 runs both)
    lora_source = data.train if data.lora_train is None else data.lora_train
    lora_train = lora_rows(config, tokenizer, lora_source) if config.lora.enabled and rank == 0 else None
    timings.lap("data")
    baseline_ppl = None
    if config.lora.enabled and config.lora.baseline and rank == 0:
        baseline_ppl = lora_adapted_teacher_perplexity(
            teacher, lora_train, data.heldout, config.lora_config()
        )
        timings.lap("LoRA baseline (teacher)")
    plan = shared_plan(config, teacher, data.train)
    plan.sinks_at_edge = resolve_sinks_at_edge(
        config, teacher, plan
    )  # convert applies it: they train with it
    timings.lap("plan (DoF estimate)" if "measure" in plan.metadata else "plan")
    # The unconverted teacher, for the side-by-side evaluation: conversion works in place and LoRA merges
    # into the shared projections, so the teacher cannot be recovered from the student afterwards.
    reference = copy.deepcopy(teacher)
    model = convert(teacher, plan)
    distilled = distill_stage(config, model, data, out_dir, stores)
    timings.lap("distill")
    if rank != 0:  # rank 0 evaluates and saves; it holds every rank's trained students
        return None
    history = list(distilled.history)
    if config.lora.enabled:
        model, history = lora_stage(config, model, lora_train, history)
        timings.lap("lora")
    check_finite_model(model, data.heldout[: config.distill.batch_size], what="the trained student")  # no NaN
    apply_position_period(config, model)
    evaluation = evaluate_student(config, reference, model, tokenizer, data, timings)
    del reference
    model_dir = save_converted(
        model,
        out_dir / "model",
        tokenizer=tokenizer,
        extra_metadata={"teacher": config.teacher.model, "recipe": config.recipe or "custom"},
        overwrite=True,  # this run's own model (the folder was checked when the run started)
        teacher_weights=teacher_weights,
    )
    timings.lap("save")
    return write_results(
        config,
        out_dir,
        model_dir,
        plan,
        data,
        distilled,
        evaluation,
        history=history,
        timings=dict(timings),
        converted_layers=sorted(students(model)),
        baseline_ppl=baseline_ppl,
        processes=processes,
    )


def write_results(
    config: LinearizeConfig,
    out_dir: Path,
    model_dir: Path,
    plan: ConversionPlan,
    data: RunData,
    distilled,
    evaluation: Evaluation,
    *,
    history: list[dict],
    timings: dict[str, float],
    converted_layers: list[int],
    baseline_ppl: float | None,
    processes: int,
) -> LinearizeResult:
    """The run's :class:`LinearizeResult`, and its plan.json, result.json, plots and report.md."""
    table = report.plan_table(plan)
    result = LinearizeResult(
        out_dir=model_dir,
        report_path=out_dir / "report.md",
        teacher_ppl=evaluation.teacher_ppl,
        student_ppl=evaluation.student_ppl,
        run_dir=out_dir,
        plan_table=table,
        timings=timings,
        data_source=data.source,
        train_tokens=distilled.tokens,
        lora_teacher_ppl=baseline_ppl,
    )
    summary = report.run_summary(
        config,
        data,
        distilled,
        evaluation,
        converted_layers=converted_layers,
        table=table,
        timings=result.timings,
        lora_teacher_ppl=baseline_ppl,
        processes=processes,
        position_period=plan.position_period,
        sinks_at_edge=plan.sinks_at_edge,
    )
    report.write_run_outputs(out_dir, result, summary, config, plan, history)
    return result


# ------------------------------------------------------------------------------------------------ stages


def open_run_folder(config: LinearizeConfig) -> Path:
    """Check the output folder and claim it, before any work. Call under its lock.

    An earlier run there is continued with ``resume`` or discarded with ``overwrite`` (only the files dofla
    wrote go), never silently; ``resume`` without a checkpoint is refused here, not after hours of work.
    """
    from dofla import outputs
    from dofla.distill.trainer import check_run_folder, discard_run
    from dofla.saving import MODEL_KIND

    out_dir = Path(config.out_dir)
    run_dir = out_dir / "distill"
    if config.overwrite and out_dir.is_dir():
        if (out_dir / "model").exists():
            outputs.remove_tree_if_ours(out_dir / "model", MODEL_KIND)
        outputs.remove_known_files(out_dir, RUN_FILES)
        for folder in [run_dir, *sorted(run_dir.glob("rank-*"))]:  # layer sharding's other ranks too
            discard_run(folder)
        discard_run(out_dir / LORA_FOLDER)
    finished = [name for name in ("model", *RESULT_FILES) if (out_dir / name).exists()]
    processes = distributed.rank_and_world_size()[1] if layer_sharding(config) else 1
    for rank in range(processes):  # with layer sharding every rank resumes from its own checkpoints
        check_run_folder(rank_run_dir(out_dir, rank), config.resume)
    if not config.resume:  # with it, the LoRA stage continues from its checkpoint where there is one
        check_run_folder(out_dir / LORA_FOLDER, False)
    if finished and not config.resume:
        raise DoflaError(
            f"{out_dir} holds an earlier run ({finished[0]}); pass --resume to continue it, --overwrite to "
            "discard it and start over, or choose another --out."
        )
    outputs.claim_output_folder(out_dir, RUN_KIND)
    outputs.remove_stale_temporaries(out_dir)  # e.g. a model half-written when a run was killed
    return out_dir


def load_teacher_for(config: LinearizeConfig, teacher, tokenizer):
    """(model, tokenizer): the given teacher or ``config.teacher``'s, in eval mode."""
    if teacher is None:
        from dofla.models import load_teacher

        loaded = load_teacher(config.teacher.model, dtype=config.teacher.dtype, device=config.teacher.device)
        teacher, tokenizer = loaded.model, loaded.tokenizer
    teacher.eval()
    return teacher, tokenizer


def check_teacher_for_run(config: LinearizeConfig, teacher, tokenizer, sequences) -> None:
    """What needs the loaded teacher but not the expensive work: its tokenizer, the LoRA targets, the
    rotary embedding a given position period wraps or edge sinks turn."""
    from dofla.distill.lora import check_targets

    if sequences is None and tokenizer is None:
        raise DoflaError(
            f"the teacher {config.teacher.model} has no usable tokenizer, which reading --data or sampling text "
            "needs; add its tokenizer files to the model folder."
        )
    if config.lora.enabled:
        check_targets(teacher, config.lora.targets)
    if config.plan.position_period:  # given: the teacher must have the one rotary embedding it wraps
        from dofla.rotary import rotary_frequencies

        if rotary_frequencies(teacher) is None:
            raise DoflaError(
                f"--position-period wraps rotary positions, and the teacher {config.teacher.model} has none; "
                "leave it unset."
            )
    if config.evaluate.edge_sinks or config.plan.sinks_at_edge:
        from dofla.evaluation.window_baseline import check_edge_sinks

        check_edge_sinks(teacher)
    if config.lora.enabled and config.lora.needle_fraction > 0:
        if tokenizer is None:
            raise DoflaError(
                "--lora-needles writes its facts as text, which needs the teacher's tokenizer; give a teacher "
                "with tokenizer files or leave --lora-needles at 0."
            )
        from dofla.data import insert_needles

        probe = torch.zeros(1, lora_seq_len(config), dtype=torch.long)  # are the rows long enough for them
        insert_needles(probe, tokenizer, 1.0, gap=recall_gap(config), seed=config.seed)


def prepare_data(config: LinearizeConfig, model, tokenizer, sequences, cache_dir: Path) -> RunData:
    """Training rows at ``data.seq_len`` (and at a length curriculum's shorter lengths) and held-out rows
    at every evaluation length, split before cutting: no training row holds held-out text.

    sequences (N, T): rows given by the caller; else the text of ``data.path`` (or sampled from the
    teacher, cached in ``cache_dir``) packed into the longest evaluation length it fills twice.
    """
    from dofla.data import (
        context_length,
        cut_rows,
        pack_rows,
        row_start_token,
        split_train_heldout,
        start_rows,
    )
    from dofla.distill.curriculum import check_schedule_context

    seq_len = config.data.seq_len
    limit = context_length(model)
    check_schedule_context(config.distill.length_schedule, limit)
    if limit is not None and seq_len > limit:
        raise DoflaError(
            f"--seq-len {seq_len} is beyond the model's context of {limit} tokens; use at most {limit}."
        )
    lengths = evaluation_lengths(config, limit)
    rank = distributed.rank_and_world_size()[0]
    if sequences is None:  # under torchrun rank 0 reads (or samples) the text and shares the packed rows
        texts, source = load_texts_for(config, model, tokenizer, cache_dir) if rank == 0 else ([], "")
        sequences = distributed.share_tensor(
            pack_rows(tokenizer, texts, lengths, seq_len) if rank == 0 else None
        )
    else:
        source = f"{len(sequences)} packed sequences given by the caller"
        if sequences.shape[1] > (limit or sequences.shape[1]):
            raise DoflaError(f"sequences of {sequences.shape[1]} tokens exceed the context of {limit}.")
        if sequences.shape[1] < seq_len:
            raise DoflaError(
                f"the given sequences have {sequences.shape[1]} tokens, fewer than --seq-len {seq_len}."
            )
    token = row_start_token(model, tokenizer)  # every row starts with it where the family needs one (Gemma)
    train_rows, heldout_rows = split_train_heldout(sequences, config.data.heldout_fraction, config.seed)
    heldout_rows = heldout_rows[: config.data.heldout_sequences]
    heldout_by_length = {
        length: start_rows(cut_rows(heldout_rows, length), token)
        for length in lengths
        if length <= sequences.shape[1]
    }
    skipped = [length for length in lengths if length not in heldout_by_length]
    if skipped:
        warnings.warn(
            f"the data is too short for held-out rows of {skipped} tokens; those lengths are not "
            "evaluated (give more text with --data)",
            stacklevel=2,
        )
    shorter_train = {
        length: start_rows(with_recall(config, cut_rows(train_rows, length)), token)
        for length, _ in config.distill.length_schedule or ()
        if length < seq_len
    }
    train = start_rows(with_recall(config, cut_rows(train_rows, seq_len)), token)
    lora_length = lora_seq_len(config)
    lora_train = None
    if config.lora.enabled and lora_length != seq_len:
        if lora_length > train_rows.shape[1]:
            raise DoflaError(
                f"--lora-seq-len {lora_length} is longer than the packed rows ({train_rows.shape[1]} tokens, the "
                "longest of --seq-len and --eval-lengths the data fills twice); add it to --eval-lengths or "
                "give more text."
            )
        lora_train = start_rows(with_recall(config, cut_rows(train_rows, lora_length)), token)
    if config.data.recall_fraction > 0:
        source += (
            f"; {config.data.recall_fraction:.0%} of the training rows repeat a span of their own text "
            f"at least {recall_gap(config)} tokens later (--recall-fraction)"
        )
    return RunData(train, heldout_by_length, seq_len, skipped, source, sequences, shorter_train, lora_train)


def trained_length(config: LinearizeConfig) -> int:
    """The longest rows the students train on: the training length, or the LoRA stage's where longer."""
    return max(config.data.seq_len, lora_seq_len(config) if config.lora.enabled else 0)


def resolve_sinks_at_edge(config: LinearizeConfig, model, plan: ConversionPlan) -> bool:
    """Whether the run's hybrid windows see their sinks from the window's edge: ``plan.sinks_at_edge`` where
    given, else on for a hybrid plan with sinks where the teacher has one rotary embedding with fixed
    frequencies (measured on the constant-memory recipe trained at 1,024 tokens: 1.26x the teacher at 8,192
    against 1.41x, the only setting that beat the no-training window cache there; equal or better at every
    shorter length) and the edge-sink baselines can run (:func:`edge_sinks_obstacle`; refused when asked
    for where they cannot)."""
    from dofla.rotary import fixed_rotary_frequencies

    obstacle = edge_sinks_obstacle(model, plan)
    chosen = config.plan.sinks_at_edge
    if chosen and obstacle:
        raise DoflaError(
            f"--sinks-at-edge is measured on unmasked, uncapped attention, and {obstacle}; leave --sinks-at-edge "
            "off for this teacher."
        )
    if chosen is not None:
        return bool(chosen)
    hybrid = config.plan.kind == "hybrid" and config.plan.sinks > 0
    return hybrid and obstacle is None and fixed_rotary_frequencies(model) is not None


def edge_sinks_obstacle(model, plan: ConversionPlan) -> str | None:
    """What keeps the edge-sink window baselines from running beside ``plan``'s students (None: nothing):
    soft-capped attention (Gemma 2), or converted layers that keep the teacher's own sliding-window mask."""
    from dofla.models import get_adapter

    adapter = get_adapter(model)
    if any(adapter.attention_softcap(module) for module in adapter.attention_modules(model)):
        return "this teacher soft-caps its attention scores"
    windowed = sorted(set(plan.metadata.get("teacher_windowed_layers") or []) & set(plan.converted_layers))
    if windowed:
        return f"the plan converts layers {windowed}, which keep the teacher's own sliding window"
    return None


def apply_position_period(config: LinearizeConfig, model) -> None:
    """The trained model's position period (:mod:`dofla.rotary`): ``plan.position_period`` where given (0:
    none), else the longest length the students trained at, where the teacher has one rotary embedding
    with fixed frequencies (measured at 8 times the training length: it removed the pure-linear student's
    collapse and gained 5% for the constant-memory hybrid, 1% beside kept softmax layers)."""
    from dofla.convert import set_position_period
    from dofla.rotary import fixed_rotary_frequencies

    period = config.plan.position_period
    if period is None:
        if fixed_rotary_frequencies(model) is None:  # none, several or length-dependent: true positions
            return
        period = trained_length(config)
    set_position_period(model, period or None)


def lora_seq_len(config: LinearizeConfig) -> int:
    """The LoRA stage's row length: ``lora.seq_len``, else the training length."""
    return config.lora.seq_len or config.data.seq_len


def recall_gap(config: LinearizeConfig) -> int:
    """How many tokens lie at least between a span and its repeat: the window's length."""
    return config.plan.window


def with_recall(config: LinearizeConfig, rows: torch.Tensor) -> torch.Tensor:
    """Training rows with ``data.recall_fraction`` of them repeating a span beyond the window
    (:func:`dofla.data.repeat_spans`)."""
    from dofla.data import repeat_spans

    return repeat_spans(rows, config.data.recall_fraction, gap=recall_gap(config), seed=config.seed)


def lora_rows(config: LinearizeConfig, tokenizer, train: torch.Tensor) -> torch.Tensor:
    """The LoRA stage's rows: the training rows with ``lora.needle_fraction`` of them stating facts that
    their last tokens ask for, more than the window back (:func:`dofla.data.insert_needles`); a row's
    first token (the beginning-of-sequence token where the family needs one) stays."""
    from dofla.data import insert_needles

    needled = insert_needles(
        train, tokenizer, config.lora.needle_fraction, gap=recall_gap(config), seed=config.seed
    )
    needled[:, 0] = train[:, 0]
    return needled


def evaluation_lengths(config: LinearizeConfig, limit: int | None) -> list[int]:
    """The held-out lengths: the training length and ``evaluate.lengths`` (default 1024 and 2048 where the
    teacher's context allows them; a length given explicitly beyond the context is an error naming both)."""
    if config.evaluate.lengths is None:
        extra = [length for length in DEFAULT_EVAL_LENGTHS if limit is None or length <= limit]
    else:
        extra = [int(length) for length in config.evaluate.lengths]
        beyond = [length for length in extra if limit is not None and length > limit]
        if beyond:
            raise DoflaError(
                f"evaluation length {beyond[0]} is beyond the teacher's context of {limit} tokens; "
                f"use lengths of at most {limit}."
            )
    return sorted({config.data.seq_len, *extra})


def load_texts_for(config: LinearizeConfig, model, tokenizer, cache_dir: Path) -> tuple[list[str], str]:
    """The run's texts and a sentence saying where they came from."""
    from dofla import data

    settings = config.data
    if settings.path is not None:
        texts = data.load_texts(settings.path)
        source = f"{settings.path} ({len(texts)} texts)"
    else:
        texts = data.sample_teacher_texts(
            model,
            tokenizer,
            num_texts=settings.sampled_texts,
            max_new_tokens=settings.sampled_tokens,
            seed=config.seed,
            cache_dir=cache_dir,
            batch_size=min(32, settings.sampled_texts),  # one generate call for small samples
        )
        source = (
            f"{len(texts)} texts of up to {settings.sampled_tokens} tokens sampled from the teacher itself "
            f"(seed {config.seed}, cached in {cache_dir})"
        )
    if not texts:
        raise DoflaError("the training data is empty; give --data with some text.")
    return texts, source


def plan_options(config: LinearizeConfig) -> dict:
    """What the plan stage gives :func:`dofla.dof.make_plan` besides the budget and the allocation."""
    plan = config.plan
    return dict(
        kind=plan.kind,
        feature_map=config.student.feature_map,
        window=plan.window,
        cell=config.student.cell,
        sinks=plan.sinks,
        share_kv_heads=not plan.per_query_head,
        options=dict(config.student.cell_options),
        convert_windowed=plan.convert_windowed,
    )


def layers_to_convert(config: LinearizeConfig, model) -> list[int]:
    """The layers the plan converts: ``plan.layers``, else those whose cache grows (all with
    ``plan.convert_windowed``)."""
    from dofla.models import get_adapter

    return get_adapter(model).layers_to_convert(
        config.plan.layers, convert_windowed=config.plan.convert_windowed
    )


def calibration_batches(config: LinearizeConfig, model, train: torch.Tensor) -> list[torch.Tensor]:
    """The first ``plan.dof_batches`` training batches (B, T), on the model's device: what a plan measures."""
    batch_size = config.distill.batch_size
    device = next(model.parameters()).device
    return [batch.to(device) for batch in train[: config.plan.dof_batches * batch_size].split(batch_size)]


def make_plan(config: LinearizeConfig, model, train: torch.Tensor):
    """The conversion plan by ``dofla.dof``: allocation ``plan.allocation``, measured first if it needs it."""
    plan = config.plan
    return dof.measure_and_plan(
        model,
        calibration_batches(config, model, train),
        variant=plan.allocation,
        measure=plan.measure,
        num_points=plan.dof_points,
        budget=plan.budget,
        layers=plan.layers,
        keep_softmax=plan.keep_softmax,
        softmax_choice=plan.softmax_choice,
        curves_folder=Path(config.out_dir).expanduser().resolve(),  # measured error curves, kept for a rerun
        **plan_options(config),
    )


def shared_plan(config: LinearizeConfig, model, train: torch.Tensor) -> ConversionPlan:
    """:func:`make_plan` on rank 0; under torchrun the other ranks receive it, so all convert alike."""
    rank = distributed.rank_and_world_size()[0]
    plan = make_plan(config, model, train) if rank == 0 else None
    if distributed.is_distributed():
        plan = ConversionPlan.from_dict(distributed.share_json(plan.to_dict() if rank == 0 else None))
    return plan


def distill_stage(config: LinearizeConfig, model, data: RunData, out_dir: Path, stores):
    """Stage 1, attention transfer (:func:`dofla.distill.trainer.distill`), sharded as ``distill.sharding``
    says under torchrun. Layer sharding: every rank trains its block of the converted layers (from the
    teacher-state ``stores`` (train, heldout) where given) in its own run folder, then every block's
    students are sent to the other ranks. Returns the :class:`~dofla.distill.trainer.DistillResult`."""
    from dofla.distill.trainer import DistillResult, distill
    from dofla.models.surgery import students

    if not any(
        parameter.requires_grad for student in students(model).values() for parameter in student.parameters()
    ):
        # a window-only plan: each student is the teacher's own softmax over a window and sinks; nothing to
        # transfer, and the LoRA stage (if any) is what trains the model
        return DistillResult(steps=0, tokens=0, seconds=0.0)
    rank, processes = distributed.rank_and_world_size()
    settings = config.distill_config()
    if not layer_sharding(config):
        return distill(
            model,
            data.train,
            data.heldout,
            settings,
            out_dir / "distill",
            resume=config.resume,
            shorter_train=data.shorter_train,
        )
    blocks = check_layer_sharding(config, students(model), processes)  # the plan's converted layers
    train_states, heldout_states = stores or (None, None)
    distilled = distill(
        model,
        data.train,
        data.heldout,
        settings,
        rank_run_dir(out_dir, rank),
        resume=config.resume,
        layers=blocks[rank],
        teacher_states=train_states,
        heldout_teacher_states=heldout_states,
        data_parallel=False,
        shorter_train=data.shorter_train,
    )
    distributed.gather_students(students(model), blocks)
    return distilled


def lora_stage(config: LinearizeConfig, model, train: torch.Tensor, history: list[dict]):
    """Stage 2, LoRA merged into the weights: (the model, ``history`` with the stage's records added)."""
    from dofla.distill.lora import train_lora

    model, result = train_lora(
        model, train, config.lora_config(), run_dir=Path(config.out_dir) / LORA_FOLDER, resume=config.resume
    )
    return model, [*history, *result.history]


def perplexity(model, sequences: torch.Tensor, batch_size: int = 4) -> float:
    """Held-out perplexity of sequences (N, T), by ``dofla.evaluation.perplexity``."""
    from dofla.evaluation.perplexity import perplexity as measure

    return float(measure(model, sequences, batch_size=batch_size)["perplexity"])


def lora_adapted_teacher_perplexity(
    teacher, train: torch.Tensor, heldout: torch.Tensor, lora_config
) -> float:
    """Held-out perplexity of the unconverted teacher after the same LoRA stage as the student's.

    The LoRA stage also fits the training text's domain; this is the reference that separates that
    from recovering what the attention change lost. The teacher's weights are restored afterwards.
    """
    from dofla.distill.lora import train_lora

    saved = {name: tensor.detach().clone() for name, tensor in teacher.state_dict().items()}
    flags = {name: parameter.requires_grad for name, parameter in teacher.named_parameters()}
    try:
        adapted, _ = train_lora(teacher, train, lora_config)
        return perplexity(adapted, heldout, lora_config.batch_size)
    finally:
        teacher.load_state_dict(saved)
        for name, parameter in teacher.named_parameters():
            parameter.requires_grad_(flags[name])


def evaluate_student(
    config: LinearizeConfig, reference, model, tokenizer, data: RunData, timings
) -> Evaluation:
    """The trained student beside the teacher (``reference``) and its no-training window baselines (the
    teacher's softmax cut to the student's window, without and with sinks): held-out quality at every
    length, the pass key, and each layer's attention error."""
    from dofla.data import min_span_length
    from dofla.evaluation.attention_error import attention_errors
    from dofla.evaluation.long_context import long_context_quality
    from dofla.evaluation.passkey import passkey_comparison
    from dofla.evaluation.recall import recall_beyond_window
    from dofla.evaluation.window_baseline import baseline_window

    batch_size, window = config.distill.batch_size, baseline_window(getattr(model, "dofla_plan", None))
    baseline_sinks = config.plan.sinks or DEFAULT_BASELINE_SINKS
    quality = long_context_quality(
        reference,
        model,
        data.heldout_by_length,
        window=window,
        sinks=sorted({0, baseline_sinks}),
        batch_size=batch_size,
        sinks_at_edge=config.evaluate.edge_sinks or model.dofla_plan.sinks_at_edge,  # the student's own cache
    )
    at_training_length = quality["by_length"][str(config.data.seq_len)]["models"]
    timings.lap("held-out quality at length (teacher, window baselines, student)")
    passkeys = None
    if config.evaluate.passkey_trials > 0 and tokenizer is not None:
        passkeys = passkey_comparison(
            reference,
            model,
            tokenizer,
            context_lengths=config.evaluate.passkey_lengths,
            trials=config.evaluate.passkey_trials,
            window=window,
            sinks=baseline_sinks,
            seed=config.seed,
        )
        timings.lap("pass key")
    recall = None
    if config.evaluate.recall:
        recall = [
            recall_beyond_window(
                reference, model, rows, window=window, sinks=baseline_sinks, batch_size=batch_size
            )
            for length, rows in sorted(data.heldout_by_length.items())
            if length >= min_span_length(window)  # rows long enough for a span past the window
        ]
        timings.lap("recall beyond the window")
    sequences = data.heldout[: config.evaluate.error_sequences]
    layer_errors = attention_errors(model, sequences.split(batch_size)) if len(sequences) else {}
    timings.lap("attention error")
    return Evaluation(
        quality=quality,
        passkeys=passkeys,
        recall=recall or None,
        layer_errors=layer_errors,
        teacher_ppl=at_training_length["teacher"]["perplexity"],
        student_ppl=at_training_length["student"]["perplexity"],
    )
