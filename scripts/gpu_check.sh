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
  # One pytest per file, each with its own time limit, so that a slow file cannot hide the others' failures.
  # GPU_TEST_FILES="a.py:secs b.py:secs" picks files (default: every file with gpu-marked tests).
  files="${GPU_TEST_FILES:-test_gpu_decode_step.py:150 test_kernels_attention_gpu.py:200 test_gpu_engine.py:90
         test_kernels_moe.py:420 test_kernels_rms_norm_gpu.py:60 test_kv_cache_fp8_gpu.py:200
         test_projection_fusion_gpu.py:240 test_runtime_speculative_chain.py:150
         test_runtime_cuda_graph_staging.py:150 test_kernels_router_logits.py:120 test_mxfp8_zero_scales.py:240
         test_runtime_cuda_graph.py:150 test_runtime_step_host_work.py:90 test_runtime_speculative_round_work.py:90
         test_op_conformance.py:240 test_tensorrt_plugins_gpu.py:300 test_moe_gemv_fused.py:200
         test_moe_prefill_round6.py:120 test_sparse_attention_fused_tma.py:200 test_indexer_tma_gpu.py:240
         test_runtime_verify_staging.py:150 test_moe_prefill_ws.py:150 test_linear_gemv_sweep.py:120
         test_kernels_sampling.py:90 test_runtime_device_sampling.py:90}"
  for spec in $files; do
    f="${spec%%:*}"; secs="${spec##*:}"
    echo "== $f (limit ${secs}s)" | tee -a "$OUT/gpu_tests.txt"
    timeout "$secs" python3 -m pytest -q -p no:cacheprovider -m gpu -rfs --tb=short --durations=5 "tests/$f" \
        2>&1 | grep -v "loading weights" | tee -a "$OUT/gpu_tests.txt" | tail -60
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || status=1
    echo "== $f exit $rc" | tee -a "$OUT/gpu_tests.txt"
  done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 120 python3 bench/attention.py --out "$OUT/attention_h200.json" 2>&1 | tee "$OUT/attention.log" | tail -30
  timeout 120 python3 bench/moe.py --sweep 0 --json "$OUT/moe_h200.json" 2>&1 | tee "$OUT/moe.log" | grep -v '^{'
  timeout 240 python3 bench/decode.py --reps 10 --json "$OUT/decode_h200.json" 2>&1 | tee "$OUT/decode.log" \
      | grep -v '^{'
  timeout 200 python3 bench/decode_profile.py --shapes 1x4096,8x32768 --steps 5 2>&1 | tee "$OUT/decode_profile.log" \
      | grep -v '^{'
  timeout 120 python3 bench/sampling.py --device cuda --batches 1,8,64 --json "$OUT/sampling_h200.json" 2>&1 \
      | tee "$OUT/sampling.log" | tail -20
fi
exit "$status"
