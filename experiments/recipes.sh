#!/usr/bin/env bash
# Quality of the two published recipes and of Fix on the embedded SmolLM2-135M, at equal tokens.
# Usage: experiments/recipes.sh DATA OUT [TOKENS] [extra linearize options...]
# DATA: calibration/distillation text (txt/jsonl/json or a folder of them); OUT: results folder.
# Each run writes OUT/<name>/report.md and result.json (held-out perplexity of teacher and student);
# `python experiments/summarize_results.py OUT` tabulates them.
# Environment: DOFLA, the dofla command (default `dofla`); MODEL, the teacher (default smollm2-135m).
set -euo pipefail
data=$1; out=$2; tokens=${3:-2M}; shift $(( $# < 3 ? $# : 3 ))
dofla=${DOFLA:-dofla}
model=${MODEL:-smollm2-135m}
run() { name=$1; shift; $dofla linearize "$model" --data "$data" --tokens "$tokens" --out "$out/$name" --no-progress "$@"; }
run dof-paper --recipe dof-paper "$@"
run fix --recipe dof-paper --allocation fix "$@"
run lolcats --recipe lolcats --lora-tokens "$tokens" "$@"
