#!/usr/bin/env bash
# Install, then run the main job on the embedded default: a tiny random-weight M3 is written as a checkpoint,
# exported to ONNX, verified in ONNX Runtime against PyTorch, and generated from. Extra args go to `m3export demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
m3export demo "$@"
