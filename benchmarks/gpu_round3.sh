#!/usr/bin/env bash
# Issue 56's device checks of items 1 and 2, as one call on a GPU machine, from the repository root:
#   ARCFACE_TORCH=work_dirs/arcface_torch OUT=benchmarks/results/round3 benchmarks/gpu_round3.sh
# 1. the whole GPU kit (`make test-gpu`'s tests), among them the head in CUDA graphs and
#    benchmarks/whole_step.py (20 steps equal to eager; a mid-run resume; both smoke halves);
# 2. our whole step against arcface_torch's: r50 and mbf at Glint360K's 8-GPU shard (45,029
#    classes) and as a 1-GPU job (360,232), batch 128, fp16; then ours alone with head_graph true
#    (the whole-step gain of the captured head); then r100 at the shard;
# 3. models used on the GPU: benchmarks/gpu.py --only embed (13,233 crops, fp32/fp16/bf16 against
#    the CPU; BIN=lfw.bin, where one was carried, adds its accuracy per precision).
# ARCFACE_TORCH: a snapshot of insightface's recognition/arcface_torch (docs/gpus.md says how to make
# one; carry it to the machine). PY: the python with torch (default .venv/bin/python, else python3).
# Each part's output is also written to $OUT. Exit status: non-zero when any part failed.
set -uo pipefail
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
ARCFACE_TORCH=${ARCFACE_TORCH:-work_dirs/arcface_torch}
OUT=${OUT:-benchmarks/results/round3}
mkdir -p "$OUT"
export ARCFACE_TORCH
status=0
part() {  # part NAME COMMAND...: run it, its output to the screen and $OUT/NAME.txt
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.txt" || status=1
}
part tests "$PY" -m pytest -q -m gpu -rs tests
part whole_step "$PY" benchmarks/whole_step.py --arcface_torch "$ARCFACE_TORCH" --network r50 mbf --classes shard full
part whole_step_head_graph "$PY" benchmarks/whole_step.py --network r50 mbf --classes shard full --set head_graph=true
part whole_step_r100 "$PY" benchmarks/whole_step.py --arcface_torch "$ARCFACE_TORCH" --network r100 --classes shard
part embed "$PY" benchmarks/gpu.py --only embed ${BIN:+--bin "$BIN"}
exit $status
