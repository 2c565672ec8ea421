#!/usr/bin/env bash
# MoE / MXFP8 kernels and CUDA-graph decode on the H200 machine: GPU tests, then bench/moe.py and bench/decode.py.
# Runs from the working tree on the machine's preinstalled torch / Triton. `pip install -e .` did not give an
# importable package there (2026-11-30), so the package is laid out under /tmp/m3pkg the way pyproject maps it
# (plugins/ -> m3export.plugins, runtime/ -> m3export.runtime), and pytest runs from / so that the checkout's own
# m3export/ (which lacks those two) is not first on sys.path. Everything lands in $OUT (or ./out).
#   bash scripts/gpu_moe.sh            # at most about 10 minutes (each step has its own timeout)
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
export OUT="${OUT:-$R/out}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
mkdir -p "$OUT"
rm -rf /tmp/m3pkg && mkdir -p /tmp/m3pkg
cp -r m3export /tmp/m3pkg/ && cp -r plugins /tmp/m3pkg/m3export/plugins && cp -r runtime /tmp/m3pkg/m3export/runtime
export PYTHONPATH="/tmp/m3pkg:$R"
(cd / && timeout 150 python3 -m pytest -q --import-mode=importlib -m gpu -p no:cacheprovider -s \
    "$R/tests/test_kernels_moe.py" "$R/tests/test_runtime_cuda_graph.py" 2>&1 | grep -v "loading weights" \
    | tail -25 | tee "$OUT/gpu_moe_tests.txt")
timeout 150 python3 bench/moe.py --json "$OUT/moe_h200.json" 2>&1 | tee "$OUT/moe.log" | grep -v '^{'
timeout 290 python3 bench/decode.py --json "$OUT/decode_h200.json" 2>&1 | tee "$OUT/decode.log" | grep -v '^{'
