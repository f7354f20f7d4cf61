#!/usr/bin/env bash
# One node, N GPUs (or N CPU processes with gloo):  scripts/train.sh configs/ms1mv3_r50 8 [--key value ...]
set -euo pipefail
config=${1:?usage: scripts/train.sh CONFIG [NPROC] [--key value ...]}
nproc=${2:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}
shift $(( $# >= 2 ? 2 : 1 ))
exec torchrun --nproc_per_node "$nproc" --master_port "${MASTER_PORT:-29500}" train.py "$config" "$@"
