#!/usr/bin/env bash
# Every CUDA check and figure from one command that fits a lent GPU's budget (planned limits add up
# to 7 minutes), in priority order, each step in its own process under its own limit. Each step
# appends one JSON line (name, ok, seconds, figures, error) to OUT/results.jsonl as it ends, so a
# killed session still returns everything before it (benchmarks/cuda_session.py says what each does).
#
#     bash benchmarks/cuda_session.sh OUT CHECKPOINT             # on a machine with an NVIDIA GPU
#     bash benchmarks/cuda_session.sh OUT CHECKPOINT --rehearse  # the same on the CPU: interpreter, tiny shapes
#
# CHECKPOINT: a MiMo-V2-Flash checkpoint exported on the CPU beforehand and carried along
# (`hal demo --export DIR`): nothing is distilled on the device.
set -uo pipefail
out=${1:?usage: cuda_session.sh OUT CHECKPOINT [--rehearse]}
checkpoint=${2:?usage: cuda_session.sh OUT CHECKPOINT [--rehearse]}
mode=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
: > "$out/results.jsonl"
if [ "$mode" = --rehearse ]; then
    export TRITON_INTERPRET=1
    rehearse=--rehearse
else
    unset TRITON_INTERPRET
    rehearse=
fi
step() {  # step NAME LIMIT_SECONDS: the step's own process, its record written by itself or, if killed, here
    local name=$1 limit=$2 start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" python3 "$here/cuda_session.py" "$name" --out "$out" --checkpoint "$checkpoint" $rehearse \
        > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 1 "$out/$name.log"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        printf '{"name": "%s", "ok": false, "seconds": %d, "figures": {}, "error": "timed out after %ds"}\n' \
            "$name" $((SECONDS - start)) "$limit" >> "$out/results.jsonl"
    fi
}
nvidia-smi -L > "$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$out/nvidia-smi.txt"
# Priority order; limits: 30 + 120 + 60 + 90 + 60 + 60 = 420 s (7 minutes).
step environment 30
step correctness 120
step graphs 60
step mtp 90
step figures 60
step bench 60
echo "=== results: $out/results.jsonl"
python3 - "$out/results.jsonl" <<'SUMMARY'
import json, sys
for row in map(json.loads, open(sys.argv[1])):
    print(f"{row['name']}: {'ok' if row['ok'] else 'FAILED'} in {row['seconds']}s {row['error'] or ''}")
SUMMARY
