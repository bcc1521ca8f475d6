"""The long-context quality report: markdown tables by length and the loss-by-position plot, from the result of
:func:`dofla.evaluation.long_context.long_context_quality`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from dofla.evaluation.cache_baselines import CACHE_BASELINES, bytes_label
from dofla.io import write_atomic


def _format_perplexity(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value < 1000 else f"{value:.0f}"


def _format(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def aligned_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A markdown table with padded columns (reads as well in a terminal as rendered)."""
    widths = [max(len(str(row[column])) for row in [header, *body]) for column in range(len(header))]

    def line(cells):
        return (
            "| "
            + " | ".join(str(cell).ljust(width) for cell, width in zip(cells, widths, strict=True))
            + " |"
        )

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in body)])


def length_table(result: dict, length: int | str) -> str:
    """One length's table: a row per model; overall perplexity, ratio to the teacher, buckets, KL, top-1."""
    measured = result["by_length"][str(length)]
    teacher_ppl = measured["models"]["teacher"]["perplexity"]
    header = ["model", "ppl", "x teacher", *(f"ppl {b['label']}" for b in measured["buckets"]), "KL", "top-1"]
    state = measured.get("state_bytes") or {}
    if state:
        header.append("state MiB")
    body = []
    for name, entry in measured["models"].items():
        ratio = None if entry["perplexity"] is None or not teacher_ppl else entry["perplexity"] / teacher_ppl
        label = (measured.get("cache_baselines") or {}).get(name, {}).get("label") or result["rows"][name][
            "label"
        ]
        body.append(
            [
                label,
                _format_perplexity(entry["perplexity"]),
                _format(ratio, 2),
                *(_format_perplexity(bucket["perplexity"]) for bucket in entry["buckets"]),
                _format(entry.get("kl"), 3) if "kl" in entry else "-",
                _format(entry.get("top1"), 3) if "top1" in entry else "-",
                *([bytes_label(state.get(name))] if state else []),
            ]
        )
    return aligned_table(header, body)


def long_context_markdown(
    result: dict, *, heading: str = "## Held-out quality at length", plot: str | None = None
) -> str:
    """A markdown section: what the rows and columns mean, one table per length, the plot if given."""
    sinks = [count for count in result["sinks"] if count]
    lines = [
        heading,
        "",
        f"Perplexity of held-out text by position of the predicted token. `window {result['window']}` is the "
        f"teacher's own softmax restricted to the last {result['window']} tokens, with no training"
        + (
            f"; `+ N sinks` also lets every token see the first N tokens ({', '.join(map(str, sinks))})"
            if sinks
            else ""
        )
        + (
            "; `at the edge`: the sinks seen as if just before the window (a fixed distance) instead of at "
            "their true positions"
            if any(row.get("at_edge") for row in result["rows"].values())
            else ""
        )
        + ". KL: mean KL divergence from the teacher's next-token distribution (nats per token); top-1: share "
        "of tokens whose most likely next token is the teacher's."
        + (
            " StreamingLLM (the last keys + sinks) and heavy hitters (H2O: sinks, recent and most-attended keys, "
            "evicted during the prompt as in decoding) are the teacher with its KV cache cut to the size given "
            "in each table, without training."
            if any(name in result["rows"] for name in CACHE_BASELINES)
            else ""
        ),
    ]
    for length, measured in result["by_length"].items():
        lines += [
            "",
            f"**{length} tokens** ({measured['sequences']} sequences)",
            "",
            length_table(result, length),
        ]
    if plot:
        lines += ["", f"![loss by position]({plot})"]
    for note in result.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def plot_loss_by_position(result: dict, path: str | Path) -> Path:
    """Mean next-token loss by position (log-spaced bins), one panel per length; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    lengths = list(result["by_length"])
    figure, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    styles = {"teacher": dict(color="black", lw=2), "student": dict(color="tab:red", lw=2)}
    for axis, length in zip(axes[0], lengths, strict=True):
        measured = result["by_length"][length]
        curve = measured["loss_by_position"]
        centres = [
            math.sqrt(start * max(start, end))
            for start, end in zip(curve["start"], curve["end"], strict=True)
        ]
        for name, values in curve["nll"].items():
            ys = [math.nan if value is None else value for value in values]
            style = styles.get(name, dict(lw=1.2, ls="--"))
            axis.plot(centres, ys, marker=".", label=result["rows"][name]["label"], **style)
        axis.axvline(result["window"], color="grey", lw=0.8, ls=":")
        axis.set_xscale("log")
        axis.set_xlabel("token position")
        axis.set_title(f"{length} tokens ({measured['sequences']} sequences)")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("next-token loss (nats)")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    suffix = path.suffix.lstrip(".").lower() or "png"
    write_atomic(path, lambda temporary: figure.savefig(temporary, format=suffix, dpi=110))
    plt.close(figure)
    return path
