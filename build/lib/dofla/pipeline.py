"""The main job: teacher -> DoF -> plan -> convert -> distill (-> LoRA) -> evaluate -> save + report.

``linearize(LinearizeConfig(...))`` runs every stage and writes into ``out_dir``:
``model/`` (the converted model, :func:`dofla.convert.save_converted`), ``distill/`` (config, JSONL log,
checkpoints for ``resume``), ``plan.json``, ``loss_curves.png``, ``result.json`` and ``report.md``.
Held-out perplexity is measured on sequences split off before training and never trained on.
"""

from __future__ import annotations

import copy
import math
import shlex
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dofla import dof
from dofla.errors import DoflaError
from dofla.evaluation.long_context import long_context_markdown, long_context_quality, plot_loss_by_position
from dofla.evaluation.passkey import passkey_comparison, passkey_markdown
from dofla.io import write_atomic, write_json_atomic, write_text_atomic
from dofla.registry import Registry

RECIPES: Registry[dict[str, Any]] = Registry("recipe")  # partial settings; explicit ones always win
# the DoF paper: learnable PRF per layer, DoF-allocated dimensions, softmax-CE loss, no LoRA
RECIPES.add(
    "dof-paper",
    dict(kind="linear", feature_map="learnable_prf", allocation="dof", loss="softmax", lora=False),
)
# LoLCATs: Hedgehog + sliding window 64, attention-output MSE, then LoRA on q/k/v/o. The LoRA
# learning rate and KL weight come from experiments/lora_sweep.py (docs/results/recipes/lora_sweep/).
RECIPES.add(
    "lolcats",
    dict(
        kind="hybrid",
        feature_map="hedgehog",
        allocation="fix",
        window=64,
        loss="output_mse",
        lora=True,
        lora_lr=3e-3,
        lora_kl_weight=1.0,
    ),
)
# Long context: a 64-token window that keeps the first 4 tokens (attention sinks) beside a cell with a bounded
# state, trained at 1,024 tokens, starting close to the window alone (the no-training baseline), then LoRA.
LONG_CONTEXT = dict(
    kind="hybrid",
    allocation="fix",
    window=64,
    sinks=4,
    loss="output_mse",
    seq_len=1024,
    lora=True,
    lora_lr=3e-3,
    lora_kl_weight=1.0,
)
# a gated delta rule memory over learned keys, mixed per head with the window
RECIPES.add(
    "gated-delta",
    dict(
        LONG_CONTEXT,
        cell="gated_delta",
        feature_map="projection",
        budget=64,
        cell_options={"window_factor": 0.95},
    ),
)
# LoLCATs' shared normalisation with forgetting (gla): the demo's cell
RECIPES.add(
    "gla", dict(LONG_CONTEXT, cell="gla", feature_map="hedgehog", cell_options={"window_factor": 0.999})
)
ALLOCATIONS = dof.ALLOCATIONS


@dataclass
class LinearizeConfig:
    """Every knob of ``dofla linearize`` (saved in result.json). ``recipe`` presets some of them.

    budget: mean feature dimension per layer; allocation: "fix" (every layer ``budget``) or a
    ``dofla.dof`` variant ("dof", "dof_clip", "headwise") allocating by the statistical ``measure``; tokens: distillation budget;
    data: a text/jsonl/datasets path, or None for the default (text sampled from the teacher, cached).
    """

    out_dir: str
    model: str = "smollm2-135m"
    recipe: str | None = None
    budget: int = 64
    allocation: str = "dof"
    measure: str = "dof"
    feature_map: str = "learnable_prf"
    kind: str = "linear"
    cell: str = "linear"
    window: int = 64
    sinks: int = 0
    cell_options: dict[str, Any] = field(default_factory=dict)  # e.g. window_factor, decay_memory, beta
    layers: list[int] | None = None
    loss: str = "softmax"
    tokens: int = 2_000_000
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 1e-2
    eval_every: int = 50
    checkpoint_every: int = 50
    patience: int = 0
    data: str | None = None
    heldout_fraction: float = 0.1
    max_heldout_sequences: int = 32
    dof_points: int = 1024
    dof_batches: int = 2
    sampled_texts: int = 64
    sampled_tokens: int = 256
    lora: bool = False
    lora_tokens: int = 200_000
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: list[str] | None = None
    lora_lr: float = 1e-3
    lora_kl_weight: float = 0.0
    lora_baseline: bool = False  # also train the same LoRA stage on the unconverted teacher and report it
    kl_weight: float = 0.0
    error_sequences: int = 8
    passkey_lengths: list[int] | None = None  # None: 256 to 2048 where the teacher's context allows
    passkey_trials: int = 2  # per length and depth; 0 skips the pass-key test
    eval_lengths: list[int] | None = (
        None  # held-out quality at these lengths too (None: 1024, 2048 if they fit)
    )
    seed: int = 0
    dtype: str | None = None
    device: str | None = None
    resume: bool = False
    overwrite: bool = False  # discard an earlier run in out_dir (only the files dofla wrote) and start over
    progress: bool = True
    command: str | None = None
    overrides: list[str] = field(default_factory=list)  # fields set explicitly: a recipe never changes them

    def apply_recipe(self) -> None:
        if self.recipe is None:
            return
        for name, value in RECIPES[self.recipe].items():
            if name not in self.overrides:
                setattr(self, name, value)

    def validate(self) -> None:
        """Everything that can be checked before a model is loaded: names against their registries, ranges."""
        from dofla.cells import cell_class
        from dofla.config import LayerPlan
        from dofla.distill.losses import check_kernel_loss
        from dofla.feature_maps import FEATURE_MAPS

        ALLOCATIONS[self.allocation]  # unknown names are refused with the registered ones
        cell_class(self.cell)
        FEATURE_MAPS[self.feature_map]
        LayerPlan(kind=self.kind, window=self.window, sinks=self.sinks, cell=self.cell).validate(0, 1, 1)
        check_kernel_loss(self.loss, self.cell, self.sinks)
        if self.budget <= 0:
            raise DoflaError(f"the feature budget must be positive, got {self.budget}.")
        if self.tokens <= 0:
            raise DoflaError(f"the token budget must be positive, got {self.tokens}; pass e.g. --tokens 2M.")
        if self.seq_len < 2:
            raise DoflaError(f"--seq-len must be at least 2, got {self.seq_len}.")
        if not 0 < self.heldout_fraction < 1:
            raise DoflaError(f"the held-out fraction must lie in (0, 1), got {self.heldout_fraction}.")


@dataclass
class LinearizeResult:
    out_dir: Path  # the saved converted model (load with dofla.convert.load_converted)
    report_path: Path
    teacher_ppl: float
    student_ppl: float
    run_dir: Path
    plan_table: list[dict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    data_source: str = ""
    train_tokens: int = 0
    lora_teacher_ppl: float | None = None  # the teacher after the same LoRA stage (``lora_baseline``)


def demo_config(out_dir: str | Path) -> LinearizeConfig:
    """The ``make demo`` run, sized for a 2-core CPU: the embedded SmolLM2-135M with every layer converted to
    the long-context recipe's cell (``gla``: linear attention with a learned decay sharing one normalisation
    with a 64-token window that keeps 4 sink tokens), Hedgehog feature dimensions allocated by DoF (mean 32);
    attention-output MSE on 12k tokens of 512-token sequences, then LoRA (lr 3e-3, KL 1 to the teacher) on 10k
    tokens, and the same LoRA stage on the unconverted teacher for reference. Held-out text is evaluated at
    512 and 1,024 tokens beside the teacher and its no-training window baselines. Data: text sampled from the
    teacher itself (32 texts, cached, joined into 1,024-token rows) unless ``data`` is set."""
    config = LinearizeConfig(out_dir=str(out_dir), recipe="gla")
    config.apply_recipe()
    settings = dict(
        budget=32,
        allocation="dof",
        tokens=12_000,
        seq_len=512,
        batch_size=2,
        eval_every=6,
        checkpoint_every=3,
        dof_points=256,
        dof_batches=1,
        sampled_texts=32,
        sampled_tokens=128,
        heldout_fraction=0.1,
        max_heldout_sequences=8,
        eval_lengths=[1024],
        passkey_lengths=[256, 1024],
        passkey_trials=1,
        lora_tokens=10_000,
        lora_baseline=True,
        command="dofla demo  (dofla.pipeline.linearize(dofla.pipeline.demo_config(out)))",
    )
    for name, value in settings.items():
        setattr(config, name, value)
    config.overrides = sorted(settings)
    return config


# ------------------------------------------------------------------------------------------------ stages


def parse_tokens(text: str | int) -> int:
    """'2M' -> 2_000_000, '500k' -> 500_000, '1e6' -> 1_000_000, 1234 -> 1234."""
    if isinstance(text, int):
        return text
    value = str(text).strip().lower().replace("_", "")
    multiplier = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "b": 1_000_000_000}.get(value[-1:], 1)
    number = value[:-1] if multiplier != 1 else value
    try:
        tokens = int(float(number) * multiplier)
    except ValueError as error:
        raise DoflaError(f"cannot read the token count {text!r}; write e.g. 2M, 500k or 100000.") from error
    return tokens


def context_length(model) -> int | None:
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


DEFAULT_EVAL_LENGTHS = (1024, 2048)
DEFAULT_BASELINE_SINKS = 4  # sink tokens of the window baseline when the student has none


def evaluation_lengths(config: LinearizeConfig, limit: int | None) -> list[int]:
    """The held-out lengths: the training length and ``eval_lengths`` (default 1024 and 2048 where the teacher's
    context allows them; a length given explicitly beyond the context is an error naming both numbers)."""
    if config.eval_lengths is None:
        extra = [length for length in DEFAULT_EVAL_LENGTHS if limit is None or length <= limit]
    else:
        extra = [int(length) for length in config.eval_lengths]
        beyond = [length for length in extra if limit is not None and length > limit]
        if beyond:
            raise DoflaError(
                f"evaluation length {beyond[0]} is beyond the teacher's context of {limit} tokens; "
                f"use lengths of at most {limit}."
            )
    return sorted({config.seq_len, *extra})


def cut_rows(rows: torch.Tensor, length: int) -> torch.Tensor:
    """(N, L) -> (N * (L // length), length): each row cut into consecutive pieces, the remainder dropped."""
    pieces = rows.shape[1] // length
    return rows[:, : pieces * length].reshape(-1, length)


def load_texts_for(config: LinearizeConfig, model, tokenizer, cache_dir: Path) -> tuple[list[str], str]:
    """The run's texts and a sentence saying where they came from."""
    from dofla import data

    if config.data is not None:
        texts = data.load_texts(config.data)
        source = f"{config.data} ({len(texts)} texts)"
    else:
        texts = data.sample_teacher_texts(
            model,
            tokenizer,
            num_texts=config.sampled_texts,
            max_new_tokens=config.sampled_tokens,
            seed=config.seed,
            cache_dir=cache_dir,
            batch_size=min(32, config.sampled_texts),  # one generate call for small samples
        )
        source = (
            f"{len(texts)} texts of up to {config.sampled_tokens} tokens sampled from the teacher itself "
            f"(seed {config.seed}, cached in {cache_dir})"
        )
    if not texts:
        raise DoflaError("the training data is empty; give --data with some text.")
    return texts, source


def pack_rows(tokenizer, texts: list[str], lengths: list[int], seq_len: int) -> torch.Tensor:
    """Texts packed into rows of the longest of ``lengths`` that still gives 2 rows (at least ``seq_len``).

    Rows are split into training and held-out rows before anything is cut, so held-out text at every length
    is text the student never trained on.
    """
    from dofla import data

    token_count = len(data.pack_token_sequences(tokenizer, texts, seq_len).view(-1))
    for length in sorted(lengths, reverse=True):
        if token_count // length >= 2 or length == seq_len:
            break
    rows = token_count // length
    if rows < 2:
        raise DoflaError(
            f"the data packs into only {rows} sequence(s) of {seq_len} tokens; at least 2 are "
            "needed: give more text or a shorter --seq-len."
        )
    return torch.as_tensor(data.pack_token_sequences(tokenizer, texts, length), dtype=torch.long)


def perplexity(model, sequences: torch.Tensor, batch_size: int = 4) -> float:
    """Held-out perplexity of sequences (N, T), by ``dofla.evaluation.perplexity``."""
    from dofla.evaluation.perplexity import perplexity as measure

    return float(measure(model, sequences, batch_size=batch_size)["perplexity"])


def distill_config_for(config: LinearizeConfig):
    """The distillation stage's settings of a linearize run."""
    from dofla.distill.trainer import DistillConfig

    return DistillConfig(
        loss=config.loss,
        tokens=config.tokens,
        batch_size=config.batch_size,
        lr=config.lr,
        eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every,
        patience=config.patience,
        kl_weight=config.kl_weight,
        seed=config.seed,
        progress=config.progress,
    )


def lora_config_for(config: LinearizeConfig):
    """The LoRA stage's settings of a linearize run."""
    from dofla.distill.lora import LoraConfig

    return LoraConfig(
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        targets=config.lora_targets,
        tokens=config.lora_tokens,
        batch_size=config.batch_size,
        lr=config.lora_lr,
        kl_weight=config.lora_kl_weight,
        seed=config.seed,
        progress=config.progress,
    )


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


def held_out_attention_errors(model, sequences: torch.Tensor, batch_size: int = 4) -> dict[int, dict]:
    """Each converted layer's relative attention-output error against the teacher on ``sequences``
    (teacher-forced, so errors do not compound; see ``dofla.evaluation.attention_error``)."""
    from dofla.evaluation.attention_error import attention_errors

    if len(sequences) == 0:
        return {}
    return attention_errors(model, sequences.split(batch_size))


def make_plan(config: LinearizeConfig, model, train: torch.Tensor):
    """The conversion plan by ``dofla.dof``: the allocation ``config.allocation``, measured first if it needs it."""
    device = next(model.parameters()).device
    batches = [
        batch.to(device) for batch in train[: config.dof_batches * config.batch_size].split(config.batch_size)
    ]
    return dof.measure_and_plan(
        model,
        batches,
        variant=config.allocation,
        measure=config.measure,
        num_points=config.dof_points,
        budget=config.budget,
        kind=config.kind,
        feature_map=config.feature_map,
        window=config.window,
        layers=config.layers,
        cell=config.cell,
        sinks=config.sinks,
        options=dict(config.cell_options),
    )


def plan_table(plan) -> list[dict]:
    return [
        dict(
            layer=index,
            kind=layer.kind,
            feature_map=layer.feature_map if layer.kind != "softmax" else "",
            feature_dim=layer.feature_dim if layer.kind != "softmax" else 0,
            head_feature_dims=layer.head_feature_dims,
        )
        for index, layer in enumerate(plan.layers)
    ]


# ------------------------------------------------------------------------------------------------ the job


RUN_KIND = "linearize run"  # the kind in the marker of a run folder (dofla.outputs)
RUN_FILES = ("plan.json", "result.json", "report.md", "loss_curves.png")  # beside model/ and distill/


def open_run_folder(config: LinearizeConfig) -> Path:
    """Check, before any work, every setting and the output folder; claim the folder. Call under its lock.

    An earlier run there is continued with ``resume`` or discarded with ``overwrite`` (only the files dofla
    wrote go), never silently; ``resume`` without a checkpoint is refused here, not after hours of work.
    """
    from dofla import outputs
    from dofla.convert import MODEL_KIND
    from dofla.distill.trainer import check_run_folder, discard_run

    distill_config_for(config).validate()
    if config.lora:
        lora_config_for(config).validate()
    if config.resume and config.overwrite:
        raise DoflaError("--resume continues the run in --out and --overwrite discards it; pass only one.")
    out_dir = Path(config.out_dir)
    run_dir = out_dir / "distill"
    if config.overwrite and out_dir.is_dir():
        if (out_dir / "model").exists():
            outputs.remove_tree_if_ours(out_dir / "model", MODEL_KIND)
        outputs.remove_known_files(out_dir, RUN_FILES)
        discard_run(run_dir)
    finished = [name for name in ("model", *RUN_FILES) if (out_dir / name).exists()]
    check_run_folder(run_dir, config.resume)
    if finished and not config.resume:
        raise DoflaError(
            f"{out_dir} holds an earlier run ({finished[0]}); pass --resume to continue it, --overwrite to "
            "discard it and start over, or choose another --out."
        )
    outputs.claim_output_folder(out_dir, RUN_KIND)
    outputs.remove_stale_temporaries(out_dir)  # e.g. a model half-written when a run was killed
    return out_dir


def check_teacher_for_run(config: LinearizeConfig, teacher, tokenizer, sequences) -> None:
    """What needs the loaded teacher but not the expensive work: its tokenizer and the LoRA targets."""
    from dofla.distill.lora import check_targets

    if sequences is None and tokenizer is None:
        raise DoflaError(
            f"the teacher {config.model} has no usable tokenizer, which reading --data or sampling text needs; "
            "add its tokenizer files to the model folder."
        )
    if config.lora:
        check_targets(teacher, config.lora_targets)


def linearize(
    config: LinearizeConfig, *, teacher=None, tokenizer=None, sequences: torch.Tensor | None = None
) -> LinearizeResult:
    """Run the whole pipeline as ``config`` says; returns where things are and the two perplexities.

    teacher/tokenizer: an already loaded model (else ``dofla.models.load_teacher(config.model)``);
    sequences (N, T): already packed token ids (else read from ``config.data`` or sampled from the teacher).
    ``out_dir`` must be new, empty, or an earlier run (see :func:`open_run_folder`); it is locked for the run.
    """
    from dofla import outputs

    config.apply_recipe()
    config.validate()
    inputs = [config.data] + ([config.model] if teacher is None else [])
    outputs.check_output_folder(config.out_dir, RUN_KIND, inputs=inputs)
    with outputs.output_lock(config.out_dir):
        out_dir = open_run_folder(config)
        return _run_stages(config, out_dir, teacher=teacher, tokenizer=tokenizer, sequences=sequences)


def _run_stages(
    config: LinearizeConfig, out_dir: Path, *, teacher, tokenizer, sequences: torch.Tensor | None
) -> LinearizeResult:
    """The stages of :func:`linearize`, in its checked and locked ``out_dir``."""
    from dofla.convert import check_finite_model, convert, save_converted, students, teacher_fingerprint
    from dofla.distill.lora import train_lora
    from dofla.distill.trainer import distill

    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 2)
        clock = now

    torch.manual_seed(config.seed)
    if teacher is None:
        from dofla.models import load_teacher

        loaded = load_teacher(config.model, dtype=config.dtype, device=config.device)
        teacher, tokenizer = loaded.model, loaded.tokenizer
    teacher.eval()
    lap("load teacher")
    check_teacher_for_run(config, teacher, tokenizer, sequences)
    teacher_weights = teacher_fingerprint(teacher) if config.lora else None  # LoRA changes its weights

    limit = context_length(teacher)
    if limit is not None and config.seq_len > limit:
        raise DoflaError(
            f"--seq-len {config.seq_len} is beyond the model's context of {limit} tokens; use at most {limit}."
        )
    lengths = evaluation_lengths(config, limit)
    if sequences is None:
        texts, data_source = load_texts_for(config, teacher, tokenizer, out_dir / "data_cache")
        sequences = pack_rows(tokenizer, texts, lengths, config.seq_len)
    else:
        data_source = f"{len(sequences)} packed sequences given by the caller"
        if sequences.shape[1] > (limit or sequences.shape[1]):
            raise DoflaError(f"sequences of {sequences.shape[1]} tokens exceed the context of {limit}.")
        if sequences.shape[1] < config.seq_len:
            raise DoflaError(
                f"the given sequences have {sequences.shape[1]} tokens, fewer than --seq-len {config.seq_len}."
            )
    from dofla.data import split_train_heldout

    train_rows, heldout_rows = split_train_heldout(sequences, config.heldout_fraction, config.seed)
    heldout_rows = heldout_rows[: config.max_heldout_sequences]
    train = cut_rows(train_rows, config.seq_len)
    heldout_by_length = {
        length: cut_rows(heldout_rows, length) for length in lengths if length <= sequences.shape[1]
    }
    heldout = heldout_by_length[config.seq_len]
    skipped_lengths = [length for length in lengths if length not in heldout_by_length]
    if skipped_lengths:
        warnings.warn(
            f"the data is too short for held-out rows of {skipped_lengths} tokens; those lengths are not "
            "evaluated (give more text with --data)",
            stacklevel=2,
        )
    lap("data")

    baseline_ppl = None
    if config.lora and config.lora_baseline:
        baseline_ppl = lora_adapted_teacher_perplexity(teacher, train, heldout, lora_config_for(config))
        lap("LoRA baseline (teacher)")

    plan = make_plan(config, teacher, train)
    lap("plan (DoF estimate)" if "measure" in plan.metadata else "plan")
    # The unconverted teacher, for the side-by-side evaluation: conversion works in place and LoRA merges
    # into the shared projections, so the teacher cannot be recovered from the student afterwards.
    reference = copy.deepcopy(teacher)
    model = convert(teacher, plan)

    run_dir = out_dir / "distill"
    distilled = distill(model, train, heldout, distill_config_for(config), run_dir, resume=config.resume)
    lap("distill")
    history = list(distilled.history)

    if config.lora:
        model, lora_result = train_lora(model, train, lora_config_for(config))
        history.extend(lora_result.history)
        lap("lora")

    check_finite_model(model, heldout[: config.batch_size], what="the trained student")  # never save NaN
    # the no-training baseline: the teacher's softmax cut to the student's window (without and with sinks)
    baseline_sinks = config.sinks or DEFAULT_BASELINE_SINKS
    quality = long_context_quality(
        reference,
        model,
        heldout_by_length,
        window=config.window,
        sinks=sorted({0, baseline_sinks}),
        batch_size=config.batch_size,
    )
    at_training_length = quality["by_length"][str(config.seq_len)]["models"]
    teacher_ppl = at_training_length["teacher"]["perplexity"]
    student_ppl = at_training_length["student"]["perplexity"]
    plot_loss_by_position(quality, out_dir / "loss_by_position.png")
    lap("held-out quality at length (teacher, window baselines, student)")
    passkeys = None
    if config.passkey_trials > 0 and tokenizer is not None:
        passkeys = passkey_comparison(
            reference,
            model,
            tokenizer,
            context_lengths=config.passkey_lengths,
            trials=config.passkey_trials,
            window=config.window,
            sinks=baseline_sinks,
            seed=config.seed,
        )
        lap("pass key")
    del reference
    layer_errors = held_out_attention_errors(model, heldout[: config.error_sequences], config.batch_size)
    lap("attention error")

    model_dir = save_converted(
        model,
        out_dir / "model",
        tokenizer=tokenizer,
        extra_metadata={"teacher": config.model, "recipe": config.recipe or "custom"},
        overwrite=True,  # this run's own model (the folder was checked when the run started)
        teacher_weights=teacher_weights,
    )
    lap("save")
    table = plan_table(plan)

    result = LinearizeResult(
        out_dir=model_dir,
        report_path=out_dir / "report.md",
        teacher_ppl=teacher_ppl,
        student_ppl=student_ppl,
        run_dir=out_dir,
        plan_table=table,
        timings=timings,
        data_source=data_source,
        train_tokens=distilled.tokens,
        lora_teacher_ppl=baseline_ppl,
    )
    summary = dict(
        config=asdict(config),
        teacher_ppl=teacher_ppl,
        student_ppl=student_ppl,
        lora_teacher_ppl=baseline_ppl,
        long_context=quality,
        skipped_lengths=skipped_lengths,
        passkey=passkeys,
        train_sequences=len(train),
        heldout_sequences=len(heldout),
        distill_tokens=distilled.tokens,
        distill_steps=distilled.steps,
        skipped_steps=distilled.skipped_steps,
        stopped_early=distilled.stopped_early,
        best_val_loss=distilled.best_val_loss,
        val_layer_losses={str(k): v for k, v in distilled.val_layer_losses.items()},
        attention_errors={str(k): v for k, v in layer_errors.items()},
        mean_attention_error=(
            sum(e["relative_error"] for e in layer_errors.values()) / len(layer_errors)
            if layer_errors
            else None
        ),
        converted_layers=sorted(students(model)),
        feature_dims=[row["feature_dim"] for row in table],
        timings=timings,
        data_source=data_source,
    )
    write_json_atomic(out_dir / "plan.json", plan.to_dict())
    write_json_atomic(out_dir / "result.json", summary)  # valid JSON: a NaN becomes null
    plot_loss_curves(history, out_dir / "loss_curves.png")
    write_report(result, summary, config)
    return result


# ------------------------------------------------------------------------------------------------ report


def plot_loss_curves(history: list[dict], path: Path) -> Path:
    """Training loss per step (and held-out loss at each evaluation; LoRA loss on its own axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    distill_steps = [r for r in history if "loss" in r and r.get("stage") != "lora"]
    evaluations = [r for r in history if "val_loss" in r]
    lora_steps = [r for r in history if r.get("stage") == "lora"]
    columns = 2 if lora_steps else 1
    figure, axes = plt.subplots(1, columns, figsize=(6 * columns, 4), squeeze=False)
    axis = axes[0][0]
    axis.plot([r["step"] for r in distill_steps], [r["loss"] for r in distill_steps], label="train", lw=1)
    axis.plot([r["step"] for r in evaluations], [r["val_loss"] for r in evaluations], "o-", label="held-out")
    axis.set_xlabel("step")
    axis.set_ylabel("attention-transfer loss (mean over layers)")
    axis.set_title("stage 1: attention transfer")
    axis.legend()
    if lora_steps:
        axis = axes[0][1]
        axis.plot([r["step"] for r in lora_steps], [r["loss"] for r in lora_steps], lw=1)
        axis.set_xlabel("step")
        axis.set_ylabel("next-token loss")
        axis.set_title("stage 2: LoRA")
    figure.tight_layout()
    write_atomic(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110))
    plt.close(figure)
    return path


def write_report(result: LinearizeResult, summary: dict, config: LinearizeConfig) -> Path:
    """DIR/report.md: command, data, plan table, perplexities, loss curves, timings."""
    command = config.command or "dofla linearize " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ratio = result.student_ppl / result.teacher_ppl if result.teacher_ppl else math.nan
    lines = [
        "# dofla linearize report",
        "",
        "Command:",
        "",
        f"    {command}",
        "",
        f"Teacher: `{config.model}`. Recipe: `{config.recipe or 'custom'}`. Saved model: `{result.out_dir}`.",
        "",
        "## Data",
        "",
        f"- Source: {result.data_source}.",
        f"- Sequence length {config.seq_len}; {summary['train_sequences']} training sequences, "
        f"{summary['heldout_sequences']} held-out sequences (split off before training, never trained on).",
        f"- Distillation: {summary['distill_tokens']} tokens in {summary['distill_steps']} steps "
        f"(loss `{config.loss}`, skipped non-finite steps: {summary['skipped_steps']}, "
        f"stopped early: {summary['stopped_early']}).",
        (
            f"- LoRA stage: {config.lora_tokens} tokens, rank {config.lora_rank}, alpha {config.lora_alpha}, "
            f"lr {config.lora_lr:g}, KL weight to the teacher's logits {config.lora_kl_weight:g}; merged into "
            "the weights. It also adapts the model to the training text, so part of any gain over the teacher "
            "is that adaptation."
            if config.lora
            else "- No LoRA stage."
        ),
        "",
        "## Held-out perplexity",
        "",
        "| model | perplexity |",
        "|---|---|",
        f"| teacher (softmax) | {result.teacher_ppl:.3f} |",
        f"| student (dofla) | {result.student_ppl:.3f} |",
        f"| student / teacher | {ratio:.3f} |",
        *(
            [
                f"| teacher + the same LoRA stage | {summary['lora_teacher_ppl']:.3f} |",
                f"| student / (teacher + LoRA) | {result.student_ppl / summary['lora_teacher_ppl']:.3f} |",
            ]
            if summary.get("lora_teacher_ppl") is not None
            else []
        ),
        "",
        f"At the training length ({config.seq_len} tokens). The table below gives every length, by position"
        + (
            f"; {summary['skipped_lengths']} were asked for but the data was too short for them."
            if summary.get("skipped_lengths")
            else "."
        ),
        "",
        long_context_markdown(summary["long_context"], plot="loss_by_position.png").rstrip(),
        *(["", passkey_markdown(summary["passkey"]).rstrip()] if summary.get("passkey") else []),
        "",
        "## Plan",
        "",
        f"Allocation `{config.allocation}`"
        + (f" (measure `{config.measure}`)" if ALLOCATIONS[config.allocation].needs_measure else "")
        + f", mean feature budget {config.budget}.",
        "",
        "Held-out layer loss: the distillation loss on held-out data. Attention error: "
        "||y_student - y_teacher|| / ||y_teacher|| of the layer's attention output before the output "
        f"projection, teacher-forced, on {min(config.error_sequences, summary['heldout_sequences'])} held-out "
        "sequences after all training stages"
        + (
            f" (mean over layers {summary['mean_attention_error']:.4f})."
            if summary.get("mean_attention_error") is not None
            else "."
        ),
        "",
        "| layer | kind | feature map | feature dim | per-head dims | held-out layer loss | attention error |",
        "|---|---|---|---|---|---|---|",
    ]
    layer_losses = summary["val_layer_losses"]
    errors = summary.get("attention_errors", {})
    for row in result.plan_table:
        loss = layer_losses.get(str(row["layer"]))
        error = errors.get(str(row["layer"]), {}).get("relative_error")
        lines.append(
            f"| {row['layer']} | {row['kind']} | {row['feature_map']} | {row['feature_dim']} | "
            f"{row['head_feature_dims'] or ''} | {'' if loss is None else f'{loss:.4g}'} | "
            f"{'' if error is None else f'{error:.4f}'} |"
        )
    lines += [
        "",
        "## Loss curves",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "## Timings (seconds, wall clock)",
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {name} | {seconds:.1f} |" for name, seconds in result.timings.items()],
        f"| total | {sum(result.timings.values()):.1f} |",
        "",
        "All numbers above were written by the run itself (`result.json` holds them as data).",
        "",
    ]
    return write_text_atomic(result.report_path, "\n".join(lines))
