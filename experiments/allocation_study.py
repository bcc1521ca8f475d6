"""Allocation study: Fix against DoF-allocated feature dimensions at equal mean budget and equal tokens.

For each allocation (Fix = every layer ``--budget``; ``dof:<measure>`` = ``dofla.dof`` with that measure,
the paper's literal DoF first) the same teacher is converted, distilled on the same training sequences
with the same seed and token budget, and measured on the same held-out sequences (never trained on):
held-out perplexity (compounded effect) and each layer's relative attention-output error under teacher
forcing (``dofla.evaluation.attention_error``). Writes ``allocation_study.md`` and ``.json`` to ``--out``.

    .venv/bin/python experiments/allocation_study.py --tokens 100k --seq-len 128 --budget 32 \
        --data /path/to/text.txt --measures dof

Every number in the output comes from this run; the command line is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla import planning
from dofla.convert import convert, unconvert
from dofla.data import (
    load_texts,
    pack_token_sequences,
    parse_tokens,
    sample_teacher_texts,
    split_train_heldout,
)
from dofla.distill.trainer import distill
from dofla.evaluation.attention_error import attention_errors
from dofla.evaluation.perplexity import perplexity as measure_perplexity
from dofla.io import write_text_atomic
from dofla.run_config import LinearizeConfig
from dofla.settings import DistillSettings, PlanSettings, StudentSettings


def perplexity(model, sequences: torch.Tensor, batch_size: int) -> float:
    return float(measure_perplexity(model, sequences, batch_size=batch_size)["perplexity"])


def allocations(measures: list[str]) -> list[tuple[str, str, str]]:
    """(label, allocation, measure) rows: Fix first, then one DoF row per measure."""
    return [("Fix", "fix", "dof")] + [(f"DoF ({measure})", "dof", measure) for measure in measures]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=None, help="training/held-out text (default: teacher samples)")
    parser.add_argument("--budget", type=int, default=32, help="mean feature dimension per layer")
    parser.add_argument("--feature-map", default="learnable_prf")
    parser.add_argument("--loss", default="softmax")
    parser.add_argument("--tokens", default="100k")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--measures", default="dof", help="comma-separated dofla.dof measures")
    parser.add_argument("--dof-points", type=int, default=512)
    parser.add_argument("--heldout", type=int, default=16, help="held-out sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampled-texts", type=int, default=32, help="teacher samples when no --data")
    parser.add_argument("--sampled-tokens", type=int, default=128)
    parser.add_argument("--cache-dir", default=None, help="teacher-sample cache (default: OUT/data_cache)")
    parser.add_argument("--out", default="docs/results/distill")
    args = parser.parse_args(argv)

    from dofla.models import load_teacher

    out = Path(args.out)
    tokens = parse_tokens(args.tokens)
    loaded = load_teacher(args.model)
    teacher, tokenizer = loaded.model.eval(), loaded.tokenizer
    if args.data:
        texts = load_texts(args.data)
        source = f"{args.data} ({len(texts)} texts)"
    else:
        cache_dir = Path(args.cache_dir) if args.cache_dir else out / "data_cache"
        texts = sample_teacher_texts(
            teacher,
            tokenizer,
            args.sampled_texts,
            args.sampled_tokens,
            args.seed,
            cache_dir,
            batch_size=min(32, args.sampled_texts),
        )
        source = f"{len(texts)} texts of up to {args.sampled_tokens} tokens sampled from the teacher (seed {args.seed})"
    sequences = pack_token_sequences(tokenizer, texts, args.seq_len)
    train, heldout = split_train_heldout(sequences, 0.15, args.seed)
    heldout = heldout[: args.heldout]
    teacher_ppl = perplexity(teacher, heldout, args.batch_size)
    heldout_batches = [heldout[i : i + args.batch_size] for i in range(0, len(heldout), args.batch_size)]

    rows = []
    for label, allocation, measure in allocations([m for m in args.measures.split(",") if m]):
        started = time.perf_counter()
        calibration = list(train[: 2 * args.batch_size].split(args.batch_size))
        plan = planning.measure_and_plan(
            teacher,
            calibration,
            plan=PlanSettings(
                allocation=allocation, measure=measure, dof_points=args.dof_points, budget=args.budget
            ),
            student=StudentSettings(feature_map=args.feature_map),
        )
        convert(teacher, plan)
        config = LinearizeConfig(
            out_dir="unused",
            seed=args.seed,
            progress=False,
            distill=DistillSettings(
                loss=args.loss,
                tokens=tokens,
                batch_size=args.batch_size,
                eval_every=0,
                checkpoint_every=0,
            ),
        )
        result = distill(teacher, train, heldout, config)
        errors = attention_errors(teacher, heldout_batches)
        rows.append(
            dict(
                allocation=label,
                feature_dims=[layer.feature_dim for layer in plan.layers],
                perplexity=perplexity(teacher, heldout, args.batch_size),
                mean_attention_error=sum(e["relative_error"] for e in errors.values()) / len(errors),
                attention_error={str(k): e["relative_error"] for k, e in errors.items()},
                tokens=result.tokens,
                seconds=round(time.perf_counter() - started, 1),
            )
        )
        unconvert(teacher)
        print(f"{label}: perplexity {rows[-1]['perplexity']:.3f}", flush=True)

    command = shlex.join(["python", "experiments/allocation_study.py", *argv])
    record = dict(command=command, data=source, teacher_ppl=teacher_ppl, rows=rows, heldout=len(heldout))
    write_text_atomic(out / "allocation_study.json", json.dumps(record, indent=2) + "\n")
    fix = rows[0]["perplexity"]
    lines = [
        "# Allocation study (written by experiments/allocation_study.py)",
        "",
        f"Command: `{command}`",
        "",
        f"Teacher `{args.model}`, held-out perplexity {teacher_ppl:.3f} on {len(heldout)} sequences of "
        f"{args.seq_len} tokens. Data: {source}. Each allocation: {rows[0]['tokens']} training tokens, "
        f"loss `{args.loss}`, map `{args.feature_map}`, mean budget {args.budget}, seed {args.seed}.",
        "",
        "| allocation | held-out perplexity | vs Fix | mean attention error | feature dims (layer 0 first) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        change = 100 * (row["perplexity"] / fix - 1)
        dims = " ".join(str(d) for d in row["feature_dims"])
        lines.append(
            f"| {row['allocation']} | {row['perplexity']:.3f} | {change:+.1f}% | "
            f"{row['mean_attention_error']:.4f} | {dims} |"
        )
    best = min(rows, key=lambda row: row["perplexity"])
    verdict = (
        "none beats Fix"
        if best is rows[0]
        else f"{best['allocation']} wins by {100 * (1 - best['perplexity'] / fix):.1f}% perplexity"
    )
    lines += ["", f"Result on this budget: {verdict}.", ""]
    lines += ["Per-layer relative attention-output error (teacher forced, held-out):", ""]
    layers = sorted(rows[0]["attention_error"], key=int)
    lines.append("| layer | " + " | ".join(row["allocation"] for row in rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for layer in layers:
        values = " | ".join(f"{row['attention_error'][layer]:.4f}" for row in rows)
        lines.append(f"| {layer} | {values} |")
    write_text_atomic(out / "allocation_study.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'allocation_study.md'}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    sys.exit(main())
