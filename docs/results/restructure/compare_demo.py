"""Print the held-out numbers of two demo runs side by side (the demo before and after a change).

    python docs/results/restructure/compare_demo.py docs/results/restructure/demo_result_before.json \
        docs/results/restructure/demo_result_after.json

With ``--all``, after that table: every number in the two ``result.json`` files outside their settings and
timings (per-bucket perplexities, KL, top-1 agreement, pass-key results, state bytes, per-layer validation
losses, ...), how many are bit-identical, the largest relative difference and the rows that differ, then the
settings that differ (run folder and data paths left out).
"""

from __future__ import annotations

import json
import sys

# what a run's clock or location decides, not its numbers
SKIPPED_KEYS = {"timings", "seconds", "data_source"}
LOCATION_KEYS = {"out_dir", "path", "heldout_path", "command"}


def numbers(path: str) -> dict[str, float]:
    result = json.loads(open(path).read())
    found = {}
    for length, entry in result["long_context"]["by_length"].items():
        for model, row in entry["models"].items():
            found[f"perplexity at {length}, {model}"] = row["perplexity"]
    found["LoRA-adapted teacher at the training length"] = result["lora_teacher_ppl"]
    found["best held-out distillation loss"] = result["best_val_loss"]
    return found


def leaves(value, prefix: str = "") -> dict[str, object]:
    """Every number, string, boolean and null of a JSON value by its path (``a.b[2].c``)."""
    if isinstance(value, dict):
        found = {}
        for key, item in value.items():
            if key not in SKIPPED_KEYS:
                found.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return found
    if isinstance(value, list):
        found = {}
        for index, item in enumerate(value):
            found.update(leaves(item, f"{prefix}[{index}]"))
        return found
    return {prefix: value}


def relative(before: float, after: float) -> float:
    if before == after:
        return 0.0
    return abs(after - before) / max(abs(before), abs(after))


def compare_all(before_path: str, after_path: str) -> list[str]:
    before, after = (json.loads(open(path).read()) for path in (before_path, after_path))
    settings = [leaves(result.pop("config", {})) for result in (before, after)]
    old, new = leaves(before), leaves(after)
    lines = []
    numeric = [
        key
        for key in old
        if key in new
        and isinstance(old[key], (int, float))
        and isinstance(new[key], (int, float))
        and not isinstance(old[key], bool)
    ]
    differing = [key for key in numeric if old[key] != new[key]]
    largest = max((relative(old[key], new[key]) for key in numeric), default=0.0)
    lines.append(
        f"{len(numeric)} numbers in both files (settings and timings left out): {len(numeric) - len(differing)} "
        f"bit-identical, {len(differing)} differ; largest relative difference {largest:.1e}."
    )
    other = [key for key in old if key in new and key not in numeric and old[key] != new[key]]
    only = sorted(set(old) ^ set(new))
    if differing:
        lines += ["", "| number | before | after | relative difference |", "|---|---|---|---|"]
        for key in sorted(differing, key=lambda key: -relative(old[key], new[key])):
            lines.append(f"| {key} | {old[key]!r} | {new[key]!r} | {relative(old[key], new[key]):.1e} |")
    if other:
        lines += ["", "Other entries that differ:"] + [
            f"- {key}: {old[key]!r} -> {new[key]!r}" for key in other
        ]
    if only:
        lines += ["", "Entries in one file only:"] + [
            f"- {key} ({'before' if key in old else 'after'} only)" for key in only
        ]
    keys = sorted(set(settings[0]) | set(settings[1]))
    changed = [
        key
        for key in keys
        if key.rsplit(".", 1)[-1] not in LOCATION_KEYS
        and settings[0].get(key, "—") != settings[1].get(key, "—")
    ]
    lines += [""]
    if changed:
        lines += ["Settings that differ:"] + [
            f"- {key}: {settings[0].get(key, '(absent)')!r} -> {settings[1].get(key, '(absent)')!r}"
            for key in changed
        ]
    else:
        lines.append("Settings: the same (run folder and data paths left out).")
    return lines


def main() -> None:
    arguments = [item for item in sys.argv[1:] if item != "--all"]
    before, after = numbers(arguments[0]), numbers(arguments[1])
    print("| quantity | before | after | relative difference |")
    print("|---|---|---|---|")
    for key, value in before.items():
        other = after[key]
        print(f"| {key} | {value:.7g} | {other:.7g} | {abs(other - value) / abs(value):.1e} |")
    if "--all" in sys.argv[1:]:
        print()
        print("\n".join(compare_all(arguments[0], arguments[1])))


if __name__ == "__main__":
    main()
