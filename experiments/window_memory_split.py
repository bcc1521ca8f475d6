"""Where a window + memory student loses what lies beyond its window, layer by layer.

For a finished ``dofla linearize`` run of a hybrid ``gated_delta`` student, the run's held-out rows of one
length are made again from its config (as ``experiments/recall_of_runs.py`` does) with a span of each row
repeated beyond the window (``dofla.evaluation.recall.repeated_rows``). Every converted layer is run on the
teacher's own q, k, v of those rows (teacher forcing), and the teacher's attention output is split exactly
as the ``split_mse`` loss splits it (``docs/distillation.md``): ``o = s w + (1 - s) f``, s the teacher's
attention mass on the window and sinks, w the softmax over them, f its output over the keys beyond them.
Per layer, on the repeated tokens ("recall") and on the other tokens past the window ("other"):

- far mass: the teacher's attention beyond the window and sinks, mean of 1 - s;
- cos: the cosine between the student's memory read-out m and f, weighted by 1 - s;
- memory share: the student's 1 - gamma;
- error: the student's squared output error relative to the teacher's output, and that of the window
  alone (gamma = 1).

    .venv/bin/python experiments/window_memory_split.py --run RUN --rows 4 --out FOLDER

(``RUN``: a run folder with ``config.toml`` and ``model/``, or ``NAME=RUN`` with the config read from
``NAME/config.toml`` when NAME holds one, as in ``recall_of_runs.py``.) Writes ``window_memory_split.md``
and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla import dispatch
from dofla.distill.losses import causal_log_sum_exp
from dofla.evaluation.recall import repeated_rows
from dofla.io import write_text_atomic
from dofla.loading import load_converted
from dofla.models import load_teacher
from dofla.run_config import CONFIG_FILE, load_config
from dofla.run_data import prepare_data


def _run_item(text: str) -> tuple[Path, Path]:
    """NAME=FOLDER -> (config file, model folder)."""
    name, _, folder = text.partition("=")
    folder = Path(folder or name)
    named = Path(name) / CONFIG_FILE
    return (named if named.is_file() else folder / CONFIG_FILE), folder / "model"


def _mean(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Mean of values (B, T, H) over the (B, T) positions of mask, weighted by weights (B, T, H)."""
    mask = mask[:, :, None].expand_as(values)
    if weights is None:
        return float(values[mask].mean())
    return float((values[mask] * weights[mask]).sum() / weights[mask].sum().clamp_min(1e-12))


@torch.no_grad()
def layer_split(student, rows: torch.Tensor, recall: torch.Tensor, other: torch.Tensor) -> list[dict]:
    """Per converted layer, the far mass, cos, memory share and errors (module docstring) on ``rows``."""
    calls = {}

    def keep(call):
        if getattr(call.module, dispatch.STUDENT_ATTRIBUTE, None) is not None:
            calls[call.layer_index] = call

    with dispatch.teacher_forced(), dispatch.observe(keep):
        student(rows)
    results = []
    for index, call in sorted(calls.items()):
        cell = getattr(call.module, dispatch.STUDENT_ATTRIBUTE)
        parts = cell.window_memory_parts(call.query, call.key, call.value, scaling=call.scaling)
        window, memory = parts["window"].float(), parts["memory"].float()  # (B, T, H, Dv)
        gamma = parts["gamma"].float().expand(*window.shape[:3], 1)
        everything = causal_log_sum_exp(call.query, call.key, scaling=call.scaling, softcap=cell.softcap)
        share = torch.exp(parts["window_lse"].float() - everything).clamp(0, 1).transpose(1, 2)[..., None]
        target = call.output.float()
        far_mass = (1 - share)[..., 0]  # (B, T, H)
        far = (target - share * window) / (1 - share).clamp_min(1e-6)
        cosine = torch.nn.functional.cosine_similarity(memory, far, dim=-1)
        output = gamma * window + (1 - gamma) * memory
        scale = target.pow(2).sum(-1).clamp_min(1e-12)
        error = (output - target).pow(2).sum(-1) / scale
        window_error = (window - target).pow(2).sum(-1) / scale
        results.append(
            dict(
                layer=index,
                **{
                    f"{name}_{where}": value
                    for where, mask in (("recall", recall), ("other", other))
                    for name, value in (
                        ("far_mass", _mean(far_mass, mask)),
                        ("cos", _mean(cosine, mask, far_mass)),
                        ("memory_share", _mean(1 - gamma[..., 0], mask)),
                        ("error", _mean(error, mask)),
                        ("window_error", _mean(window_error, mask)),
                    )
                },
            )
        )
    return results


def markdown(results: list[dict]) -> str:
    lines = [
        "| layer | far mass recall / other | cos(memory, far part) recall / other | memory share recall / other "
        "| student error recall / other | window-only error recall / other |",
        "|---|---|---|---|---|---|",
    ]
    for row in results:
        cells = [
            f"{row[f'{name}_recall']:.3f} / {row[f'{name}_other']:.3f}"
            for name in ("far_mass", "cos", "memory_share", "error", "window_error")
        ]
        lines.append(f"| {row['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="RUN or NAME=RUN (see above)")
    parser.add_argument("--length", type=int, default=1024, help="held-out row length (one of the run's)")
    parser.add_argument("--rows", type=int, default=4, help="held-out rows used")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    command = "experiments/window_memory_split.py " + " ".join(shlex.quote(item) for item in sys.argv[1:])
    config_file, model_folder = _run_item(args.run)
    config = load_config(config_file)
    teacher = load_teacher(config.teacher.model, dtype=config.teacher.dtype, device=config.teacher.device)
    out = Path(args.out)
    data = prepare_data(config, teacher.model, teacher.tokenizer, None, out / "data_cache")
    if args.length not in data.heldout_by_length:
        parser.error(
            f"the run has held-out rows of {sorted(data.heldout_by_length)} tokens, not {args.length}."
        )
    del teacher
    student, _, _ = load_converted(model_folder)
    rows, scored = repeated_rows(data.heldout_by_length[args.length][: args.rows], config.plan.window)
    recall = torch.zeros(rows.shape, dtype=torch.bool)
    for row, positions, _ in scored:
        recall[row, positions] = True
    other = (torch.arange(rows.shape[1]) >= config.plan.window)[None] & ~recall
    results = layer_split(student, rows, recall, other)
    text = "\n".join(
        [
            "# The teacher's attention beyond the window, and the student's memory, layer by layer",
            "",
            f"Command: `{command}` ({time.time() - started:.0f} s, {torch.get_num_threads()} threads); "
            f"{rows.shape[0]} held-out rows of {rows.shape[1]} tokens, {int(recall.sum())} recall and "
            f"{int(other.sum())} other positions.",
            "",
            markdown(results),
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "window_memory_split.md", text)
    write_text_atomic(
        out / "window_memory_split.json", json.dumps({"command": command, "layers": results}, indent=2)
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
