"""Which layers should keep their full softmax for quality at length? The teacher as an upper bound.

The teacher is measured on held-out text with every layer's softmax restricted to the last ``--window``
tokens plus ``--sinks`` first ones (the no-training window baseline) except K layers that keep their full
softmax, for each K in ``--keep`` and each way of choosing them:

- ``window_kl``: the K layers whose restriction alone costs the most (``--softmax-choice window``,
  :func:`dofla.planning.window_costs.window_costs`): for each layer, the mean KL from the full
  teacher's next-token distribution when only that layer is cut to the window, on ``--score-rows``
  training rows of ``--score-length`` tokens (rows the held-out text does not contain);
- ``uniform``: K layers evenly spaced (as ``--softmax-choice uniform``);
- ``--given NAME=L1,L2,...``: layer sets chosen elsewhere, e.g. a run's ``measured`` choice from its plan.

Perplexity at each of ``--lengths`` and in the bucket from the shortest length on (where the window
baseline loses most) says what a student keeping those K layers could at best reach if its other layers
carried nothing beyond the window. The held-out rows are those of ``dofla linearize`` with the same data,
lengths, training length, held-out fraction and seed. Writes ``softmax_layers_at_length.md`` and ``.json``:

    .venv/bin/python experiments/softmax_layers_at_length.py --threads 1 \\
        --data ../shared/data/wiki_demo/wiki_demo.txt --given measured=4,20,23 \\
        --out docs/results/long_context/softmax_layers
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla.commands._common import integer_list
from dofla.data import cut_rows, load_texts, pack_rows, split_train_heldout
from dofla.dof import SOFTMAX_CHOICES
from dofla.evaluation.window_baseline import window_restricted
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.planning.window_costs import window_costs


def perplexities(model, rows: torch.Tensor, start: int) -> tuple[float, float]:
    """(perplexity over all predicted tokens, perplexity of the tokens predicted at positions >= start)."""
    total = late = 0.0
    count = late_count = 0
    with torch.no_grad():
        for row in rows:
            logits = model(row[None]).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, row[1:], reduction="none")
            total, count = total + nll.sum().item(), count + len(nll)
            late, late_count = late + nll[start - 1 :].sum().item(), late_count + len(nll[start - 1 :])
    return math.exp(total / count), math.exp(late / max(late_count, 1))


def parse_given(values: list[str], layers: int) -> dict[str, list[int]]:
    given = {}
    for value in values:
        name, _, listed = value.partition("=")
        if not name or not listed:
            raise SystemExit(f"--given takes NAME=L1,L2,..., got {value!r}.")
        chosen = integer_list(listed, "--given", minimum=0)
        if max(chosen) >= layers:
            raise SystemExit(
                f"--given {name} names layer {max(chosen)}; the model has layers 0 to {layers - 1}."
            )
        given[name] = sorted(set(chosen))
    return given


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="text file, as dofla linearize --data")
    parser.add_argument("--keep", default="0,1,2,3,6", help="K values, comma-separated")
    parser.add_argument("--lengths", default="1024,2048", help="held-out lengths, comma-separated")
    parser.add_argument("--seq-len", type=int, default=1024, help="the training length of the runs compared")
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--heldout-sequences", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score-rows", type=int, default=4)
    parser.add_argument("--score-length", type=int, default=1024)
    parser.add_argument("--given", action="append", default=[], help="NAME=L1,L2,...: a layer set to compare")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.keep = integer_list(args.keep, "--keep", minimum=0)
    args.lengths = integer_list(args.lengths, "--lengths", minimum=2)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    teacher = load_teacher(args.model)
    model, tokenizer = teacher.model, teacher.tokenizer
    layers = model.config.num_hidden_layers
    if max(args.keep) > layers:
        raise SystemExit(f"--keep goes up to {max(args.keep)} but the model has {layers} layers.")
    given = parse_given(args.given, layers)
    sequences = pack_rows(tokenizer, load_texts(args.data), args.lengths, args.seq_len)
    train, heldout = split_train_heldout(sequences, args.heldout_fraction, args.seed)
    heldout = heldout[: args.heldout_sequences]
    score_rows = cut_rows(train, min(args.score_length, train.shape[1]))[: args.score_rows]
    costs = window_costs(model, list(score_rows.split(1)), args.window, args.sinks)
    ranked = sorted(range(layers), key=lambda layer: -costs[layer])
    start = min(args.lengths)
    choices = {(0, "none"): []}
    for keep in args.keep:
        if keep:
            choices[(keep, "window_kl")] = sorted(ranked[:keep])
            choices[(keep, "uniform")] = SOFTMAX_CHOICES["uniform"](
                list(range(layers)), keep, measure=None, curves=None, budget=0
            )
    for name, chosen in given.items():
        choices[(len(chosen), name)] = chosen
    choices[(layers, "all")] = list(range(layers))
    rows = []
    for (keep, choice), kept in sorted(choices.items()):
        restricted = [layer for layer in range(layers) if layer not in kept]
        measured = {}
        for length in args.lengths:
            held = cut_rows(heldout, length)
            if restricted:
                with window_restricted(model, args.window, args.sinks, layers=restricted):
                    measured[str(length)] = perplexities(model, held, start)
            else:
                measured[str(length)] = perplexities(model, held, start)
        rows.append(dict(keep=keep, choice=choice, layers=kept, perplexity=measured))
        print(keep, choice, kept, measured, flush=True)
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    result = dict(
        command=command,
        model=args.model,
        window=args.window,
        sinks=args.sinks,
        heldout_rows={str(length): len(cut_rows(heldout, length)) for length in args.lengths},
        window_kl=costs,
        rows=rows,
        seconds=round(time.time() - started, 1),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "softmax_layers_at_length.json", json.dumps(result, indent=2) + "\n")
    write_text_atomic(args.out / "softmax_layers_at_length.md", render(result, args.lengths, start))


def render(result: dict, lengths: list[int], start: int) -> str:
    teacher = next(row for row in result["rows"] if row["choice"] == "all")["perplexity"]
    header = []
    for length in lengths:
        header += [f"ppl @ {length}", "x teacher"]
    header.append(f"ppl {start}+ @ {max(lengths)} (x teacher)")
    lines = [
        "# Perplexity at length with K full-softmax layers, the rest restricted to the window",
        "",
        f"Command: `{result['command']}` ({result['seconds']:.0f} s). Teacher `{result['model']}`; window "
        f"{result['window']} + {result['sinks']} sinks on every other layer; held-out rows per length: "
        + ", ".join(f"{count} x {length}" for length, count in result["heldout_rows"].items())
        + ".",
        "",
        "Cost of restricting one layer alone (KL per token, `window_kl`): "
        + ", ".join(f"{layer}: {value:.3f}" for layer, value in enumerate(result["window_kl"])),
        "",
        "| K | choice | full-softmax layers | " + " | ".join(header) + " |",
        "|---|---|---|" + "---|" * len(header),
    ]
    for row in result["rows"]:
        cells = []
        for length in lengths:
            value = row["perplexity"][str(length)][0]
            cells += [f"{value:.2f}", f"{value / teacher[str(length)][0]:.3f}"]
        late = row["perplexity"][str(max(lengths))][1]
        cells.append(f"{late:.2f} ({late / teacher[str(max(lengths))][1]:.3f})")
        lines.append(f"| {row['keep']} | {row['choice']} | {row['layers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
