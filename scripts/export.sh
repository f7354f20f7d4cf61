#!/usr/bin/env bash
# Export to ONNX with an onnxruntime parity check:  scripts/export.sh work_dirs/ms1mv3_r50 model.onnx [--network r50]
set -euo pipefail
exec python -m scripts.export_onnx "${1:?usage: scripts/export.sh CHECKPOINT OUTPUT.onnx [--network NAME]}" "${2:?output path}" "${@:3}"
