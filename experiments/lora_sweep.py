"""LoRA-stage settings for the LoLCATs recipe: learning rate, KL to the teacher's logits, target modules.

Usage:
    python experiments/lora_sweep.py --data DATA --out OUT [--tokens 1M] [--lora-tokens 1M]
        [--batch-size 16] [--model smollm2-135m]

One attention transfer (stage 1 of ``--recipe lolcats``), then every LoRA variant starts from the same
students and weights, with the same token budget. The held-out sequences are split in two: the first
ones are those ``dofla linearize`` reports on (the *report* split, 32), the next 32 are a *validation*
split. Stage 1's best-state selection and the choice of LoRA settings use the validation split only, so
a separate ``dofla linearize`` run with the chosen settings measures them on data the choice never saw.
``--teacher-variants`` also trains the same LoRA settings on the unconverted teacher: the LoRA stage
adapts to the training text's domain, so an equally adapted teacher is the fair reference for it.
Writes OUT/lora_sweep.json and OUT/lora_sweep.md after every variant (a cut-off run keeps what it did).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from dofla.convert import convert
from dofla.data import load_texts, pack_token_sequences, parse_tokens, split_train_heldout
from dofla.distill.lora import train_lora
from dofla.distill.trainer import distill
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.pipeline import make_plan, perplexity
from dofla.run_config import LinearizeConfig

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# name: (learning rate, KL weight, targets)
VARIANTS = {
    "lr1e-4": (1e-4, 0.0, ATTENTION),
    "lr1e-3": (1e-3, 0.0, ATTENTION),
    "lr1e-3-kl1": (1e-3, 1.0, ATTENTION),
    "lr3e-3-kl1": (3e-3, 1.0, ATTENTION),
    "lr1e-3-kl1-mlp": (1e-3, 1.0, ALL_LINEAR),
}


def write_results(out: Path, header: dict, rows: list[dict]) -> None:
    write_text_atomic(out / "lora_sweep.json", json.dumps(dict(header, variants=rows), indent=2) + "\n")
    lines = [
        "# LoRA-stage sweep for the lolcats recipe",
        "",
        f"Command: `{header['command']}`",
        "",
        f"Teacher perplexity: report split {header['teacher_report_ppl']:.3f}, validation split "
        f"{header['teacher_validation_ppl']:.3f}. Stage 1 (attention transfer, shared by every variant): "
        f"{header['distill_tokens']} tokens; after it, before LoRA: report {header['stage1_report_ppl']:.3f}, "
        f"validation {header['stage1_validation_ppl']:.3f}. Each variant: {header['lora_tokens']} LoRA tokens.",
        "",
        "| variant | LoRA lr | KL weight | targets | validation ppl | report ppl | report / teacher | seconds |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['lr']:g} | {row['kl_weight']:g} | {','.join(row['targets'])} | "
            f"{row['validation_ppl']:.3f} | {row['report_ppl']:.3f} | "
            f"{row['report_ppl'] / header['teacher_report_ppl']:.3f} | {row['seconds']:.0f} |"
        )
    students = [row for row in rows if not row["name"].startswith("teacher+")]
    if students:
        best = min(students, key=lambda row: row["validation_ppl"])
        lines += ["", f"Best student on the validation split: `{best['name']}`."]
    if len(students) < len(rows):
        lines += [
            "",
            "`teacher+` rows: the same LoRA stage trained on the unconverted teacher (no attention change).",
        ]
    write_text_atomic(out / "lora_sweep.md", "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", default="1M", help="stage-1 (attention transfer) tokens")
    parser.add_argument("--lora-tokens", default="1M")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names ('' = none)")
    parser.add_argument("--teacher-variants", default="", help="variants also run on the plain teacher")
    parser.add_argument(
        "--report-sequences",
        type=int,
        default=None,
        help="held-out sequences reported on (default: linearize's)",
    )
    parser.add_argument("--validation-sequences", type=int, default=32, help="held-out sequences chosen on")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = LinearizeConfig.from_dict(
        dict(
            out_dir=str(out),
            recipe="lolcats",
            progress=False,
            teacher=dict(model=args.model),
            data=dict(path=args.data, seq_len=args.seq_len),
            distill=dict(tokens=parse_tokens(args.tokens), batch_size=args.batch_size),
            lora=dict(tokens=parse_tokens(args.lora_tokens)),
        )
    )
    config.validate()
    torch.manual_seed(config.seed)
    loaded = load_teacher(config.teacher.model)
    teacher, tokenizer = loaded.model, loaded.tokenizer
    teacher.eval()
    sequences = pack_token_sequences(tokenizer, load_texts(config.data.path), config.data.seq_len)
    train, heldout = split_train_heldout(sequences, config.data.heldout_fraction, config.seed)
    reported = config.data.heldout_sequences if args.report_sequences is None else args.report_sequences
    report, validation = heldout[:reported], heldout[reported : reported + args.validation_sequences]
    if len(validation) == 0:
        raise SystemExit("not enough held-out data for a validation split; give more text.")
    header = dict(
        command="python experiments/lora_sweep.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        teacher_report_ppl=perplexity(teacher, report, args.batch_size),
        teacher_validation_ppl=perplexity(teacher, validation, args.batch_size),
        report_sequences=len(report),
        validation_sequences=len(validation),
        train_sequences=len(train),
    )
    rows: list[dict] = []
    header.update(distill_tokens=0, lora_tokens=config.lora.tokens)
    header.update(stage1_report_ppl=float("nan"), stage1_validation_ppl=float("nan"))
    if args.teacher_variants:
        teacher_snapshot = {name: tensor.detach().clone() for name, tensor in teacher.state_dict().items()}
        for name in args.teacher_variants.split(","):
            teacher.load_state_dict(teacher_snapshot)
            teacher = run_variant(teacher, name, train, report, validation, config, header, rows, "teacher+")
            write_results(out, header, rows)
        teacher.load_state_dict(teacher_snapshot)
    if not args.variants:
        return
    model = convert(teacher, make_plan(config, teacher, train))
    distilled = distill(model, train, validation, config, None)  # no run folder
    header.update(
        distill_tokens=distilled.tokens,
        stage1_report_ppl=perplexity(model, report, args.batch_size),
        stage1_validation_ppl=perplexity(model, validation, args.batch_size),
    )
    snapshot = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    write_results(out, header, rows)
    for name in args.variants.split(","):
        model.load_state_dict(snapshot)
        model = run_variant(model, name, train, report, validation, config, header, rows)
        write_results(out, header, rows)


def run_variant(model, name, train, report, validation, config, header, rows, prefix=""):
    """Train LoRA variant ``name`` on ``model``; append its row; return the merged model."""
    lr, kl_weight, targets = VARIANTS[name]
    started = time.perf_counter()
    lora = dataclasses.replace(config.lora, lr=lr, kl_weight=kl_weight, targets=targets)
    model, _ = train_lora(model, train, dataclasses.replace(config, lora=lora))
    seconds = time.perf_counter() - started
    rows.append(
        dict(
            name=prefix + name,
            lr=lr,
            kl_weight=kl_weight,
            targets=targets,
            validation_ppl=perplexity(model, validation, config.distill.batch_size),
            report_ppl=perplexity(model, report, config.distill.batch_size),
            seconds=seconds,
        )
    )
    print(json.dumps(rows[-1]), flush=True)
    return model


if __name__ == "__main__":
    main()
