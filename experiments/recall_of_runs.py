"""Recall beyond the window of finished `dofla linearize` runs, on each run's own held-out rows.

For every run folder given (holding ``config.toml`` and ``model/``), the run's held-out rows are made
again from its config exactly as the run made them (``dofla.run_data.prepare_data``: same text, packing,
split and seed; never trained on), and :func:`dofla.evaluation.recall.recall_beyond_window` scores the
teacher, the teacher cut to the run's window (+ its sinks, else 4) and the saved student on tokens
repeated beyond the window. Runs made before the linearize report measured recall get the same table
this way. Writes ``recall_of_runs.md`` and ``.json`` to ``--out``:

    .venv/bin/python experiments/recall_of_runs.py --threads 1 --lengths 1024,2048 \\
        --runs docs/results/long_context/cpu_150k/gated_delta_w128=runs/cpu_150k/gated_delta_w128 \\
        --out docs/results/long_context/recall

Each ``--runs`` item is ``NAME=FOLDER`` (or just FOLDER): the config is read from ``NAME/config.toml``
when NAME holds one (a results folder) and the model from ``FOLDER/model``.
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
from dofla.evaluation.recall import recall_beyond_window, recall_markdown
from dofla.io import write_text_atomic
from dofla.loading import load_converted
from dofla.models import load_teacher
from dofla.pipeline import DEFAULT_BASELINE_SINKS
from dofla.run_config import CONFIG_FILE, load_config
from dofla.run_data import prepare_data


def _run_item(text: str) -> tuple[str, Path, Path]:
    """NAME=FOLDER -> (name, config file, model folder)."""
    name, _, folder = text.partition("=")
    folder = Path(folder or name)
    named = Path(name) / CONFIG_FILE
    config_file = named if named.is_file() else folder / CONFIG_FILE
    return Path(name).name, config_file, folder / "model"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", required=True, help="comma-separated NAME=FOLDER items (see above)")
    parser.add_argument("--lengths", default=None, help="held-out lengths (default: every length of the run)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    lengths = integer_list(args.lengths, "--lengths", minimum=2) if args.lengths else None
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    command = "experiments/recall_of_runs.py " + " ".join(shlex.quote(item) for item in sys.argv[1:])
    started = time.time()
    results = {}
    teachers = {}
    for item in [item for item in args.runs.split(",") if item.strip()]:
        name, config_file, model_folder = _run_item(item.strip())
        config = load_config(config_file)
        if config.teacher.model not in teachers:
            loaded = load_teacher(
                config.teacher.model, dtype=config.teacher.dtype, device=config.teacher.device
            )
            teachers[config.teacher.model] = loaded
        teacher = teachers[config.teacher.model]
        data = prepare_data(config, teacher.model, teacher.tokenizer, None, out / "data_cache")
        student, _, _ = load_converted(model_folder)
        window, sinks = config.plan.window, config.plan.sinks or DEFAULT_BASELINE_SINKS
        results[name] = [
            recall_beyond_window(
                teacher.model, student, rows, window=window, sinks=sinks, batch_size=args.batch_size
            )
            for length, rows in sorted(data.heldout_by_length.items())
            if lengths is None or length in lengths
        ]
        print(f"{name}: done after {time.time() - started:.0f} s", flush=True)
    lines = [
        "# Recall beyond the window of finished runs, on their own held-out rows",
        "",
        f"Command: `{command}` ({time.time() - started:.0f} s, {torch.get_num_threads()} threads)",
        "",
    ]
    for name, measured in results.items():
        lines.append(recall_markdown(measured, heading=f"## {name}"))
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "recall_of_runs.md", "\n".join(lines))
    write_text_atomic(
        out / "recall_of_runs.json", json.dumps({"command": command, "runs": results}, indent=2)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
