#!/usr/bin/env bash
# The GPU tier on the H200 machine, in one call: every test marked `gpu` (op conformance on CUDA, the kernels at
# M3's per-layer dims, the whole decode step against the reference ops, CUDA-graph decode, engine tokens against
# CPU continuations), then the benchmarks. Runs from the working tree on the machine's preinstalled torch /
# Triton (m3export finds runtime/ and plugins/ in the tree; nothing is installed). Results land in $OUT (./out).
#   bash scripts/gpu_check.sh            # tests + benchmarks (about 9 minutes)
#   bash scripts/gpu_check.sh tests      # tests only
#   bash scripts/gpu_check.sh bench      # benchmarks only
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
what="${1:-all}"
export OUT="${OUT:-$R/out}" PYTHONPATH="$R${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # kernels must compile for the GPU
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout "${GPU_TEST_SECONDS:-330}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=15 \
      --timeout=240 --junitxml="$OUT/gpu_tests.xml" tests 2>&1 | grep -v "loading weights" \
      | tee "$OUT/gpu_tests.txt" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 120 python3 bench/attention.py --out "$OUT/attention_h200.json" 2>&1 | tee "$OUT/attention.log" | tail -30
  timeout 120 python3 bench/moe.py --sweep 0 --json "$OUT/moe_h200.json" 2>&1 | tee "$OUT/moe.log" | grep -v '^{'
  timeout 240 python3 bench/decode.py --reps 10 --json "$OUT/decode_h200.json" 2>&1 | tee "$OUT/decode.log" \
      | grep -v '^{'
fi
exit "$status"
