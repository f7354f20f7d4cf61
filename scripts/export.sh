#!/usr/bin/env bash
# Export to ONNX with an onnxruntime parity check:  scripts/export.sh work_dirs/ms1mv3_r50 [OUT] [--network r50]
# OUT: the .onnx file or a directory; by default model.onnx in the run's directory.
set -euo pipefail
source "$(dirname "$0")/env.sh"
exec "$python" -m scripts.export_onnx "${1:?usage: scripts/export.sh CHECKPOINT [OUT] [--network NAME]}" "${@:2}"
