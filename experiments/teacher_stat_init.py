"""Initialising the gated-delta hybrid's memory from the teacher's own attention statistics, against the
recipe's fixed initialisation, before any training.

The ``gated-delta`` recipe starts every head with the window's share gamma = 0.95 and decay memories spread
geometrically over 128-2,048 tokens, whatever the teacher does. Here the teacher's attention on ``--text``
gives, per query head, the share of its attention mass that the recipe's window and sinks see
(the near mass; gamma's initial value is 1 - s x the far mass for each s of ``--far-scales``, clamped to
``--gamma-range``), and per state (key-value) head the mean distance past the window's edge of the rest (the
decay memory, clamped to ``--memory-range``). Each initialisation is
scored by every converted layer's attention-output error against the teacher's, teacher-forced
(:func:`dofla.evaluation.attention_errors`), on ``--rows`` rows of ``--length`` tokens of ``--heldout``
(another text than the one the statistics come from). With ``--distill-tokens N``, the recipe's initialisation
and the ``--trained`` one are then each distilled (the recipe's layer-wise attention transfer, same seed, N
tokens of ``--text`` in rows of ``--length``) and scored again, with the converted model's perplexity on the
held-out rows (no LoRA stage). Writes ``teacher_stat_init.md``/``.json`` to
``--out``::

    nice .venv/bin/python experiments/teacher_stat_init.py --out docs/results/teacher_stat_init
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla.cells.gated import DEFAULT_DECAY_MEMORY
from dofla.convert import convert, plan_for, unconvert
from dofla.data import load_texts
from dofla.demo import DEMO_HELDOUT_TEXT, DEMO_TRAIN_TEXT
from dofla.distill.trainer import distill
from dofla.evaluation.attention_error import attention_errors
from dofla.evaluation.perplexity import perplexity
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.models.surgery import students
from dofla.recipes import plan_for_arguments
from dofla.run_config import LinearizeConfig

RECIPE = "gated-delta"


def token_rows(tokenizer, path, length: int, rows: int) -> torch.Tensor:
    """(rows, length) consecutive token ids of the texts in ``path``, joined."""
    ids = tokenizer("\n\n".join(load_texts(str(path))), add_special_tokens=False)["input_ids"]
    if len(ids) < rows * length:
        raise SystemExit(f"{path} holds {len(ids)} tokens; {rows} rows of {length} need {rows * length}.")
    return torch.tensor(ids[: rows * length]).view(rows, length)


@torch.no_grad()
def teacher_statistics(model, rows: torch.Tensor, window: int, sinks: int) -> list[dict[str, torch.Tensor]]:
    """Per layer: ``near`` (H,) the attention mass on the last ``window`` keys and the first ``sinks``, and
    ``distance`` (H,) the mass-weighted mean distance past the window's edge of the rest, over queries past
    window + sinks (eager attention weights)."""
    length = rows.shape[1]
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    near = ((key > query - window) | (key < sinks)) & (key <= query)  # (T, T)
    past_edge = (query - window + 1 - key).clamp_min(0).float()  # 0 inside the window
    wanted = slice(window + sinks, length)
    sums: list[dict[str, torch.Tensor]] = []
    for row in rows:
        attentions = model(row[None], output_attentions=True).attentions  # per layer (1, H, T, T)
        for index, weights in enumerate(attentions):
            weights = weights[0, :, wanted].float()  # (H, Q, T)
            near_mass = (weights * near[wanted]).sum(-1)  # (H, Q)
            far = weights * (~near[wanted])
            moments = {
                "near": near_mass.sum(-1),
                "far": far.sum((-1, -2)),
                "far_distance": (far * past_edge[wanted]).sum((-1, -2)),
                "queries": torch.full_like(near_mass[:, 0], near_mass.shape[1]),
            }
            if len(sums) <= index:
                sums.append(moments)
            else:
                sums[index] = {name: sums[index][name] + value for name, value in moments.items()}
    return [
        {"near": s["near"] / s["queries"], "distance": s["far_distance"] / s["far"].clamp_min(1e-12)}
        for s in sums
    ]


def logit(probability: torch.Tensor) -> torch.Tensor:
    return torch.log(probability / (1 - probability))


def set_from_teacher(model, statistics, gamma_range, memory_range, far_scale: float | None) -> None:
    """Each converted layer's decay memory per state head from the mean far distance of the query heads it
    serves; with ``far_scale``, its gamma per query head 1 - far_scale x the teacher's far mass."""
    for index, cell in sorted(students(model).items()):
        stats = statistics[index]
        if far_scale is not None:
            gamma = (1 - far_scale * (1 - stats["near"])).clamp(*gamma_range)
            cell.window_factor_logit.data.copy_(logit(gamma.double()).float())
        group = cell.num_heads // cell.state_heads
        distance = stats["distance"].view(cell.state_heads, group).mean(-1).clamp(*memory_range)
        cell.decay.bias.data.copy_(logit(1 - 1 / distance.double()).float())


def summary(errors: dict[int, dict[str, float]]) -> dict[str, float]:
    relative = [row["relative_error"] for row in errors.values()]
    cosine = [row["cosine"] for row in errors.values()]
    return {"mean_relative_error": sum(relative) / len(relative), "mean_cosine": sum(cosine) / len(cosine)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--text", default=str(DEMO_TRAIN_TEXT), help="where the statistics come from")
    parser.add_argument("--heldout", default=str(DEMO_HELDOUT_TEXT), help="where the errors are measured")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--stat-rows", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--gamma-range", default="0.5,0.99")
    parser.add_argument("--memory-range", default="16,4096")
    parser.add_argument(
        "--far-scales", default="1,0.25,0.1", help="gamma = 1 - scale x the teacher's far mass"
    )
    parser.add_argument("--distill-tokens", type=int, default=0)
    parser.add_argument("--trained", default="0.25", help="the far scale distilled beside the recipe")
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    started = time.time()
    arguments.far_scales = [float(x) for x in arguments.far_scales.split(",") if x]
    gamma_range = tuple(float(x) for x in arguments.gamma_range.split(","))
    memory_range = tuple(float(x) for x in arguments.memory_range.split(","))
    teacher = load_teacher(arguments.teacher, dtype="float32", device="cpu", attn_implementation="eager")
    model, tokenizer = teacher.model, teacher.tokenizer
    recipe = plan_for_arguments(RECIPE)  # the students every initialisation starts from
    plan = plan_for(model, **recipe)
    window, sinks, gamma = recipe["window"], recipe["sinks"], recipe["options"]["window_factor"]
    statistics = teacher_statistics(
        model, token_rows(tokenizer, arguments.text, arguments.length, arguments.stat_rows), window, sinks
    )
    heldout = token_rows(tokenizer, arguments.heldout, arguments.length, arguments.rows)
    teacher_perplexity = perplexity(model, heldout, batch_size=1)["perplexity"]
    results, trained = {}, {}
    shortest, longest = DEFAULT_DECAY_MEMORY
    variants = {
        f"recipe (gamma {gamma:g}, memories {shortest:,.0f}-{longest:,.0f})": False,
        f"memories from the teacher, gamma {gamma:g}": None,
    }
    for scale in arguments.far_scales:
        variants[f"memories and gamma = 1 - {scale:g} x far mass from the teacher"] = scale
    for name, far_scale in variants.items():
        convert(model, plan)
        if far_scale is not False:
            set_from_teacher(model, statistics, gamma_range, memory_range, far_scale)
        errors = attention_errors(model, [heldout[i : i + 1] for i in range(len(heldout))])
        results[name] = {**summary(errors), "layers": {str(k): v for k, v in sorted(errors.items())}}
        if arguments.distill_tokens and far_scale in (False, float(arguments.trained)):
            rows = arguments.distill_tokens // arguments.length
            train = token_rows(tokenizer, arguments.text, arguments.length, rows + arguments.stat_rows)
            config = LinearizeConfig.from_dict(
                {"out_dir": "unused", "recipe": RECIPE, "distill": {"tokens": rows * arguments.length}}
            )
            run = distill(model, train[arguments.stat_rows :], heldout, config)
            errors = attention_errors(model, [heldout[i : i + 1] for i in range(len(heldout))])
            trained[name] = {
                **summary(errors),
                "perplexity": perplexity(model, heldout, batch_size=1)["perplexity"],
                "tokens": run.tokens,
                "seconds": run.seconds,
            }
        unconvert(model)
    near = [float(s["near"].mean()) for s in statistics]
    distance = [float(s["distance"].mean()) for s in statistics]
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lines = [
        "# Memory initialised from the teacher's attention statistics, before training",
        "",
        f"Command: `{command}` ({time.time() - started:.0f} s, {arguments.threads} thread(s)). Statistics from "
        f"{arguments.stat_rows} rows of {arguments.length} tokens of `{Path(arguments.text).name}`; errors on "
        f"{arguments.rows} rows of `{Path(arguments.heldout).name}`; the `{RECIPE}` recipe's students (window "
        f"{window} + {sinks} sinks, {recipe['feature_map']} keys of {recipe['feature_dim']}).",
        "",
        "| initialisation | mean relative error | mean cosine |",
        "|---|---|---|",
        *(f"| {n} | {r['mean_relative_error']:.4f} | {r['mean_cosine']:.4f} |" for n, r in results.items()),
        "",
        *(
            [
                f"After distillation ({arguments.distill_tokens:,} tokens asked, the recipe's attention transfer, "
                f"no LoRA), on the same held-out rows (the teacher's perplexity: {teacher_perplexity:.2f}):",
                "",
                "| initialisation | tokens | mean relative error | mean cosine | perplexity |",
                "|---|---|---|---|---|",
                *(
                    f"| {n} | {r['tokens']:,} | {r['mean_relative_error']:.4f} | {r['mean_cosine']:.4f} | "
                    f"{r['perplexity']:.2f} |"
                    for n, r in trained.items()
                ),
                "",
            ]
            if trained
            else []
        ),
        "Relative error per layer, one column per initialisation in the order above:",
        "",
        "| layer | teacher's near mass | mean far distance | "
        + " | ".join(f"init {i + 1}" for i in range(len(results)))
        + " |",
        "|---|---|---|" + "---|" * len(results),
    ]
    for index in range(len(statistics)):
        errors = " | ".join(f"{r['layers'][str(index)]['relative_error']:.4f}" for r in results.values())
        lines.append(f"| {index} | {near[index]:.3f} | {distance[index]:.0f} | {errors} |")
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "near": near,
        "distance": distance,
        "results": results,
        "trained": trained,
        "teacher_perplexity": teacher_perplexity,
    }
    write_text_atomic(out / "teacher_stat_init.json", json.dumps(payload, indent=1) + "\n")
    write_text_atomic(out / "teacher_stat_init.md", "\n".join(lines) + "\n")
    print(
        "\n".join(
            line
            for line in lines
            if not line.startswith("| ") or "initialisation" in line or not line[2].isdigit()
        )
    )


if __name__ == "__main__":
    main()
