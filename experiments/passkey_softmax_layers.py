"""How many of the teacher's layers must keep their full softmax for pass-key retrieval to survive?

The teacher is measured with every layer's softmax restricted to the last ``--window`` tokens plus
``--sinks`` first ones (the no-training window baseline) except K layers that keep their full softmax,
for each K in ``--keep`` and two ways of choosing them:

- ``retrieval``: the K layers whose heads put the most attention on the pass key's digits from the last
  prompt position (the teacher's own attention, averaged over depths 0.1 / 0.5 / 0.9 of one calibration
  prompt with a fixed key that the trials never use);
- ``uniform``: K layers evenly spaced;
- ``recall`` (with ``--recall-rows N``): chosen greedily, one layer at a time, the layer whose full softmax
  (beside those already chosen, every other layer restricted) most lowers the teacher's loss on repeated
  spans of ``N`` rows of ``--recall-data`` (:func:`dofla.evaluation.recall.repeated_rows`: a span copied more
  than the window later in its own row; no pass-key prompt involved), so K's layers are the first K of one
  greedy order.

It says what a student that keeps K softmax layers could at best retrieve if its other layers carried
nothing beyond the window: an upper bound for hybrids whose converted layers act as the window alone.
Writes ``passkey_softmax_layers.md`` and ``.json`` to ``--out``:

    .venv/bin/python experiments/passkey_softmax_layers.py --threads 1 \
        --out docs/results/long_context/passkey_layers
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla.commands._common import integer_list
from dofla.data import load_texts, pack_token_sequences
from dofla.evaluation.passkey import DEFAULT_DEPTHS, build_prompt, passkey_retrieval
from dofla.evaluation.window_baseline import window_restricted
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.planning.recall_order import recall_layer_order

CALIBRATION_KEY = "80516"  # five digits; the trials draw their keys from the seed


def needle_attention(model, tokenizer, length: int) -> list[float]:
    """Per layer: attention from the last prompt position to the key's tokens, the largest over heads,
    averaged over the default depths (eager attention weights of the teacher, no restriction)."""
    needle = tokenizer(CALIBRATION_KEY, add_special_tokens=False)["input_ids"]
    mass = None
    for depth in DEFAULT_DEPTHS:
        ids = build_prompt(tokenizer, CALIBRATION_KEY, length, depth)
        sequence = ids[0].tolist()
        starts = [i for i in range(len(sequence)) if sequence[i : i + len(needle)] == needle]
        columns = sorted({start + offset for start in starts for offset in range(len(needle))})
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions  # per layer (1, H, T, T)
        per_layer = torch.stack([weights[0, :, -1, columns].sum(-1).amax() for weights in attentions])
        mass = per_layer if mass is None else mass + per_layer
    return (mass / len(DEFAULT_DEPTHS)).tolist()


def uniform_layers(count: int, layers: int) -> list[int]:
    """``count`` layers evenly spaced over ``layers``, centred in their strides."""
    return sorted({int((index + 0.5) * layers / count) for index in range(count)}) if count else []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--keep", default="0,3,6,10,15,20,30", help="K values, comma-separated")
    parser.add_argument("--lengths", default="1024", help="pass-key context lengths, comma-separated")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--choices", default="retrieval,uniform", help="of retrieval, uniform, recall")
    parser.add_argument("--recall-rows", type=int, default=4, help="rows of --seq-len tokens for recall")
    parser.add_argument("--recall-data", default="../shared/data/wiki_demo/wiki_demo.txt")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.keep = integer_list(args.keep, "--keep", minimum=0)
    args.lengths = integer_list(args.lengths, "--lengths", minimum=16)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    teacher = load_teacher(args.model, attn_implementation="eager")
    model, tokenizer = teacher.model, teacher.tokenizer
    layers = model.config.num_hidden_layers
    if max(args.keep) > layers:
        raise SystemExit(f"--keep goes up to {max(args.keep)} but the model has {layers} layers.")
    mass = needle_attention(model, tokenizer, max(args.lengths))
    model.set_attn_implementation("sdpa")
    ranked = sorted(range(layers), key=lambda layer: -mass[layer])
    wanted = args.choices.split(",")
    order = []
    if "recall" in wanted:
        texts = load_texts(args.recall_data)
        calibration = pack_token_sequences(tokenizer, texts, args.seq_len)[: args.recall_rows]
        order = recall_layer_order(model, [calibration], max(args.keep), window=args.window, sinks=args.sinks)
        print("recall order", order, flush=True)
    rows = []
    for keep in args.keep:
        choices = {
            "retrieval": sorted(ranked[:keep]),
            "uniform": uniform_layers(keep, layers),
            "recall": sorted(layer for layer, _ in order[:keep]),
        }
        for choice, kept in ((name, choices[name]) for name in wanted):
            if keep in (0, layers) and choice == "uniform":
                continue  # the same layers as the retrieval choice
            restricted = [layer for layer in range(layers) if layer not in kept]
            with window_restricted(model, args.window, args.sinks, layers=restricted):
                results = passkey_retrieval(
                    model, tokenizer, context_lengths=args.lengths, trials=args.trials
                )
            accuracy = {
                str(length): sum(r.accuracy for r in results if r.context_tokens == length)
                / sum(1 for r in results if r.context_tokens == length)
                for length in args.lengths
            }
            rows.append(dict(keep=keep, choice=choice, layers=kept, accuracy=accuracy))
            print(keep, choice, kept, accuracy, flush=True)
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    result = dict(
        command=command,
        model=args.model,
        window=args.window,
        sinks=args.sinks,
        trials=args.trials,
        depths=list(DEFAULT_DEPTHS),
        needle_attention=mass,
        recall_order=order,
        rows=rows,
        seconds=round(time.time() - started, 1),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "passkey_softmax_layers.json", json.dumps(result, indent=2) + "\n")
    lines = [
        "# Pass key with K full-softmax layers, the rest restricted to the window",
        "",
        f"Command: `{command}` ({result['seconds']:.0f} s). Teacher `{args.model}`; window {args.window} + "
        f"{args.sinks} sinks on every other layer; {args.trials} trials per length and depth "
        f"({', '.join(map(str, DEFAULT_DEPTHS))}); exact match of the generated key.",
        "",
        "Attention on the key from the last prompt position (largest head, per layer): "
        + ", ".join(f"{layer}: {value:.2f}" for layer, value in enumerate(mass)),
        "",
        *(
            [
                "Greedy recall order (layer, loss on the repeated spans once added): "
                + ", ".join(f"{layer} ({loss:.2f})" for layer, loss in order),
                "",
            ]
            if order
            else []
        ),
        "| K | choice | full-softmax layers | " + " | ".join(f"pass key @ {n}" for n in args.lengths) + " |",
        "|---|---|---|" + "---|" * len(args.lengths),
    ]
    for row in rows:
        cells = " | ".join(f"{row['accuracy'][str(n)]:.2f}" for n in args.lengths)
        lines.append(f"| {row['keep']} | {row['choice']} | {row['layers']} | {cells} |")
    write_text_atomic(args.out / "passkey_softmax_layers.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
