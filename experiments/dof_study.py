"""DoF study on a teacher: speed, saturation, λ / J / seed stability, alternative measures, error correlation.

Writes ``dof_study.json`` and ``dof_study.md`` to ``--out``; every number in them comes from this run and
the command line is recorded with it.

    .venv/bin/python experiments/dof_study.py --out docs/results/dof \
        --data /work/shared/data/wiki_demo/wiki_demo.txt

What it measures, from ONE capture of the teacher (J = ``--capture-points`` points per head, seed 0;
every smaller J is a seeded uniform subset of it, so "seed 1" is a second subset, not a second capture):
- the default estimation (J = 1024, λ = 2^-4, measure dof): time with load and capture, saturation,
  heads where a plain eigendecomposition would be wrong, log-kernel ranges;
- the paper's DoF at four λ (subset seed 0) and at λ = 2^-4 (subset seed 1), dims at C = ``--budget``;
- DoF/J at J = 1024 and at the full capture for ``--big-j-layers``;
- the alternative measures (``dof_trace``, ``attention_rank``) and their allocations;
- each layer's relative attention-output error of a fixed-dimension random-feature (``prf``) linear
  attention under teacher forcing, and the Spearman correlation of every measure with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla import dof
from dofla.io import write_text_atomic

LAMBDAS = (2**-2, 2**-4, 2**-6, 2**-8)


def layer_rows(result: dof.DofEstimate, adapter, budget: int) -> dict:
    """Per λ: layer measure (max over heads), per-head values, and dof / headwise dims at ``budget``."""
    rows = {}
    for lam in result.lambdas:
        allocations = dof.allocate_all(result, adapter, budget=budget, lam=lam)
        rows[dof.lambda_key(lam)] = {
            "layer_measure": result.layer_measure(lam),
            "head_measure": result.head_measure(lam),
            "dims": {name: allocation.layer_dims for name, allocation in allocations.items()},
            "head_dims": allocations["headwise"].head_dims,
        }
    return rows


def summary(result: dof.DofEstimate) -> dict:
    heads = result.heads
    return {
        "seconds": result.seconds,
        "saturated_fraction": result.saturated_fraction(),
        "plain_eig_unreliable_heads": sum(head.plain_eig_unreliable for head in heads),
        "log_kernel_max": max(head.log_kernel_max for head in heads),
        "log_kernel_median_per_layer": [
            float(torch.tensor([h.log_kernel_max for h in heads if h.layer == layer]).median())
            for layer in range(result.num_layers)
        ],
        "warnings": result.warnings,
    }


def spearman(first: list[float], second: list[float]) -> float:
    from scipy.stats import spearmanr

    value = spearmanr(first, second).statistic
    return float(value) if value == value else float("nan")  # constant input -> nan


def fmt(values, digits: int = 1) -> str:
    return " ".join(f"{value:.{digits}f}" for value in values)


def save(out: Path, results: dict, md: list[str]) -> None:
    write_text_atomic(out / "dof_study.json", json.dumps(results, indent=1) + "\n")
    write_text_atomic(out / "dof_study.md", "\n".join(md) + "\n")


def dims_line(row: dict) -> str:
    return " ".join(map(str, row["dims"]["dof"]))


def headwise_line(row: dict) -> str:
    return " ".join(f"{min(h)}-{max(h)}" for h in row["head_dims"])


def render_default(path: str) -> str:
    """Markdown of the default-estimation part of a (possibly unfinished) dof_study.json."""
    results = json.loads(Path(path).read_text())
    default = results["default"]
    lines = [f"Command: `{results['command']}` (default part)", "", "| quantity | value |", "|---|---|"]
    lines += [
        f"| load + data (s) | {default['load_seconds']:.1f} |",
        f"| capture (s) | {default['capture_seconds']:.1f} |",
        f"| stable solve, all heads, J = 1024, λ = 2^-4 (s) | {default['seconds'] - default['capture_seconds']:.1f} |",
        f"| total (s) | {default['total_seconds']:.1f} |",
        f"| heads with DoF/J > 0.9 | {default['saturated_fraction']:.1%} |",
        f"| heads where plain eigvalsh error > λ | {default['plain_eig_unreliable_heads']} |",
        f"| max s·‖x‖² | {default['log_kernel_max']:.1f} |",
        "| per layer, median over heads of max s·‖x‖² | "
        + " ".join(f"{value:.0f}" for value in default["log_kernel_median_per_layer"])
        + " |",
        "",
    ]
    return "\n".join(lines + [f"> {message}\n" for message in default["warnings"]])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--render-default":
        print(render_default(argv[1]))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="calibration text (txt / jsonl / saved dataset)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--points", type=int, default=1024, help="J of the default estimate and the sweep")
    parser.add_argument("--capture-points", type=int, default=2048, help="J captured once (seed 0)")
    parser.add_argument("--sweep-lambdas", default="2^-2,2^-4,2^-6,2^-8")
    parser.add_argument("--second-seed-lambdas", default="2^-4", help="λ for the seed-1 J-subset")
    parser.add_argument("--big-j-layers", default="0,15,29", help="layers measured at the captured J")
    parser.add_argument("--trace-lambdas", default="2^-4,2^-8", help="λ for dof_trace")
    parser.add_argument("--error-feature-dims", default="16,64", help="prf feature dims for the error")
    parser.add_argument("--error-sequences", type=int, default=4)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parse = lambda text: [dof.parse_lambda(item) for item in text.split(",")]  # noqa: E731
    lambdas, default_lambda = parse(args.sweep_lambdas), [2**-4]
    command = shlex.join(["python", "experiments/dof_study.py", *argv])
    results: dict = {"command": command, "torch_threads": torch.get_num_threads()}
    md = [f"Command: `{results['command']}`", ""]

    start = time.perf_counter()
    from dofla.data import load_texts, pack_token_sequences
    from dofla.models import load_teacher

    teacher = load_teacher(args.model)
    sequences = pack_token_sequences(teacher.tokenizer, load_texts(args.data), args.seq_len)[: args.sequences]
    batches = list(sequences.split(4))
    load_seconds = time.perf_counter() - start
    adapter = teacher.adapter
    md += [
        f"Teacher {args.model}; calibration {sequences.shape[0]} x {args.seq_len} tokens of `{args.data}`.",
        "",
    ]
    with torch.no_grad():
        # One capture (the teacher's forward dominates); every J below is a seeded uniform subset of it.
        captured = dof.capture_points(
            teacher.model, batches, num_points=args.capture_points, seed=0, spectra_sequences=2
        )
        default = dof.measure_points(captured, lambdas=default_lambda, num_points=args.points, seed=0)
        total = time.perf_counter() - start
        timing = {"load_seconds": load_seconds, "capture_seconds": captured.seconds, "total_seconds": total}
        timing.update(summary(default))
        results["default"] = timing
        print("default", f"{total:.1f}s", flush=True)
        md += [
            f"## Default estimation (J = {args.points}, λ = 2^-4, measure dof)",
            "",
            f"- time: load + data {load_seconds:.1f} s, capture {captured.seconds:.1f} s (sampling "
            f"{args.capture_points} points per head, 2 attention spectra), stable solve "
            f"{default.seconds - captured.seconds:.1f} s; total {total:.1f} s "
            f"({results['torch_threads']} torch threads; machine shared, load average "
            f"{os.getloadavg()[0]:.1f})",
            f"- heads with DoF/J > {dof.SATURATION_LEVEL}: {default.saturated_fraction():.1%}",
            f"- heads where a plain float64 eigvalsh error (J·ε·μ_max) exceeds λ: "
            f"{timing['plain_eig_unreliable_heads']} of {len(default.heads)}",
            f"- max s·|x|²: {timing['log_kernel_max']:.1f}; per layer, median over heads of max s·|x|²: "
            + fmt(timing["log_kernel_median_per_layer"]),
            f"- layer 0 per-head DoF: {fmt(default.head_measure()[0])}",
            *[f"- warning: {message}" for message in default.warnings],
            "",
        ]
        save(out, results, md + ["(in progress)"])

        sweep = {}
        for seed, seed_lambdas in ((0, lambdas), (1, parse(args.second_seed_lambdas))):
            result = dof.measure_points(captured, lambdas=seed_lambdas, num_points=args.points, seed=seed)
            sweep[f"J={args.points},subset seed {seed}"] = layer_rows(result, adapter, args.budget)
            print("sweep", seed, flush=True)
        results["sweep"] = sweep
        md += [f"## Paper's DoF per layer (max over heads) and dof dims at C = {args.budget}", ""]
        md += [
            "| run | λ | layer DoF | dof dims | headwise dims min-max per layer |",
            "|---|---|---|---|---|",
        ]
        for key, rows in sweep.items():
            for name, row in rows.items():
                md.append(
                    f"| {key} | {name} | {fmt(row['layer_measure'], 0)} | {dims_line(row)} | {headwise_line(row)} |"
                )
        first, second = sweep.values()
        moved = max(
            abs(a - b)
            for a, b in zip(first["2^-4"]["dims"]["dof"], second["2^-4"]["dims"]["dof"], strict=True)
        )
        md += [
            "",
            f"Largest change of a layer's dof dims between the two subset seeds (λ = 2^-4): {moved}.",
            "",
        ]

        big = {}
        for layer in [int(value) for value in args.big_j_layers.split(",")]:
            single = dof.CapturedPoints(
                points=[captured.points[layer]],
                scalings=[captured.scalings[layer]],
                num_layers=1,
                num_heads=captured.num_heads,
                num_kv_heads=captured.num_kv_heads,
            )
            for points in (args.points, args.capture_points):
                result = dof.measure_points(single, lambdas=default_lambda, num_points=points, seed=0)
                big[f"layer {layer}, J={points}"] = [h.measure["2^-4"] / points for h in result.heads]
        results["big_j"] = big
        print("big J", flush=True)
        md += ["## DoF/J per head at J = 1024 and the full capture (λ = 2^-4)", ""]
        md += [f"- {key}: {fmt(values, 3)}" for key, values in big.items()]
        md.append("")

        measure_values = {f"dof λ={name}": row["layer_measure"] for name, row in first.items()}
        alternatives = {}
        for measure, measure_lambdas in (
            ("dof_trace", parse(args.trace_lambdas)),
            ("attention_rank", lambdas),
        ):
            result = dof.measure_points(
                captured, lambdas=measure_lambdas, measure=measure, num_points=args.points, seed=0
            )
            alternatives[measure] = {"seconds": result.seconds - captured.seconds}
            alternatives[measure]["rows"] = layer_rows(result, adapter, args.budget)
            for name, row in alternatives[measure]["rows"].items():
                measure_values[f"{measure} λ={name}"] = row["layer_measure"]
            print(measure, flush=True)
            save(out, results, md)
        results["measures"] = alternatives
        md += [
            f"## Alternative measures: layer measure (max over heads) and dof dims at C = {args.budget}",
            "",
        ]
        md += [
            "| measure | λ | layer measure | dof dims | headwise dims min-max per layer |",
            "|---|---|---|---|---|",
        ]
        for measure, entry in alternatives.items():
            for name, row in entry["rows"].items():
                md.append(
                    f"| {measure} | {name} | {fmt(row['layer_measure'])} | {dims_line(row)} | {headwise_line(row)} |"
                )
        md.append("")

        from dofla.convert import convert, plan_for, unconvert
        from dofla.evaluation.attention_error import attention_errors

        error_batches = list(sequences[: args.error_sequences].split(2))
        errors = {}
        for feature_dim in [int(f) for f in args.error_feature_dims.split(",")]:
            torch.manual_seed(0)
            convert(teacher.model, plan_for(teacher.model, feature_map="prf", feature_dim=feature_dim))
            try:
                measured = attention_errors(teacher.model, error_batches)
            finally:
                unconvert(teacher.model)
            errors[feature_dim] = [measured[layer]["relative_error"] for layer in range(adapter.num_layers)]
            print("error", feature_dim, flush=True)
        correlations = {
            name: {str(dim): spearman(values, error) for dim, error in errors.items()}
            for name, values in measure_values.items()
        }
        results["error"] = {"relative_error": errors, "spearman": correlations}
        md += [
            f"## Per-layer relative attention error of a fixed-dimension prf linear attention "
            f"({args.error_sequences} sequences, teacher-forced)",
            "",
        ]
        md += [f"- F = {dim}: {fmt(error, 3)}" for dim, error in errors.items()]
        md += [
            "",
            f"Spearman correlation over the {adapter.num_layers} layers of each layer measure with that error:",
            "",
        ]
        md += [
            "| measure | " + " | ".join(f"F = {dim}" for dim in errors) + " |",
            "|---|" + "---:|" * len(errors),
        ]
        md += [
            f"| {name} | " + " | ".join(f"{value:.2f}" for value in row.values()) + " |"
            for name, row in correlations.items()
        ]
        md.append("")
    save(out, results, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
