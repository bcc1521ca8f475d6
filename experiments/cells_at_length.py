"""Student cells at length: which cell, initialised how, beats the teacher's own window on held-out text.

Text is packed into rows of ``--eval-length`` tokens and split into held-out rows (never trained on) and
training rows, which are cut into ``--seq-len`` pieces. Each variant converts the same teacher (every layer,
sliding window ``--window``), distils it with attention-output MSE on the same training pieces for the same
token budget and seed, and is measured on the held-out rows beside the teacher and the teacher's softmax
restricted to the window without and with sink tokens (no training), by token position
(``dofla.evaluation.long_context``). Writes ``cells_at_length.md`` and ``.json`` to ``--out``.

    .venv/bin/python experiments/cells_at_length.py --data ../shared/data/wiki_demo/wiki_demo.txt \
        --tokens 10k --seq-len 512 --eval-length 1024 --out docs/results/long_context/cells

A variant is ``cell:feature_map:dim:window_factor`` with ``--sinks`` shared; every number in the output comes
from this run, and the command line is recorded with it.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla.convert import convert, plan_for, unconvert
from dofla.data import cut_rows, load_texts, pack_token_sequences, parse_tokens, split_train_heldout
from dofla.distill.trainer import distill
from dofla.evaluation.long_context import long_context_quality
from dofla.evaluation.long_context_report import long_context_markdown
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.run_config import LinearizeConfig
from dofla.settings import DistillSettings

DEFAULT_VARIANTS = "linear:hedgehog:32:0.1,gla:hedgehog:32:0.999,gated_delta:projection:64:0.95"


def parse_variant(text: str) -> dict:
    cell, feature_map, dim, window_factor = text.split(":")
    return dict(cell=cell, feature_map=feature_map, feature_dim=int(dim), window_factor=float(window_factor))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="text to train on and hold out")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated cell:map:dim:gamma")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--tokens", default="10k")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heldout", type=int, default=8, help="held-out rows of --eval-length tokens")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    variants = [parse_variant(text) for text in args.variants.split(",") if text]
    out = Path(args.out)
    torch.manual_seed(args.seed)

    loaded = load_teacher(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    teacher = copy.deepcopy(model)  # the reference beside each converted copy
    rows = pack_token_sequences(tokenizer, load_texts(args.data), args.eval_length)
    train_rows, heldout = split_train_heldout(rows, 0.1, args.seed)
    heldout = {args.eval_length: heldout[: args.heldout]}
    train = cut_rows(train_rows, args.seq_len)
    config = LinearizeConfig(
        out_dir="unused",
        seed=args.seed,
        progress=False,
        distill=DistillSettings(
            loss="output_mse",
            tokens=parse_tokens(args.tokens),
            batch_size=args.batch_size,
            lr=args.lr,
            eval_every=0,
            checkpoint_every=0,
        ),
    )
    sinks = sorted({0, args.sinks})
    results: dict = {"command": "python experiments/cells_at_length.py " + shlex.join(argv), "variants": {}}
    baseline = long_context_quality(teacher, None, heldout, window=args.window, sinks=sinks)
    results["baselines"] = baseline
    for variant in variants:
        label = "{cell} {feature_map} {feature_dim}, gamma0 {window_factor}".format(**variant)
        plan = plan_for(
            model,
            kind="hybrid",
            cell=variant["cell"],
            feature_map=variant["feature_map"],
            feature_dim=variant["feature_dim"],
            window=args.window,
            sinks=args.sinks,
            options={"window_factor": variant["window_factor"]},
        )
        started = time.perf_counter()
        convert(model, plan)
        untrained = long_context_quality(teacher, model, heldout, window=args.window, sinks=sinks)
        distilled = distill(
            model, train, train[:2], config, None
        )  # validation on training text: no selection
        trained = long_context_quality(teacher, model, heldout, window=args.window, sinks=sinks)
        unconvert(model)  # the students go; the teacher's weights were never trained
        results["variants"][label] = {
            "untrained": untrained,
            "trained": trained,
            "distill_tokens": distilled.tokens,
            "seconds": round(time.perf_counter() - started, 1),
        }
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "cells_at_length.json", json.dumps(results, indent=2) + "\n")
    write_text_atomic(out / "cells_at_length.md", render(results))
    return 0


def render(results: dict) -> str:
    lines = ["# Student cells at length", "", f"Command: `{results['command']}`", ""]
    lines.append(long_context_markdown(results["baselines"], heading="## Teacher and window baselines"))
    for label, measured in results["variants"].items():
        lines.append(long_context_markdown(measured["untrained"], heading=f"## {label}: untrained"))
        lines.append(
            long_context_markdown(
                measured["trained"],
                heading=f"## {label}: after {measured['distill_tokens']} tokens ({measured['seconds']} s)",
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
