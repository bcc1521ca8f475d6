"""Where a run's attention transfer falls short: its distilled students with only some layers converted.

Loads a finished run's teacher and the best students of its attention transfer (the distillation's last
checkpoint, before any LoRA stage) and measures, on the first ``--rows`` of the run's held-out rows at its
training length (made again from its config exactly as the run made them):

- for each block of ``--blocks`` (``0-9,10-19,20-29,all``): the held-out loss (nats per token) with only
  those layers converted, every other layer the teacher's softmax;
- for each layer of ``--layers``, that layer alone converted: the held-out loss, and the relative error of
  its attention module's output (after the output projection, the layer's contribution to the residual
  stream) against the teacher's on the same rows, ``||student - teacher||^2 / ||teacher||^2`` (a zero
  output scores 1). Every other layer is the teacher's, so the layer reads the teacher's hidden states:
  the error the attention transfer's teacher-forced loss trains down, in the units of the residual stream.

    .venv/bin/python experiments/student_layer_blocks.py --run RUN --blocks 0-9,10-19,20-29,all \\
        --layers 1,2,5,27,29 --rows 4 --threads 2 --out OUT

Writes ``student_layer_blocks.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dofla.commands._common import integer_list
from dofla.config import ConversionPlan, LayerPlan
from dofla.convert import convert, unconvert
from dofla.distill.checkpoint import latest_checkpoint, load_checkpoint
from dofla.evaluation.perplexity import perplexity
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.models.surgery import architecture
from dofla.run_config import CONFIG_FILE, load_config
from dofla.run_data import prepare_data
from dofla.saving import is_student_key

BEST = "best/"  # the checkpoint's prefix of the best students' tensors


def parse_blocks(text: str, layers: int) -> dict[str, list[int]]:
    """``"0-9,12,all"`` -> {"0-9": [0..9], "12": [12], "all": [0..layers-1]}; one sentence for anything else."""
    blocks = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        first, _, last = item.partition("-")
        if item == "all":
            blocks[item] = list(range(layers))
        elif first.isdigit() and (last.isdigit() or not last) and int(last or first) < layers:
            blocks[item] = list(range(int(first), int(last or first) + 1))
        else:
            raise SystemExit(
                f"--blocks takes FIRST-LAST, LAYER or all items of layers below {layers}, got {item!r}."
            )
        if not blocks[item]:
            raise SystemExit(f"the block {item!r} holds no layer; give FIRST <= LAST.")
    return blocks


def heldout_loss(model, rows: torch.Tensor) -> float:
    """Mean next-token loss (nats per token) of ``model`` over rows (N, T)."""
    return perplexity(model, rows, batch_size=1)["nll"]


@contextmanager
def attention_outputs(model, layers: list[int]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, every forward's output of ``layers``' attention modules (after the output
    projection), appended by layer."""
    modules = architecture(model).attention_modules
    outputs: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def hook(layer: int):
        return lambda _, args, output: outputs[layer].append(
            output[0] if isinstance(output, tuple) else output
        )

    handles = [modules[layer].register_forward_hook(hook(layer)) for layer in layers]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def only_converted(model, plan: ConversionPlan, students: dict[str, torch.Tensor], layers: list[int]):
    """The teacher ``model`` with only ``layers`` of ``plan`` converted and their distilled ``students``
    loaded, the teacher again after the block."""
    chosen = set(layers)
    kept = [
        layer if index in chosen else LayerPlan(kind="softmax") for index, layer in enumerate(plan.layers)
    ]
    convert(model, dataclasses.replace(plan, layers=kept))
    try:
        expected = {name for name in model.state_dict() if is_student_key(name)}
        missing = expected - set(students)
        if missing:
            raise SystemExit(f"the checkpoint lacks {len(missing)} of the students' tensors.")
        model.load_state_dict({name: students[name] for name in expected}, strict=False)
        yield model
    finally:
        unconvert(model)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run", required=True, help="a finished run's folder (config.toml, plan.json, distill/)"
    )
    parser.add_argument("--blocks", default="all", help="comma-separated FIRST-LAST, LAYER or all items")
    parser.add_argument("--layers", default="", help="comma-separated layers converted one at a time")
    parser.add_argument("--rows", type=int, default=4, help="held-out rows measured")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run, out = Path(args.run), Path(args.out)
    plan = ConversionPlan.load(run / "plan.json")
    blocks = parse_blocks(args.blocks, len(plan.layers))
    singles = integer_list(args.layers, "--layers", minimum=0) if args.layers else []
    if any(layer >= len(plan.layers) for layer in singles):
        raise SystemExit(f"--layers names a layer beyond the plan's {len(plan.layers)}.")
    checkpoint = latest_checkpoint(run / "distill" / "checkpoints")
    if checkpoint is None:
        raise SystemExit(f"{run} has no attention-transfer checkpoint under distill/checkpoints.")
    tensors = load_checkpoint(checkpoint)[0]
    students = {name.removeprefix(BEST): tensor for name, tensor in tensors.items() if name.startswith(BEST)}
    config = load_config(run / CONFIG_FILE)
    command = "experiments/student_layer_blocks.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.time()
    torch.manual_seed(config.seed)  # as the run: its rows draw from this
    loaded = load_teacher(config.teacher.model, dtype=config.teacher.dtype, device=config.teacher.device)
    model = loaded.model
    data = prepare_data(config, model, loaded.tokenizer, None, out / "data_cache")
    rows = data.heldout[: args.rows]
    with attention_outputs(model, singles) as outputs:  # the teacher's, read in the same forwards
        teacher_loss = heldout_loss(model, rows)
    references = {layer: torch.cat(outputs[layer]) for layer in singles}
    by_block = {}
    for name, layers in blocks.items():
        with only_converted(model, plan, students, layers) as student:
            by_block[name] = heldout_loss(student, rows)
        print(json.dumps({"block": name, "loss": by_block[name]}), flush=True)
    by_layer = {}
    for layer in singles:
        with (
            only_converted(model, plan, students, [layer]) as student,
            attention_outputs(student, [layer]) as outputs,
        ):
            loss = heldout_loss(student, rows)
        output, reference = torch.cat(outputs[layer]), references[layer]
        error = float((output - reference).pow(2).sum() / reference.pow(2).sum())
        by_layer[layer] = {"loss": loss, "relative_error": error}
        print(json.dumps({"layer": layer, **by_layer[layer]}), flush=True)
    seconds = time.time() - started
    lines = [
        "# The run's distilled students with only some layers converted",
        "",
        f"Command: `{command}` ({seconds:.0f} s, {torch.get_num_threads()} threads). Run: `{run}` (recipe "
        f"`{config.recipe}`), its attention transfer's best students ({checkpoint.name}, before any LoRA "
        f"stage), on {len(rows)} held-out rows of {rows.shape[1]} tokens. The teacher's loss there: "
        f"{teacher_loss:.3f} nats per token.",
        "",
        "| layers converted | loss | over the teacher's |",
        "|---|---:|---:|",
        *(f"| {name} | {loss:.3f} | {loss - teacher_loss:+.3f} |" for name, loss in by_block.items()),
    ]
    if by_layer:
        lines += [
            "",
            "One layer alone converted (it reads the teacher's hidden states): loss, and the relative error of "
            "its attention output after the output projection.",
            "",
            "| layer | loss | over the teacher's | relative error |",
            "|---:|---:|---:|---:|",
            *(
                f"| {layer} | {v['loss']:.3f} | {v['loss'] - teacher_loss:+.3f} | {v['relative_error']:.3f} |"
                for layer, v in by_layer.items()
            ),
        ]
    payload = dict(
        command=command,
        seconds=seconds,
        run=str(run),
        checkpoint=checkpoint.name,
        rows=list(rows.shape),
        teacher_loss=teacher_loss,
        blocks=by_block,
        layers=by_layer,
    )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "student_layer_blocks.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "student_layer_blocks.json", json.dumps(payload, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
