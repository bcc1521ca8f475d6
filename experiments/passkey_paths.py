"""Which path carries a converted model's pass-key retrieval: its kept softmax layers or its memory?

Each saved run's model (``--runs name=FOLDER,...``, a folder holding ``model/`` or the model folder itself) is
scored on the pass key (:func:`dofla.evaluation.passkey.passkey_retrieval`, the same prompts for every
variant) four ways:

- ``as saved``;
- ``softmax layers cut``: the layers it kept as full softmax restricted to the plan's window and sinks
  (:func:`dofla.evaluation.window_baseline.window_restricted`), so only the converted layers' memories can
  reach beyond the window;
- ``memories off``: every converted layer's window share set to 1, so those layers are their window and
  sinks alone and only the kept softmax layers reach beyond it;
- ``both``: the two together (nothing reaches beyond the window).

Writes ``passkey_paths.md`` and ``.json`` to ``--out``:

    .venv/bin/python experiments/passkey_paths.py --threads 2 --lengths 1024,2048 --trials 4 \
        --runs needles=runs/cpu_150k/gated_delta_w128_recall4_needles --out FOLDER
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from dofla.commands._common import integer_list
from dofla.evaluation.passkey import passkey_retrieval
from dofla.evaluation.window_baseline import window_restricted
from dofla.io import write_json_atomic, write_text_atomic
from dofla.loading import load_converted
from dofla.models.surgery import students

VARIANTS = ("as saved", "softmax layers cut", "memories off", "both")
WINDOW_ONLY_LOGIT = 40.0  # sigmoid(40) is 1 in float32: the memory's share is exactly 0


@contextmanager
def memories_off(model):
    """Within this block every converted layer with a window share answers with its window alone."""
    saved = {}
    with torch.no_grad():
        for index, student in students(model).items():
            logit = getattr(student, "window_factor_logit", None)
            if logit is None:
                raise SystemExit(f"layer {index} has no window share (a cell without a window or a mix)")
            saved[index] = logit.detach().clone()
            logit.fill_(WINDOW_ONLY_LOGIT)
    try:
        yield model
    finally:
        with torch.no_grad():
            for index, student in students(model).items():
                student.window_factor_logit.copy_(saved[index])


def kept_softmax_layers(plan) -> list[int]:
    """The layers ``plan`` keeps as full softmax."""
    converted = set(plan.converted_layers)
    return [index for index in range(len(plan.layers)) if index not in converted]


def variant_scores(model, tokenizer, plan, kept, variant: str, lengths, trials: int) -> dict[int, float]:
    """Mean pass-key accuracy per context length for one variant of the model (``kept``: its softmax
    layers)."""
    window = plan.layers[plan.converted_layers[0]]
    with ExitStack() as stack:
        if variant in ("softmax layers cut", "both") and kept:
            stack.enter_context(window_restricted(model, window.window, window.sinks, layers=kept))
        if variant in ("memories off", "both"):
            stack.enter_context(memories_off(model))
        results = passkey_retrieval(model, tokenizer, context_lengths=lengths, trials=trials)
    by_length: dict[int, list[float]] = {}
    for result in results:
        by_length.setdefault(result.context_tokens, []).append(result.accuracy)
    return {length: sum(values) / len(values) for length, values in by_length.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="name=FOLDER, comma-separated")
    parser.add_argument("--lengths", default="1024,2048", help="pass-key context lengths, comma-separated")
    parser.add_argument("--trials", type=int, default=4, help="trials per length and depth")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    variants = [variant.strip() for variant in args.variants.split(",")]
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {', '.join(unknown)}; use some of: {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = integer_list(args.lengths, "--lengths", minimum=16)
    command = shlex.join(["experiments/passkey_paths.py", *(sys.argv[1:] if argv is None else argv)])
    rows = []
    started = time.perf_counter()
    for entry in args.runs.split(","):
        name, folder = entry.split("=", 1)
        path = Path(folder) / "model" if (Path(folder) / "model").is_dir() else Path(folder)
        model, tokenizer, plan = load_converted(path)
        model.eval()
        kept = kept_softmax_layers(plan)
        for variant in variants:
            scores = variant_scores(model, tokenizer, plan, kept, variant, lengths, args.trials)
            rows.append(dict(run=name, folder=folder, kept_softmax=kept, variant=variant, scores=scores))
            print(name, variant, scores, flush=True)
    seconds = time.perf_counter() - started
    header = " | ".join(f"{length} tokens" for length in lengths)
    lines = [
        "# Which path carries the pass key",
        "",
        f"Command: `{command}` ({seconds:.0f} s). Mean exact-match accuracy over depths 0.1 / 0.5 / 0.9, "
        f"{args.trials} trials each. softmax layers cut: the kept softmax layers restricted to the plan's "
        "window and sinks; memories off: every converted layer's window share set to 1 (its window alone).",
        "",
        f"| run | kept softmax layers | variant | {header} |",
        "|---|---|---|" + "---|" * len(lengths),
    ]
    for row in rows:
        cells = " | ".join(f"{row['scores'][length]:.2f}" for length in lengths)
        lines.append(f"| {row['run']} | {row['kept_softmax']} | {row['variant']} | {cells} |")
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "passkey_paths.md", "\n".join(lines) + "\n")
    write_json_atomic(args.out / "passkey_paths.json", dict(command=command, seconds=seconds, rows=rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
