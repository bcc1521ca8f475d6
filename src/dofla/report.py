"""What a ``dofla linearize`` run leaves beside its model: result.json, report.md and the plots.

:func:`run_summary` gathers the run's numbers (the ``result.json`` data); :func:`write_run_outputs` writes
plan.json, result.json, loss_curves.png and report.md from it. Nothing here trains or measures.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dofla.evaluation.long_context_report import long_context_markdown, plot_loss_by_position
from dofla.evaluation.passkey import passkey_markdown
from dofla.evaluation.recall import recall_markdown
from dofla.io import write_atomic, write_json_atomic, write_text_atomic
from dofla.run_config import LinearizeConfig
from dofla.run_data import RunData


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
class Evaluation:
    """Held-out quality after training: by length (teacher, window baselines, student), pass key, errors."""

    quality: dict
    passkeys: dict | None
    recall: list[dict] | None
    layer_errors: dict[int, dict]
    teacher_ppl: float
    student_ppl: float


def plan_table(plan) -> list[dict]:
    """One row per layer of a :class:`~dofla.config.ConversionPlan`: kind, feature map, dimensions, and what
    the plan does with the layer and why (``attention``). Layers without a feature map (kept softmax, and
    cells with their own projections such as ``gated_delta_net``) show none."""
    from dofla.cells.registry import cell_class

    reasons = plan.layer_reasons()
    rows = []
    for index, layer in enumerate(plan.layers):
        featured = layer.kind != "softmax" and cell_class(layer.cell).uses_features
        rows.append(
            dict(
                layer=index,
                kind=layer.kind,
                attention=reasons[index],
                feature_map=layer.feature_map if featured else "",
                feature_dim=layer.feature_dim if featured else 0,
                head_feature_dims=layer.head_feature_dims if featured else None,
            )
        )
    return rows


def run_summary(
    config: LinearizeConfig,
    data: RunData,
    distilled,
    evaluation: Evaluation,
    *,
    converted_layers: list[int],
    table: list[dict],
    timings: dict[str, float],
    lora_teacher_by_length: dict[int, float] | None,
    processes: int = 1,
    position_period: int | None = None,
    sinks_at_edge: bool = False,
) -> dict[str, Any]:
    """The data of result.json: the resolved config (by section) and every number the run measured."""
    errors = evaluation.layer_errors
    return dict(
        config=config.to_dict(),
        teacher_ppl=evaluation.teacher_ppl,
        student_ppl=evaluation.student_ppl,
        lora_teacher_ppl=(
            None if lora_teacher_by_length is None else lora_teacher_by_length[config.data.seq_len]
        ),
        lora_teacher_by_length=(
            None
            if lora_teacher_by_length is None
            else {str(k): v for k, v in sorted(lora_teacher_by_length.items())}
        ),
        long_context=evaluation.quality,
        skipped_lengths=data.skipped_lengths,
        passkey=evaluation.passkeys,
        recall=evaluation.recall,
        train_sequences=len(data.train),
        heldout_sequences=len(data.heldout),
        distill_tokens=distilled.tokens,
        distill_processes=processes,
        distill_steps=distilled.steps,
        skipped_steps=distilled.skipped_steps,
        stopped_early=distilled.stopped_early,
        distill_stages=distilled.stages,
        best_val_loss=distilled.best_val_loss,
        val_layer_losses={str(k): v for k, v in distilled.val_layer_losses.items()},
        attention_errors={str(k): v for k, v in errors.items()},
        mean_attention_error=(
            sum(e["relative_error"] for e in errors.values()) / len(errors) if errors else None
        ),
        converted_layers=converted_layers,
        feature_dims=[row["feature_dim"] for row in table],
        layer_attention=[row["attention"] for row in table],
        position_period=position_period,
        sinks_at_edge=sinks_at_edge,
        timings=timings,
        data_source=data.source,
    )


def write_run_outputs(
    out_dir: Path, result: LinearizeResult, summary: dict, config: LinearizeConfig, plan, history: list[dict]
) -> None:
    """plan.json, result.json (valid JSON: a NaN becomes null), the two plots and report.md."""
    write_json_atomic(out_dir / "plan.json", plan.to_dict())
    write_json_atomic(out_dir / "result.json", summary)
    plot_loss_by_position(summary["long_context"], out_dir / "loss_by_position.png")
    plot_loss_curves(history, out_dir / "loss_curves.png")
    write_report(result, summary, config)


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


def _stages_lines(summary: dict, config: LinearizeConfig) -> list[str]:
    """The report's data section: source, sequences, the distillation and the LoRA stage."""
    lora = config.lora
    return [
        f"- Source: {summary['data_source']}.",
        f"- Sequence length {config.data.seq_len}; {summary['train_sequences']} training sequences, "
        f"{summary['heldout_sequences']} held-out sequences (split off before training, never trained on).",
        (
            f"- Distillation: {summary['distill_tokens']} tokens in {summary['distill_steps']} steps "
            f"(loss `{config.distill.loss}`, skipped non-finite steps: {summary['skipped_steps']}, "
            f"stopped early: {summary['stopped_early']})."
            if summary["distill_steps"]
            else "- No attention transfer: the students have no trainable parameters (the teacher's own "
            "softmax over a window and sinks)."
        ),
        *_curriculum_lines(summary.get("distill_stages") or []),
        (
            f"- LoRA stage: {lora.tokens} tokens, rank {lora.rank}, alpha {lora.alpha}, "
            f"lr {lora.lr:g}, KL weight to the teacher's logits {lora.kl_weight:g}; merged into "
            "the weights. It also adapts the model to the training text, so part of any gain over the teacher "
            "is that adaptation."
            + (
                f" {lora.needle_fraction:.0%} of its rows state five-digit facts that their last tokens ask "
                f"for, at least {config.plan.window} tokens back (`--lora-needles`): it is taught the "
                "retrieval the pass key tests."
                if lora.needle_fraction > 0
                else ""
            )
            if lora.enabled
            else "- No LoRA stage."
        ),
    ]


def _curriculum_lines(stages: list[dict]) -> list[str]:
    """The length curriculum's stages, in one line (none without a curriculum)."""
    if not stages:
        return []
    parts = [
        f"{stage['length']} tokens x {stage['batch_size']} sequences for {stage['steps']} steps "
        f"({stage['tokens']} tokens, share {stage['share']:g})"
        for stage in stages
    ]
    return ["- Length curriculum, shortest first: " + "; ".join(parts) + "."]


def _perplexity_lines(result: LinearizeResult, summary: dict, config: LinearizeConfig) -> list[str]:
    """The held-out perplexity table, then every length and the pass key."""
    ratio = result.student_ppl / result.teacher_ppl if result.teacher_ppl else math.nan
    baseline = summary.get("lora_teacher_ppl")
    skipped = summary.get("skipped_lengths")
    return [
        "| model | perplexity |",
        "|---|---|",
        f"| teacher (softmax) | {result.teacher_ppl:.3f} |",
        f"| student (dofla) | {result.student_ppl:.3f} |",
        f"| student / teacher | {ratio:.3f} |",
        *(
            [
                f"| teacher + the same LoRA stage | {baseline:.3f} |",
                f"| student / (teacher + LoRA) | {result.student_ppl / baseline:.3f} |",
            ]
            if baseline is not None
            else []
        ),
        "",
        f"At the training length ({config.data.seq_len} tokens). The table below gives every length, by position"
        + (f"; {skipped} were asked for but the data was too short for them." if skipped else "."),
        *_lora_baseline_lines(summary),
        "",
        long_context_markdown(summary["long_context"], plot="loss_by_position.png").rstrip(),
        *(["", passkey_markdown(summary["passkey"]).rstrip()] if summary.get("passkey") else []),
        *(["", recall_markdown(summary["recall"]).rstrip()] if summary.get("recall") else []),
    ]


def _lora_baseline_lines(summary: dict) -> list[str]:
    """The teacher after the same LoRA stage at every held-out length beside the student (none without it)."""
    by_length = summary.get("lora_teacher_by_length") or {}
    lengths = summary.get("long_context", {}).get("by_length", {})
    if len(by_length) < 2:
        return []
    parts = []
    for length, ppl in by_length.items():
        student = lengths.get(length, {}).get("models", {}).get("student", {}).get("perplexity")
        ratio = f", student / it {student / ppl:.3f}" if student and ppl else ""
        parts.append(f"{length} tokens {ppl:.3f}{ratio}")
    return ["", "The teacher after the same LoRA stage, at every held-out length: " + "; ".join(parts) + "."]


def _plan_lines(result: LinearizeResult, summary: dict, config: LinearizeConfig) -> list[str]:
    """The allocation and one row per layer: dimensions, held-out layer loss, attention error."""
    from dofla.dof import ALLOCATIONS

    plan = config.plan
    mean_error = summary.get("mean_attention_error")
    kept = [
        row["layer"] for row in result.plan_table if row.get("attention", "").startswith("kept: the teacher")
    ]
    lines = [
        f"Allocation `{plan.allocation}`"
        + (f" (measure `{plan.measure}`)" if ALLOCATIONS[plan.allocation].needs_measure else "")
        + f", mean feature budget {plan.budget}. "
        + (
            f"The converted layers' memories read rotary positions modulo {summary['position_period']} tokens "
            "(`position_period`, the positions they trained at; windows keep the true ones)."
            if summary.get("position_period")
            else "The converted layers read the true rotary positions (no `position_period`)."
        )
        + (
            " Their windows see their sinks from the window's edge (`sinks_at_edge`), and so do the "
            "`window+sinks…@edge` baselines beside them."
            if summary.get("sinks_at_edge")
            else ""
        )
        + (
            f" Layers {kept} already attend to the teacher's own sliding window (a bounded cache) and are kept "
            "as they are; `--convert-windowed` converts them too."
            if kept
            else ""
        ),
        "",
        "Held-out layer loss: the distillation loss on held-out data. Attention error: "
        "||y_student - y_teacher|| / ||y_teacher|| of the layer's attention output before the output "
        f"projection, teacher-forced, on {min(config.evaluate.error_sequences, summary['heldout_sequences'])} "
        "held-out sequences after all training stages"
        + (f" (mean over layers {mean_error:.4f})." if mean_error is not None else "."),
        "",
        "| layer | kind | attention | feature map | feature dim | per-head dims | held-out layer loss | "
        "attention error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    layer_losses = summary["val_layer_losses"]
    errors = summary.get("attention_errors", {})
    for row in result.plan_table:
        loss = layer_losses.get(str(row["layer"]))
        error = errors.get(str(row["layer"]), {}).get("relative_error")
        lines.append(
            f"| {row['layer']} | {row['kind']} | {row.get('attention', '')} | {row['feature_map']} | "
            f"{row['feature_dim'] or ''} | "
            f"{row['head_feature_dims'] or ''} | {'' if loss is None else f'{loss:.4g}'} | "
            f"{'' if error is None else f'{error:.4f}'} |"
        )
    return lines


def write_report(result: LinearizeResult, summary: dict, config: LinearizeConfig) -> Path:
    """DIR/report.md: command, data, perplexities, plan table, loss curves, timings."""
    command = config.command or "dofla linearize " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# dofla linearize report",
        "",
        "Command:",
        "",
        f"    {command}",
        "",
        f"Teacher: `{config.teacher.model}`. Recipe: `{config.recipe or 'custom'}`. "
        f"Saved model: `{result.out_dir}`. Settings: `config.toml`.",
        "",
        "## Data",
        "",
        *_stages_lines(summary, config),
        "",
        "## Held-out perplexity",
        "",
        *_perplexity_lines(result, summary, config),
        "",
        "## Plan",
        "",
        *_plan_lines(result, summary, config),
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
