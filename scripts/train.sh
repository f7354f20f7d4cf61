#!/usr/bin/env bash
# One node, N GPUs (or N CPU processes with gloo):  scripts/train.sh CONFIG [NPROC] [--key value ...]
# NPROC defaults to the number of visible GPUs, or 1 on a machine without any.
set -euo pipefail
source "$(dirname "$0")/env.sh"
config=${1:?usage: scripts/train.sh CONFIG [NPROC] [--key value ...]}
shift
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  nproc=$1
  shift
else
  nproc=$("$python" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
exec "$python" -m torch.distributed.run --nproc_per_node "$nproc" --master_port "${MASTER_PORT:-29500}" \
  "$root/train.py" "$config" "$@"
