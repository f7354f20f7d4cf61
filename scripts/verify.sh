#!/usr/bin/env bash
# Verify a run (or checkpoint / model.pt) on .bin sets:  scripts/verify.sh work_dirs/ms1mv3_r50 /data/lfw.bin /data/cfp_fp.bin
set -euo pipefail
source "$(dirname "$0")/env.sh"
ckpt=${1:?usage: scripts/verify.sh CHECKPOINT BIN [BIN ...]}
shift
args=()
for b in "$@"; do args+=(--bin "$b"); done
exec "$python" -m scripts.verify "$ckpt" "${args[@]}"
