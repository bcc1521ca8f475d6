"""DoF study on a teacher: speed, saturation, λ / J / seed stability, alternative measures, error correlation.

Writes ``dof_study.json`` and ``dof_study.md`` to ``--out``; every number in them comes from this run and
the command line is recorded with it.

    .venv/bin/python experiments/dof_study.py --out docs/results/dof \
        --data /work/shared/data/wiki_demo/wiki_demo.txt

Parts (``--parts``, comma-separated):
- ``timing``: the default estimation (16 x 512 tokens, J = 1024, λ = 2^-4, measure dof), load included.
- ``lambdas``: measure ``dof`` at four λ for each (J, seed) in ``--points`` x ``--seeds``; dims at C = ``--budget``.
- ``measures``: the alternative measures (``dof_trace``, ``attention_rank``) at the same λ, their allocations.
- ``error``: each layer's relative attention-output error of a fixed-dimension random-feature (``prf``)
  linear attention under teacher forcing, and the Spearman correlation of every measure with it.
"""

from __future__ import annotations

import argparse
import json
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
        rows[dof._lambda_key(lam)] = {
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="calibration text (txt / jsonl / saved dataset)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--points", default="1024,2048", help="J values for the λ sweep")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--sweep-lambdas", default="2^-2,2^-4,2^-6,2^-8")
    parser.add_argument("--error-feature-dims", default="16,64", help="prf feature dims for the error")
    parser.add_argument("--error-sequences", type=int, default=4)
    parser.add_argument("--parts", default="timing,lambdas,measures,error")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": shlex.join([sys.executable.split("/")[-1], *sys.argv]), "torch_threads": None}
    results["torch_threads"] = torch.get_num_threads()
    lambdas = [dof.parse_lambda(text) for text in args.sweep_lambdas.split(",")]

    start = time.perf_counter()
    from dofla.data import load_texts, pack_token_sequences
    from dofla.models import load_teacher

    teacher = load_teacher(args.model)
    sequences = pack_token_sequences(teacher.tokenizer, load_texts(args.data), args.seq_len)[: args.sequences]
    batches = list(sequences.split(4))
    load_seconds = time.perf_counter() - start
    adapter = teacher.adapter
    md = [f"Command: `{results['command']}`", ""]
    md += [
        f"Teacher {args.model}; calibration {sequences.shape[0]} x {args.seq_len} tokens of `{args.data}`.",
        "",
    ]

    with torch.no_grad():
        if "timing" in parts:
            result = dof.estimate(teacher.model, batches, num_points=1024, lambdas=[2**-4], seed=0)
            total = time.perf_counter() - start
            results["timing"] = {
                "load_seconds": load_seconds,
                "estimate_seconds": result.seconds,
                "total": total,
            }
            results["timing"].update(summary(result))
            results["timing"]["layer0_heads"] = result.head_measure()[0]
            md += [
                "## Default estimation (J = 1024, λ = 2^-4, measure dof)",
                "",
                f"- time: load + data {load_seconds:.1f} s, capture + stable solve {result.seconds:.1f} s, "
                f"total {total:.1f} s ({results['torch_threads']} torch threads, shared machine)",
                f"- saturated heads (DoF/J > {dof.SATURATION_LEVEL}): {result.saturated_fraction():.1%}",
                f"- heads where plain float64 eigvalsh error exceeds λ: {results['timing']['plain_eig_unreliable_heads']}"
                f" of {len(result.heads)}",
                f"- max s·|x|²: {results['timing']['log_kernel_max']:.1f}; per-layer median of the per-head max: "
                + fmt(results["timing"]["log_kernel_median_per_layer"]),
                f"- layer 0 per-head DoF: {fmt(result.head_measure()[0])}",
                *[f"- warning: {message}" for message in result.warnings],
                "",
            ]
        if "lambdas" in parts or "measures" in parts:
            sweep = {}
            point_counts = [int(p) for p in args.points.split(",")]
            captures = {}
            for seed in [int(s) for s in args.seeds.split(",")]:
                # One capture per seed with the largest J; smaller J are seeded uniform subsets of it.
                captures[seed] = dof.capture_points(
                    teacher.model,
                    batches,
                    num_points=max(point_counts),
                    seed=seed,
                    spectra_sequences=2 if seed == 0 and "measures" in parts else 0,
                )
                print("captured seed", seed, f"{captures[seed].seconds:.1f}s", flush=True)
                for points in point_counts if "lambdas" in parts else []:
                    result = dof.measure_points(captures[seed], lambdas=lambdas, num_points=points, seed=seed)
                    key = f"J={points},seed={seed}"
                    sweep[key] = {
                        "summary": summary(result),
                        "rows": layer_rows(result, adapter, args.budget),
                    }
                    print(key, f"{result.seconds:.1f}s", flush=True)
        if "lambdas" in parts:
            results["lambdas"] = sweep
            md += [f"## Paper's DoF: per-layer DoF (max over heads) and dof dims at C = {args.budget}", ""]
            for lam in lambdas:
                name = dof._lambda_key(lam)
                md += [
                    f"### λ = {name}",
                    "",
                    "| run | time s | saturated | layer DoF | dof dims | headwise range |",
                ]
                md += ["|---|---:|---:|---|---|---|"]
                for key, entry in sweep.items():
                    row = entry["rows"][name]
                    spread = [f"{min(h)}-{max(h)}" for h in row["head_dims"]]
                    md.append(
                        f"| {key} | {entry['summary']['seconds']:.0f} | {entry['summary']['saturated_fraction']:.2f} "
                        f"| {fmt(row['layer_measure'], 0)} | {' '.join(map(str, row['dims']['dof']))} "
                        f"| {' '.join(spread)} |"
                    )
                runs = [entry["rows"][name]["dims"]["dof"] for entry in sweep.values()]
                moved = max(abs(a - b) for run in runs for a, b in zip(runs[0], run, strict=True))
                md += ["", f"Largest change of a layer's dof dims between runs: {moved} features.", ""]
        measure_values: dict[str, list[float]] = {}
        if "lambdas" in parts:
            first = next(iter(results["lambdas"].values()))["rows"]
            for name, row in first.items():
                measure_values[f"dof λ={name}"] = row["layer_measure"]
        if "measures" in parts:
            alternatives = {}
            for measure in ("dof_trace", "attention_rank"):
                result = dof.estimate(
                    teacher.model, batches, num_points=1024, lambdas=lambdas, measure=measure
                )
                alternatives[measure] = {
                    "seconds": result.seconds,
                    "rows": layer_rows(result, adapter, args.budget),
                }
                for name, row in alternatives[measure]["rows"].items():
                    measure_values[f"{measure} λ={name}"] = row["layer_measure"]
                print(measure, f"{result.seconds:.1f}s", flush=True)
            results["measures"] = alternatives
            md += [f"## Alternative measures: layer measure and dof dims at C = {args.budget}", ""]
            for measure, entry in alternatives.items():
                md += [
                    f"### {measure} ({entry['seconds']:.0f} s)",
                    "",
                    "| λ | layer measure | dof dims | headwise |",
                ]
                md += ["|---|---|---|---|"]
                for name, row in entry["rows"].items():
                    spread = [f"{min(h)}-{max(h)}" for h in row["head_dims"]]
                    md.append(
                        f"| {name} | {fmt(row['layer_measure'])} | {' '.join(map(str, row['dims']['dof']))} "
                        f"| {' '.join(spread)} |"
                    )
                md.append("")
        if "error" in parts:
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
                errors[feature_dim] = [
                    measured[layer]["relative_error"] for layer in range(adapter.num_layers)
                ]
                print("error", feature_dim, flush=True)
            correlations = {
                name: {str(dim): spearman(values, error) for dim, error in errors.items()}
                for name, values in measure_values.items()
            }
            results["error"] = {"relative_error": errors, "spearman": correlations}
            md += ["## Per-layer relative attention error of a fixed-dimension prf linear attention", ""]
            md += [f"- F = {dim}: {fmt(error, 3)}" for dim, error in errors.items()]
            md += ["", "Spearman correlation over layers of each layer measure with that error:", ""]
            md += ["| measure | " + " | ".join(f"F = {dim}" for dim in errors) + " |"]
            md += ["|---|" + "---:|" * len(errors)]
            md += [
                f"| {name} | " + " | ".join(f"{value:.2f}" for value in row.values()) + " |"
                for name, row in correlations.items()
            ]
            md.append("")
    write_text_atomic(out / "dof_study.json", json.dumps(results, indent=1) + "\n")
    write_text_atomic(out / "dof_study.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
