#!/usr/bin/env bash
# Install m3export and what it needs on a fresh machine (idempotent). The CPU torch wheel goes first:
# a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
if [ "$extras" = "dev" ] || [ "$extras" = "serve" ]; then
  # tritonserver 2.51 with the Python backend ships inside this wheel; its own pins would downgrade our stack.
  python3 -m pip install -q --disable-pip-version-check --no-deps "nvidia-pytriton==0.7.0"
  # The Python-backend stub's environment (numpy<2 beside ours) is made here, so serving never installs anything.
  python3 -m m3export.serve.stubenv
fi
