#!/usr/bin/env bash
# Several nodes through torchrun's rendezvous. Run the same command on every node:
#   NNODES=2 NPROC=8 RDZV_HOST=node0 scripts/train_multinode.sh configs/glint360k_r100 [--key value ...]
# The output directory must be on a file system all nodes share (checkpoints are written by every rank).
#   MAX_RESTARTS=3 lets torchrun restart the job (with --resume auto in the config or arguments).
set -euo pipefail
source "$(dirname "$0")/env.sh"
# a fresh rendezvous store per restart: the shared one would hand restarted ranks the previous
# attempt's addresses (pytorch#135712); parallel/dist.py refuses restarts across nodes without it
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
config=${1:?usage: NNODES=.. NPROC=.. RDZV_HOST=.. scripts/train_multinode.sh CONFIG [--key value ...]}
shift
exec "$python" -m torch.distributed.run --nnodes "${NNODES:?set NNODES}" --nproc_per_node "${NPROC:?set NPROC}" --max-restarts "${MAX_RESTARTS:-0}" \
  --rdzv_backend c10d --rdzv_endpoint "${RDZV_HOST:?set RDZV_HOST}:${RDZV_PORT:-29400}" \
  --rdzv_id "${RDZV_ID:-shardface}" "$root/train.py" "$config" "$@"
