"""Summarise every finished cell of /work/runs-alloc/grid with dofla.frontier.summarise."""
import json
from pathlib import Path

from dofla.frontier import FrontierConfig, summarise

grid = Path("/work/runs-alloc/grid")
results = sorted(grid.glob("cells/*/result.json"))
source = json.loads(results[0].read_text())["data_source"] if results else ""
command = (
    "dofla frontier smollm2-135m --out /work/runs-alloc/grid --allocations fix,measured --softmax-layers 0 $COMMON; "
    "dofla frontier smollm2-135m --out /work/runs-alloc/grid --allocations fix --softmax-layers 3 "
    "--softmax-choices uniform,measured $COMMON  (COMMON: see README.md)"
)
config = FrontierConfig(
    out_dir=str(grid),
    allocations=["fix", "measured"],
    budgets=[32],
    softmax_counts=[0, 3],
    softmax_choices=["uniform", "measured"],
    eval_length=1024,
    command=command,
)
summary = summarise(config, source)
print(json.dumps({"rows": [r["name"] for r in summary["rows"]], "missing": summary["missing"]}))
