"""Print the held-out numbers of two demo runs side by side (the demo before and after the restructure).

    python docs/results/restructure/compare_demo.py docs/results/restructure/demo_result_before.json \
        docs/results/restructure/demo_result_after.json
"""

from __future__ import annotations

import json
import sys


def numbers(path: str) -> dict[str, float]:
    result = json.loads(open(path).read())
    found = {}
    for length, entry in result["long_context"]["by_length"].items():
        for model, row in entry["models"].items():
            found[f"perplexity at {length}, {model}"] = row["perplexity"]
    found["LoRA-adapted teacher at the training length"] = result["lora_teacher_ppl"]
    found["best held-out distillation loss"] = result["best_val_loss"]
    return found


def main() -> None:
    before, after = numbers(sys.argv[1]), numbers(sys.argv[2])
    print("| quantity | before | after | relative difference |")
    print("|---|---|---|---|")
    for key, value in before.items():
        other = after[key]
        print(f"| {key} | {value:.7g} | {other:.7g} | {abs(other - value) / abs(value):.1e} |")


if __name__ == "__main__":
    main()
