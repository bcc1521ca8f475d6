#!/usr/bin/env bash
# Saved students measured far beyond the length they were trained at, up to the teacher's whole context
# (8,192 tokens for SmolLM2-135M), on one long continuous text no run trained on: the complete
# tinyshakespeare.txt as a single document (its blank lines are speech breaks, not document ends, so it is
# written as one JSONL record). Perplexity by position at 1,024 to 8,192 tokens beside the teacher and its
# softmax cut to the student's window (with and without sinks, no training), pass keys at 4,096 and 8,192.
#
#   bash experiments/beyond_training_length.sh OUT RUN_FOLDER...   # each RUN_FOLDER holds a saved model/
#
# Environment: DOFLA (default `dofla`), DATA (default ../shared/data/wiki_demo/tinyshakespeare.txt),
# LENGTHS, SEQUENCES, PASSKEY (empty: no pass keys), TRIALS (defaults below); PERIOD: the converted layers'
# position period (`dofla evaluate --position-period`; default: what each saved plan says); EDGE: on or off,
# where the hybrid layers' windows see their sinks (`dofla evaluate --sinks-at-edge`; default: what each saved
# plan says; on also adds the window baselines with their sinks at the edge); SUFFIX: added to each run's
# output folder name.
set -euo pipefail
out=$1
shift
dofla=${DOFLA:-dofla}
data=${DATA:-../shared/data/wiki_demo/tinyshakespeare.txt}
lengths=${LENGTHS:-1024,2048,4096,8192}
sequences=${SEQUENCES:-4}
passkey=${PASSKEY-4096,8192}
trials=${TRIALS:-2}
mkdir -p "$out"
document="$out/$(basename "${data%.*}").jsonl"
python3 - "$data" "$document" <<'PY'
import json, sys
from pathlib import Path
text = Path(sys.argv[1]).read_text(encoding="utf-8")
Path(sys.argv[2]).write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
PY
period=()
[[ -n ${PERIOD:-} ]] && period=(--position-period "$PERIOD")
[[ -n ${EDGE:-} ]] && period+=(--sinks-at-edge "$EDGE")
for run in "$@"; do
    name=$(basename "$run")${SUFFIX:-}
    mkdir -p "$out/$name"
    $dofla evaluate "$run/model" --data "$document" --lengths "$lengths" --sequences "$sequences" \
        --passkey "$passkey" --passkey-trials "$trials" --error-sequences 0 "${period[@]}" \
        --json "$out/$name/evaluate.json" --plot "$out/$name/loss_by_position.png" | tee "$out/$name/evaluate.md"
done
