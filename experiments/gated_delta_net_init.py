"""How close the ``gated_delta_net`` cell starts to the teacher's attention, for settings of its initialisation.

Each layer of the embedded SmolLM2 is fed the teacher's own hidden states (captured entering each attention
module on shipped held-out Wikipedia text), and the cell built from that layer's attention module with the
given options is compared with the teacher's attention output, both after the output projection (the
layer's contribution to the residual stream): relative error ``||cell - teacher|| / ||teacher||`` over all
tokens of the layer (a zero output scores 1), and the cosine between the two (same flattening; it ignores a
common gain, which the read-out norm's weight learns first), with the relative error left at the best
gain, ``sqrt(1 - cosine^2)``, and that gain ``<cell, teacher> / <cell, cell>``. Figures are means over the layers; the defaults are chosen by the cosine. One setting
is changed at a time from the cell's defaults, then the best of each is combined: by the cosine, except
``output_scale`` (the read-out norm's initial weight, times ``gate_scale``), which changes only the size
and is chosen by the relative error.

    PYTHONPATH=src python experiments/gated_delta_net_init.py [--sequences 4] [--seq-len 512]

(``--teacher`` measures another teacher, e.g. a tiny one in tests/test_experiments.py.)
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "src" / "dofla" / "demo_text" / "wikipedia_heldout.txt"


def captured(model, adapter, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states entering, output leaving) each attention module of the teacher, by layer."""
    found: dict[int, list[torch.Tensor]] = {}
    handles = []
    for index, module in enumerate(adapter.attention_modules(model)):

        def before(_, args, kwargs, index=index):
            found[index] = [args[0] if args else kwargs["hidden_states"]]

        def after(_, args, kwargs, output, index=index):
            found[index].append(output[0] if isinstance(output, tuple) else output)

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [tuple(found[index]) for index in range(len(found))]


def measure(teacher, layers, options: dict) -> tuple[float, float, float, float]:
    """Mean over layers of (relative error, cosine, relative error at the best gain, the best gain) of the
    cells built with ``options``."""
    from dofla.convert import convert, plan_for
    from dofla.models.surgery import students

    model = copy.deepcopy(teacher.model)
    convert(model, plan_for(model, kind="linear", cell="gated_delta_net", options=options))
    modules = teacher.adapter.attention_modules(model)
    errors, cosines, at_best_gain, gains = [], [], [], []
    with torch.no_grad():
        for index, cell in sorted(students(model).items()):
            hidden, target = layers[index]
            core, _ = cell.mix(hidden, None, "chunked", None)
            output = modules[index].o_proj(core.flatten(2)).flatten()
            target = target.flatten()
            errors.append(((output - target).norm() / target.norm()).item())
            cosine = torch.nn.functional.cosine_similarity(output, target, dim=0).item()
            cosines.append(cosine)
            at_best_gain.append((1 - cosine**2) ** 0.5)
            gains.append((output @ target / (output @ output)).item())
    count = len(errors)
    return tuple(sum(values) / count for values in (errors, cosines, at_best_gain, gains))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)

    from dofla.cells import gated_delta_net as cell
    from dofla.models import load_teacher

    torch.manual_seed(0)
    teacher = load_teacher(args.teacher, dtype="float32", device="cpu")
    ids = teacher.tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    rows = [ids[start : start + args.seq_len] for start in range(0, len(ids), args.seq_len)]
    rows = [row for row in rows if len(row) == args.seq_len][: args.sequences]
    layers = captured(teacher.model, teacher.adapter, torch.tensor(rows))
    defaults = dict(
        conv_scale=cell.DEFAULT_CONV_SCALE,
        gate_scale=cell.DEFAULT_GATE_SCALE,
        output_scale=cell.DEFAULT_OUTPUT_SCALE,
        decay_memory=tuple(cell.DEFAULT_DECAY_MEMORY),
    )
    print(
        f"teacher {args.teacher}, {len(rows)} sequences of {args.seq_len} tokens of {TEXT.name}; "
        f"defaults now {defaults}"
    )
    print("| setting | value | relative error | cosine | relative error at the best gain | best gain |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    grid = {
        "conv_scale": [4.0, 1.0, 0.25, 0.05],
        "gate_scale": [0.25, 1.0, 4.0, 16.0],
        "decay_memory": [(2.0, 16.0), (4.0, 64.0), (16.0, 1024.0), (64.0, 4096.0), (256.0, 16384.0)],
        "output_scale": [1.0, 0.3, 0.1, 0.03],
    }
    best = {}
    started = time.perf_counter()
    for name, values in grid.items():
        scores = []
        for value in values:
            error, cosine, best_gain, gain = measure(teacher, layers, {**defaults, name: value})
            scores.append((-error if name == "output_scale" else cosine, value))
            print(
                f"| {name} | {value} | {error:.3f} | {cosine:.3f} | {best_gain:.3f} | {gain:.3f} |",
                flush=True,
            )
        best[name] = max(scores)[1]
    error, cosine, best_gain, gain = measure(teacher, layers, best)
    print(
        f"| the best of each, combined | {best} | {error:.3f} | {cosine:.3f} | {best_gain:.3f} | {gain:.3f} |"
    )
    print(f"({time.perf_counter() - started:.0f} s of measuring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
