"""The quality-cost frontier: a grid of allocations × budgets × softmax layers through the public pipeline.

``run_frontier(FrontierConfig(...))`` loads the teacher and the data once, then runs
:func:`dofla.pipeline.linearize` once per grid cell in ``OUT/cells/NAME/`` (a cell whose ``result.json``
exists is skipped; one interrupted in distillation is resumed from its checkpoint), measures each finished
student's decode speed and state size at the evaluation length, and writes ``OUT/frontier.json``,
``OUT/frontier.md`` and ``OUT/frontier.png`` (held-out perplexity at ``eval_length`` against inference
state bytes and decode tokens/s, with the teacher and the sliding-window baseline as reference lines), and
``OUT/curves.png`` (the measured error curves, when the grid measured them).

A cell is (allocation, budget, K, choice): K layers stay softmax, chosen by the softmax-layer choice
(:data:`dofla.dof.SOFTMAX_CHOICES`: ``uniform``, ``dof``, ``measured``, ``window``) and passed to the pipeline as the
layers to convert; the budget is the mean feature dimension per converted layer. Measured error curves
(:mod:`dofla.dof.error_curves`) are measured once on the pipeline's own calibration batches and kept in
``OUT/curves/`` where every cell's plan finds them.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dofla import dof, planning
from dofla.errors import DoflaError
from dofla.io import write_atomic, write_json_atomic, write_text_atomic

CELL_RESULT = "frontier_cell.json"
# What every cell shares unless the caller's settings say otherwise (nested as in a run's config.toml):
# short attention transfer without LoRA or pass keys, error on at most 8 held-out rows.
DEFAULT_SETTINGS: dict[str, Any] = dict(
    data=dict(seq_len=512),
    plan=dict(kind="linear"),
    distill=dict(tokens=20_000, batch_size=4, loss="output_mse", eval_every=0),
    lora=dict(enabled=False),
    evaluate=dict(error_sequences=8, passkey_trials=0),
)


@dataclass
class FrontierConfig:
    """The grid and what every cell shares.

    allocations × budgets × softmax_counts; a K > 0 runs once per entry of ``softmax_choices``. ``settings``:
    run settings every cell shares, nested by section as in a run's ``config.toml`` (e.g. ``{"distill":
    {"tokens": 20000}, "student": {"cell": "gla"}}``; :data:`DEFAULT_SETTINGS` is what ``dofla frontier``
    and every cell starts from); eval_length: the held-out length of the frontier; decode_tokens: tokens decoded after a prompt of
    eval_length to time decoding (0: no speed measurement); curve_options: the error-curve knobs the pipeline's
    plan stage passes to :func:`dofla.planning.measure_and_plan` (they must match for the cells to reuse the grid's
    curves; none today).
    """

    out_dir: str
    model: str = "smollm2-135m"
    allocations: list[str] = field(default_factory=lambda: ["fix", "measured"])
    budgets: list[int] = field(default_factory=lambda: [32])
    softmax_counts: list[int] = field(default_factory=lambda: [0])
    softmax_choices: list[str] = field(default_factory=lambda: ["uniform", "measured"])
    settings: dict[str, Any] = field(default_factory=dict)
    eval_length: int = 1024
    decode_tokens: int = 16
    curve_options: dict[str, Any] = field(default_factory=dict)
    command: str | None = None

    def validate(self, num_layers: int | None = None) -> None:
        for name in self.allocations:
            dof.ALLOCATIONS[name]
        for name in self.softmax_choices:
            dof.SOFTMAX_CHOICES[name]
        if not self.allocations or not self.budgets or not self.softmax_counts:
            raise DoflaError("the frontier grid is empty: give at least one allocation, budget and K.")
        if min(self.budgets) < 1:
            raise DoflaError(f"every budget must be at least one feature per layer, got {min(self.budgets)}.")
        if min(self.softmax_counts) < 0:
            raise DoflaError(f"K (softmax layers) must be 0 or more, got {min(self.softmax_counts)}.")
        if num_layers is not None and max(self.softmax_counts) >= num_layers:
            raise DoflaError(
                f"K = {max(self.softmax_counts)} softmax layers leaves nothing to convert in a {num_layers}-layer "
                f"model; use K of at most {num_layers - 1}."
            )
        if self.eval_length < 2:
            raise DoflaError(f"the evaluation length must be at least 2 tokens, got {self.eval_length}.")


@dataclass(frozen=True)
class GridCell:
    allocation: str
    budget: int
    softmax_count: int
    softmax_choice: str | None

    @property
    def name(self) -> str:
        name = f"{self.allocation}-b{self.budget}-k{self.softmax_count}"
        return name + (f"-{self.softmax_choice}" if self.softmax_count else "")


def grid(config: FrontierConfig) -> list[GridCell]:
    """Every cell of the grid, in run order (K = 0 once, K > 0 once per softmax-layer choice)."""
    cells = []
    for allocation in config.allocations:
        for budget in config.budgets:
            for count in config.softmax_counts:
                for choice in [None] if count == 0 else config.softmax_choices:
                    cells.append(GridCell(allocation, int(budget), int(count), choice))
    return cells


def cell_config(config: FrontierConfig, cell: GridCell, layers: list[int] | None):
    """The one place a grid cell becomes a :class:`~dofla.run_config.LinearizeConfig`: :data:`DEFAULT_SETTINGS`,
    then the shared ``settings``, then the cell's allocation, budget and converted layers and the
    evaluation at ``eval_length``."""
    from dofla.run_config import LinearizeConfig
    from dofla.setting_values import merge

    cell_settings = dict(
        out_dir=str(Path(config.out_dir) / "cells" / cell.name),
        command=f"dofla frontier ... (grid cell {cell.name})",
        teacher=dict(model=config.model),
        plan=dict(allocation=cell.allocation, budget=cell.budget, layers=layers),
        evaluate=dict(lengths=[config.eval_length]),
    )
    settings = merge(DEFAULT_SETTINGS, config.settings, cell_settings)
    return LinearizeConfig.from_dict(settings, source=f"the frontier settings of cell {cell.name}")


# ------------------------------------------------------------------------------------------ running


def _calibration(linearize_config, teacher, tokenizer, out_dir: Path):
    """The packed sequences every cell gets and the calibration batches the pipeline's plan stage will use
    (the pipeline's own public stages)."""
    from dofla import pipeline, run_data

    data = run_data.prepare_data(linearize_config, teacher, tokenizer, None, out_dir / "data_cache")
    return data.rows, pipeline.calibration_batches(linearize_config, teacher, data.train), data.source


def _softmax_layers(
    cell: GridCell, num_layers: int, *, curves, measure, window_cost=None, recall_order=None
) -> list[int]:
    if cell.softmax_count == 0:
        return []
    return dof.SOFTMAX_CHOICES[cell.softmax_choice](
        list(range(num_layers)),
        cell.softmax_count,
        measure=measure,
        curves=curves,
        budget=cell.budget,
        window_cost=window_cost,
        recall_order=recall_order,
    )


def _decode_measure(model_dir: Path, length: int, new_tokens: int) -> dict[str, float] | None:
    """Decode tokens/s after a prompt of ``length`` tokens and the cache bytes then, for a saved model folder."""
    from dofla.evaluation.speed import measure_generation
    from dofla.loading import load_converted

    if new_tokens <= 0:
        return None
    model, _, _ = load_converted(model_dir)
    row = measure_generation(model, context_lengths=[length], new_tokens=new_tokens)[0]
    return {key: row[key] for key in ("decode_tokens_per_second", "cache_bytes_after_decode")}


def run_frontier(config: FrontierConfig, *, teacher=None, tokenizer=None, progress: bool = True) -> dict:
    """Run every unfinished grid cell, then summarise all finished ones (see the module docstring)."""
    from dofla.distill.checkpoint import latest_checkpoint
    from dofla.evaluation.speed import measure_generation
    from dofla.models.surgery import architecture
    from dofla.pipeline import linearize

    out = Path(config.out_dir)
    if teacher is None:
        from dofla.models import load_teacher

        where = config.settings.get("teacher", {})
        loaded = load_teacher(config.model, dtype=where.get("dtype"), device=where.get("device"))
        teacher, tokenizer = loaded.model, loaded.tokenizer
    teacher.eval()
    facts = architecture(teacher)
    config.validate(facts.num_layers)
    cells = grid(config)
    first = cell_config(config, cells[0], None)
    first.apply_recipe()
    sequences, batches, source = _calibration(first, teacher, tokenizer, out)
    curves_folder = out / "curves"
    needs_curves = any(dof.ALLOCATIONS[c.allocation].needs_curves for c in cells) or any(
        c.softmax_choice == "measured" for c in cells
    )
    curves = None
    if needs_curves:
        from dofla.planning.error_curves import settings_for

        settings = settings_for(first.plan, first.student, **dict(config.curve_options))
        curves = planning.cached_error_curves(
            teacher, batches, settings, folder=curves_folder, progress=progress
        )
    measure = None
    if any(c.softmax_choice == "dof" for c in cells):
        estimate = dof.estimate(
            teacher, batches, num_points=first.plan.dof_points, measure=first.plan.measure
        )
        measure = estimate.layer_measure()
    window, sinks = first.plan.window, first.plan.sinks  # what the restricted teacher is measured with
    window_cost = None
    if any(c.softmax_choice == "window" for c in cells):
        from dofla.planning.window_costs import window_costs

        window_cost = window_costs(teacher, batches, window=window, sinks=sinks)
    recall_order = None
    recall_counts = [c.softmax_count for c in cells if c.softmax_choice == "recall"]
    if recall_counts:
        from dofla.planning.recall_order import cached_recall_order

        order = cached_recall_order(
            teacher,
            batches,
            max(recall_counts),
            window=window,
            sinks=sinks,
            folder=curves_folder,
        )
        recall_order = [layer for layer, _ in order]

    reference_path = out / "teacher_speed.json"
    if config.decode_tokens > 0 and not reference_path.is_file():
        row = measure_generation(
            teacher, context_lengths=[config.eval_length], new_tokens=config.decode_tokens
        )[0]
        write_json_atomic(reference_path, row)
    for cell in cells:
        cell_dir = out / "cells" / cell.name
        if (cell_dir / "result.json").is_file() and (cell_dir / CELL_RESULT).is_file():
            continue
        softmax = _softmax_layers(
            cell,
            facts.num_layers,
            curves=curves,
            measure=measure,
            window_cost=window_cost,
            recall_order=recall_order,
        )
        layers = [index for index in range(facts.num_layers) if index not in softmax] if softmax else None
        linearize_config = cell_config(config, cell, layers)
        if not (cell_dir / "result.json").is_file():
            resumable = latest_checkpoint(cell_dir / "distill" / "checkpoints") is not None
            linearize_config.resume = resumable
            linearize_config.overwrite = cell_dir.is_dir() and not resumable
            linearize_config.progress = progress
            started = time.perf_counter()
            with planning.curve_cache(curves_folder):
                linearize(
                    linearize_config, teacher=copy.deepcopy(teacher), tokenizer=tokenizer, sequences=sequences
                )
            if progress:
                print(f"frontier: {cell.name} done in {time.perf_counter() - started:.0f} s", flush=True)
        speed = _decode_measure(cell_dir / "model", config.eval_length, config.decode_tokens)
        write_json_atomic(
            cell_dir / CELL_RESULT, dict(cell=asdict(cell), softmax_layers=softmax, speed=speed)
        )
    return summarise(config, source)


# ------------------------------------------------------------------------------------------ summary


def _row(cell: GridCell, cell_dir: Path, length: int) -> dict | None:
    if not (cell_dir / "result.json").is_file() or not (cell_dir / CELL_RESULT).is_file():
        return None
    result = json.loads((cell_dir / "result.json").read_text())
    extra = json.loads((cell_dir / CELL_RESULT).read_text())
    models = result["long_context"]["by_length"][str(length)]["models"]
    window = {name: value["perplexity"] for name, value in models.items() if name.startswith("window")}
    speed = extra.get("speed") or {}
    return dict(
        name=cell.name,
        **asdict(cell),
        softmax_layers=extra["softmax_layers"],
        feature_dims=result["feature_dims"],
        perplexity=models["student"]["perplexity"],
        teacher_perplexity=models["teacher"]["perplexity"],
        window_perplexity=window,
        window_layers=result["long_context"].get("window_layers"),
        state_bytes=speed.get("cache_bytes_after_decode"),
        decode_tokens_per_second=speed.get("decode_tokens_per_second"),
        distill_tokens=result["distill_tokens"],
    )


def reference_row(rows: list[dict]) -> dict:
    """The row whose window baselines restrict every layer (a cell without softmax layers): the grid's
    reference lines. A cell keeping softmax layers has its own baselines, restricting only the layers it
    converted; with no other cell, the first row's are used."""
    return next((row for row in rows if row.get("window_layers") is None), rows[0])


def _sink_count(name: str) -> int:
    """``window`` -> 0, ``window+sinks4`` -> 4 (the window baselines' row names)."""
    return int(name.removeprefix("window+sinks")) if name.startswith("window+sinks") else 0


def _own_baseline(row: dict) -> str:
    """The cell's own window + sinks baseline when it differs from the reference (softmax layers kept)."""
    if row.get("window_layers") is None or not row["window_perplexity"]:
        return ""
    name = max(row["window_perplexity"], key=_sink_count)
    return f"{row['window_perplexity'][name]:.3f}"


def excess_removed(perplexity: float, baseline: float, teacher: float) -> float:
    """The share of ``baseline``'s perplexity excess over the teacher that ``perplexity`` removes."""
    excess = baseline - teacher
    return (baseline - perplexity) / excess if excess > 0 else math.nan


def targets(rows: list[dict]) -> list[dict]:
    """The issue's two comparisons wherever the grid has their cells: ``measured`` against ``fix`` at equal
    budget and K (target: >= 30% of Fix's excess removed), and K measured against K uniform softmax layers,
    each against the same allocation and budget at K = 0 (target: >= 1.2 times the uniform choice's share)."""
    by_name = {row["name"]: row for row in rows}
    found = []
    for row in rows:
        if row["allocation"] != "measured":
            continue
        fix = by_name.get(row["name"].replace("measured-", "fix-", 1))
        if fix is not None:
            removed = excess_removed(row["perplexity"], fix["perplexity"], row["teacher_perplexity"])
            found.append(
                dict(kind="allocation", cell=row["name"], against=fix["name"], removed=removed, target=0.3)
            )
    for row in rows:
        if row["softmax_choice"] != "measured":
            continue
        base = by_name.get(GridCell(row["allocation"], row["budget"], 0, None).name)
        uniform = by_name.get(
            GridCell(row["allocation"], row["budget"], row["softmax_count"], "uniform").name
        )
        if base is None or uniform is None:
            continue
        teacher = row["teacher_perplexity"]
        ours = excess_removed(row["perplexity"], base["perplexity"], teacher)
        theirs = excess_removed(uniform["perplexity"], base["perplexity"], teacher)
        found.append(
            dict(
                kind="softmax layers",
                cell=row["name"],
                against=uniform["name"],
                removed=ours,
                uniform_removed=theirs,
                ratio=ours / theirs if theirs > 0 else math.nan,
                target=1.2,
            )
        )
    return found


def _order(cell: GridCell) -> tuple:
    return (cell.allocation, cell.budget, cell.softmax_count, cell.softmax_choice or "")


def summarise(config: FrontierConfig, source: str = "") -> dict:
    """frontier.json, frontier.md and frontier.png from every finished cell in ``OUT/cells`` (this grid's and
    any an earlier grid with other settings finished there)."""
    out = Path(config.out_dir)
    wanted = {cell.name for cell in grid(config)}
    finished = []  # this grid's cells, then those an earlier grid in the same folder finished
    for path in sorted((out / "cells").glob(f"*/{CELL_RESULT}")):
        cell = GridCell(**json.loads(path.read_text())["cell"])
        finished.append((cell.name not in wanted, cell))
    rows = [
        row
        for _, cell in sorted(finished, key=lambda item: (item[0], _order(item[1])))
        if (row := _row(cell, out / "cells" / cell.name, config.eval_length))
    ]
    teacher_speed = None
    if (out / "teacher_speed.json").is_file():
        teacher_speed = json.loads((out / "teacher_speed.json").read_text())
    summary = dict(
        command=config.command,
        config=asdict(config),
        data=source,
        rows=rows,
        teacher_speed=teacher_speed,
        targets=targets(rows),
        missing=sorted(wanted - {row["name"] for row in rows}),
    )
    write_json_atomic(out / "frontier.json", summary)
    write_text_atomic(out / "frontier.md", markdown(summary, config.eval_length))
    if rows:
        plot(summary, out / "frontier.png", config.eval_length)
    if (out / "curves" / dof.error_curves.CURVES_FILE).is_file():
        dof.plot_error_curves(
            dof.ErrorCurves.load(out / "curves" / dof.error_curves.CURVES_FILE), out / "curves.png"
        )
    return summary


def _number(value, digits: int = 3) -> str:
    return (
        ""
        if value is None or (isinstance(value, float) and not math.isfinite(value))
        else f"{value:.{digits}f}"
    )


def markdown(summary: dict, length: int) -> str:
    rows = summary["rows"]
    lines = ["# Quality-cost frontier (written by dofla frontier)", ""]
    if summary.get("command"):
        lines += ["Command:", "", f"    {summary['command']}", ""]
    if summary.get("data"):
        lines += [f"Data: {summary['data']}.", ""]
    if rows:
        reference = reference_row(rows)
        windows = ", ".join(f"{name} {value:.3f}" for name, value in reference["window_perplexity"].items())
        every = (
            "every layer restricted" if reference.get("window_layers") is None else "converted layers only"
        )
        lines += [
            f"Held-out perplexity at {length} tokens: teacher {reference['teacher_perplexity']:.3f}; no-training "
            f"window baselines ({every}) {windows}. A cell that keeps softmax layers also has its own window "
            "baseline, restricting only the layers it converted (column `own window baseline`, with the most "
            "sinks).",
            "",
        ]
    lines += [
        f"| cell | allocation | budget | K | choice | softmax layers | perplexity @ {length} | own window "
        "baseline | state bytes | decode tok/s | distill tokens | feature dims |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['allocation']} | {row['budget']} | {row['softmax_count']} | "
            f"{row['softmax_choice'] or ''} | {row['softmax_layers']} | {row['perplexity']:.3f} | "
            f"{_own_baseline(row)} | {row['state_bytes'] or ''} | {_number(row['decode_tokens_per_second'], 1)} | "
            f"{row['distill_tokens']} | {' '.join(str(d) for d in row['feature_dims'])} |"
        )
    if summary["targets"]:
        lines += ["", "## Targets", ""]
        for target in summary["targets"]:
            if target["kind"] == "allocation":
                met = target["removed"] >= target["target"]
                lines.append(
                    f"- {target['cell']} removes {100 * target['removed']:.1f}% of {target['against']}'s perplexity "
                    f"excess over the teacher (target >= 30%): {'met' if met else 'NOT met'}."
                )
            else:
                met = target["ratio"] >= target["target"]
                lines.append(
                    f"- {target['cell']} removes {100 * target['removed']:.1f}% of the K = 0 excess, "
                    f"{target['against']} {100 * target['uniform_removed']:.1f}% (ratio {_number(target['ratio'], 2)}, "
                    f"target >= 1.2): {'met' if met else 'NOT met'}."
                )
    if summary["missing"]:
        lines += ["", f"Not run (no finished result): {', '.join(summary['missing'])}."]
    lines += ["", "![frontier](frontier.png)", ""]
    return "\n".join(lines)


def plot(summary: dict, path: Path, length: int) -> Path:
    """Perplexity at ``length`` against state bytes and decode tokens/s, teacher and window as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for axis, key, label in (
        (axes[0][0], "state_bytes", "inference state at the evaluation length (bytes)"),
        (axes[0][1], "decode_tokens_per_second", "decode tokens/s"),
    ):
        for allocation in sorted({row["allocation"] for row in rows}):
            points = [row for row in rows if row["allocation"] == allocation and row[key] is not None]
            axis.scatter(
                [row[key] for row in points], [row["perplexity"] for row in points], label=allocation
            )
            for row in points:
                axis.annotate(row["name"], (row[key], row["perplexity"]), fontsize=6)
        axis.axhline(rows[0]["teacher_perplexity"], color="black", lw=1, label="teacher")
        teacher_speed = summary.get("teacher_speed") or {}
        teacher_x = teacher_speed.get({"state_bytes": "cache_bytes_after_decode"}.get(key, key))
        if teacher_x is not None:
            axis.scatter([teacher_x], [rows[0]["teacher_perplexity"]], marker="*", s=120, color="black")
        for name, value in reference_row(rows)["window_perplexity"].items():
            axis.axhline(value, color="grey", lw=1, ls="--", label=f"{name} (no training)")
        axis.set_xlabel(label)
        axis.set_ylabel(f"held-out perplexity at {length} tokens")
        axis.legend(fontsize=7)
    figure.tight_layout()
    write_atomic(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110))
    plt.close(figure)
    return path
