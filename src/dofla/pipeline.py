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
import dataclasses
import time
from pathlib import Path

import torch

from dofla import planning, report
from dofla.cells.recall_cache import switch_on_recall_cache
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
from dofla.report import Evaluation, LinearizeResult
from dofla.run_checks import check_teacher_for_run
from dofla.run_config import CONFIG_FILE, LinearizeConfig, save_config
from dofla.run_data import RunData, lora_rows, prepare_data
from dofla.run_positions import apply_position_period, resolve_sinks_at_edge

RUN_KIND = "linearize run"  # the kind in the marker of a run folder (dofla.outputs)
RESULT_FILES = ("plan.json", "result.json", "report.md", "loss_curves.png", "loss_by_position.png")
LORA_FOLDER = "lora"  # the LoRA stage's log and checkpoints
RUN_FILES = (CONFIG_FILE, *RESULT_FILES)  # beside model/ and distill/; removed by overwrite
DEFAULT_BASELINE_SINKS = 4  # sink tokens of the window baseline when the student has none


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
    inputs = [config.data.path, config.data.heldout_path] + (
        [config.teacher.model] if teacher is None else []
    )
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
    whole = (
        config.distill.teacher_states is not None
    )  # the rows `dofla teacher-states` stored, from all the text
    data = prepare_data(config, teacher, tokenizer, sequences, out_dir / "data_cache", whole_data=whole)
    stores = checked_layer_stores(config, teacher, data) if config.distill.teacher_states else None
    # the LoRA stage's rows, once for the stage and its baseline on the teacher (rank 0 runs both)
    lora_source = data.train if data.lora_train is None else data.lora_train
    lora_train = lora_rows(config, tokenizer, lora_source) if config.lora.enabled and rank == 0 else None
    timings.lap("data")
    baseline_ppl = None
    if config.lora.enabled and config.lora.baseline and rank == 0:
        baseline_ppl = lora_adapted_perplexities(teacher, lora_train, data.heldout_by_length, config)
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
    if config.student.recall_cache:  # trained without it: no parameters (dofla.cells.recall_cache)
        switch_on_recall_cache(model, config.student.recall_cache)
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
    baseline_ppl: dict[int, float] | None,
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
        lora_teacher_ppl=None if baseline_ppl is None else baseline_ppl[config.data.seq_len],
    )
    summary = report.run_summary(
        config,
        data,
        distilled,
        evaluation,
        converted_layers=converted_layers,
        table=table,
        timings=result.timings,
        lora_teacher_by_length=baseline_ppl,
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
    """The conversion plan of the ``plan`` and ``student`` sections (:func:`dofla.planning.measure_and_plan`),
    measured first on the calibration batches where the allocation needs it."""
    return planning.measure_and_plan(
        model,
        calibration_batches(config, model, train),
        plan=config.plan,
        student=config.student,
        curves_folder=Path(config.out_dir).expanduser().resolve(),  # measured error curves, kept for a rerun
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
    if not layer_sharding(config):
        return distill(
            model,
            data.train,
            data.heldout,
            config,
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
        config,
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
        model, train, config, run_dir=Path(config.out_dir) / LORA_FOLDER, resume=config.resume
    )
    return model, [*history, *result.history]


def perplexity(model, sequences: torch.Tensor, batch_size: int = 4) -> float:
    """Held-out perplexity of sequences (N, T), by ``dofla.evaluation.perplexity``."""
    from dofla.evaluation.perplexity import perplexity as measure

    return float(measure(model, sequences, batch_size=batch_size)["perplexity"])


def lora_adapted_perplexities(
    teacher, train: torch.Tensor, heldout_by_length: dict[int, torch.Tensor], config: LinearizeConfig
) -> dict[int, float]:
    """Held-out perplexity at every length of ``teacher`` after the same LoRA stage as the student's.

    The LoRA stage also fits the training text's domain; this is the reference that separates that
    from recovering what the attention change lost. ``teacher``: the unconverted teacher, or a baseline
    made from it (e.g. its softmax cut to a window: ``experiments/lora_baselines_at_length.py``); its
    converted layers, if any, do not train (``lora.train_students`` does not apply), only the adapters.
    Its weights are restored afterwards.
    """
    from dofla.distill.lora import train_lora

    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, train_students=False))
    saved = {name: tensor.detach().clone() for name, tensor in teacher.state_dict().items()}
    flags = {name: parameter.requires_grad for name, parameter in teacher.named_parameters()}
    try:
        adapted, _ = train_lora(teacher, train, config)
        return {
            length: perplexity(adapted, rows, config.distill.batch_size)
            for length, rows in sorted(heldout_by_length.items())
        }
    finally:
        teacher.load_state_dict(saved)
        for name, parameter in teacher.named_parameters():
            parameter.requires_grad_(flags[name])


def evaluate_student(
    config: LinearizeConfig, reference, model, tokenizer, data: RunData, timings
) -> Evaluation:
    """The trained student beside the teacher (``reference``) and its no-training baselines (the teacher's
    softmax cut to the student's window, without and with sinks; StreamingLLM and heavy hitters holding the
    bytes of the student's state): held-out quality at every length, the pass key, recall, and each layer's
    attention error."""
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
        cache_sinks=baseline_sinks,
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
