"""``dofla info MODEL``: the teacher's architecture summary as a table."""

from __future__ import annotations

import argparse
import json
from itertools import groupby

from dofla.commands._common import add_model_arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser("info", help="print a teacher's architecture summary")
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _runs(kinds: list[str]) -> str:
    return ", ".join(kind if len(run) == 1 else f"{kind} x{len(run)}" for kind, run in _grouped(kinds))


def _grouped(kinds: list[str]) -> list[tuple[str, list[str]]]:
    return [(kind, list(run)) for kind, run in groupby(kinds)]


def compress_kinds(kinds: list[str]) -> str:
    """Per-layer attention kinds as their shortest repeating pattern.

    ["full"] * 30 -> "full x30"; ["sliding", "full"] * 13 -> "sliding,full x13";
    (["sliding"] * 5 + ["full"]) * 4 + ["sliding"] * 2 -> "(sliding x5,full) x4; then sliding x2".
    """
    if not kinds:
        return "none"
    period = next(
        length
        for length in range(1, len(kinds) + 1)
        if all(kinds[index] == kinds[index % length] for index in range(len(kinds)))
    )
    pattern, repeats = kinds[:period], len(kinds) // period
    if period == len(kinds) and len(_grouped(kinds)) <= 3:
        return _runs(kinds)
    shown = _runs(pattern).replace(", ", ",") if period > 1 else pattern[0]
    if " x" in shown:
        shown = f"({shown})"
    remainder = kinds[repeats * period :]
    return f"{shown} x{repeats}" + (f"; then {_runs(remainder)}" if remainder else "")


def _rotary_text(adapter) -> str:
    if not adapter.uses_rotary:
        return "no"
    return "yes" if adapter.rotary_fraction == 1.0 else f"yes, on {adapter.rotary_fraction:.0%} of each head"


def _layer_list(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def conversion_text(adapter) -> str:
    """Which layers a plan converts by default, and why the others stay."""
    windowed = adapter.windowed_layers()
    if not windowed:
        return "every layer (full attention)"
    if len(windowed) == adapter.num_layers:
        return "none: every layer keeps its own sliding window (--convert-windowed converts them)"
    growing = [index for index in range(adapter.num_layers) if index not in set(windowed)]
    return (
        f"layers {_layer_list(growing)} (full attention); {_layer_list(windowed)} keep their own sliding "
        "window (--convert-windowed converts them too)"
    )


def summary(teacher) -> dict:
    adapter = teacher.adapter
    return {
        "source": teacher.source,
        "family": adapter.family.name,
        "model type": adapter.model_type,
        "layers": adapter.num_layers,
        "query heads": adapter.num_heads,
        "key/value heads": adapter.num_kv_heads,
        "head size": adapter.head_dim,
        "hidden size": adapter.hidden_size,
        "parameters": adapter.parameter_count(teacher.model),
        "context length": adapter.context_length,
        "rotary": _rotary_text(adapter),
        "attention scaling": adapter.attention_scaling(0, teacher.model),
        "sliding window": adapter.sliding_window or "none",
        "attention per layer": compress_kinds(adapter.layer_kinds),
        "converted by default": conversion_text(adapter),
        "dtype": str(next(teacher.model.parameters()).dtype).removeprefix("torch."),
    }


def run(args: argparse.Namespace) -> int:
    from dofla.models import load_teacher

    facts = summary(load_teacher(args.model, dtype=args.dtype, device=args.device))
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    shown = {name: f"{value:,}" if name == "parameters" else str(value) for name, value in facts.items()}
    width = max(len(name) for name in shown)
    value_width = max(len(value) for value in shown.values())
    print(f"| {'':<{width}} | {'value':<{value_width}} |")
    print(f"|{'-' * (width + 2)}|{'-' * (value_width + 2)}|")
    for name, value in shown.items():
        print(f"| {name:<{width}} | {value:<{value_width}} |")
    return 0
