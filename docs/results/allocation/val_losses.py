"""Write val_losses.md: each grid cell's held-out attention-transfer loss after distillation (the last
``val_loss`` record of OUT/cells/NAME/distill/log.jsonl, written by dofla.distill.trainer)."""
import json
import sys
from pathlib import Path

from dofla.io import write_text_atomic

grid, out = Path(sys.argv[1]), Path(sys.argv[2])
lines = [
    "# Held-out attention-transfer loss per grid cell (written by val_losses.py from the runs' own logs)",
    "",
    "Mean over the converted layers of the held-out `output_mse` after the 8 distillation steps; softmax layers",
    "have no loss and are left out of the mean. This is a teacher-forced, per-layer measure, not perplexity.",
    "",
    "| cell | steps | tokens | held-out loss (mean over converted layers) | converted layers |",
    "|---|---|---|---|---|",
]
for log in sorted(grid.glob("cells/*/distill/log.jsonl")):
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evaluations = [record for record in records if "val_loss" in record]
    steps = [record for record in records if "loss" in record and "val_loss" not in record]
    if not evaluations:
        continue
    last = evaluations[-1]
    lines.append(
        f"| {log.parent.parent.name} | {last['step']} | {steps[-1]['tokens'] if steps else ''} | "
        f"{last['val_loss']:.5f} | {len(last['val_layers'])} |"
    )
write_text_atomic(out, "\n".join(lines) + "\n")
