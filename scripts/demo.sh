#!/usr/bin/env bash
# Install, then run the main job on the embedded default (a small M3 trained on Python source, shipped in
# m3export/embedded/): exported to ONNX, verified in ONNX Runtime against PyTorch, and generated from with MTP
# speculation. Extra args go to `m3export demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
m3export demo "$@"
