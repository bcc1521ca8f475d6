"""The trained baselines of a finished `dofla linearize` run, at every held-out length of the run.

A student's LoRA stage also adapts the model to the training text, so the fair references are given the
same stage: the teacher (full KV cache) and StreamingLLM holding as many bytes as the student's state (the
teacher's softmax cut to the last N keys + its sinks, the run's ``cache_baselines`` entry, built as a
window-only conversion). Both are trained with the run's LoRA settings on the run's own LoRA rows and
measured on its held-out rows, made again from its config exactly as the run made them (same text,
packing, split and seed): ``dofla.pipeline.lora_adapted_perplexities``. The StreamingLLM conversion is also
measured untrained at the training length, where it must equal the run's own StreamingLLM row.

    .venv/bin/python experiments/lora_baselines_at_length.py --run RUN_FOLDER --out OUT

RUN_FOLDER holds the run's ``config.toml`` and ``result.json``. Writes ``lora_baselines.md`` and ``.json``.
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

from dofla.convert import convert, plan_for
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.pipeline import lora_adapted_perplexities, perplexity
from dofla.run_config import CONFIG_FILE, load_config
from dofla.run_data import lora_rows, prepare_data


def streaming_baseline(result: dict, length: int) -> dict:
    """The run's StreamingLLM baseline at ``length``: {"tokens", "sinks", "label"}."""
    return result["long_context"]["by_length"][str(length)]["cache_baselines"]["streaming"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="a finished run's folder (config.toml, result.json)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run, out = Path(args.run), Path(args.out)
    command = "experiments/lora_baselines_at_length.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    config = load_config(run / CONFIG_FILE)
    result = json.loads((run / "result.json").read_text())
    started = time.time()
    torch.manual_seed(config.seed)  # as the run: its LoRA rows and adapters draw from this
    loaded = load_teacher(config.teacher.model, dtype=config.teacher.dtype, device=config.teacher.device)
    teacher, tokenizer = loaded.model, loaded.tokenizer
    data = prepare_data(config, teacher, tokenizer, None, out / "data_cache")
    train = lora_rows(config, tokenizer, data.train if data.lora_train is None else data.lora_train)
    streaming = streaming_baseline(result, config.data.seq_len)
    if any(streaming_baseline(result, length) != streaming for length in data.heldout_by_length):
        raise SystemExit("the run's StreamingLLM baseline differs between lengths; this script takes one.")
    measured = {"teacher + LoRA": lora_adapted_perplexities(teacher, train, data.heldout_by_length, config)}
    window_model = convert(
        copy.deepcopy(teacher),
        plan_for(
            teacher,
            kind="hybrid",
            cell="window",
            window=streaming["tokens"] - streaming["sinks"],
            sinks=streaming["sinks"],
        ),
    )
    untrained = perplexity(window_model, data.heldout, config.distill.batch_size)
    measured[f"{streaming['label']} + LoRA"] = lora_adapted_perplexities(
        window_model, train, data.heldout_by_length, config
    )
    lengths = sorted(data.heldout_by_length)
    by_length = result["long_context"]["by_length"]

    def in_run(model: str) -> dict[int, float]:  # the run's own perplexity of ``model`` at each length
        return {n: by_length[str(n)]["models"][model]["perplexity"] for n in lengths}

    rows = {
        "teacher": in_run("teacher"),
        "teacher + LoRA": measured["teacher + LoRA"],
        streaming["label"]: in_run("streaming"),
        f"{streaming['label']} + LoRA": measured[f"{streaming['label']} + LoRA"],
        "heavy hitters (H2O)": in_run("heavy-hitter"),
        "student": in_run("student"),
    }
    seconds = time.time() - started
    lines = [
        "# The run's baselines given the same LoRA stage, at every held-out length",
        "",
        f"Command: `{command}` ({seconds:.0f} s, {torch.get_num_threads()} threads). Run: `{run}`; its rows as "
        "the run made them. Rows without `+ LoRA` are the run's own (result.json); the two `+ LoRA` rows are "
        "trained and measured here.",
        "",
        "| model | " + " | ".join(f"ppl {n}" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[n]:.3f}" for n in lengths) + " |")
    student = rows["student"]
    for name in measured:
        ratios = ", ".join(f"{n}: {student[n] / rows[name][n]:.3f}" for n in lengths)
        lines.append(f"\nstudent / ({name}): {ratios}")
    run_streaming = rows[streaming["label"]][config.data.seq_len]
    lines.append(
        f"\nCheck: the StreamingLLM conversion untrained at {config.data.seq_len} tokens {untrained:.3f}, the "
        f"run's StreamingLLM row {run_streaming:.3f}; the teacher + LoRA at {config.data.seq_len} tokens "
        f"{measured['teacher + LoRA'][config.data.seq_len]:.3f}, the run's {result.get('lora_teacher_ppl')}."
    )
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(command=command, seconds=seconds, untrained_streaming=untrained, perplexity=rows)
    write_text_atomic(out / "lora_baselines.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "lora_baselines.json", json.dumps(payload, indent=2, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
