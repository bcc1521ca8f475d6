"""Length curriculum: does training on shorter sequences first help a student at 1,024 and 2,048 tokens?

Text is packed into rows of the longest ``--eval-lengths`` and split into held-out rows (never trained on)
and training rows before anything is cut. Each cell is converted from the same teacher (``gla``: the
long-context recipe's hybrid, linear attention with a learned decay beside a ``--window``-token window
keeping ``--sinks`` sink tokens; ``linear``: pure linear attention, no window; Hedgehog features of
``--feature-dim``) and distilled with attention-output MSE for the same ``--tokens`` and seed, once per
curriculum: ``none`` (every step at ``--seq-len``) and each ``--curricula`` schedule (stages
``LENGTH:SHARE``, shortest first, ending at ``--seq-len``; a shorter stage's batch holds about as many
tokens, :mod:`dofla.distill.curriculum`; default: half the tokens at L/2, and L/4, L/2, L by quarter,
quarter, half). The training rows of every stage are cut from the same training rows. Each student is
measured on the held-out rows at every evaluation length beside the teacher; the teacher's softmax
restricted to the window with the sink tokens (no training) is measured once. Writes
``length_curriculum.md`` and ``.json`` to ``--out``. The default (gla; 12k tokens, batch 2 at 512 tokens;
4 held-out rows of 2,048 tokens, also cut into 8 of 1,024) is sized for about 10-15 minutes on an idle
2-core CPU; ``--cells gla,linear`` adds three runs of the pure linear cell:

    .venv/bin/python experiments/length_curriculum.py --data ../shared/data/wiki_demo/wiki_demo.txt \
        --threads 2 --out docs/results/long_context/curriculum

To train at 1,024 tokens instead add ``--seq-len 1024`` (each step then costs more). Every number in the
output comes from this run, and the command line is recorded with it.
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

from dofla.commands._common import integer_list
from dofla.convert import convert, plan_for, unconvert
from dofla.data import cut_rows, load_texts, pack_token_sequences, parse_tokens, split_train_heldout
from dofla.distill.curriculum import check_length_schedule
from dofla.distill.trainer import distill
from dofla.errors import DoflaError
from dofla.evaluation.long_context import long_context_quality
from dofla.evaluation.long_context_report import aligned_table, long_context_markdown
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.run_config import LinearizeConfig
from dofla.settings import DistillSettings

CELLS = ("gla", "linear")


def parse_schedule(text: str) -> list[tuple[int, float]]:
    """'256:0.5,512:0.5' -> [(256, 0.5), (512, 0.5)]; 'none' -> []."""
    if text.strip() == "none":
        return []
    try:
        return [
            (int(length), float(share)) for length, share in (item.split(":") for item in text.split(","))
        ]
    except ValueError:
        raise DoflaError(
            f"a curriculum is LENGTH:SHARE,... like 256:0.5,512:0.5 or none, got {text!r}."
        ) from None


def default_curricula(seq_len: int) -> str:
    """Half the tokens at half the length, then a quarter each at a quarter and a half: for 512,
    '256:0.5,512:0.5;128:0.25,256:0.25,512:0.5'."""
    half, quarter = seq_len // 2, seq_len // 4
    return f"{half}:0.5,{seq_len}:0.5;{quarter}:0.25,{half}:0.25,{seq_len}:0.5"


def cell_plan(model, cell: str, args: argparse.Namespace):
    """The conversion plan of ``cell``: gla = hybrid with the window and sinks, linear = pure linear."""
    if cell == "gla":
        return plan_for(
            model,
            kind="hybrid",
            cell="gla",
            feature_map="hedgehog",
            feature_dim=args.feature_dim,
            window=args.window,
            sinks=args.sinks,
            options={"window_factor": 0.999},
        )
    if cell == "linear":
        return plan_for(model, kind="linear", feature_map="hedgehog", feature_dim=args.feature_dim)
    raise DoflaError(f"unknown cell {cell!r} for this experiment; choose from {', '.join(CELLS)}.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="text to train on and hold out")
    parser.add_argument("--cells", default="gla", help=f"comma-separated: {', '.join(CELLS)}")
    parser.add_argument(
        "--curricula",
        default=None,
        help="';'-separated LENGTH:SHARE,... schedules ending at --seq-len; none (no curriculum) is always run "
        "first (default: L/2:0.5,L:0.5;L/4:0.25,L/2:0.25,L:0.5 for --seq-len L)",
    )
    parser.add_argument("--feature-dim", type=int, default=32)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--tokens", default="12k", help="distillation tokens of every run")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-lengths", default="1024,2048")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step at --seq-len")
    parser.add_argument(
        "--heldout", type=int, default=4, help="held-out rows of the longest evaluation length"
    )
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cells = [cell.strip() for cell in args.cells.split(",") if cell.strip()]
    texts = (args.curricula or default_curricula(args.seq_len)).split(";")
    curricula = [[]] + [parse_schedule(text) for text in texts if text.strip() and text.strip() != "none"]
    for schedule in curricula:
        check_length_schedule(schedule, args.seq_len)
    lengths = sorted(integer_list(args.eval_lengths, "--eval-lengths", minimum=2))
    out = Path(args.out)
    torch.manual_seed(args.seed)

    loaded = load_teacher(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    teacher = copy.deepcopy(model)  # the reference beside each converted copy
    rows = pack_token_sequences(tokenizer, load_texts(args.data), lengths[-1])
    train_rows, heldout_rows = split_train_heldout(rows, 0.1, args.seed)
    heldout = {length: cut_rows(heldout_rows[: args.heldout], length) for length in lengths}
    train = cut_rows(train_rows, args.seq_len)
    results: dict = {
        "command": "python experiments/length_curriculum.py " + shlex.join(argv),
        "train_tokens_available": int(train.numel()),
        "heldout_sequences": {str(length): len(rows) for length, rows in heldout.items()},
        "runs": [],
    }
    started = time.perf_counter()
    results["baseline"] = long_context_quality(
        teacher, None, heldout, window=args.window, sinks=[args.sinks], batch_size=args.batch_size
    )
    results["baseline_seconds"] = round(time.perf_counter() - started, 1)
    for cell in cells:
        for schedule in curricula:
            started = time.perf_counter()
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
                    length_schedule=schedule or None,
                ),
            )
            shorter = {
                length: cut_rows(train_rows, length) for length, _ in schedule if length < args.seq_len
            }
            convert(model, cell_plan(model, cell, args))
            # validation on training text at the end only: no selection on held-out text
            distilled = distill(model, train, train[:2], config, None, shorter_train=shorter)
            trained_seconds = time.perf_counter() - started
            quality = long_context_quality(
                teacher, model, heldout, window=args.window, sinks=[], batch_size=args.batch_size
            )
            unconvert(model)  # the students go; the teacher's weights were never trained
            results["runs"].append(
                {
                    "cell": cell,
                    "curriculum": ",".join(f"{length}:{share:g}" for length, share in schedule) or "none",
                    "stages": distilled.stages,
                    "distill_tokens": distilled.tokens,
                    "distill_steps": distilled.steps,
                    "final_train_loss": distilled.final_val_loss,
                    "distill_seconds": round(trained_seconds, 1),
                    "seconds": round(time.perf_counter() - started, 1),
                    "quality": quality,
                }
            )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "length_curriculum.json", json.dumps(results, indent=2) + "\n")
    write_text_atomic(out / "length_curriculum.md", render(results))
    return 0


def _perplexity(quality: dict, length: int, row: str) -> float:
    return quality["by_length"][str(length)]["models"][row]["perplexity"]


def summary_table(results: dict) -> str:
    """One row per model: held-out perplexity at each length and its ratio to the teacher."""
    baseline = results["baseline"]
    lengths = [int(length) for length in baseline["by_length"]]
    sinks_row = next(name for name in baseline["rows"] if name != "teacher")
    header = ["model", "curriculum", "tokens", "steps", "distill s"]
    for length in lengths:
        header += [f"ppl {length}", "x teacher", f"KL {length}"]
    teacher = {length: _perplexity(baseline, length, "teacher") for length in lengths}
    body = []
    for label, row in (("teacher", "teacher"), (baseline["rows"][sinks_row]["label"], sinks_row)):
        cells = [label, "-", "-", "-", "-"]
        for length in lengths:
            measured = baseline["by_length"][str(length)]["models"][row]
            value = measured["perplexity"]
            cells += [f"{value:.2f}", f"{value / teacher[length]:.3f}", _kl(measured)]
        body.append(cells)
    for run in results["runs"]:
        cells = [run["cell"], run["curriculum"], str(run["distill_tokens"]), str(run["distill_steps"])]
        cells.append(f"{run['distill_seconds']:.0f}")
        for length in lengths:
            measured = run["quality"]["by_length"][str(length)]["models"]["student"]
            value = measured["perplexity"]
            cells += [f"{value:.2f}", f"{value / teacher[length]:.3f}", _kl(measured)]
        body.append(cells)
    return aligned_table(header, body)


def _kl(measured: dict) -> str:
    return "-" if measured.get("kl") is None else f"{measured['kl']:.3f}"


def render(results: dict) -> str:
    sequences = ", ".join(f"{count} x {length}" for length, count in results["heldout_sequences"].items())
    lines = [
        "# Length curriculum at equal distillation tokens",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Held-out perplexity ({sequences} tokens, never trained on) of each student beside the teacher and the "
        "teacher's own window with sink tokens (no training); KL to the teacher per token.",
        "",
        summary_table(results),
        "",
        long_context_markdown(results["baseline"], heading="## Teacher and window baseline by position"),
    ]
    for run in results["runs"]:
        stages = "; ".join(
            f"{stage['length']} x {stage['batch_size']} for {stage['steps']} steps" for stage in run["stages"]
        )
        heading = f"## {run['cell']}, curriculum {run['curriculum']}" + (f" ({stages})" if stages else "")
        lines.append(long_context_markdown(run["quality"], heading=heading))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
